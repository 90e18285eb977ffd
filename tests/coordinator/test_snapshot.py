"""Scheduler.checkpoint / restore and the checkpoint bytes (coordinator.snapshot): a job stopped
after k evaluations and restored into a fresh scheduler ends with bit-identical images."""

from __future__ import annotations

import numpy as np
import pytest

from coordinator.scheduler import Rejected, Scheduler, SchedulerConfig
from coordinator.snapshot import decode, encode
from schemas import DoneEvent, ErrorCode, FrameEvent, JobRequest, ProtocolError
from tests.coordinator.test_scheduler import SHAPE, V2, make


def x_router(x, t, y):
    """Weights that depend on the state, so reusing stale weights would change the result."""
    a = 1.0 / (1.0 + np.exp(-x.reshape(len(x), -1).mean(axis=1)))
    return np.stack([a, 1.0 - a], axis=1)


def tick(sched, now, every=1):
    batch = sched.schedule(now)
    if batch is None:
        return False
    fresh, w = batch.routing_plan(every)
    if fresh.any():
        w[fresh] = x_router(batch.x[fresh], batch.t[fresh], batch.y[fresh])
    batch.route(w, fresh)
    while reqs := batch.requests():
        for k, idx in reqs.items():
            batch.record(k, idx, V2[k](batch.x[idx], batch.t[idx], batch.y[idx]))
    sched.update(batch, now)
    return True


def finish(sched, every=1, start=0):
    events = []
    for i in range(start, start + 10_000):
        if not tick(sched, float(i), every):
            break
        events += sched.pop_events()
    return events + sched.pop_events()


def done(events, job_id) -> DoneEvent:
    (d,) = [e for e in events if isinstance(e, DoneEvent) and e.job_id == job_id]
    return d


@pytest.mark.parametrize("solver", ["euler", "heun"])
@pytest.mark.parametrize("strategy", ["top1", "full", "sample"])  # sample: the draws follow the seed
@pytest.mark.parametrize("evals", [1, 5, 8])  # heun: 5 stops between its two stages (v0 kept)
@pytest.mark.parametrize("every", [1, 3])
def test_restored_job_ends_bit_identical(solver, strategy, evals, every):
    req = JobRequest(job_id="j1", digits=[1, 7, 3], steps=12, seed=42, solver=solver, strategy=strategy)
    ref = make()
    ref.submit(req, 0.0, client="alice/s1")
    want = done(finish(ref, every), "j1")

    a = make()
    a.submit(req, 0.0, client="alice/s1")
    for i in range(evals):
        assert tick(a, float(i), every)
    a.pop_events()
    cp = a.checkpoint("j1")
    assert cp is not None and cp.x is not None and cp.evals == evals
    assert (cp.stage == 1) == (solver == "heun" and evals % 2 == 1)
    cp2, rec = decode(encode(cp, owner="c1", written_at=12.5))
    assert rec.owner == "c1" and rec.written_at == 12.5 and rec.kind == "job_checkpoint"
    b = make()
    adm = b.restore(cp2, now=100.0)
    assert adm.queue_position == 0 and b.job_progress("j1")["step"] == cp.step
    assert b.owner_of("j1") == "alice/s1"
    events = finish(b, every, start=100)
    got = done(events, "j1")
    assert np.array_equal(got.images, want.images)
    assert np.array_equal(got.usage, want.usage)
    assert got.digits == want.digits == [1, 7, 3]
    frames = [e.step for e in events if isinstance(e, FrameEvent)]
    assert frames == list(range(cp.step + 1, 13))  # frames go on from the checkpoint's step
    # the original goes on unaffected by the checkpoint taken from it
    assert np.array_equal(done(finish(a, every, start=evals), "j1").images, want.images)


