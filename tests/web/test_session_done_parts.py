"""The web viewer's server side puts a `done` sent in parts (`image_parts`, which every job of the viewer sets)
back together before the page sees it: the page gets one `done` with every image. A part that did not come is
asked for again (a status request, which publishes the result again); still missing after
client.done_parts.MAX_RESULT_ASKS requests, or parts that do not add up, the page gets `failed`. Pure: fake
connection, the events made by the coordinator's own split (coordinator.done_parts)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np

import web.session as web_session
from coordinator.done_parts import done_messages
from schemas import DoneEvent, DonePartEvent, FailedEvent, pack, subjects
from web.session import Session, _Job

N = 12
IMAGE = (3, 256, 256)  # 10 images a part: 2 parts


def _done(job_id: str) -> DoneEvent:
    rng = np.random.default_rng(3)
    return DoneEvent(
        job_id=job_id,
        images=rng.uniform(-1, 1, (N, *IMAGE)).astype(np.float32),
        digits=[i % 10 for i in range(N)],
        usage=np.ones((N, 2), np.float32),
        steps=4,
        strategy="top1",
        elapsed_s=1.0,
        epoch=0,
    )


def _tab(monkeypatch):
    """(a viewer session holding one announced job, its id, a function that delivers packed events of it, the
    status requests the session made)."""
    nc = SimpleNamespace(_inbox_prefix=b"_INBOX", options={}, connected_url=None)

    async def send(_msg):
        pass

    session = Session(nc, send)
    job_id = "web0123456789abcdef"
    session.jobs[job_id] = _Job(announced=True)
    subject = subjects.job_events(session.client, job_id)
    asked: list[str] = []

    async def status(_nc, asked_id, **kw):
        asked.append(asked_id)

    monkeypatch.setattr(web_session, "job_status", status)

    async def deliver(data: bytes):
        await session._on_event(SimpleNamespace(subject=subject, data=data))

    return session, job_id, deliver, asked


async def test_a_done_in_parts_reaches_the_page_whole(monkeypatch):
    session, job_id, deliver, asked = _tab(monkeypatch)
    done = _done(job_id)
    messages = list(done_messages(done, in_parts=True))
    assert len(messages) == 3  # two parts and the done that counts them
    for data in messages:
        await deliver(data)
    assert job_id not in session.jobs and not asked
    shown = session.outbox._frames[job_id]
    assert isinstance(shown, DoneEvent) and shown.parts is None
    assert shown.images.tobytes() == done.images.tobytes()


async def test_a_missing_part_is_asked_for_again_then_the_page_gets_the_whole_done(monkeypatch):
    session, job_id, deliver, asked = _tab(monkeypatch)
    part0, part1, counted = list(done_messages(_done(job_id), in_parts=True))
    await deliver(part0)
    await deliver(counted)  # part 1 was lost
    await asyncio.gather(*session._tasks)  # the requests for the result again
    assert asked == [job_id] and job_id in session.jobs and job_id not in session.outbox._frames
    for data in (part0, part1, counted):  # the copy the status request published
        await deliver(data)
    shown = session.outbox._frames[job_id]
    assert isinstance(shown, DoneEvent) and shown.images.shape == (N, *IMAGE)


async def test_parts_still_missing_after_the_requests_fail_the_job_on_the_page(monkeypatch):
    monkeypatch.setattr(web_session, "REPUBLISH_GAP_S", 0.0)
    session, job_id, deliver, asked = _tab(monkeypatch)
    part0, _, counted = list(done_messages(_done(job_id), in_parts=True))
    for _ in range(web_session.MAX_RESULT_ASKS + 1):
        await deliver(part0)
        await deliver(counted)
    await asyncio.gather(*session._tasks)  # the requests for the result again
    assert len(asked) == web_session.MAX_RESULT_ASKS and job_id not in session.jobs
    shown = session.outbox._frames[job_id]
    assert isinstance(shown, FailedEvent) and shown.code.value == "unavailable"
    assert "without 1 of its 2 parts (done_part 1: lost on the way), still after asking for it again 3" in shown.reason


async def test_parts_that_do_not_add_up_fail_the_job_on_the_page(monkeypatch):
    session, job_id, deliver, _ = _tab(monkeypatch)
    rows = np.zeros((10, *IMAGE), np.float32)
    await deliver(pack(DonePartEvent(job_id=job_id, part=0, parts=2, start=0, total=N, images=rows, epoch=0)))
    await deliver(pack(DonePartEvent(job_id=job_id, part=1, parts=2, start=5, total=N, images=rows[:7], epoch=0)))
    await deliver(list(done_messages(_done(job_id), in_parts=True))[-1])
    shown = session.outbox._frames[job_id]
    assert isinstance(shown, FailedEvent) and shown.code.value == "bad_shape" and "do not add up" in shown.reason
