"""Owner epochs (client.epochs and the coordinator's side of them), pure: no server.

A job that asked (`JobRequest.report_epoch`) carries `epoch` on every event; a client keeps the highest
seen and drops events of a lower one, so a coordinator that lost the job cannot get a frame, and never a
`done`, delivered after the new owner's events have come."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from client.epochs import MAX_EPOCH_JUMP, EpochFilter, epoch_of
from coordinator.ledger import JobLedger
from coordinator.snapshot import JobCheckpoint, bump_epoch, decode, encode
from schemas import (
    DoneEvent,
    FailedEvent,
    FrameEvent,
    JobAccepted,
    JobEvent,
    JobRequest,
    JobStatus,
    ProtocolError,
    pack,
    unpack,
)


def frame(step: int, epoch: int | None) -> FrameEvent:
    ev = FrameEvent.trusted(
        job_id="j",
        step=step,
        steps=40,
        t=step / 40,
        x=np.zeros((1, 1, 2, 2), np.float16),
        experts=[0],
        weights=np.ones((1, 2), np.float32),
        notes=[],
    )
    return ev if epoch is None else ev.model_copy(update={"epoch": epoch})


def done(epoch: int | None, value: float = 0.5) -> DoneEvent:
    return DoneEvent(
        job_id="j",
        images=np.full((1, 1, 2, 2), value, np.float32),
        digits=[3],
        usage=np.ones((1, 2), np.float32),
        steps=40,
        strategy="top1",
        elapsed_s=1.0,
        epoch=epoch,
    )


def test_events_of_a_lower_epoch_are_dropped_and_counted_once_a_higher_one_came():
    f = EpochFilter("j")
    # the first owner (epoch 1) streams, a take-over (epoch 2) resumes from its checkpoint at step 30
    assert [f.admit(frame(s, 1)) for s in (29, 30, 31)] == [True, True, True]
    assert f.admit(frame(31, 2)) and f.highest == 2
    # the old owner's frames queued behind a cut arrive now: dropped, whatever their step
    assert not f.admit(frame(32, 1)) and not f.admit(frame(38, 1))
    assert f.admit(frame(32, 2))
    # ... and its `done` is never delivered, the new owner's is
    assert not f.admit(done(1, value=-1.0))
    assert not f.admit(FailedEvent(job_id="j", code="unavailable", reason="x", epoch=1))
    assert f.admit(done(2))
    assert f.dropped == 4 and f.dropped_kinds == {"frame": 2, "done": 1, "failed": 1}
    # the same epoch again (a `done` published again for a status request) is no stale event
    assert f.admit(done(2)) and f.dropped == 4


def test_an_event_without_epoch_counts_as_epoch_0():
    f = EpochFilter()
    assert epoch_of(frame(1, None)) == 0 and epoch_of(done(3)) == 3
    assert f.admit(frame(1, None)) and f.admit(frame(2, 0))  # a job that is not durable: epoch 0 all along
    assert f.admit(frame(3, 1)) and not f.admit(frame(4, None))  # once a durable owner spoke, 0 is stale
    assert f.dropped == 1


def test_a_status_of_a_lower_epoch_is_ignored_and_a_higher_one_raises_the_floor():
    f = EpochFilter("j")
    assert f.admit(frame(10, 2))
    assert not f.admit_status(JobStatus(job_id="j", state="running", epoch=1)) and f.stale_statuses == 1
    assert f.admit_status(JobStatus(job_id="j", state="unknown"))  # no epoch: judged as before
    assert f.admit_status(JobStatus(job_id="j", state="running", epoch=3)) and f.highest == 3
    assert not f.admit(frame(11, 2))  # the owner that answered holds epoch 3: epoch 2 is stale now


def test_an_epoch_jump_no_take_over_makes_is_ignored_not_adopted(caplog, monkeypatch):
    """Issue 44: one forged frame of epoch 2^63-1 on an open bus made a viewer drop every real event after
    it. A jump of more than MAX_EPOCH_JUMP above the highest seen is ignored (counted, logged) instead."""
    import client.epochs
    from bus.ratelimited_log import RateLimitedLog

    monkeypatch.setattr(client.epochs, "_IMPLAUSIBLE_LOG", RateLimitedLog(client.epochs.log))  # no line held back
    f = EpochFilter("j")
    assert f.admit(frame(1, 1))
    caplog.set_level("WARNING", logger="client.epochs")
    for forged in (frame(2, 2**63 - 1), done(2 + MAX_EPOCH_JUMP, value=-1.0)):
        assert not f.admit(forged)
    assert f.highest == 1 and f.implausible == 2 and f.dropped == 0
    assert not f.admit_status(JobStatus(job_id="j", state="done", epoch=2**63 - 1)) and f.highest == 1
    assert f.implausible == 3 and f.stale_statuses == 0
    assert any("ignored a frame event of owner epoch 9223372036854775807" in r.getMessage() for r in caplog.records)
    # the real events keep coming: the owner's, then a take-over's (one more), then one MAX_EPOCH_JUMP above
    assert f.admit(frame(2, 1)) and f.admit(frame(3, 2)) and f.highest == 2
    assert f.admit(frame(4, 2 + MAX_EPOCH_JUMP)) and f.highest == 2 + MAX_EPOCH_JUMP
    assert f.admit(done(2 + MAX_EPOCH_JUMP)) and f.implausible == 3


def test_epoch_is_on_the_wire_only_when_set_and_decodes_back():
    plain = [frame(1, None), done(None), FailedEvent(job_id="j", code="internal", reason="r")]
    plain.append(JobAccepted(job_id="j", events_subject="s", seed=1, digits=[3]))
    for ev in plain:  # what a client that predates epochs receives from a job that did not ask
        assert "epoch" not in msgpack.unpackb(pack(ev), raw=False), ev.kind
        assert unpack(pack(ev), JobEvent).epoch is None
    for ev in plain:
        stamped = ev.model_copy(update={"epoch": 7})
        assert msgpack.unpackb(pack(stamped), raw=False)["epoch"] == 7, ev.kind
        assert unpack(pack(stamped), JobEvent).epoch == 7
    st = JobStatus(job_id="j", state="running")
    assert "epoch" not in msgpack.unpackb(pack(st), raw=False)
    assert unpack(pack(st.model_copy(update={"epoch": 0})), JobStatus).epoch == 0
    # the request's key is left off the wire unless used, so older coordinators still take it
    assert "report_epoch" not in msgpack.unpackb(pack(JobRequest(digits=[1])), raw=False)
    assert unpack(pack(JobRequest(digits=[1], report_epoch=True)), JobRequest).report_epoch
    raw = msgpack.unpackb(pack(frame(1, 1)), raw=False)
    for bad in (-1, 1.5, "2", True):  # an epoch is a non-negative int, strictly
        with pytest.raises(ProtocolError, match="epoch"):
            unpack(msgpack.packb({**raw, "epoch": bad}, use_bin_type=True), JobEvent)


def test_the_ledger_stamps_only_jobs_that_asked():
    led = JobLedger()
    led.admit("a", "anon", "a", steps=40, epoch=3, report_epoch=True)
    led.admit("b", "anon", "b", steps=40, epoch=3, report_epoch=False)
    assert led.stamp("a", frame(1, None)).epoch == 3
    assert led.stamp("b", frame(1, None)).epoch is None
    assert led.epoch_of("a") == led.epoch_of("b") == 3 and led.epoch_of("gone") == 0
    led.remember("a", done(3))
    assert led.epoch_of("a") == 0  # a finished job holds no epoch; its remembered `done` keeps its own


def test_each_take_over_writes_one_more_epoch_into_the_checkpoint():
    req = JobRequest(digits=[3], steps=40, seed=1, report_epoch=True)
    cp = JobCheckpoint(request=req, job_id="j", client="anon", digits=[3], seed=1, submitted_at=0.0)
    data = encode(cp, owner="ca", epoch=1)
    assert decode(data)[1].epoch == 1
    data2, epoch, previous = bump_epoch(data, owner="cb", written_at=5.0)
    assert (epoch, previous) == (2, "ca")
    rec = decode(data2)[1]
    assert (rec.epoch, rec.owner, rec.written_at) == (2, "cb", 5.0) and rec.request.report_epoch
    assert bump_epoch(data2, owner="ca")[1] == 3
    # a checkpoint written before epochs (no key: 0) is taken over at epoch 1, above its owner's 0
    assert bump_epoch(encode(cp, owner="old"), owner="cb")[1] == 1
