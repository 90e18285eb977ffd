"""A running job's snapshot (resumable state, not model weights: those are models.checkpoint), and
its bytes. Pure: no I/O, no clocks.

`Scheduler.checkpoint(job_id)` takes a `JobCheckpoint` (everything needed to go on with the job
exactly where it is); `Scheduler.restore(cp, now)` re-creates the job from it, in this or another
coordinator. `encode(cp)` / `decode(data)` turn it into msgpack bytes (the `job_checkpoint`
message below, tensors in the `schemas.tensor` encoding) and back; `coordinator.durable_store` keeps those
bytes in a JetStream KV bucket.

What makes a restore bit-identical: the committed state x [N, C, H, W] float32, the step, Heun's
stage and stage-0 velocity v0 [N, C, H, W] float32, the evaluation count and the router weights
last computed (route_w [N, K] float64, routed_at) are stored exactly; the time grid is a function
of `steps`. What is not stored: the last frame's weights / experts / velocity (rewritten by the
next step before any frame uses them).

Size: about N x C x H x W x 4 bytes (4 KiB per 32x32 image), twice that while a Heun job sits
between its two stages, plus ~1 KiB of fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np
from pydantic import Field, ValidationError

from schemas import JobRequest, ProtocolError, pack, unpack
from schemas.errors import ErrorCode
from schemas.messages import FiniteTensor, Message, Tensor


@dataclass
class JobCheckpoint:
    """One job, as a scheduler held it. `x is None`: the job had not started (it was queued; it
    starts from its seed's noise). Shapes: x, v0 [N, C, H, W] float32; usage [N, K] int64;
    route_w [N, K] float64 or None; oracle_expert [N] int64. Times are the scheduler's clock
    (the engine's: wall-clock seconds, so they mean the same in another process)."""

    request: JobRequest
    job_id: str
    client: str  # the scheduler's fairness key ("<client>" or "<client>/<session>")
    digits: list[int]
    seed: int
    submitted_at: float
    started_at: float | None = None
    x: np.ndarray | None = None
    step: int = 0
    stage: int = 0
    v0: np.ndarray | None = None
    evals: int = 0
    usage: np.ndarray | None = None
    route_w: np.ndarray | None = None
    routed_at: int = -1
    oracle_expert: np.ndarray | None = None
    notes: list[str] = field(default_factory=list)
    pending_notes: list[str] = field(default_factory=list)

    @property
    def n(self) -> int:
        return len(self.digits)

    @property
    def started(self) -> bool:
        return self.x is not None


class JobCheckpointRecord(Message):
    """The wire form of a `JobCheckpoint` (a value in the `ddm_jobs` KV bucket, see docs/PROTOCOL.md).
    `owner`: the coordinator name that wrote it; `written_at`: its clock then (both informative)."""

    kind: Literal["job_checkpoint"] = "job_checkpoint"
    job_id: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    client: str = Field(min_length=1, max_length=129)
    request: JobRequest
    digits: list[int]
    seed: int = Field(ge=0, lt=2**63)
    submitted_at: float
    started_at: float | None = None
    x: FiniteTensor | None = None
    step: int = Field(default=0, ge=0)
    stage: int = Field(default=0, ge=0, le=1)
    v0: FiniteTensor | None = None
    evals: int = Field(default=0, ge=0)
    usage: Tensor | None = None
    route_w: Tensor | None = None
    routed_at: int = -1
    oracle_expert: Tensor | None = None
    notes: list[str] = Field(default_factory=list)
    pending_notes: list[str] = Field(default_factory=list)
    owner: str = ""
    written_at: float = 0.0
    #: the job's owner epoch (docs/PROTOCOL.md, "Owner epochs"): 1 for its first owner, one more at each
    #: take-over (`bump_epoch`, written by the taker before it publishes anything); 0: written before epochs
    epoch: int = Field(default=0, ge=0, lt=2**63)


#: Largest checkpoint accepted (bytes): 256 images x 2 tensors x 4 KiB plus fields fit far below.
MAX_CHECKPOINT_BYTES = 8 * 1024 * 1024


def encode(cp: JobCheckpoint, *, owner: str = "", written_at: float = 0.0, epoch: int = 0) -> bytes:
    """JobCheckpoint -> msgpack bytes (raises ProtocolError if it cannot be encoded)."""
    try:
        rec = _record(cp, owner, written_at, epoch)
    except ValidationError as err:
        first = err.errors(include_url=False, include_input=False)[0]
        raise ProtocolError(
            ErrorCode.BAD_REQUEST,
            f"cannot encode the checkpoint of job {cp.job_id!r}: "
            f"{'.'.join(str(p) for p in first['loc'])}: {first['msg']}",
        ) from None
    return pack(rec, max_bytes=MAX_CHECKPOINT_BYTES)


def bump_epoch(data: bytes, *, owner: str = "", written_at: float = 0.0) -> tuple[bytes, int, str]:
    """A checkpoint's bytes as its taker writes them back: the owner epoch one more than the stored
    one, `owner` and `written_at` its own; (bytes, the new epoch, the owner that wrote `data`). Raises
    ProtocolError on bytes that are no checkpoint."""
    rec = unpack(data, JobCheckpointRecord, max_bytes=MAX_CHECKPOINT_BYTES)
    epoch, previous = rec.epoch + 1, rec.owner
    rec = rec.model_copy(update={"epoch": epoch, "owner": owner, "written_at": float(written_at)})
    return pack(rec, max_bytes=MAX_CHECKPOINT_BYTES), epoch, previous


def _record(cp: JobCheckpoint, owner: str, written_at: float, epoch: int = 0) -> JobCheckpointRecord:
    return JobCheckpointRecord(
        job_id=cp.job_id,
        client=cp.client,
        request=cp.request,
        digits=[int(d) for d in cp.digits],
        seed=int(cp.seed),
        submitted_at=float(cp.submitted_at),
        started_at=None if cp.started_at is None else float(cp.started_at),
        x=cp.x,
        step=int(cp.step),
        stage=int(cp.stage),
        v0=cp.v0,
        evals=int(cp.evals),
        usage=cp.usage,
        route_w=cp.route_w,
        routed_at=int(cp.routed_at),
        oracle_expert=cp.oracle_expert,
        notes=list(cp.notes),
        pending_notes=list(cp.pending_notes),
        owner=owner,
        written_at=float(written_at),
        epoch=int(epoch),
    )


def _array(a, dtype, name: str, shape: tuple[int, ...] | None = None) -> np.ndarray | None:
    if a is None:
        return None
    if a.dtype != np.dtype(dtype):
        raise ProtocolError(ErrorCode.BAD_DTYPE, f"checkpoint {name} must be {np.dtype(dtype).name}, got {a.dtype}")
    if shape is not None and tuple(a.shape) != shape:
        raise ProtocolError(
            ErrorCode.BAD_SHAPE, f"checkpoint {name} must have shape {list(shape)}, got {list(a.shape)}"
        )
    return np.array(a, dtype=dtype, copy=True)  # writable copies (decoded tensors are read-only views)


def decode(data: bytes) -> tuple[JobCheckpoint, JobCheckpointRecord]:
    """msgpack bytes -> (JobCheckpoint, the record with owner / written_at). Raises ProtocolError with
    a clear message on anything malformed (wrong dtypes, shapes that disagree with the digits)."""
    rec = unpack(data, JobCheckpointRecord, max_bytes=MAX_CHECKPOINT_BYTES)
    n = len(rec.digits)
    x = _array(rec.x, np.float32, "x")
    if x is not None and (x.ndim != 4 or x.shape[0] != n):
        raise ProtocolError(ErrorCode.BAD_SHAPE, f"checkpoint x must be [N={n}, C, H, W], got {list(x.shape)}")
    full = tuple(x.shape) if x is not None else None
    usage = _array(rec.usage, np.int64, "usage")
    k = usage.shape[1] if usage is not None and usage.ndim == 2 else None
    if usage is not None and (usage.ndim != 2 or usage.shape[0] != n):
        raise ProtocolError(ErrorCode.BAD_SHAPE, f"checkpoint usage must be [N={n}, K], got {list(usage.shape)}")
    cp = JobCheckpoint(
        request=rec.request,
        job_id=rec.job_id,
        client=rec.client,
        digits=list(rec.digits),
        seed=rec.seed,
        submitted_at=rec.submitted_at,
        started_at=rec.started_at,
        x=x,
        step=rec.step,
        stage=rec.stage,
        v0=_array(rec.v0, np.float32, "v0", full),
        evals=rec.evals,
        usage=usage,
        route_w=_array(rec.route_w, np.float64, "route_w", (n, k) if k is not None else None),
        routed_at=rec.routed_at,
        oracle_expert=_array(rec.oracle_expert, np.int64, "oracle_expert", (n,)),
        notes=list(rec.notes),
        pending_notes=list(rec.pending_notes),
    )
    if cp.started and cp.usage is None:
        raise ProtocolError(ErrorCode.BAD_REQUEST, "checkpoint of a started job has no usage")
    return cp, rec
