"""What an expert worker checks in a `StepRequest` before it queues it, and the arrays it queues.

A request is refused (a `ProtocolError` with the code its error reply carries) when its bytes do not
decode, it is for another expert, its rows are not the model's [C, H, W], it has more rows than the
worker takes (null-label twins of guided rows included), its labels are outside the model's classes
(y = -1 needs a model with a null label), it asks for guidance from a model without a null label, or
its deadline has passed. The backend is read for what the model takes: `input_shape`, `num_classes`,
`null_label` (each optional).

    step = decode_step(data, expert=0, backend=be, max_request_rows=512)
    fut = batcher.submit(*add_null_twins(step.x, step.t, step.y, step.twins), deadline=step.request.deadline)
"""

from __future__ import annotations

import time
from typing import Any, NamedTuple

import numpy as np

from flow.guidance import guided_rows
from schemas import UNCONDITIONAL, ErrorCode, ProtocolError, StepRequest, unpack
from schemas.tensor import widen_float32


class DecodedStep(NamedTuple):
    """A checked request and its arrays: x float32 [B, C, H, W], t float32 [B], y int64 [B], twins int64
    [G] (the rows classifier-free guidance doubles: `guided_twins`)."""

    request: StepRequest
    x: np.ndarray
    t: np.ndarray
    y: np.ndarray
    twins: np.ndarray

    @property
    def rows(self) -> int:
        """The rows this request puts through the model (its own and the twins)."""
        return self.x.shape[0] + len(self.twins)


def decode_step(data: bytes, *, expert: int, backend: Any, max_request_rows: int) -> DecodedStep:
    """bytes -> the checked request (see the module docstring); ProtocolError if bad.

    float32 x_t / t are read-only views over the received bytes (no copy; the batcher and backends only
    read them); float16 x_t is widened to float32 here (one pass)."""
    step = unpack(data, StepRequest)
    if step.expert != expert:
        raise ProtocolError(
            ErrorCode.UNKNOWN_EXPERT,
            f"this worker serves expert {expert}; the request is for expert {step.expert}",
        )
    b = step.x_t.shape[0]
    want = tuple(getattr(backend, "input_shape", step.x_t.shape[1:]))
    if tuple(step.x_t.shape[1:]) != want:
        raise ProtocolError(
            ErrorCode.BAD_SHAPE,
            f"x_t rows must be [C, H, W] = {list(want)} for this model, got {list(step.x_t.shape[1:])}",
        )
    twins = guided_twins(step)
    if b + len(twins) > max_request_rows:
        doubled = f" ({b} and {len(twins)} null-label twins of its guided rows)" if len(twins) else ""
        raise ProtocolError(
            ErrorCode.TOO_LARGE,
            f"request has {b + len(twins)} rows{doubled}; this worker accepts at most {max_request_rows} per request",
        )
    classes = getattr(backend, "num_classes", None)
    if classes is not None and b:
        check_labels(step.y, classes, has_null=bool(getattr(backend, "null_label", False)), expert=expert)
    if len(twins):
        check_guidance(has_null=bool(getattr(backend, "null_label", False)), expert=expert)
    if step.deadline is not None and time.time() > step.deadline:
        raise ProtocolError(
            ErrorCode.DEADLINE_EXCEEDED,
            f"deadline passed {time.time() - step.deadline:.3f} s before the request arrived",
        )
    x = widen_float32(step.x_t)
    t = np.asarray(step.t, dtype=np.float32)
    y = np.asarray(step.y, dtype=np.int64)
    return DecodedStep(step, x, t, y, twins)


def guided_twins(step: StepRequest) -> np.ndarray:
    """[G] the rows of the request that classifier-free guidance doubles (`flow.guidance.guided_rows`):
    a scale other than 1 and a known label; none without `guidance`."""
    if step.guidance is None:
        return np.zeros(0, np.int64)
    return guided_rows(step.y, step.guidance)


def check_guidance(*, has_null: bool, expert: int) -> None:
    """A request with guided rows needs the null label (each row's twin is evaluated at y = -1);
    ProtocolError(bad_request) saying so when the model has none."""
    if not has_null:
        raise ProtocolError(
            ErrorCode.BAD_REQUEST,
            (
                f"classifier-free guidance (a guidance scale other than 1) needs an expert trained with a null "
                f"label (train-expert --label-dropout > 0); expert {expert}'s model on this worker has none: "
                "send the job with guidance_scale 1, or serve a checkpoint that has a null label"
            ),
        )


def check_labels(y: np.ndarray, classes: int, *, has_null: bool, expert: int) -> None:
    """y [B] int: each label in [0, classes), or -1 (label unknown) when the model has a null
    label; ProtocolError(bad_request) saying which otherwise."""
    lo, hi = int(y.min()), int(y.max())
    if lo == UNCONDITIONAL and hi < classes and not has_null:
        raise ProtocolError(
            ErrorCode.BAD_REQUEST,
            (
                f"y = {UNCONDITIONAL} (label unknown: an unconditional row) needs an expert trained with a null "
                f"label (train-expert --label-dropout > 0); expert {expert}'s model on this worker has none: "
                f"send class labels 0-{classes - 1}, or serve a checkpoint that has a null label"
            ),
        )
    if lo < (UNCONDITIONAL if has_null else 0) or hi >= classes:
        allowed = f"[0, {classes - 1}]" + (f" or {UNCONDITIONAL} (label unknown)" if has_null else "")
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"class labels y must lie in {allowed}, got min {lo} max {hi}")


def peek_request_id(data: bytes) -> str | None:
    """Best-effort request_id from bytes that failed validation (for the error reply)."""
    try:
        from schemas import loads

        obj = loads(data)
        rid = obj.get("request_id") if isinstance(obj, dict) else None
        return rid if isinstance(rid, str) and 0 < len(rid) <= 128 else None
    except Exception:
        return None
