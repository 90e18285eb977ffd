"""What makes an expert worker's reply usable (pure: bytes in, a float32 velocity or an exception out).

A reply is unusable (`BadReply`) when it is undecodable, not a `step_reply`, for another expert, with
other row ids than the request's, a velocity of the wrong shape or dtype, or with NaN/Inf (also after
the cast to float32); when it is a run-ahead velocity where the step's own is due; and when its worker
serves another model spec: it claims a worker discovery rejected (coordinator/worker_discovery.py), or,
on a fleet whose spec was checked (requests carry the checked shape), it is a `bad_shape` error, which
only a worker of another spec answers. Any other `ErrorReply` is the worker's answer (`ReplyError`);
the retry policy (coordinator/retry_policy.py) says what follows either.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np

from schemas import ErrorCode, ErrorReply, ProtocolError, StepReply, StepResult, loads, validate
from schemas.tensor import widen_float32

if TYPE_CHECKING:
    from .fleet_spec import RejectedWorker


class BadReply(Exception):
    """A reply we cannot use. `worker` is the worker id the reply claims ("" if none); `odd_spec`: refused
    because its worker serves another model spec (a rejected worker's reply, or a `bad_shape` error, which
    names no worker)."""

    def __init__(self, why: str, worker: str = "", *, odd_spec: bool = False):
        super().__init__(why)
        self.why = why
        self.worker = worker
        self.odd_spec = odd_spec


class ReplyError(Exception):
    """A worker answered with an ErrorReply of `code`."""

    def __init__(self, code: ErrorCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


def check_reply(
    data: bytes,
    expert: int,
    shape: tuple[int, ...],
    row_ids,
    *,
    rejected: Mapping[str, RejectedWorker],
    fleet_checked: bool,
    first: bool = True,
) -> tuple[np.ndarray, str, StepReply]:
    """(the velocity as float32 [n, C, H, W], the worker id the reply claims, the reply) of a reply to a request
    of `expert` for rows `row_ids` of x_t of `shape`; raises BadReply or ReplyError. rejected: the workers of
    another spec, by id; fleet_checked: the fleet's spec is known (so a bad_shape is an odd worker's);
    first: the reply due first, the step's own velocity (the further replies of a run ahead say their index)."""
    try:
        raw = loads(data)
    except ProtocolError as err:
        raise BadReply(f"undecodable ({err.code.value}: {err.message})") from None
    worker = _claimed_worker(raw)
    odd = rejected.get(worker) if worker else None
    if odd is not None:
        raise BadReply(
            f"its model spec differs from the fleet's ({odd.differs}); reply not used", worker, odd_spec=True
        )
    try:
        reply = validate(raw, StepResult)
    except ProtocolError as err:
        raise BadReply(f"{err.code.value}: {err.message}", worker) from None
    if isinstance(reply, ErrorReply):
        if reply.code == ErrorCode.BAD_SHAPE and fleet_checked:
            # requests carry the checked fleet's shape: only a worker of another spec says bad_shape (from
            # the queue group, unnamed); try again elsewhere
            why = f"bad_shape: {reply.message} (a worker whose model spec differs from the fleet's)"
            raise BadReply(why, odd_spec=True)
        raise ReplyError(reply.code, reply.message)
    assert isinstance(reply, StepReply)
    if reply.expert != expert:
        raise BadReply(f"answers for expert {reply.expert}, not {expert}", worker)
    if reply.row_ids and reply.row_ids != list(row_ids):
        raise BadReply("row_ids do not match the request", worker)
    v = reply.velocity
    if v.shape != shape:
        raise BadReply(f"velocity shape {list(v.shape)} != request {list(shape)}", worker)
    if v.dtype.kind != "f":
        raise BadReply(f"velocity dtype {v.dtype.str} is not float", worker)
    v = widen_float32(v)  # float32: the received bytes' read-only view, no copy
    if not np.isfinite(v).all():  # e.g. float64 values beyond float32's range
        raise BadReply("velocity has NaN/Inf values as float32", worker)
    if first and reply.ahead_index:
        raise BadReply(f"a run-ahead velocity ({reply.ahead_index}) where the step's own was due", worker)
    return v, worker, reply


def _claimed_worker(raw) -> str:
    """The worker_id a (possibly invalid) decoded reply claims, printable and short, or ""."""
    w = raw.get("worker_id") if isinstance(raw, dict) else None
    return w[:128] if isinstance(w, str) and w.isprintable() else ""
