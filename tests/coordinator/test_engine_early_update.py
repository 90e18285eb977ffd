"""early_update: a batch's jobs take their solver step (and their events go out) as soon as the experts their
rows need have answered, while slower experts still compute; the next requests still leave together at the
tick's end. Without it every job of a batch waits for the slowest expert. The images do not depend on it."""

from __future__ import annotations

import asyncio

import numpy as np

from coordinator.batch import Batch
from coordinator.engine import Engine
from coordinator.local_fleet import LabelRouter
from coordinator.rows import RowGroup
from coordinator.scheduler import Scheduler, SchedulerConfig
from schemas import ErrorCode, JobRequest
from tests.waiting import wait_until

SHAPE = (1, 4, 4)
C2E = [0] * 5 + [1] * 5  # digits 0-4: expert 0, 5-9: expert 1


class GatePerExpert:
    """Expert k answers v = -(k + 1) x once `gates[k]` is open (expert 0's is open from the start);
    records each call's expert and rows."""

    def __init__(self):
        self.gates = [asyncio.Event(), asyncio.Event()]
        self.gates[0].set()
        self.calls: list[tuple[int, int]] = []

    async def velocity(self, k, x, t, y, row_ids):
        self.calls.append((k, len(x)))
        await self.gates[k].wait()
        return (-(k + 1) * x).astype(np.float32)


def _engine(early: bool, tr, events, scheduler=Scheduler) -> Engine:
    sched = scheduler(SchedulerConfig(num_experts=2, image_shape=SHAPE, class_to_expert=C2E))
    router = LabelRouter(C2E, 2, confidence=1.0)
    return Engine(sched, router, tr, events.append, router_in_thread=False, cohorts=1, early_update=early)


JOBS = [
    JobRequest(job_id="fast", digits=[1], steps=4, seed=1),  # expert 0 only
    JobRequest(job_id="slow", digits=[7], steps=4, seed=2),  # expert 1 only
    JobRequest(job_id="both", digits=[2, 8], steps=4, seed=3),  # a row on each
]


async def _serve(early: bool) -> tuple[dict, list, GatePerExpert, int]:
    """Run JOBS with expert 1 held at first; returns (each job's step while expert 1 held its first
    request, the events, the transport, the ticks the scheduler counted)."""
    events, tr = [], GatePerExpert()
    e = _engine(early, tr, events)
    task = asyncio.create_task(e.run())
    try:
        for j in JOBS:
            e.submit(j)
        await wait_until(lambda: tr.calls.count((1, 2)) == 1, timeout=5, what="expert 1 asked for its two rows")
        if early:  # "fast" took its step at expert 0's answer, and its frame went out
            await wait_until(lambda: any(ev.kind == "frame" for ev in events), timeout=5, what="fast's first frame")
        for _ in range(50):  # and nothing else happens while expert 1 computes
            await asyncio.sleep(0)
        held = {j.job_id: e.job_state(j.job_id)["step"] for j in JOBS}
        assert tr.calls == [(0, 2), (1, 2)] and e.batches_out == 1  # the next requests wait for the tick's end:
        assert e.scheduler.in_flight_rows == 4  # a job updated early is not free before it (nor for another cohort)
        tr.gates[1].set()
        await wait_until(lambda: sum(ev.kind == "done" for ev in events) == 3, timeout=5, what="every job done")
        assert e.batches_out == 0 and e.scheduler.in_flight_rows == 0
    finally:
        await e.stop()
        await asyncio.wait_for(task, 5)
    return held, events, tr, e.scheduler.stats.ticks


async def test_a_job_whose_experts_answered_takes_its_step_while_another_expert_computes():
    held, events, tr, ticks = await _serve(early=True)
    assert held == {"fast": 1, "slow": 0, "both": 0}  # "both" waits for its row on expert 1
    assert [ev.job_id for ev in events if ev.kind == "frame"][0] == "fast"
    lock_held, lock_events, lock_tr, lock_ticks = await _serve(early=False)
    assert lock_held == {"fast": 0, "slow": 0, "both": 0}  # the lock-step tick: every job waits for expert 1
    assert tr.calls == lock_tr.calls  # the same requests, of the same sizes, in the same order
    assert ticks == lock_ticks == 4  # a tick updated in parts counts once
    for kind in ("frame", "done"):  # each job's events and images are the same either way
        for job in JOBS:
            mine = [ev for ev in events if ev.kind == kind and ev.job_id == job.job_id]
            theirs = [ev for ev in lock_events if ev.kind == kind and ev.job_id == job.job_id]
            assert len(mine) == len(theirs) == (job.steps if kind == "frame" else 1), (kind, job.job_id)
            for a, b in zip(mine, theirs):
                x = "images" if kind == "done" else "x"
                assert getattr(a, x).tobytes() == getattr(b, x).tobytes(), (kind, job.job_id)


