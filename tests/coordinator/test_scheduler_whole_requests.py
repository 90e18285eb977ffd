"""Whole expert requests: with `request_rows` R the scheduler leaves an expert's partial request
for the next batch (its youngest jobs, never the same job twice in a row), so a fixed-cost device
is not handed near-empty forwards; results do not change."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from coordinator.cohorts import whole_requests
from coordinator.engine import Engine
from coordinator.local_fleet import LabelRouter
from coordinator.scheduler import Scheduler, SchedulerConfig
from schemas import JobRequest
from tests.waiting import wait_until

SHAPE = (1, 4, 4)
C2E = [0] * 5 + [1] * 5


def make() -> Scheduler:
    return Scheduler(SchedulerConfig(num_experts=2, image_shape=SHAPE, class_to_expert=C2E))


def serve(sched: Scheduler, batch) -> None:
    """Route every row to the expert owning its label, answer v = -x, apply."""
    w = np.zeros((len(batch), 2))
    w[np.arange(len(batch)), [C2E[int(y)] for y in batch.y]] = 1.0
    batch.route(w)
    while reqs := batch.requests():
        for k, idx in reqs.items():
            batch.record(k, idx, -batch.x[idx])
    sched.update(batch, 0.0)


def submit(s: Scheduler, jobs: list[tuple[str, int]], steps: int = 6, **kw) -> None:
    for job_id, digit in jobs:
        s.submit(JobRequest(job_id=job_id, digits=[digit], steps=steps, stream=False, **kw), 0.0)


def _stepped(jobs: list[tuple[str, int]], **kw) -> Scheduler:
    """A scheduler whose jobs have made one step (so each knows the expert it went to)."""
    s = make()
    submit(s, jobs, **kw)
    serve(s, s.schedule(0.0))
    return s


def test_the_youngest_jobs_of_a_partial_request_wait_and_never_twice_in_a_row():
    s = _stepped([("a0", 1), ("a1", 2), ("a2", 3), ("a3", 4), ("a4", 0), ("b0", 7), ("b1", 8)])
    jobs = list(s._jobs.active.values())  # oldest first
    # expert 0 expects 5 rows: one whole request of 4, the youngest (a4) waits; expert 1's 2 rows
    # are less than one request and go
    kept = whole_requests(jobs, 4)
    assert [j.job_id for j in kept] == ["a0", "a1", "a2", "a3", "b0", "b1"]
    assert [j.job_id for j in jobs if j.deferred] == ["a4"]
    again = whole_requests(jobs, 4)  # a4 was just deferred: it stays, a3 waits instead
    assert "a4" in [j.job_id for j in again] and "a3" not in [j.job_id for j in again]
    fresh = _stepped([(f"c{i}", 1) for i in range(5)])
    assert len(whole_requests(list(fresh._jobs.active.values()), 5)) == 5


def test_jobs_with_no_single_expected_expert_are_never_held_back():
    s = _stepped([(f"f{i}", 1) for i in range(5)], strategy="full")  # every expert, no prediction
    assert len(whole_requests(list(s._jobs.active.values()), 4)) == 5
    t = make()
    t.submit(JobRequest(job_id="mixed", digits=[1, 7, 2, 8, 3], steps=4, stream=False), 0.0)
    t.submit(JobRequest(job_id="one", digits=[4], steps=4, stream=False), 0.0)
    serve(t, t.schedule(0.0))
    assert [j.job_id for j in whole_requests(list(t._jobs.active.values()), 4)] == ["mixed", "one"]
    u = make()
    submit(u, [("z", 1)])
    assert u.schedule(0.0) is not None  # fresh jobs: nothing known, nothing held back
    with pytest.raises(ValueError, match="request_rows"):
        u.schedule(0.0, cohorts=2, request_rows=0)


class RecordingTransport:
    """v = -x at once; records the rows of every call per expert."""

    def __init__(self):
        self.calls: dict[int, list[int]] = {0: [], 1: []}

    async def velocity(self, k, x, t, y, row_ids):
        self.calls[k].append(len(x))
        await asyncio.sleep(0)
        return -x


async def _run(request_rows):
    events = []
    tr = RecordingTransport()
    e = Engine(
        make(),
        LabelRouter(C2E, 2, confidence=1.0),
        tr,
        events.append,
        router_in_thread=False,
        cohorts=2,
        request_rows=request_rows,
    )
    task = asyncio.create_task(e.run())
    rng = np.random.default_rng(5)
    for i in range(23):
        e.submit(JobRequest(job_id=f"j{i}", digits=[int(rng.integers(0, 10))], steps=8, seed=i, stream=False))
    await wait_until(lambda: sum(ev.kind == "done" for ev in events) == 23, timeout=10, what="every job done")
    await e.stop()
    await asyncio.wait_for(task, 5)
    return {ev.job_id: ev.images for ev in events if ev.kind == "done"}, tr.calls


async def test_engine_sends_whole_requests_and_the_images_do_not_change():
    plain, plain_calls = await _run(None)
    whole, calls = await _run(4)
    assert plain.keys() == whole.keys()
    for job_id in plain:
        assert np.array_equal(plain[job_id], whole[job_id]), job_id
    sizes = [n for k in calls for n in calls[k]]
    partial = sum(n % 4 != 0 for n in sizes)
    plain_partial = sum(n % 4 != 0 for k in plain_calls for n in plain_calls[k])
    assert partial < plain_partial, (calls, plain_calls)  # fewer calls that are not whole 4-row requests
    with pytest.raises(ValueError, match="request_rows"):
        Engine(make(), LabelRouter(C2E, 2), RecordingTransport(), request_rows=0)


def test_no_job_starves_behind_the_cap_and_deferral():
    """12 jobs of one expert, R = 4, two lanes: with deferral shrinking each batch, the jobs past
    the cap must still come round (least recently scheduled first), every job within a few batches."""
    s = make()
    submit(s, [(f"j{i:02d}", 1) for i in range(12)], steps=40)
    last = {f"j{i:02d}": 0 for i in range(12)}
    worst = 0
    out = []
    for n in range(1, 61):  # 60 batches served: a few steps short of the end for every job
        while len(out) < 2 and (b := s.schedule(0.0, cohorts=2, request_rows=4)) is not None:  # two lanes
            out.append(b)
            for job_id in b.job_ids:
                worst = max(worst, n - last[job_id])
                last[job_id] = n
        serve(s, out.pop(0))
    assert worst <= 4, worst
    steps = [s.job_progress(j)["step"] for j in last]
    assert min(steps) >= max(steps) - 3, steps  # they advance together, none left behind


def test_one_lane_never_defers():
    s = make()
    submit(s, [(f"a{i}", 1) for i in range(5)])
    serve(s, s.schedule(0.0, request_rows=4))
    assert len(s.schedule(0.0, cohorts=1, request_rows=4).job_ids) == 5  # lock-step: a deferral costs a round trip
