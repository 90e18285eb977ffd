"""A `done` too large for one message, for a job that asked for parts (`JobRequest.image_parts`): the
coordinator's split (`coordinator.done_parts`) and the client's join (`client.done_parts`) give back the very
same arrays, every message under the limit; the messages' rules (`schemas.messages`) and what a job may ask
for at submit (`coordinator.admission`). No bus here: the fleet tests are in test_done_parts_fleet.py."""

from __future__ import annotations

import math

import msgpack
import numpy as np
import pytest

from client.done_parts import DoneParts
from coordinator.admission import check_event_sizes, largest_event
from coordinator.done_parts import PART_MARGIN_BYTES, done_messages, rows_per_part
from coordinator.scheduler import Rejected
from schemas import (
    DoneEvent,
    DonePartEvent,
    ErrorCode,
    JobEvent,
    JobRequest,
    ProtocolError,
    encode_tensor,
    pack,
    unpack,
)
from schemas.limits import MAX_PAYLOAD_BYTES

IMAGE = (3, 256, 256)  # 786 432 bytes of float32 per image: 10 per part
K = 4


def _done(n: int, *, image=IMAGE, latents: tuple | None = None, epoch: int | None = 1) -> DoneEvent:
    rng = np.random.default_rng(n)
    return DoneEvent(
        job_id="j" * 64,
        labels=[int(i % 7) - 1 for i in range(n)],
        images=rng.uniform(-1, 1, (n, *image)).astype(np.float32),
        latents=None if latents is None else rng.standard_normal((n, *latents)).astype(np.float32),
        usage=rng.random((n, K)).astype(np.float32),
        steps=40,
        strategy="topk",
        elapsed_s=3.5,
        notes=["row 2: expert 1 unavailable, fell back to 0"],
        epoch=epoch,
    )


def _events(done: DoneEvent, in_parts: bool = True) -> tuple[list[bytes], list]:
    data = list(done_messages(done, in_parts=in_parts))
    return data, [unpack(d, JobEvent) for d in data]


def _same(a: np.ndarray, b: np.ndarray) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def test_a_done_that_fits_is_one_message_unchanged_whatever_the_job_asked():
    done = _done(10)  # 7.5 MiB of images: fits
    for in_parts in (True, False):
        data, events = _events(done, in_parts)
        assert data == [pack(done)] and isinstance(events[0], DoneEvent) and events[0].parts is None


def test_a_done_too_large_comes_in_parts_each_under_the_limit_and_joins_bit_identical():
    done = _done(26, latents=(4, 32, 32))
    data, events = _events(done)
    per = rows_per_part(4 * math.prod(IMAGE))
    assert per == 10
    assert [e.kind for e in events] == ["done_part"] * 4 + ["done"]  # 10 + 10 + 6 images, all 26 latents, done
    assert max(map(len, data)) <= MAX_PAYLOAD_BYTES - PART_MARGIN_BYTES + 1024  # under the limit, with margin
    parts, last = events[:-1], events[-1]
    assert [(p.part, p.parts, p.start, p.field, len(p.rows)) for p in parts] == [
        (0, 4, 0, "images", 10),
        (1, 4, 10, "images", 10),
        (2, 4, 20, "images", 6),
        (3, 4, 0, "latents", 26),
    ]
    assert all(p.total == 26 and p.epoch == 1 and p.job_id == done.job_id for p in parts)
    assert last.parts == 4 and last.images is None and last.latents is None and last.labels == done.labels
    wire = msgpack.unpackb(data[-1], raw=False)
    assert "images" not in wire and "latents" not in wire and wire["parts"] == 4
    joined = DoneParts(done.job_id)
    for p in reversed(parts):  # any order
        joined.add(p)
    whole = joined.whole(last)
    _same(whole.images, done.images)
    _same(whole.latents, done.latents)
    assert whole.parts is None and whole.labels == done.labels and whole.elapsed_s == done.elapsed_s
    _same(whole.usage, done.usage)
    assert list(done_messages(done, in_parts=True)) == data  # published again: the very same messages
    with pytest.raises(ProtocolError) as refused:  # a job that did not ask: too large, as ever
        list(done_messages(done, in_parts=False))
    assert refused.value.code == ErrorCode.TOO_LARGE


def test_missing_parts_are_named_and_a_copy_published_again_fills_them():
    done = _done(21)
    _, events = _events(done)
    parts, last = events[:-1], events[-1]
    joined = DoneParts(done.job_id)
    joined.add(parts[0])
    joined.add(parts[2])
    assert joined.whole(last) is None and joined.missing(last) == [1]
    assert "without 1 of its 3 parts (done_part 1: lost on the way)" in joined.incomplete(last)
    for p in parts:  # the copy a status request publishes: each part kept once
        joined.add(p)
    _same(joined.whole(last).images, done.images)


