"""Turn job events (tensors) into the compact JSON the page renders.

Images travel to the browser as one base64 string per tile, raw uint8 pixels, row-major:
* 1 channel (MNIST): grey, H*W bytes (32*32 = 1024 bytes -> 1368 base64 chars);
* 3 channels: RGB, H*W*3 bytes, interleaved (r, g, b of pixel 0, then pixel 1, ...);
* 2 channels: grey, the channel mean;  4 or more: RGB of the first three channels (e.g. latents).
`tile_channels(C)` says which (1 or 3); frame and done messages carry it as `channels`. The page
writes the bytes into a canvas' ImageData. Floats become pixels by `dataset.images.to_uint8`, after
the spec's `value_range` is mapped onto [-1, 1] (the identity for today's [-1, 1] fleets, so their
bytes are unchanged). Router weights are rounded to 3 decimals.

A latent fleet (spec `space: latent`) is drawn from its decoder's images, never from latent channels:
frames that carry `preview` (the job's `preview_every`) show those, the others carry no tiles, and
`done` shows the decoded final images (pixels in [-1, 1]).
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np

from dataset.images import to_uint8
from schemas import DoneEvent, FailedEvent, FrameEvent, JobAccepted

#: The range `to_uint8` maps onto [0, 255]; other value ranges are mapped onto it first.
MODEL_RANGE = (-1.0, 1.0)


def tile_channels(channels: int) -> int:
    """What a tile of a C-channel sample carries: 3 (RGB) for C >= 3, else 1 (grey)."""
    return 3 if channels >= 3 else 1


def tiles_b64(x: np.ndarray, value_range: tuple[float, float] = MODEL_RANGE) -> list[str]:
    """[N, C, H, W] float in `value_range` -> N base64 strings of H*W*tile_channels(C) uint8 bytes each.

    C == 1 or 2: grey, the channel mean, H*W bytes. C >= 3: RGB of channels 0-2, [H, W, 3] row-major
    (interleaved), H*W*3 bytes. Pixels come from `dataset.images.to_uint8` (clipped; a diverging
    trajectory's non-finite values do not break the encoder) after mapping `value_range` onto [-1, 1]."""
    a = np.asarray(x, dtype=np.float32)
    if a.ndim != 4:
        raise ValueError(f"expected images [N, C, H, W], got shape {list(a.shape)}")
    lo, hi = float(value_range[0]), float(value_range[1])
    if (lo, hi) != MODEL_RANGE:
        if not hi > lo:
            raise ValueError(f"value_range must be [low, high] with low < high, got {[lo, hi]}")
        a = (a - np.float32(lo)) * np.float32(2.0 / (hi - lo)) - np.float32(1.0)
    if tile_channels(a.shape[1]) == 3:
        px = np.ascontiguousarray(to_uint8(a[:, :3].transpose(0, 2, 3, 1)))  # [N, H, W, 3]
    else:
        px = np.ascontiguousarray(to_uint8(a.mean(axis=1)))  # [N, H, W]
    return [base64.b64encode(tile.tobytes()).decode("ascii") for tile in px]


def _weights(w: np.ndarray, n: int) -> list[list[float]]:
    a = np.asarray(w, dtype=np.float64)
    if a.ndim != 2 or a.shape[0] != n:
        return []
    return np.round(np.nan_to_num(a), 3).tolist()


def accepted_message(ev: JobAccepted) -> dict[str, Any]:
    """JobAccepted -> {"type": "accepted", job_id, labels, digits, seed, queue_position}. `labels` is each
    image's class (-1: unknown), whichever field the coordinator used; `digits` is the same list (what
    pages before `labels` read). `seed` is a decimal string: seeds go up to 2**63 and JavaScript numbers
    are exact only to 2**53."""
    return {
        "type": "accepted",
        "job_id": ev.job_id,
        "labels": list(ev.classes),
        "digits": list(ev.classes),
        "seed": str(ev.seed),
        "queue_position": ev.queue_position,
    }


def frame_message(
    ev: FrameEvent, value_range: tuple[float, float] = MODEL_RANGE, *, latent: bool = False
) -> dict[str, Any]:
    """FrameEvent -> {"type": "frame", job_id, step, steps, t, size: [H, W], channels, tiles, experts, weights,
    notes} plus `x1` (tiles of the predicted final image, same encoding) when the event carries it.
    `channels`: bytes per pixel of each tile (1 grey, 3 RGB; `tile_channels`).

    latent: the fleet works on latents (its spec's `space`). Its frames' `x` is latents, which are not drawn:
    a frame that carries `preview` (the decoded images, pixels in [-1, 1]) gets those as `tiles` and
    `"preview": true`; one without gets `tiles: []` (the page keeps what it shows and updates the rest).
    `x1` (latents too) is never sent for a latent fleet."""
    x = np.asarray(ev.x)
    n = x.shape[0] if x.ndim == 4 else 0
    pixels, pixel_range = x, value_range
    if latent:
        pixels = np.asarray(ev.preview) if ev.preview is not None else None
        pixel_range = MODEL_RANGE  # the decoder's images, whatever the latents' range
    drawn = pixels is not None and pixels.ndim == 4 and n > 0
    msg = {
        "type": "frame",
        "job_id": ev.job_id,
        "step": ev.step,
        "steps": ev.steps,
        "t": round(float(ev.t), 4),
        "size": list(pixels.shape[2:4]) if drawn else [0, 0],
        "channels": tile_channels(pixels.shape[1]) if drawn else 1,
        "tiles": tiles_b64(pixels, pixel_range) if drawn else [],
        "experts": list(ev.experts),
        "weights": _weights(ev.weights, n),
        "notes": list(ev.notes),
    }
    if latent:
        msg["preview"] = drawn
    elif ev.x1 is not None and n:
        msg["x1"] = tiles_b64(ev.x1, value_range)
    return msg


def done_message(
    ev: DoneEvent, value_range: tuple[float, float] = MODEL_RANGE, *, latent: bool = False
) -> dict[str, Any]:
    """DoneEvent -> {"type": "done", job_id, size, channels, tiles, labels, digits, usage, steps, strategy,
    elapsed_s, notes} (`labels` / `digits`: as in `accepted_message`). latent: the fleet works on latents,
    and `images` are the decoder's output, pixels in [-1, 1] (not in the latents' `value_range`)."""
    x = np.asarray(ev.images)
    if latent:
        value_range = MODEL_RANGE
    return {
        "type": "done",
        "job_id": ev.job_id,
        "size": list(x.shape[2:4]),
        "channels": tile_channels(x.shape[1]),
        "tiles": tiles_b64(x, value_range),
        "labels": list(ev.classes),
        "digits": list(ev.classes),
        "usage": _weights(ev.usage, x.shape[0]),
        "steps": ev.steps,
        "strategy": ev.strategy,
        "elapsed_s": round(float(ev.elapsed_s), 3),
        "notes": list(ev.notes),
    }


def failed_message(ev: FailedEvent) -> dict[str, Any]:
    return {"type": "failed", "job_id": ev.job_id, "code": ev.code.value, "reason": ev.reason}


def event_message(ev: Any, value_range: tuple[float, float] = MODEL_RANGE, *, latent: bool = False) -> dict[str, Any]:
    """Any JobEvent -> its page message (images in `value_range`, the fleet spec's; `latent`: the spec's
    space is latent, so frames show their decoded previews and `done` the decoded images)."""
    if isinstance(ev, FrameEvent):
        return frame_message(ev, value_range, latent=latent)
    if isinstance(ev, DoneEvent):
        return done_message(ev, value_range, latent=latent)
    if isinstance(ev, FailedEvent):
        return failed_message(ev)
    if isinstance(ev, JobAccepted):
        return accepted_message(ev)
    raise TypeError(f"not a job event: {type(ev).__name__}")
