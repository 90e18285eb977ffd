"""Whole expert requests: with `request_rows` R the scheduler leaves an expert's partial request
for the next batch (its youngest jobs, never the same job twice in a row), so a fixed-cost device
is not handed near-empty forwards; results do not change."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

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


def submit(s: Scheduler, jobs: list[tuple[str, int]], **kw) -> None:
    for job_id, digit in jobs:
        s.submit(JobRequest(job_id=job_id, digits=[digit], steps=6, stream=False, **kw), 0.0)


def test_the_youngest_jobs_of_a_partial_request_wait_one_batch_and_never_twice_in_a_row():
    s = make()
    submit(s, [("a0", 1), ("a1", 2), ("a2", 3), ("a3", 4), ("a4", 0), ("b0", 7), ("b1", 8)])
    serve(s, s.schedule(0.0, request_rows=4))  # step 1: nothing known about the experts yet: all go
    first = s.schedule(0.0, request_rows=4)
    # expert 0 expects 5 rows: one whole request of 4, the youngest (a4) waits; expert 1's 2 rows
    # are less than one request and go
    assert first.job_ids == ["a0", "a1", "a2", "a3", "b0", "b1"]
    serve(s, first)
    again = s.schedule(0.0, request_rows=4)  # a4 was deferred: it stays; a3 waits instead
    assert "a4" in again.job_ids and "a3" not in again.job_ids and len(again.job_ids) == 6
    serve(s, again)
    third = s.schedule(0.0, request_rows=4)
    assert "a3" in third.job_ids
    assert s.job_progress("a4")["step"] == s.job_progress("a3")["step"] == 2  # each waited one batch
    assert s.job_progress("a0")["step"] == 3


def test_jobs_with_no_single_expected_expert_are_never_held_back():
    s = make()
    submit(s, [(f"f{i}", 1) for i in range(5)], strategy="full")
    serve(s, s.schedule(0.0, request_rows=4))
    assert len(s.schedule(0.0, request_rows=4).job_ids) == 5  # full: every expert, no prediction
    t = make()
    t.submit(JobRequest(job_id="mixed", digits=[1, 7, 2, 8, 3], steps=4, stream=False), 0.0)
    t.submit(JobRequest(job_id="one", digits=[4], steps=4, stream=False), 0.0)
    serve(t, t.schedule(0.0, request_rows=4))
    assert t.schedule(0.0, request_rows=4).job_ids == ["mixed"] * 5 + ["one"]  # "mixed" spans both experts
    with pytest.raises(ValueError, match="request_rows"):
        submit(t, [("z", 1)])
        t.schedule(0.0, request_rows=0)


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
    e = Engine(make(), LabelRouter(C2E, 2, confidence=1.0), tr, events.append, router_in_thread=False,
               cohorts=2, request_rows=request_rows)
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