def test_parts_of_another_owner_epoch_are_not_mixed():
    old, new = _events(_done(21, epoch=1))[1], _events(_done(21, epoch=2))[1]
    joined = DoneParts()
    for p in old[:-1]:
        joined.add(p)
    assert joined.missing(new[-1]) == [0, 1, 2]  # the old owner's parts are no part of the new owner's done
    joined.add(new[0])
    joined.add(old[1])  # stale: dropped
    assert joined.missing(new[-1]) == [1, 2]


def _part(**fields) -> DonePartEvent:
    base = dict(job_id="j", part=0, parts=2, start=0, total=4, images=np.zeros((2, 1, 4, 4), np.float32))
    return DonePartEvent(**{**base, **fields})


def _counted(parts: int = 2, n: int = 4) -> DoneEvent:
    return DoneEvent(
        job_id="j",
        digits=[1] * n,
        parts=parts,
        usage=np.ones((n, 2), np.float32),
        steps=1,
        strategy="top1",
        elapsed_s=0,
    )


@pytest.mark.parametrize(
    "parts, words",
    [
        ([_part(), _part(part=1, start=1)], "leave out or repeat rows at row 1"),  # overlap
        ([_part(), _part(part=1, start=2, images=np.zeros((1, 1, 4, 4), np.float32))], "hold 3 rows for 4"),
        ([_part(), _part(part=1, start=2, images=np.zeros((2, 1, 4, 5), np.float32))], "differ in shape"),
        ([_part(), _part(part=1, parts=3, start=2)], "do not belong to a done of 2 parts"),
        ([_part(latents=np.zeros((2, 1, 4, 4), np.float32), images=None), _part(part=1, start=2)], "leave out"),
    ],
)
def test_parts_that_do_not_add_up_are_refused_bad_shape(parts, words):
    joined = DoneParts("j")
    for p in parts:
        joined.add(p)
    with pytest.raises(ProtocolError) as refused:
        joined.whole(_counted())
    assert refused.value.code == ErrorCode.BAD_SHAPE and words in refused.value.message, refused.value.message


def _refused(obj: dict, tp, code: ErrorCode, *words: str) -> None:
    with pytest.raises(ProtocolError) as info:
        unpack(msgpack.packb(obj, use_bin_type=True), tp)
    assert info.value.code is code, info.value
    assert all(w in info.value.message for w in words), info.value.message


def test_the_messages_refuse_what_cannot_be_a_part_or_a_counted_done():
    part = msgpack.unpackb(pack(_part()), raw=False)
    assert unpack(pack(_part()), DonePartEvent).rows.shape == (2, 1, 4, 4)
    _refused(
        {**part, "latents": encode_tensor(np.zeros((2, 1, 4, 4), np.float32))}, DonePartEvent, ErrorCode.BAD_REQUEST
    )
    _refused({k: v for k, v in part.items() if k != "images"}, DonePartEvent, ErrorCode.BAD_REQUEST, "exactly one")
    _refused({**part, "part": 2}, DonePartEvent, ErrorCode.BAD_REQUEST, "part 2 of 2")
    _refused({**part, "start": 3}, DonePartEvent, ErrorCode.BAD_SHAPE, "past the job's 4 images")
    _refused({**part, "total": 0}, DonePartEvent, ErrorCode.BAD_REQUEST, "total")
    _refused({**part, "parts": 513}, DonePartEvent, ErrorCode.BAD_REQUEST, "parts")
    _refused({**part, "images": encode_tensor(np.zeros((0, 1, 4, 4), np.float32))}, DonePartEvent, ErrorCode.BAD_SHAPE)
    _refused({**part, "images": encode_tensor(np.zeros((2, 16), np.float32))}, DonePartEvent, ErrorCode.BAD_SHAPE)
    _refused({**part, "images": encode_tensor(np.zeros((2, 1, 4, 4), np.int32))}, DonePartEvent, ErrorCode.BAD_DTYPE)
    nan = encode_tensor(np.full((2, 1, 4, 4), np.nan, np.float32))
    _refused({**part, "images": nan}, DonePartEvent, ErrorCode.NON_FINITE)
    done = msgpack.unpackb(pack(_counted()), raw=False)
    assert "images" not in done and unpack(pack(_counted()), DoneEvent).parts == 2
    four = encode_tensor(np.zeros((4, 1, 4, 4), np.float32))
    _refused({**done, "images": four}, DoneEvent, ErrorCode.BAD_REQUEST, "exactly one of images")
    _refused({k: v for k, v in done.items() if k != "parts"}, DoneEvent, ErrorCode.BAD_REQUEST, "exactly one of images")
    _refused({**done, "latents": four}, DoneEvent, ErrorCode.BAD_REQUEST, "latents in parts")
    _refused({**done, "parts": 0}, DoneEvent, ErrorCode.BAD_REQUEST, "parts")
    _refused({**done, "usage": encode_tensor(np.ones((3, 2), np.float32))}, DoneEvent, ErrorCode.BAD_SHAPE, "N = 4")
    request = msgpack.unpackb(pack(JobRequest(count=3)), raw=False)
    assert "image_parts" not in request  # not on the wire unless asked: older coordinators refuse the key
    assert unpack(pack(JobRequest(count=3, image_parts=True)), JobRequest).image_parts is True
    _refused({**request, "image_parts": 1}, JobRequest, ErrorCode.BAD_REQUEST, "image_parts")


