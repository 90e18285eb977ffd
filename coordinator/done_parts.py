"""A `done` too large for one message, as the messages that carry it (pure, no I/O): for a job that asked
for parts (`JobRequest.image_parts`), its `images` (then its `latents`, when it has them) in `done_part`
events of whole images, each under the message limit with `PART_MARGIN_BYTES` to spare, then the `done`
without them that counts the parts (`DoneEvent.parts`). A `done` that fits one message is that message,
unchanged, whatever the job asked. The same `done` always gives the same messages, so a result published
again (a status request, a durable job's take-over) repeats its parts identically.

    for data in done_messages(done, in_parts=True):
        await nc.publish(subject, data)         # in this order, on the job's events subject
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from schemas import DoneEvent, DonePartEvent, ErrorCode, ProtocolError, pack
from schemas.limits import MAX_PAYLOAD_BYTES

#: Bytes a `done_part` keeps free below the message limit for everything beside its tensor's data (map keys,
#: job id, indices, epoch, the tensor's dtype and shape: well under 1 KiB); the rest is margin.
PART_MARGIN_BYTES = 64 * 1024


def rows_per_part(row_bytes: int, limit: int = MAX_PAYLOAD_BYTES) -> int:
    """Whole rows (images or latents) of `row_bytes` bytes each that one `done_part` carries; 0 when not even
    one fits (such a job is refused at submit: `admission.check_event_sizes`)."""
    return max(0, (limit - PART_MARGIN_BYTES) // max(1, int(row_bytes)))


def tensor_bytes(done: DoneEvent) -> int:
    """Bytes of the done's tensors (images, usage, latents): a lower bound of its packed size."""
    return sum(int(a.nbytes) for a in (done.images, done.usage, done.latents) if a is not None)


def done_messages(done: DoneEvent, *, in_parts: bool, limit: int = MAX_PAYLOAD_BYTES) -> Iterator[bytes]:
    """The packed messages that carry `done`, to publish in this order: `done` itself when it fits one message
    of `limit` bytes (or when the job did not ask for parts: then a `done` too large raises `too_large`, as
    `pack` does), else its `done_part` events, then the `done` that counts them. Raises ProtocolError
    (`too_large`) when one image alone cannot fit a part."""
    if not in_parts or done.images is None or tensor_bytes(done) <= limit:
        try:
            yield pack(done, max_bytes=limit)
            return
        except ProtocolError as err:
            if not in_parts or done.images is None or err.code != ErrorCode.TOO_LARGE:
                raise
    parts = split_done(done, limit)
    for part in parts:
        yield pack(part, max_bytes=limit)
    yield pack(done.model_copy(update={"images": None, "latents": None, "parts": len(parts)}), max_bytes=limit)


def split_done(done: DoneEvent, limit: int = MAX_PAYLOAD_BYTES) -> list[DonePartEvent]:
    """The `done_part` events of `done` (which carries its images): its images in parts of as many whole
    images as fit `limit`, then its latents (when it has them) likewise, numbered from 0."""
    fields = [(name, a) for name, a in (("images", done.images), ("latents", done.latents)) if a is not None]
    slices = []
    for name, rows in fields:
        rows = np.asarray(rows)
        per = rows_per_part(rows[0].nbytes if len(rows) else 1, limit)
        if per < 1:
            raise ProtocolError(
                ErrorCode.TOO_LARGE,
                f"one of {done.job_id}'s {name} is {rows[0].nbytes} bytes: even alone it does not fit a "
                f"{limit}-byte message",
            )
        slices += [(name, start, rows[start : start + per]) for start in range(0, len(rows), per)]
    total = len(done.classes)
    return [
        DonePartEvent.model_construct(
            job_id=done.job_id, part=i, parts=len(slices), start=start, total=total, epoch=done.epoch, **{name: rows}
        )
        for i, (name, start, rows) in enumerate(slices)
    ]
