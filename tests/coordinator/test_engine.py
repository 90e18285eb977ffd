"""The engine loop over in-memory transports: ordering of events, failures that must not stop it."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from coordinator.engine import Engine
from coordinator.errors import ExpertUnavailable
from coordinator.local_fleet import LabelRouter
from coordinator.scheduler import Rejected, Scheduler, SchedulerConfig
from schemas import ErrorCode, JobRequest
from tests.waiting import wait_until

SHAPE = (1, 4, 4)
C2E = [0] * 5 + [1] * 5


class Velocities:
    """v_k(x) = -(k + 1) x; experts in `down` raise ExpertUnavailable, in `broken` a RuntimeError."""

    def __init__(self, down=(), broken=(), bad_shape=()):
        self.down, self.broken, self.bad_shape = set(down), set(broken), set(bad_shape)
        self.calls: list[tuple[int, int]] = []

    async def velocity(self, k, x, t, y, row_ids):
        self.calls.append((k, len(x)))
        await asyncio.sleep(0)  # kept: stands in for the network round trip (a yield), orders nothing
        if k in self.down:
            raise ExpertUnavailable(k, "has no responders")
        if k in self.broken:
            raise RuntimeError("connection lost")
        if k in self.bad_shape:
            return np.zeros((len(x) + 1,) + x.shape[1:], np.float32)
        return (-(k + 1) * x).astype(np.float32)


def engine(transport, router=None, cohorts=1, emit=None, **cfg):
    """An engine whose `tick()` steps every active row (cohorts=1: the lock-step tick these tests drive);
    its events go to the list returned, or to `emit` when given."""
    events = []
    e = Engine(
        Scheduler(SchedulerConfig(num_experts=2, image_shape=SHAPE, class_to_expert=C2E, **cfg)),
        router or LabelRouter(C2E, 2),
        transport,
        emit or events.append,
        router_in_thread=False,
        cohorts=cohorts,
    )
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
    await asyncio.sleep(0.05)  # kept: the window in which an idle loop must do nothing (and not end)
    assert not task.done() and events == []
    e.submit(JobRequest(job_id="late", digits=[3], steps=2))
    await wait_until(lambda: any(ev.kind == "done" for ev in events), timeout=5, what="the late job's done event")
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


async def test_job_stranded_by_a_garbage_answering_expert_fails_with_bad_reply():
    """Expert 1 answers with the wrong shape, expert 0 has no workers: a digit-7 job (wants 1)
    fails with bad_reply naming expert 1; a digit-2 job (wants 0) fails with bad_reply too
    (the only garbage of the tick), and both experts' errors are counted by code."""
    e, events = engine(Velocities(down={0}, bad_shape={1}))
    accepted = e.submit(JobRequest(job_id="seven", digits=[7], steps=2))
    e.submit(JobRequest(job_id="two", digits=[2], steps=2))
    # the engine names subjects (in the owner's namespace), not the scheduler
    assert accepted.events_subject == "ddm.v1.c.anon.jobs.seven.events"
    await drain(e)
    failed = {ev.job_id: ev for ev in events if ev.kind == "failed"}
    assert {j: f.code for j, f in failed.items()} == {"seven": ErrorCode.BAD_REPLY, "two": ErrorCode.BAD_REPLY}
    assert failed["seven"].reason.startswith("expert 1 never sent a usable velocity")
    m = e.metrics
    assert m.sample("ddm_coordinator_expert_errors_total", expert="1", code="bad_reply") == 1
    assert m.sample("ddm_coordinator_expert_errors_total", expert="0", code="unavailable") == 1
    assert m.sample("ddm_coordinator_expert_request_seconds_count", expert="1") == 1
    assert m.sample("ddm_coordinator_jobs_finished_total", outcome="failed") == 2


