"""A latent fleet's decode stage at work: the engine's `done` and preview frames wait here for the
decoder's images, in each job's order, without holding up the engine; then they are published.

`coordinator.decode_stage` holds the stage's rules (pure: which events need the decoder, what they
become); `coordinator.decoder_client` asks the decoders over NATS; this module runs the stage between
the engine's events and their publishing (`coordinator.events.EventPublisher`):

    stage = DecodeStage.open(nc, spec, timeout=..., retries=..., publish=..., stats=...)
    stage.admit(internal, request)          # what the job asks of the decoder
    if not stage.take(event): publish(event)
    await stage.close()                     # stopping: wait a while, then publish what is left undecoded
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from bus.cancel import cancel_and_wait
from schemas import ErrorCode, FailedEvent, subjects

from .decode_stage import (
    LatentOptions,
    decoded_done,
    decoder_failed,
    final_latents,
    frame_latents,
    wants_preview,
    with_preview,
    without_preview,
)

log = logging.getLogger(__name__)

#: Seconds a stopping coordinator waits for the images of jobs in its decode stage (decoders answer in
#: milliseconds; a hung one is asked for up to the step timeout x (retries + 1)) before failing those jobs
#: `unavailable`: within `ddm-fleet up`'s 20 s stop timeout.
DECODE_STOP_WAIT_S = 8.0


class DecodeStage:
    """The events of a latent fleet's jobs that need the decoder, each decoded and then published, one
    job's in order. `publish(event)` sends an event out; `stats` (the scheduler's) counts a `done` that
    no decoder turned into images as a failed job."""

    def __init__(
        self,
        decoder,
        publish: Callable[[Any], Awaitable[None]],
        stats,
        stop_wait_s: float = DECODE_STOP_WAIT_S,
    ):
        self.decoder = decoder  # a DecoderClient
        self.publish, self.stats, self.stop_wait_s = publish, stats, stop_wait_s
        self._options: dict[str, LatentOptions] = {}  # internal id -> what the job asked of the decoder
        self._last: dict[str, asyncio.Task] = {}  # internal id -> the last event of the job in the stage
        self._tasks: set[asyncio.Task] = set()  # every event in the stage
        self._ends: dict[str, Any] = {}  # internal id -> its done / failed, in the stage, not yet published
        # what its decoders produce, for the fleet's reported spec: looked up now, in the background
        self._image_lookup: asyncio.Future | None = asyncio.ensure_future(decoder.learn_images())

    @classmethod
    def open(cls, nc, spec, *, timeout: float, retries: int, **kw: Any) -> DecodeStage:
        """The stage of a latent fleet's `spec`, whose decoder must name the autoencoder by content hash."""
        from models.autoencoder import content_hash_of

        from .decoder_client import DecoderClient

        digest = content_hash_of(spec.decoder or "")
        if digest is None or not subjects.is_content_hash(digest):
            raise ValueError(
                f"the fleet's spec says space latent with decoder {spec.decoder!r}, which names no "
                "autoencoder ('autoencoder@sha256:<content hash>'): no decoder can serve it"
            )
        return cls(DecoderClient(nc, digest, timeout=timeout, retries=retries), **kw)

    def admit(self, internal: str, request) -> None:
        """Note what job `internal` (just admitted) asks of the decoder."""
        self._options[internal] = LatentOptions.of(request)

    def is_decoding(self, internal: str) -> bool:
        """True while an event of job `internal` is in the stage (its images are being decoded)."""
        return internal in self._last

    def take(self, event) -> bool:
        """Take `event` into the stage (True) when it needs the decoder or an earlier event of its job is
        still in the stage; False: publish it now."""
        internal = event.job_id
        if event.kind == "accepted":
            return False
        opts = self._options.get(internal, LatentOptions())
        staged = event.kind == "done" or (event.kind == "frame" and wants_preview(opts, event))
        if not staged and internal not in self._last:
            if event.kind == "failed":
                self._options.pop(internal, None)
            return False
        if event.kind in ("done", "failed"):
            self._options.pop(internal, None)
            self._ends[internal] = event
        task = asyncio.ensure_future(self._decode_then_publish(event, opts, self._last.get(internal)))
        self._last[internal] = task
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(functools.partial(self._left, internal))
        return True

    def _left(self, internal: str, task: asyncio.Task) -> None:
        """A staged event of job `internal` is out: the job leaves the stage unless a later event of it is in."""
        if self._last.get(internal) is task:
            del self._last[internal]

    async def _decode_then_publish(self, event, opts: LatentOptions, before: asyncio.Future | None) -> None:
        """After the job's previous staged event: decode what `event` needs, then publish it. A `done`
        whose latents no decoder turned into images becomes `failed` / `decoder_unavailable`."""
        from .decoder_client import DecoderUnavailable

        if before is not None:
            await asyncio.wait([before])
        try:
            if event.kind == "done":
                try:
                    event = decoded_done(event, await self.decoder.decode(final_latents(event)), opts)
                except (DecoderUnavailable, ValueError) as err:
                    log.warning("job %s: decoding its images failed: %s", event.job_id, err)
                    self._count_failed(event)
                    event = decoder_failed(event.job_id, str(err))
            elif event.kind == "frame" and wants_preview(opts, event):
                try:
                    if self.decoder.previews_paused:  # do not hold the frames of every job on a dead decoder
                        raise DecoderUnavailable("a decode failed in the last seconds; previews resume after a pause")
                    event = with_preview(event, await self.decoder.decode(frame_latents(event)))
                except DecoderUnavailable as err:
                    event = without_preview(event, err.reason)
            # the job's end leaves the stage's books before the publish: a cancel at shutdown that lands in
            # it must not have `close` publish the end a second time
            if event.kind in ("done", "failed"):
                self._ends.pop(event.job_id, None)
            await self.publish(event)
        except Exception:  # never lose the event to a bug in the stage
            log.exception("decode stage failed for %s of job %s", event.kind, event.job_id)
            if event.kind in ("done", "failed"):
                self._ends.pop(event.job_id, None)
                await self.publish(decoder_failed(event.job_id, "internal error in the decode stage"))

    def _count_failed(self, done) -> None:
        """A `done` that will not reach its client as such: count the job as failed."""
        stats = self.stats
        stats.jobs_done, stats.jobs_failed = stats.jobs_done - 1, stats.jobs_failed + 1
        stats.images_done -= len(done.images)

    async def stop_lookup(self) -> None:
        """Stop looking the decoders' images up (a start that failed part-way)."""
        if self._image_lookup is not None and not self._image_lookup.done():
            await cancel_and_wait([self._image_lookup], 2.0)

    async def close(self) -> None:
        """Stopping: jobs whose images are being decoded get `stop_wait_s` seconds; then the stage is
        cancelled, and each job whose last event had not gone out gets it now without decoding: a `failed`
        as it was, a `done` as `failed` / `unavailable` (its images were never decoded). Previews still in
        the stage are dropped."""
        pending = [t for t in self._tasks if not t.done()]
        if pending:
            await asyncio.wait(pending, timeout=self.stop_wait_s)
        if self._image_lookup is not None:
            self._image_lookup.cancel()
            self._image_lookup = None
        await self.decoder.close()  # a decode still asked of a hung decoder is not waited for either
        if all(t.done() for t in pending):
            return
        await cancel_and_wait(pending, 1.0)
        ends, self._ends = self._ends, {}
        if ends:
            log.warning(
                "stopping: %d jobs still in the decode stage after %g s; publishing their end without images",
                len(ends),
                self.stop_wait_s,
            )
        for internal, event in ends.items():
            try:
                if event.kind == "done":
                    self._count_failed(event)
                    event = FailedEvent(
                        job_id=internal,
                        code=ErrorCode.UNAVAILABLE,
                        reason="the coordinator stopped while the job's images were being decoded; submit it again",
                    )
                await self.publish(event)
            except Exception:  # pragma: no cover - a bug here must not stop the others' ends
                log.exception("publishing the end of job %s at shutdown failed", internal)
