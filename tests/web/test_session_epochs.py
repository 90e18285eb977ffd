"""The web viewer's server side applies the owner-epoch rule (client.epochs) to each tab's jobs: an event
of a lower epoch than one already seen for the job (a coordinator that lost the job, delivered late) is
dropped and counted, never shown, and a stale `done` does not end the job. Pure: fake connection."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from schemas import DoneEvent, FrameEvent, pack, subjects
from web.session import Session, _Job


def frame(job_id: str, step: int, epoch: int) -> FrameEvent:
    return FrameEvent.trusted(
        job_id=job_id,
        step=step,
        steps=40,
        t=step / 40,
        x=np.zeros((1, 1, 32, 32), np.float16),
        experts=[0],
        weights=np.ones((1, 2), np.float32),
        notes=[],
    ).model_copy(update={"epoch": epoch})


def done(job_id: str, epoch: int, value: float) -> DoneEvent:
    return DoneEvent(
        job_id=job_id,
        images=np.full((1, 1, 32, 32), value, np.float32),
        digits=[3],
        usage=np.ones((1, 2), np.float32),
        steps=40,
        strategy="top1",
        elapsed_s=1.0,
        epoch=epoch,
    )


def _tab_with_a_job():
    """(a viewer session holding one announced job, its id, a function that delivers an event of it)."""
    nc = SimpleNamespace(_inbox_prefix=b"_INBOX", options={}, connected_url=None)

    async def send(_msg):
        pass

    session = Session(nc, send)
    job_id = "web0123456789abcdef"
    session.jobs[job_id] = _Job(announced=True)
    subject = subjects.job_events(session.client, job_id)

    async def event(ev):
        await session._on_event(SimpleNamespace(subject=subject, data=pack(ev)))

    return session, job_id, event


async def test_a_tab_drops_events_of_an_owner_that_lost_the_job():
    session, job_id, event = _tab_with_a_job()

    await event(frame(job_id, 31, 2))  # the new owner, after a take-over
    await event(frame(job_id, 35, 1))  # the old owner's frame, late
    await event(done(job_id, 1, value=-1.0))  # ... and its `done`
    assert job_id in session.jobs and session.stale_events == 2  # the job goes on: that was no result
    assert session.outbox._frames[job_id].step == 31  # the page still has the new owner's frame
    await event(done(job_id, 2, value=0.5))
    assert job_id not in session.jobs
    shown = session.outbox._frames[job_id]
    assert isinstance(shown, DoneEvent) and shown.epoch == 2 and float(shown.images.max()) == 0.5


async def test_a_forged_event_of_a_huge_epoch_does_not_blind_the_tab():
    """A frame of epoch 2^63-1 published on an open bus made the tab drop every real event
    after it. It is ignored (more than client.epochs.MAX_EPOCH_JUMP above the job's highest epoch)."""
    session, job_id, event = _tab_with_a_job()

    await event(frame(job_id, 5, 1))
    await event(frame(job_id, 6, 2**63 - 1))  # forged
    assert session.stale_events == 1 and session.jobs[job_id].epochs.implausible == 1
    assert session.outbox._frames[job_id].step == 5
    await event(frame(job_id, 7, 1))  # the real owner's next frame is shown
    assert session.outbox._frames[job_id].step == 7
    await event(done(job_id, 1, value=0.5))
    assert job_id not in session.jobs and isinstance(session.outbox._frames[job_id], DoneEvent)
