"""The decode stage of a latent fleet, as pure functions (no I/O): which events need the decoder,
and the events it turns them into.

A latent fleet's experts denoise latents; the scheduler's `done` then carries the final latents
(in `images` and `latents`, unclipped) and its frames carry latents in `x`. The coordinator
(`coordinator.service`) asks a decoder (`coordinator.decoder_client`) for the pixels and publishes:

* `done` with `images` = decode(latents) (float32, the autoencoder's value range), and `latents`
  only when the job asked (`JobRequest.return_latents`): v1 clients never see the new key;
* a `frame` whose step is a multiple of the job's `preview_every` (or the last step) with `preview`
  = decode(x) as float16; a frame whose preview could not be decoded goes out without one, with a note;
* `failed` / `decoder_unavailable` instead of `done` when no decoder answered usably.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from schemas import DoneEvent, ErrorCode, FailedEvent, FrameEvent


@dataclass(frozen=True)
class LatentOptions:
    """What one job asked of the decode stage."""

    preview_every: int | None = None
    return_latents: bool = False

    @classmethod
    def of(cls, request) -> LatentOptions:
        return cls(preview_every=request.preview_every, return_latents=bool(request.return_latents))


def wants_preview(opts: LatentOptions, frame: FrameEvent) -> bool:
    """True if `frame` should carry decoded images: its step is a multiple of `preview_every`, or the last."""
    every = opts.preview_every
    return every is not None and (frame.step % every == 0 or frame.step == frame.steps)


def final_latents(done: DoneEvent) -> np.ndarray:
    """The latents a latent fleet's `done` holds (float32 [N, c, h, w])."""
    z = done.latents if done.latents is not None else done.images
    return np.ascontiguousarray(z, dtype=np.float32)


def frame_latents(frame: FrameEvent) -> np.ndarray:
    return np.ascontiguousarray(frame.x, dtype=np.float32)


def with_preview(frame: FrameEvent, images: np.ndarray) -> FrameEvent:
    """`frame` carrying `images` (decoded x) as float16 `preview`."""
    return frame.model_copy(update={"preview": np.asarray(images, np.float32).astype(np.float16)})


def without_preview(frame: FrameEvent, reason: str) -> FrameEvent:
    """`frame` as it is, with a note saying why it has no preview."""
    return frame.model_copy(update={"notes": [*frame.notes, f"no preview: {reason}"]})


def decoded_done(done: DoneEvent, images: np.ndarray, opts: LatentOptions) -> DoneEvent:
    """The client's `done`: decoded `images`, and `latents` only if the job asked for them."""
    images = np.asarray(images, np.float32)
    if images.ndim != 4 or images.shape[0] != done.images.shape[0]:
        raise ValueError(f"decoder gave images {list(images.shape)} for {done.images.shape[0]} latents")
    latents = final_latents(done) if opts.return_latents else None
    return done.model_copy(update={"images": images, "latents": latents})


def decoder_failed(job_id: str, reason: str) -> FailedEvent:
    return FailedEvent(
        job_id=job_id,
        code=ErrorCode.DECODER_UNAVAILABLE,
        reason=f"the job's latents could not be decoded to images: {reason}",
    )
