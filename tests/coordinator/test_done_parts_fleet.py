"""A job whose `done` cannot fit one message, over a real nats-server: with `image_parts` (what `run_job` sets) it
arrives whole, bit for bit the coordinator's own result, in messages that each fit the limit (a subscriber on the
job's events subject weighs every one); without it, it is refused at submit as before; a status request after it
publishes the parts and the `done` again, byte for byte; a part lost on the client's side is asked for again and
recovered, or, lost every time, reported by name. A fleet of 3x256x256 pixels (786 KB of float32 per image: 10 fit
one message) whose "experts" are an elementwise stand-in: what is tested is the coordinator and the client, not a
network."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

import client.jobs as jobs
from bus.connect import flushed
from client.jobs import JobFailed, job_status, run_job
from coordinator.local_fleet import LabelRouter
from coordinator.service import Coordinator
from schemas import DoneEvent, ErrorCode, JobRequest, subjects
from schemas.limits import MAX_PAYLOAD_BYTES
from tests.waiting import wait_until

IMAGE = (3, 256, 256)
C2E = [0] * 5 + [1] * 5
N = 16  # 12.6 MB of images: 2 parts (10 + 6)


class Elementwise:
    """Stand-in experts: each row's velocity pulls it towards a flat image of its label's grey level, elementwise
    (so a row's result does not depend on the rows batched beside it), in microseconds."""

    async def velocity(self, expert, x, t, y, row_ids, guidance=None):
        target = (np.asarray(y, np.float32) / 4.5 - 1.0).reshape(-1, 1, 1, 1)
        return (target - x) * np.float32(1.0 + 0.25 * expert)


@pytest.fixture
async def coordinator(nats_url):
    async with Coordinator(
        LabelRouter(C2E, 2), num_experts=2, nats_url=nats_url, transport=Elementwise(), image_shape=IMAGE, max_rows=64
    ) as coord:
        yield coord


class Recorder:
    """Every message on one job's events subject: its kind and its bytes."""

    def __init__(self):
        self.messages: list[tuple[str, bytes]] = []

    async def put(self, msg) -> None:
        self.messages.append((msgpack.unpackb(msg.data, raw=False)["kind"], bytes(msg.data)))

    def kinds(self) -> list[str]:
        return [kind for kind, _ in self.messages]


async def _recorded(nc, job_id: str) -> tuple[Recorder, object]:
    rec = Recorder()
    sub = await nc.subscribe(subjects.job_events("anon", job_id), cb=rec.put)
    await flushed(nc)
    return rec, sub


def _request(job_id: str, n: int = N) -> JobRequest:
    return JobRequest(job_id=job_id, labels=[i % 10 for i in range(n)], steps=2, seed=11, stream=False)


def _same(a: np.ndarray, b: np.ndarray) -> None:
    assert a.dtype == b.dtype == np.float32 and a.shape == b.shape and a.tobytes() == b.tobytes()


async def test_a_done_too_large_arrives_whole_in_parts_each_under_the_limit(nc, coordinator):
    rec, sub = await _recorded(nc, "big")
    done = await run_job(nc, _request("big"), timeout=60)
    assert isinstance(done, DoneEvent) and done.parts is None and done.images.shape == (N, *IMAGE)
    await wait_until(lambda: rec.kinds()[-1:] == ["done"], what="the done on the recording subscription")
    await sub.unsubscribe()
    assert rec.kinds() == ["accepted", "done_part", "done_part", "done"], rec.kinds()
    sizes = [len(data) for _, data in rec.messages]
    assert max(sizes) <= MAX_PAYLOAD_BYTES and sum(sizes) > N * np.prod(IMAGE) * 4, sizes
    mine = coordinator.finished_event("big", client="anon")  # the coordinator's own result, before it was split
    _same(done.images, mine.images)
    _same(done.usage, mine.usage)
    assert done.labels == mine.labels and done.steps == 2
    # the first ten images are those of a ten-image job of the same seed and labels, which fits one message
    ten = await run_job(nc, _request("ten", 10), timeout=60, image_parts=False)
    _same(ten.images, done.images[:10])
    # the same job without image_parts is refused at submit, as before, saying what to do
    with pytest.raises(JobFailed) as refused:
        await run_job(nc, _request("plain"), timeout=60, image_parts=False)
    assert refused.value.code == ErrorCode.TOO_LARGE
    assert "done event would be" in refused.value.reason and "or set image_parts" in refused.value.reason


async def test_a_status_request_after_the_job_publishes_the_parts_and_the_done_again(nc, coordinator):
    rec, sub = await _recorded(nc, "again")
    await run_job(nc, _request("again"), timeout=60)
    await wait_until(lambda: rec.kinds()[-1:] == ["done"], what="the done on the recording subscription")
    first = rec.messages[1:]
    rec.messages.clear()
    status = await job_status(nc, "again")
    assert status.state == "done"
    await wait_until(lambda: len(rec.messages) == 3, what="the parts and the done published again")
    await sub.unsubscribe()
    assert rec.messages == first  # the same messages, byte for byte, in the same order
    assert coordinator.republished == 1


def _dropping(monkeypatch, part: int, times: int | None) -> list[int]:
    """Make run_job's event inbox drop done_part `part` (the first `times` copies; None: every one)."""
    dropped: list[int] = []
    put = jobs._EventInbox.put

    async def lossy(self, msg):
        head = msgpack.unpackb(msg.data, raw=False)
        if head["kind"] == "done_part" and head["part"] == part and (times is None or len(dropped) < times):
            dropped.append(part)
            return
        await put(self, msg)

    monkeypatch.setattr(jobs._EventInbox, "put", lossy)
    return dropped


async def test_a_part_lost_on_the_way_is_asked_for_again_and_the_result_comes_whole(nc, coordinator, monkeypatch):
    dropped = _dropping(monkeypatch, part=1, times=1)
    done = await run_job(nc, _request("lossy"), timeout=60)
    assert dropped == [1] and coordinator.republished == 1  # one status request brought the copy
    _same(done.images, coordinator.finished_event("lossy", client="anon").images)


async def test_a_part_lost_every_time_is_reported_by_name(nc, coordinator, monkeypatch):
    dropped = _dropping(monkeypatch, part=0, times=None)
    monkeypatch.setattr(jobs, "MAX_RESULT_ASKS", 1)  # one request again (2 s apart each, by default 3)
    with pytest.raises(JobFailed) as failed:
        await run_job(nc, _request("lost"), timeout=60)
    assert dropped == [0, 0] and coordinator.republished == 1
    err = failed.value
    assert err.code == ErrorCode.UNAVAILABLE and err.job_id == "lost"
    assert "the result of job lost came without 1 of its 2 parts (done_part 0: lost on the way)" in err.reason
    assert "still after asking for it again 1 times" in err.reason