async def test_engine_metrics_follow_the_scheduler():
    e, _ = engine(Velocities(), max_rows=3, max_queued_jobs=1)
    m = e.metrics
    e.submit(JobRequest(job_id="a", digits=[1, 6], steps=2))
    e.submit(JobRequest(job_id="b", digits=[1, 2], steps=2))  # waits: 2 + 2 rows > 3
    assert (m.sample("ddm_coordinator_active_jobs"), m.sample("ddm_coordinator_queued_jobs")) == (1, 1)
    for bad, code in (([1] * 4, "too_large"), ([1], "overloaded")):
        with pytest.raises(Rejected):
            e.submit(JobRequest(digits=bad))
        assert m.sample("ddm_coordinator_jobs_rejected_total", code=code) == 1
    await drain(e)
    assert m.sample("ddm_coordinator_jobs_accepted_total") == 2
    assert m.sample("ddm_coordinator_ticks_total") == 4 == e.status()["ticks"]
    assert m.sample("ddm_coordinator_rows_stepped_total") == 2 * 2 + 2 * 2
    assert m.sample("ddm_coordinator_jobs_finished_total", outcome="done") == 2
    assert m.sample("ddm_coordinator_expert_request_seconds_count", expert="0") == 4
    assert m.sample("ddm_coordinator_row_fallbacks_total") == 0
    assert (m.sample("ddm_coordinator_active_rows"), m.sample("ddm_coordinator_queued_jobs")) == (0, 0)
    # the clocks `bench fleet` splits a tick with: ticks hold the expert calls, routing ran in some of them
    tick_s, call_s = (
        m.sample("ddm_coordinator_tick_seconds_total"),
        m.sample("ddm_coordinator_expert_request_seconds_sum", expert="0"),
    )
    assert tick_s >= call_s > 0 and tick_s == pytest.approx(sum(e.tick_ms) / 1000)
    assert m.sample("ddm_coordinator_router_seconds_total") > 0


def engine_with(scheduler_cls, transport, **cfg):
    """Like `engine`, with a Scheduler subclass that injects a failure."""
    events = []
    e = Engine(
        scheduler_cls(SchedulerConfig(num_experts=2, image_shape=SHAPE, class_to_expert=C2E, **cfg)),
        LabelRouter(C2E, 2),
        transport,
        events.append,
        router_in_thread=False,
        cohorts=1,
    )
    return e, events


async def test_a_failing_schedule_fails_its_jobs_and_the_loop_goes_on():
    """schedule() sat outside the tick's try block: an error there killed the loop silently."""

    class ScheduleBreaksOnce(Scheduler):
        broke = False

        def schedule(self, now, unavailable=frozenset(), **kw):
            if not self.broke:
                self.broke = True
                raise KeyError("scheduler bug")
            return super().schedule(now, unavailable, **kw)

    e, events = engine_with(ScheduleBreaksOnce, Velocities(), max_rows=1)
    task = asyncio.create_task(e.run())
    e.submit(JobRequest(job_id="running", digits=[1], steps=2))
    e.submit(JobRequest(job_id="queued", digits=[1], steps=2))
    await wait_until(lambda: len(events) >= 2, timeout=5, what="the failures of the broken tick")
    assert {(ev.job_id, ev.kind, ev.code) for ev in events} == {
        ("running", "failed", ErrorCode.INTERNAL),
        ("queued", "failed", ErrorCode.INTERNAL),
    }
    assert "scheduler bug" in events[0].reason
    e.submit(JobRequest(job_id="after", digits=[1], steps=2))  # the loop still runs
    await wait_until(lambda: any(ev.kind == "done" for ev in events), timeout=5, what="the next job's done event")
    assert not task.done() and e.dead is None
    await e.stop()
    await asyncio.wait_for(task, 5)


async def test_a_dying_loop_fails_every_job_with_internal_and_refuses_submits():
    """An error while handling a tick's error kills the loop: every running and queued job fails with
    `internal` (events emitted), submits are refused `unavailable`, and run() raises for its supervisor."""

    class Doomed(Scheduler):
        def update(self, batch, now):
            raise RuntimeError("update bug")

        def fail_batch(self, batch, code, reason):
            raise RuntimeError("fail_batch bug")

    e, events = engine_with(Doomed, Velocities(), max_rows=1)
    e.submit(JobRequest(job_id="running", digits=[1], steps=2))
    e.submit(JobRequest(job_id="queued", digits=[1], steps=2))
    with pytest.raises(RuntimeError, match="fail_batch bug"):
        await asyncio.wait_for(e.run(), 5)
    assert {(ev.job_id, ev.kind, ev.code) for ev in events} == {
        ("running", "failed", ErrorCode.INTERNAL),
        ("queued", "failed", ErrorCode.INTERNAL),
    }
    assert all(ev.reason.startswith("coordinator engine stopped: RuntimeError: fail_batch bug") for ev in events)
    assert e.scheduler.active_jobs == 0 and e.scheduler.queued_jobs == 0
    with pytest.raises(Rejected) as err:
        e.submit(JobRequest(digits=[1]))
    assert err.value.code == ErrorCode.UNAVAILABLE and "engine stopped" in err.value.reason
    assert e.metrics.sample("ddm_coordinator_jobs_rejected_total", code="unavailable") == 1