async def test_an_early_update_that_breaks_fails_only_its_own_jobs():
    """The update of the jobs whose expert answered first raises (once): those jobs fail with `internal`,
    the batch's other jobs take their step at the tick's end and finish, and the engine serves on."""

    class BreaksOnce(Scheduler):
        broke = False

        def update(self, batch, now, *, part=False):
            if part and not BreaksOnce.broke:
                BreaksOnce.broke = True
                raise RuntimeError("update bug")
            super().update(batch, now, part=part)

    events, tr = [], GatePerExpert()
    e = _engine(True, tr, events, scheduler=BreaksOnce)
    task = asyncio.create_task(e.run())
    try:
        for j in JOBS:
            e.submit(j)
        await wait_until(lambda: any(ev.kind == "failed" for ev in events), timeout=5, what="fast failed")
        tr.gates[1].set()
        await wait_until(lambda: len([ev for ev in events if ev.kind in ("done", "failed")]) == 3, timeout=5)
        ends = {ev.job_id: (ev.kind, getattr(ev, "code", None)) for ev in events if ev.kind in ("done", "failed")}
        # expert 0 answers first: "fast" alone is complete then ("both" waits for expert 1)
        assert ends == {"fast": ("failed", ErrorCode.INTERNAL), "slow": ("done", None), "both": ("done", None)}
        assert "update bug" in next(ev.reason for ev in events if ev.kind == "failed")
        assert not task.done() and e.dead is None and e.scheduler.in_flight_rows == 0
    finally:
        await e.stop()
        await asyncio.wait_for(task, 5)


async def test_answers_that_come_in_together_are_applied_in_one_pass():
    """Experts that answer at once (both gates open): no job is updated ahead of the tick, whose own
    update applies them all (one pass, not two)."""
    events, tr = [], GatePerExpert()
    tr.gates[1].set()
    e = _engine(True, tr, events)
    parts = []
    update = e.scheduler.update

    def counting(batch, now, *, part=False):
        parts.append(part)
        update(batch, now, part=part)

    e.scheduler.update = counting
    task = asyncio.create_task(e.run())
    try:
        for j in JOBS:
            e.submit(j)
        await wait_until(lambda: sum(ev.kind == "done" for ev in events) == 3, timeout=5, what="every job done")
        assert parts == [False] * 4  # 4 ticks, each one update of the whole batch
    finally:
        await e.stop()
        await asyncio.wait_for(task, 5)


def _routed_batch() -> Batch:
    groups = [
        RowGroup.from_seed(f"j{i}", i, digits, SHAPE, steps=3, num_experts=2)
        for i, digits in enumerate([[1], [2, 7], [8]])
    ]
    b = Batch(groups, 2)
    w = np.zeros((len(b), 2))
    w[[0, 1], 0] = 1.0
    w[[2, 3], 1] = 1.0
    return b.route(w)


def test_subset_carries_the_groups_rows_routing_and_answers():
    b = _routed_batch()
    b.record(0, np.array([0, 1]), -b.x[[0, 1]])
    assert b.complete_groups() == [0]  # j1 waits for expert 1 on its second row
    b.record(1, np.array([2, 3]), -2 * b.x[[2, 3]])
    assert b.complete_groups() == [0, 1, 2]
    part = b.subset([0, 2])
    assert [g.job_id for g in part.groups] == ["j0", "j2"] and part.row_ids == ["j0:0", "j2:0"]
    np.testing.assert_array_equal(part.x, b.x[[0, 3]])
    np.testing.assert_array_equal(part.weights, b.weights[[0, 3]])
    np.testing.assert_array_equal(part.combined(), b.combined()[[0, 3]])
    assert part.row_complete().all() and list(part.bounds) == [0, 1, 2]
    b.released.update([0, 2])
    assert b.complete_groups() == [1]  # the released groups are not offered again


def test_the_update_of_a_batch_leaves_its_released_groups_alone():
    s = Scheduler(SchedulerConfig(num_experts=2, image_shape=SHAPE, class_to_expert=C2E))
    for i, digits in enumerate([[1], [2, 7]]):
        s.submit(JobRequest(job_id=f"j{i}", digits=digits, steps=3, seed=i, stream=False), 0.0)
    b = s.schedule(0.0)
    w = np.zeros((3, 2))
    w[[0, 1], 0] = 1.0
    w[2, 1] = 1.0
    b.route(w)
    b.record(0, np.array([0, 1]), -b.x[[0, 1]])
    assert b.complete_groups() == [0]
    b.released.add(0)
    s.update(b.subset([0]), 0.0, part=True)  # j0 ahead of its tick: stepped, still in flight
    assert s.job_progress("j0")["step"] == 1 and s.in_flight_rows == 3 and s.stats.ticks == 0
    b.record(1, np.array([2]), -b.x[[2]])
    s.update(b, 0.0)  # the tick's own update: j1 only, and the tick counted once
    assert s.job_progress("j0")["step"] == 1 and s.job_progress("j1")["step"] == 1 and s.stats.ticks == 1
    s.fail_batch(b, ErrorCode.INTERNAL, "test")  # a failing tick fails only the jobs it did not release
    assert s.job_progress("j0") is not None and s.job_progress("j1") is None