def test_admission_with_parts_drops_the_done_refusal_but_keeps_the_frame_one():
    sample = IMAGE  # a 256px pixel fleet
    many = JobRequest(count=256, steps=40, stream=False)
    with pytest.raises(Rejected) as refused:
        check_event_sizes(many, sample, sample, K, False, MAX_PAYLOAD_BYTES)
    assert refused.value.code == ErrorCode.TOO_LARGE and "or set image_parts" in refused.value.reason
    parted = many.model_copy(update={"image_parts": True})
    check_event_sizes(parted, sample, sample, K, False, MAX_PAYLOAD_BYTES)
    assert largest_event(parted, sample, sample, K, False)[0] == "done_part"
    ten = JobRequest(count=10, steps=40, stream=False, image_parts=True)  # fits whole: the done counts whole
    assert largest_event(ten, sample, sample, K, False) == largest_event(
        ten.model_copy(update={"image_parts": False}), sample, sample, K, False
    )
    streamed = parted.model_copy(update={"stream": True})  # its frames (float16) still cannot fit
    with pytest.raises(Rejected, match=r"frame event would be .* leave out frame_x1 / previews, or stream false"):
        check_event_sizes(streamed, sample, sample, K, False, MAX_PAYLOAD_BYTES)
    latent = JobRequest(count=256, steps=40, image_parts=True, return_latents=True)  # a 256px latent fleet
    check_event_sizes(latent, (4, 32, 32), sample, K, True, MAX_PAYLOAD_BYTES)
    huge = JobRequest(count=2, steps=40, stream=False, image_parts=True)  # one 3x1024x1024 image: 12 MiB
    with pytest.raises(Rejected, match="one image of 3x1024x1024 is 12.0 MiB: even alone it does not fit"):
        check_event_sizes(huge, (3, 1024, 1024), (3, 1024, 1024), K, False, MAX_PAYLOAD_BYTES)


class FakeBus:
    """What the coordinator publishes: (subject, bytes) in order."""

    def __init__(self):
        self.published: list[tuple[str, bytes]] = []

    async def publish(self, subject: str, data: bytes) -> None:
        self.published.append((subject, data))


@pytest.mark.parametrize("image_parts", [True, False])
@pytest.mark.parametrize("keep_mb", [64, 1], ids=["kept", "too large to keep"])
async def test_the_publisher_sends_a_job_that_asked_its_done_in_parts_the_same_each_time(image_parts, keep_mb, caplog):
    from coordinator.events import EventPublisher
    from coordinator.ledger import JobLedger
    from schemas import subjects

    ledger, bus = JobLedger(keep_finished_bytes=keep_mb << 20), FakeBus()
    events = EventPublisher(bus, ledger)
    ledger.admit("internal-1", "alice", "mine", steps=40, image_parts=image_parts)
    assert ledger.in_parts("alice", "mine") is image_parts
    done = _done(21, epoch=None).model_copy(update={"job_id": "internal-1"})  # 16.5 MB of images
    await events.publish_now(done)  # the job's end: remembered for status requests (if it fits), then published
    if not image_parts:  # refused at submit in a real fleet: never published in parts to a client that cannot join
        assert bus.published == [] and "cannot publish done for job mine" in caplog.text
        return
    subject = subjects.job_events("alice", "mine")
    assert [s for s, _ in bus.published] == [subject] * 4
    kinds = [unpack(data, JobEvent).kind for _, data in bus.published]
    assert kinds == ["done_part"] * 3 + ["done"]
    kept = ledger.finished("alice", "mine")
    if keep_mb == 1:  # a result over the ledger's bytes is not kept: it cannot be published again
        assert kept is None and not ledger.in_parts("alice", "mine")
        return
    assert ledger.in_parts("alice", "mine")  # still known once the job has finished
    first = list(bus.published)
    await events.send("alice", kept[0])  # what a status request publishes again
    assert bus.published[4:] == first


def test_a_durable_jobs_checkpoint_keeps_image_parts():
    """The taker of a durable job reads image_parts from its checkpoint (coordinator.durable_jobs)."""
    from coordinator.snapshot import decode, encode
    from tests.coordinator.test_scheduler import make

    sched = make()
    sched.submit(JobRequest(job_id="d", digits=[1, 2], steps=3, seed=1, image_parts=True), 0.0)
    assert decode(encode(sched.checkpoint("d")))[0].request.image_parts is True
