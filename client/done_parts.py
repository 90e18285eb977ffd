"""A `done` sent in parts made whole again (docs/PROTOCOL.md, `done_part`), for `run_job` and the web viewer.

A job that sets `JobRequest.image_parts` may get its result as `done_part` events (slices of its `images`, then
of its `latents`) followed by a `done` that carries neither but `parts`, their count. `DoneParts` keeps one
job's parts and gives back the `done` with its full `images` (and `latents`), so the caller sees a `done`
like any other. Parts can be lost on the way (a slow consumer's dropped messages, a reconnect): then
`whole` says None and `missing` which; the client asks for the job's status, which publishes the parts and
the `done` again (at most every `REPUBLISH_GAP_S` per job), and gives up after `MAX_RESULT_ASKS` such
requests. Copies are identical, so each part is kept once, whichever copy brought it. Pure: no I/O.

    parts = DoneParts(job_id)
    parts.add(part)                      # each done_part event
    done = parts.whole(done)             # the done made whole; None while parts are missing
"""

from __future__ import annotations

import numpy as np

from client.epochs import epoch_of
from schemas import DoneEvent, DonePartEvent, ErrorCode, ProtocolError

#: Most times a client asks for a result again because parts of it did not arrive, before it gives up.
MAX_RESULT_ASKS = 3
#: Seconds between two such requests: a coordinator publishes a finished job's result again at most once
#: every 2 s per job (docs/PROTOCOL.md, `job_status`); a request sooner gets the status alone.
REPUBLISH_GAP_S = 2.1


class DoneParts:
    """One job's `done_part` events, kept until its `done` comes. Parts of an owner epoch lower than the
    highest seen (a coordinator that lost the job) are dropped; a part seen twice is kept once."""

    def __init__(self, job_id: str = ""):
        self.job_id = job_id
        self._parts: dict[int, DonePartEvent] = {}
        self._epoch = 0
        self.asks = 0  # requests for the result again, made because parts were missing

    def add(self, part: DonePartEvent) -> None:
        epoch = epoch_of(part)
        if epoch < self._epoch:
            return
        if epoch > self._epoch:  # a new owner's result: the old one's parts are no part of it
            self._parts.clear()
            self._epoch = epoch
        self._parts.setdefault(part.part, part)

    def missing(self, done: DoneEvent) -> list[int]:
        """The part numbers of `done` not received (all of them when the parts came from another owner epoch)."""
        if done.parts is None:
            return []
        if epoch_of(done) != self._epoch:
            return list(range(done.parts))
        return [i for i in range(done.parts) if i not in self._parts]

    def whole(self, done: DoneEvent) -> DoneEvent | None:
        """`done` with its `images` (and `latents`) back: `done` itself when it came whole, None while parts
        are missing (`missing`). Raises ProtocolError (`bad_shape`) when the parts do not make its images:
        another count of parts, rows that overlap, leave a gap or run past the job's images, shapes that differ."""
        if done.parts is None:
            return done
        if self.missing(done):
            return None
        parts = [self._parts[i] for i in range(done.parts)]
        n = len(done.classes)
        odd = [p.part for p in parts if p.parts != done.parts or p.total != n]
        if odd or len(self._parts) != done.parts:
            extra = sorted(set(self._parts) - set(range(done.parts)))
            raise _bad(f"parts {odd or extra} do not belong to a done of {done.parts} parts and {n} images", done)
        fields = {name: _joined([p for p in parts if p.field == name], n, name, done) for name in ("images", "latents")}
        if fields["images"] is None:
            raise _bad("no part carries its images", done)
        self._parts.clear()
        return done.model_copy(update={**fields, "parts": None})

    def incomplete(self, done: DoneEvent) -> str:
        """A sentence saying which parts of `done` did not arrive."""
        missing = self.missing(done)
        shown = ", ".join(map(str, missing[:10])) + (", …" if len(missing) > 10 else "")
        return (
            f"the result of job {done.job_id} came without {len(missing)} of its {done.parts} parts "
            f"(done_part {shown}: lost on the way)"
        )


def _joined(parts: list[DonePartEvent], n: int, name: str, done: DoneEvent) -> np.ndarray | None:
    """The rows of one field, put together from its parts in row order; None when no part carries it.
    Raises ProtocolError (`bad_shape`) unless they tile rows 0 to n - 1 exactly, all of one shape."""
    if not parts:
        return None
    parts = sorted(parts, key=lambda p: p.start)
    at = 0
    for p in parts:
        if p.start != at:
            raise _bad(f"its {name} parts leave out or repeat rows at row {min(at, p.start)}", done)
        if p.rows.shape[1:] != parts[0].rows.shape[1:]:
            raise _bad(
                f"its {name} parts differ in shape: {list(p.rows.shape[1:])} against {list(parts[0].rows.shape[1:])}",
                done,
            )
        at += p.rows.shape[0]
    if at != n:
        raise _bad(f"its {name} parts hold {at} rows for {n} images", done)
    return np.concatenate([np.asarray(p.rows, np.float32) for p in parts])


def _bad(what: str, done: DoneEvent) -> ProtocolError:
    return ProtocolError(ErrorCode.BAD_SHAPE, f"the parts of job {done.job_id}'s result do not add up: {what}")