async def test_client_keys_reach_the_scheduler_and_name_the_events_subject():
    e, _ = engine(Velocities(), max_rows=1, max_client_queued_jobs=2, max_session_queued_jobs=1)
    acc = e.submit(JobRequest(job_id="w1", digits=[1]), client="web/tab-7")
    assert acc.events_subject == "ddm.v1.c.web.jobs.w1.events"  # the session only keys fairness
    assert e.scheduler.owner_of("w1") == "web/tab-7"
    e.submit(JobRequest(job_id="w2", digits=[1]), client="web/tab-7")  # queued: its session's one place
    with pytest.raises(Rejected) as err:
        e.submit(JobRequest(digits=[1]), client="web/tab-7")
    assert err.value.limit == "max_session_queued_jobs"
    e.submit(JobRequest(job_id="w3", digits=[1]), client="web/tab-8")  # another socket still gets in
    with pytest.raises(Rejected) as err:  # ... until the client's own quota (its sessions together)
        e.submit(JobRequest(digits=[1]), client="web/tab-9")
    assert err.value.limit == "max_client_queued_jobs"
    assert e.metrics.sample("ddm_coordinator_jobs_rejected_by_limit_total", limit="max_client_queued_jobs") == 1
    with pytest.raises(Rejected, match="client name"):
        e.submit(JobRequest(digits=[1]), client="no.dots/x")


def test_rate_window_is_bounded_by_count():
    from coordinator.engine import MAX_RATE_SAMPLES

    e, _ = engine(Velocities())
    for _ in range(MAX_RATE_SAMPLES + 100):
        e._count_rows(1)
    assert len(e._rate) == MAX_RATE_SAMPLES and e.rows_per_s() > 0


async def test_the_router_runs_in_one_thread_of_its_own_which_ends_with_the_loop():
    """Every router call of more than INLINE_ROUTER_ROWS rows goes to the same thread, not the event loop's
    and not asyncio's default executor's (whose calls moved between threads); run() ending shuts it down.
    A call of a few rows runs on the loop itself (the hand-off would cost more than it blocks)."""
    import threading

    from coordinator.executor import INLINE_ROUTER_ROWS

    class Where(LabelRouter):
        def __init__(self):
            super().__init__(C2E, 2)
            self.calls: list[tuple[threading.Thread, int]] = []

        def weights(self, x, t, y):
            self.calls.append((threading.current_thread(), len(y)))
            return super().weights(x, t, y)

    def threads(router, small: bool) -> set:
        return {th for th, rows in router.calls if (rows <= INLINE_ROUTER_ROWS) == small}

    router = Where()
    e = Engine(
        Scheduler(SchedulerConfig(num_experts=2, image_shape=SHAPE, class_to_expert=C2E)),
        router,
        Velocities(),
        lambda ev: None,
        cohorts=2,
    )
    task = asyncio.create_task(e.run())
    for i in range(6):
        e.submit(JobRequest(job_id=f"j{i}", digits=[i, 9 - i, i, 9 - i, i], steps=3))
    await wait_until(lambda: e.status()["jobs_done"] == 6)
    assert len([c for c in router.calls if c[1] > INLINE_ROUTER_ROWS]) >= 3
    (thread,) = threads(router, small=False)
    assert thread is not threading.current_thread() and thread.name.startswith("router")
    e.submit(JobRequest(job_id="small", digits=[3], steps=2))
    await wait_until(lambda: e.status()["jobs_done"] == 7)
    assert threads(router, small=True) == {threading.current_thread()}
    await e.stop()
    await asyncio.wait_for(task, 5)
    await wait_until(lambda: not thread.is_alive())

    driven = Engine(
        Scheduler(SchedulerConfig(num_experts=2, image_shape=SHAPE, class_to_expert=C2E)),
        Where(),
        Velocities(),
        lambda ev: None,
        cohorts=1,
    )  # ticked by hand, no run()
    driven.submit(JobRequest(job_id="by-hand", digits=[4] * 8, steps=2))
    while await driven.tick():
        pass
    (thread,) = threads(driven.executor.router, small=False)
    assert thread.is_alive() and thread.name.startswith("router")
    await driven.stop()  # ends it too
    await wait_until(lambda: not thread.is_alive())