def test_queued_job_checkpoint_restores_as_a_queued_job_with_its_seed():
    s = make(max_rows=2)
    s.submit(JobRequest(job_id="big", digits=[1, 2], steps=3, seed=1), 0.0)
    s.submit(JobRequest(job_id="q", digits=[4], steps=3, seed=9), 0.0)
    cp = s.checkpoint("q")
    assert cp is not None and cp.x is None and cp.step == 0
    b = make(max_rows=2)
    b.restore(decode(encode(cp))[0], 0.0)
    ref = make()
    ref.submit(JobRequest(job_id="q", digits=[4], steps=3, seed=9), 0.0)
    assert np.array_equal(done(finish(b), "q").images, done(finish(ref), "q").images)


def test_restore_that_does_not_fit_waits_in_the_queue_then_runs_on():
    req = JobRequest(job_id="r", digits=[1, 2], steps=6, seed=3, solver="heun")
    a = make()
    a.submit(req, 0.0)
    for i in range(3):
        tick(a, float(i))
    cp = a.checkpoint("r")
    b = make(max_rows=2)
    b.submit(JobRequest(job_id="other", digits=[5, 6], steps=2, seed=0), 0.0)
    adm = b.restore(cp, 0.0)
    assert adm.queue_position == 1 and b.job_progress("r")["state"] == "queued"
    ev = finish(b)
    ref = make()
    ref.submit(req, 0.0)
    assert np.array_equal(done(ev, "r").images, done(finish(ref), "r").images)


def test_restore_refusals_name_the_reason():
    a = make()
    a.submit(JobRequest(job_id="x", digits=[1, 2, 3], steps=4, seed=3), 0.0)
    tick(a, 0.0)
    cp = a.checkpoint("x")
    with pytest.raises(Rejected) as err:
        make(max_rows=2).restore(cp, 0.0)
    assert err.value.code == ErrorCode.TOO_LARGE and err.value.limit == "max_rows"
    with pytest.raises(Rejected) as err:
        make(num_experts=3).restore(cp, 0.0)
    assert "3 experts" in err.value.reason
    with pytest.raises(Rejected) as err:
        a.restore(cp, 0.0)  # the same id is held here
    assert "already in use" in err.value.reason
    with pytest.raises(Rejected) as err:
        Scheduler(SchedulerConfig(num_experts=2, image_shape=(1, 8, 8))).restore(cp, 0.0)
    assert "do not match" in err.value.reason
    full = make(max_rows=3, max_queued_jobs=1)
    full.submit(JobRequest(job_id="f1", digits=[1, 2, 3], steps=4, seed=0), 0.0)
    full.submit(JobRequest(job_id="f2", digits=[1], steps=4, seed=0), 0.0)
    with pytest.raises(Rejected) as err:
        full.restore(cp, 0.0)
    assert err.value.code == ErrorCode.OVERLOADED and err.value.limit == "max_queued_jobs"


def test_drop_forgets_a_job_without_an_event():
    s = make()
    s.submit(JobRequest(job_id="d", digits=[1], steps=4, seed=0), 0.0)
    tick(s, 0.0)
    s.pop_events()
    assert s.drop("d") and not s.knows("d") and s.active_rows == 0
    assert s.pop_events() == [] and not s.drop("d")
    assert s.checkpoint("d") is None


def test_decode_refuses_malformed_checkpoints():
    s = make()
    s.submit(JobRequest(job_id="m", digits=[1, 2], steps=4, seed=0), 0.0)
    tick(s, 0.0)
    cp = s.checkpoint("m")
    cp.x = cp.x[:1]
    with pytest.raises(ProtocolError, match="checkpoint x must be"):
        decode(encode(cp))
    cp = s.checkpoint("m")
    cp.x = cp.x.astype(np.float16)
    with pytest.raises(ProtocolError, match="float32"):
        decode(encode(cp))
    with pytest.raises(ProtocolError):
        decode(b"\x93\x01\x02")
    cp = s.checkpoint("m")
    cp.x[0, 0, 0, 0] = np.nan
    with pytest.raises(ProtocolError):
        decode(encode(cp))
    assert SHAPE == (1, 4, 4)
