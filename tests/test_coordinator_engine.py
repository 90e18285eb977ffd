"""The engine loop over in-memory transports: ordering of events, failures that must not stop it."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from coordinator.engine import Engine, ExpertUnavailable
from coordinator.local_fleet import LabelRouter
from coordinator.scheduler import Rejected, Scheduler, SchedulerConfig
from schemas import ErrorCode, JobRequest

SHAPE = (1, 4, 4)
C2E = [0] * 5 + [1] * 5


class Velocities:
    """v_k(x) = -(k + 1) x; experts in `down` raise ExpertUnavailable, in `broken` a RuntimeError."""

    def __init__(self, down=(), broken=(), bad_shape=()):
        self.down, self.broken, self.bad_shape = set(down), set(broken), set(bad_shape)
        self.calls: list[tuple[int, int]] = []

    async def velocity(self, k, x, t, y, row_ids):
        self.calls.append((k, len(x)))
        await asyncio.sleep(0)
        if k in self.down:
            raise ExpertUnavailable(k, "has no responders")
        if k in self.broken:
            raise RuntimeError("connection lost")
        if k in self.bad_shape:
            return np.zeros((len(x) + 1,) + x.shape[1:], np.float32)
        return (-(k + 1) * x).astype(np.float32)


def engine(transport, router=None, **cfg):
    events = []
    e = Engine(Scheduler(SchedulerConfig(num_experts=2, image_shape=SHAPE, class_to_expert=C2E, **cfg)),
               router or LabelRouter(C2E, 2), transport, events.append, router_in_thread=False)
    return e, events


async def drain(e):
    while await e.tick():
        pass


async def test_events_per_job_are_ordered_and_end_with_done():
    e, events = engine(Velocities())
    e.submit(JobRequest(job_id="a", digits=[1, 7], steps=3))
    e.submit(JobRequest(job_id="b", digits=[2], steps=2, solver="heun", stream=False))
    await drain(e)
    a = [ev.kind for ev in events if ev.job_id == "a"]
    assert a == ["frame", "frame", "frame", "done"]
    assert [ev.kind for ev in events if ev.job_id == "b"] == ["done"]
    assert e.status()["jobs_done"] == 2 and e.status()["active_rows"] == 0


async def test_broken_and_misbehaving_experts_fall_back():
    for tr in (Velocities(broken={1}), Velocities(bad_shape={1})):
        e, events = engine(tr)
        e.submit(JobRequest(job_id="a", digits=[7], steps=2))
        await drain(e)
        (done,) = [ev for ev in events if ev.kind == "done"]
        assert done.usage.tolist() == [[1.0, 0.0]] and "fell back to 0" in done.notes[0]
        assert e.status()["unavailable_experts"] == [1]


async def test_a_failing_router_fails_that_tick_and_the_engine_goes_on():
    class Flaky:
        calls = 0

        def weights(self, x, t, y):
            Flaky.calls += 1
            if Flaky.calls == 1:
                raise ValueError("router exploded")
            return LabelRouter(C2E, 2).weights(x, t, y)

    e, events = engine(Velocities(), router=Flaky())
    e.submit(JobRequest(job_id="first", digits=[1], steps=2))
    await e.tick()
    e.submit(JobRequest(job_id="second", digits=[1], steps=2))
    await drain(e)
    failed = [ev for ev in events if ev.kind == "failed"]
    assert [(f.job_id, f.code) for f in failed] == [("first", ErrorCode.INTERNAL)]
    assert "router exploded" in failed[0].reason
    assert any(ev.kind == "done" and ev.job_id == "second" for ev in events)


async def test_run_loop_sleeps_when_idle_and_wakes_on_submit():
    e, events = engine(Velocities())
    task = asyncio.create_task(e.run())
    await asyncio.sleep(0.05)
    assert not task.done() and events == []
    e.submit(JobRequest(job_id="late", digits=[3], steps=2))
    for _ in range(200):
        if any(ev.kind == "done" for ev in events):
            break
        await asyncio.sleep(0.01)
    assert any(ev.kind == "done" and ev.job_id == "late" for ev in events)
    e.submit(JobRequest(job_id="never", digits=[3], steps=1000))
    await e.stop()
    await asyncio.wait_for(task, 5)
    assert events[-1].kind == "failed" and events[-1].code == ErrorCode.UNAVAILABLE


async def test_rejections_propagate_to_the_caller():
    e, _ = engine(Velocities(), max_rows=2)
    with pytest.raises(Rejected) as err:
        e.submit(JobRequest(digits=[1, 2, 3]))
    assert err.value.code == ErrorCode.TOO_LARGE


async def test_one_request_per_expert_per_tick():
    tr = Velocities()
    e, _ = engine(tr)
    for i in range(10):
        e.submit(JobRequest(digits=[i % 10, (i + 5) % 10], steps=1, strategy="top1"))
    await e.tick()
    assert sorted(tr.calls) == [(0, 10), (1, 10)]