class Growing:
    """v(x) = 3: from noise, x ends far above 1 (and above any small value range)."""

    async def velocity(self, k, x, t, y, row_ids):
        await asyncio.sleep(0)
        return np.full_like(x, 3.0, dtype=np.float32)


@pytest.mark.parametrize("value_range", [(-1.0, 1.0), (0.0, 0.5)])
async def test_a_pixel_fleets_images_are_clipped_to_its_value_range(value_range):
    """`done.images` lie in the spec's `value_range` (what the fleet reports as `image_value_range`)."""
    from coordinator.config import CoordinatorConfig
    from schemas.spec import ModelSpec

    spec = ModelSpec(sample_shape=SHAPE, value_range=value_range)
    cfg = CoordinatorConfig().scheduler_config(2, C2E, spec=spec)
    assert cfg.value_range == value_range
    events = []
    e = Engine(Scheduler(cfg), LabelRouter(C2E, 2), Growing(), events.append, router_in_thread=False, cohorts=1)
    e.submit(JobRequest(job_id="a", digits=[1, 7], steps=2, seed=1))
    await drain(e)
    (done,) = [ev for ev in events if ev.kind == "done"]
    assert float(done.images.max()) == value_range[1] and float(done.images.min()) >= value_range[0]


async def test_a_running_engine_sends_the_next_requests_before_the_last_ticks_frames():
    """In the running engine (its lanes) a tick's frames go out once the next tick's requests have left, so
    the experts do not wait for the coordinator's event work; every event still comes, in order. `tick()`
    driven alone emits a tick's events before it returns."""
    log: list[tuple] = []

    class Logged(Velocities):
        async def velocity(self, k, x, t, y, row_ids):
            log.append(("call", round(float(np.asarray(t)[0]) * 4)))  # the evaluation's step
            return await super().velocity(k, x, t, y, row_ids)

    def emit(ev):
        log.append((ev.kind, getattr(ev, "step", None)))

    for lanes in (True, False):
        log.clear()
        e, _ = engine(Logged(), emit=emit)
        e.submit(JobRequest(job_id="a", digits=[7], steps=4, seed=1))
        if lanes:
            task = asyncio.create_task(e.run())
            await wait_until(lambda: ("done", None) in log)
            await e.stop()
            await asyncio.gather(task, return_exceptions=True)
        else:
            await drain(e)
        events = [x for x in log if x[0] != "call"]
        assert events == [("frame", 1), ("frame", 2), ("frame", 3), ("frame", 4), ("done", None)]
        for step in (1, 2, 3):  # the call of evaluation `step` against the frame of the step before it
            call, frame = log.index(("call", step)), log.index(("frame", step))
            assert (call < frame) if lanes else (frame < call), (lanes, log)


async def test_a_status_request_publishes_a_finished_jobs_end_still_waiting_to_go_out():
    """A lane's tick leaves its events for a task of its own: a status request for a job the scheduler has
    let go, asked before that task ran, publishes the job's `done` first and answers `done`, not "unknown"
    (which a client takes for a coordinator that lost the job)."""
    from types import SimpleNamespace

    from coordinator.ledger import JobLedger
    from coordinator.status_answers import job_status

    ledger = JobLedger()

    def emit(ev):
        if ev.kind in ("done", "failed"):
            ledger.remember(ev.job_id, ev)

    e, _ = engine(Velocities(), emit=emit)
    e.submit(JobRequest(job_id="a", digits=[7], steps=1, seed=1))
    ledger.admit("a", "c", "a", steps=1)
    coord = SimpleNamespace(ledger=ledger, engine=e, decode_stage=None, name="co", instance="i1")
    assert await e.tick(flush_later=True)
    assert e.job_state("a") is None and ledger.find("a", "c") == "a"  # its `done` has not gone out yet
    st = await job_status(coord, "a", "c")
    assert st is not None and (st.state, st.step, st.steps) == ("done", 1, 1)
    await e.stop()
