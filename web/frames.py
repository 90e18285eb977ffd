"""Turn job events (tensors) into the compact JSON the page renders.

Images travel to the browser as one base64 string per tile: the raw uint8 grayscale pixels
of a [H, W] image, row-major (H*W bytes; 32*32 = 1024 bytes -> 1368 base64 chars). The page
writes them into a canvas' ImageData. Router weights are rounded to 3 decimals.
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np

from dataset.images import to_uint8
from schemas import DoneEvent, FailedEvent, FrameEvent, JobAccepted


def tiles_b64(x: np.ndarray) -> list[str]:
    """[N, C, H, W] float in [-1, 1] -> N base64 strings of H*W uint8 bytes each.

    Grayscale is the channel mean, made pixels by `dataset.images.to_uint8` (clipped; a diverging
    trajectory's non-finite values do not break the encoder)."""
    a = np.asarray(x, dtype=np.float32)
    if a.ndim != 4:
        raise ValueError(f"expected images [N, C, H, W], got shape {list(a.shape)}")
    gray = np.ascontiguousarray(to_uint8(a.mean(axis=1)))
    return [base64.b64encode(tile.tobytes()).decode("ascii") for tile in gray]


def _weights(w: np.ndarray, n: int) -> list[list[float]]:
    a = np.asarray(w, dtype=np.float64)
    if a.ndim != 2 or a.shape[0] != n:
        return []
    return np.round(np.nan_to_num(a), 3).tolist()


def accepted_message(ev: JobAccepted) -> dict[str, Any]:
    """JobAccepted -> {"type": "accepted", job_id, digits, seed, queue_position}. `seed` is a decimal
    string: seeds go up to 2**63 and JavaScript numbers are exact only to 2**53."""
    return {
        "type": "accepted",
        "job_id": ev.job_id,
        "digits": list(ev.digits),
        "seed": str(ev.seed),
        "queue_position": ev.queue_position,
    }


def frame_message(ev: FrameEvent) -> dict[str, Any]:
    """FrameEvent -> {"type": "frame", job_id, step, steps, t, size: [H, W], tiles, experts, weights, notes}
    plus `x1` (tiles of the predicted final image, same encoding) when the event carries it."""
    x = np.asarray(ev.x)
    n = x.shape[0] if x.ndim == 4 else 0
    msg = {
        "type": "frame",
        "job_id": ev.job_id,
        "step": ev.step,
        "steps": ev.steps,
        "t": round(float(ev.t), 4),
        "size": list(x.shape[2:4]) if n else [0, 0],
        "tiles": tiles_b64(x) if n else [],
        "experts": list(ev.experts),
        "weights": _weights(ev.weights, n),
        "notes": list(ev.notes),
    }
    if ev.x1 is not None and n:
        msg["x1"] = tiles_b64(ev.x1)
    return msg


def done_message(ev: DoneEvent) -> dict[str, Any]:
    """DoneEvent -> {"type": "done", job_id, size, tiles, digits, usage, steps, strategy, elapsed_s, notes}."""
    x = np.asarray(ev.images)
    return {
        "type": "done",
        "job_id": ev.job_id,
        "size": list(x.shape[2:4]),
        "tiles": tiles_b64(x),
        "digits": list(ev.digits),
        "usage": _weights(ev.usage, x.shape[0]),
        "steps": ev.steps,
        "strategy": ev.strategy,
        "elapsed_s": round(float(ev.elapsed_s), 3),
        "notes": list(ev.notes),
    }


def failed_message(ev: FailedEvent) -> dict[str, Any]:
    return {"type": "failed", "job_id": ev.job_id, "code": ev.code.value, "reason": ev.reason}


def event_message(ev: Any) -> dict[str, Any]:
    """Any JobEvent -> its page message."""
    if isinstance(ev, FrameEvent):
        return frame_message(ev)
    if isinstance(ev, DoneEvent):
        return done_message(ev)
    if isinstance(ev, FailedEvent):
        return failed_message(ev)
    if isinstance(ev, JobAccepted):
        return accepted_message(ev)
    raise TypeError(f"not a job event: {type(ev).__name__}")
