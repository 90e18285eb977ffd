"""The coordinator's calls to a latent fleet's decoders (`ddm-fleet decoder`) over NATS.

    client = DecoderClient(nc, content_hash, timeout=10.0, retries=2)
    images = await client.decode(latents)     # float32 [N, c, h, w] -> float32 [N, C, H, W]
                                              # raises DecoderUnavailable(reason)

Calls made in the same event-loop turn (the done events of one tick, several jobs' preview frames)
are sent as one `DecodeRequest` of their rows together (at most `max_rows`, whole calls only) and the
reply is split back. Each request goes to the decoders' queue group; a time-out, *no responders*,
an `overloaded` / `internal` / `deadline_exceeded` reply or an unusable reply is tried again, up to
`retries` more times (the queue group sends a retry to another decoder, so a decoder killed
mid-request costs one `timeout`); then `DecoderUnavailable`. Each request's reply comes on a private
inbox (`bus.inbox.private_request`: 128 random bits, where nats-py's request inboxes can be predicted
by a host that sees a few). A reply that is no `DecodeReply` of this autoencoder with one image per
latent row, in the fleet's image shape (once known) and value range, counts as a failed try
(`bad_replies`). Nothing
waits longer than (retries + 1) × (timeout + `NO_RESPONDERS_WAIT_S`).

What its decoders produce (`image_shape` [C, H, W], `image_value_range` [low, high]; None until known) is
learned from their `$SRV.INFO.ddm-decoder` metadata (`learn_images`: at most one discovery every
`DISCOVER_EVERY_S`) and from every usable reply, for the fleet's reported spec (`fleet.status`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time

import numpy as np

from schemas import DecodeRequest, DecodeResult, ErrorCode, ProtocolError, pack, subjects, unpack
from schemas.limits import MAX_PAYLOAD_BYTES

log = logging.getLogger(__name__)

#: Pause before trying again after *no responders* (a decoder restarting, the bus reconnecting).
NO_RESPONDERS_WAIT_S = 0.5
#: Rows of one decode request (whole calls are never split; one call may exceed it alone).
DEFAULT_MAX_ROWS = 256
#: Bytes a decode reply spends beside its images (keys, request id, tensor headers): a generous bound.
REPLY_OVERHEAD_BYTES = 64 * 1024
#: After a decode fails, previews are skipped for this long (final images are still tried), so a
#: fleet whose decoders are gone does not hold every job's frames for the full retry time each.
PREVIEW_BACKOFF_S = 10.0
#: Error codes worth another try (another decoder of the queue group may answer).
RETRY_CODES = {ErrorCode.OVERLOADED, ErrorCode.INTERNAL, ErrorCode.DEADLINE_EXCEEDED, ErrorCode.UNAVAILABLE}
#: The NATS micro service name of every decoder (workers.decoder_service.SERVICE_NAME).
DECODER_SERVICE = "ddm-decoder"
#: Seconds a decoder discovery collects `$SRV.INFO` replies, and the least time between two of them.
DISCOVER_WINDOW_S = 0.2
DISCOVER_EVERY_S = 2.0
#: The images' value range of a decoder that does not advertise one (every ddm-fleet autoencoder's).
DEFAULT_IMAGE_VALUE_RANGE = (-1.0, 1.0)


def images_of_metadata(metadata: dict, content_hash: str) -> tuple[tuple[int, int, int], tuple[float, float]] | None:
    """(image_shape, image_value_range) a decoder of `content_hash` advertises in its service metadata
    ("C,H,W" and "low,high" strings; a decoder without `image_value_range` decodes to [-1, 1]); None for
    another autoencoder's decoder or metadata that does not read."""
    if not isinstance(metadata, dict) or metadata.get("decoder") != content_hash:
        return None
    try:
        shape = tuple(int(v) for v in str(metadata["image_shape"]).split(","))
        raw = metadata.get("image_value_range")
        vrange = tuple(float(v) for v in str(raw).split(",")) if raw else DEFAULT_IMAGE_VALUE_RANGE
    except (KeyError, ValueError):
        return None
    if len(shape) != 3 or min(shape) < 1 or len(vrange) != 2 or not vrange[0] < vrange[1]:
        return None
    return shape, vrange


class DecoderUnavailable(Exception):
    """No decoder answered usably; `reason` says what happened on the last try."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class DecoderClient:
    def __init__(
        self,
        nc,
        content_hash: str,
        *,
        timeout: float = 10.0,
        retries: int = 2,
        max_rows: int = DEFAULT_MAX_ROWS,
    ):
        self.nc = nc
        self.content_hash = content_hash
        self.subject = subjects.decoder_decode(content_hash)
        self.timeout, self.retries, self.max_rows = float(timeout), int(retries), int(max_rows)
        self._pending: list[tuple[np.ndarray, asyncio.Future]] = []
        self._flush_scheduled = False
        self._tasks: set[asyncio.Task] = set()
        self.requests = 0  # decode requests sent (tries included)
        self.failures = 0  # tries that failed
        self.bad_replies = 0  # replies that are no usable DecodeReply for the request (counted in failures too)
        self._failed_at = -float("inf")  # monotonic time of the last DecoderUnavailable
        # what the decoders produce: learned from discovery and replies (None: not known yet)
        self.image_shape: tuple[int, int, int] | None = None
        self.image_value_range: tuple[float, float] | None = None
        self._discovery: asyncio.Future | None = None
        self._discovered_at = -float("inf")

    async def learn_images(self, window_s: float = DISCOVER_WINDOW_S) -> None:
        """Learn `image_shape` / `image_value_range` from the decoders' `$SRV.INFO.ddm-decoder` metadata,
        unless known: joins a discovery under way, else starts one unless one started within
        DISCOVER_EVERY_S (then returns at once). Never raises (a failed discovery leaves them unknown)."""
        if self.image_shape is not None:
            return
        if self._discovery is None or self._discovery.done():
            if time.monotonic() - self._discovered_at < DISCOVER_EVERY_S:
                return
            self._discovered_at = time.monotonic()
            self._discovery = asyncio.ensure_future(self._discover(window_s))
            self._tasks.add(self._discovery)
            self._discovery.add_done_callback(self._tasks.discard)
        try:
            await asyncio.shield(self._discovery)
        except asyncio.CancelledError:
            raise
        except Exception:
            pass

    async def _discover(self, window_s: float) -> None:
        from bus.gather import gather_replies

        try:
            replies = await gather_replies(self.nc, f"$SRV.INFO.{DECODER_SERVICE}", window=window_s)
        except Exception as err:
            log.info("decoder discovery failed: %r", err)
            return
        for raw in replies:
            try:
                info = json.loads(raw)
            except ValueError:
                continue
            found = images_of_metadata(info.get("metadata") if isinstance(info, dict) else None, self.content_hash)
            if found is not None and self.image_shape is None:
                self.image_shape, self.image_value_range = found

    @property
    def previews_paused(self) -> bool:
        """True within PREVIEW_BACKOFF_S of the last failed decode: skip previews meanwhile."""
        return time.monotonic() - self._failed_at < PREVIEW_BACKOFF_S

    async def decode(self, latents: np.ndarray) -> np.ndarray:
        """The images of `latents` float32 [N, c, h, w] (batched with other calls of this loop turn)."""
        z = np.ascontiguousarray(latents, dtype=np.float32)
        fut = asyncio.get_running_loop().create_future()
        self._pending.append((z, fut))
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)
        return await fut

    def rows_per_request(self) -> int:
        """Most latent rows one request gathers: `max_rows`, and fewer once the decoders' image shape is known
        when their float32 images would not fit one reply message (MAX_PAYLOAD_BYTES: a 3x256x256 image is
        786 KB, so 10 per reply). Whole calls are never split: the coordinator admits no job whose own
        `done` would not fit (`admission.check_event_sizes`), so a call alone always does."""
        if self.image_shape is None:
            return self.max_rows
        image_bytes = 4 * int(np.prod(self.image_shape, dtype=np.int64))
        return max(1, min(self.max_rows, (MAX_PAYLOAD_BYTES - REPLY_OVERHEAD_BYTES) // image_bytes))

    def _flush(self) -> None:
        self._flush_scheduled = False
        pending, self._pending = self._pending, []
        pending = [(z, f) for z, f in pending if not f.done()]  # a caller that gave up
        cap = self.rows_per_request()
        while pending:
            take, rows = 0, 0
            while take < len(pending) and (take == 0 or rows + len(pending[take][0]) <= cap):
                rows += len(pending[take][0])
                take += 1
            group, pending = pending[:take], pending[take:]
            task = asyncio.ensure_future(self._serve(group))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _serve(self, group: list[tuple[np.ndarray, asyncio.Future]]) -> None:
        try:
            images = await self._request(np.concatenate([z for z, _ in group]) if len(group) > 1 else group[0][0])
        except Exception as err:  # DecoderUnavailable, or a bug: every caller learns it
            err = err if isinstance(err, DecoderUnavailable) else DecoderUnavailable(f"{type(err).__name__}: {err}")
            for _, fut in group:
                if not fut.done():
                    fut.set_exception(err)
            return
        at = 0
        for z, fut in group:
            if not fut.done():
                fut.set_result(images[at : at + len(z)])
            at += len(z)

    async def _request(self, z: np.ndarray) -> np.ndarray:
        import nats.errors

        from bus.inbox import private_request

        request_id = secrets.token_hex(8)
        payload = pack(DecodeRequest(decoder=self.content_hash, latents=z, request_id=request_id))
        reason = "no try was made"
        for attempt in range(self.retries + 1):
            self.requests += 1
            try:
                msg = await private_request(self.nc, self.subject, payload, timeout=self.timeout)
            except nats.errors.NoRespondersError:
                reason = f"no decoder serves {self.subject} (start `ddm-fleet decoder --checkpoint <autoencoder>`)"
                self.failures += 1
                if attempt < self.retries:
                    await asyncio.sleep(NO_RESPONDERS_WAIT_S)
                continue
            except (TimeoutError, nats.errors.TimeoutError):
                reason = f"no decoder answered within {self.timeout:g} s"
                self.failures += 1
                continue
            except Exception as err:  # connection trouble
                reason = f"request failed: {type(err).__name__}: {err}"
                self.failures += 1
                await asyncio.sleep(NO_RESPONDERS_WAIT_S)
                continue
            try:
                return self._check(msg.data, len(z))
            except ProtocolError as err:
                reason = f"decoder answered {err.code.value}: {err.message}"
                self.failures += 1
                if err.code == ErrorCode.BAD_REPLY:
                    self.bad_replies += 1
                log.warning("decode request %s, try %d: %s", request_id, attempt + 1, reason)
                if err.code not in RETRY_CODES and err.code != ErrorCode.BAD_REPLY:
                    break  # the request itself is refused: another try would be refused too
        self._failed_at = time.monotonic()
        raise DecoderUnavailable(reason)

    def _check(self, data: bytes, rows: int) -> np.ndarray:
        try:
            reply = unpack(data, DecodeResult)
        except ProtocolError as err:
            raise ProtocolError(ErrorCode.BAD_REPLY, f"unusable reply ({err.code.value}: {err.message})") from None
        if reply.kind == "error":
            raise ProtocolError(reply.code, reply.message)
        if reply.decoder != self.content_hash:
            raise ProtocolError(ErrorCode.BAD_REPLY, f"a reply from decoder {reply.decoder[:12]}…, not ours")
        if reply.images.shape[0] != rows:
            raise ProtocolError(
                ErrorCode.BAD_REPLY,
                f"{reply.images.shape[0]} images for {rows} latents (shape {list(reply.images.shape)})",
            )
        images = np.asarray(reply.images, dtype=np.float32)  # [B, C, H, W], finite (DecodeReply checks)
        shape = tuple(int(v) for v in images.shape[1:])
        if self.image_shape is not None and shape != self.image_shape:
            raise ProtocolError(
                ErrorCode.BAD_REPLY, f"images of shape {list(shape)}, but this fleet's are {list(self.image_shape)}"
            )
        low, high = self.image_value_range or DEFAULT_IMAGE_VALUE_RANGE
        slack = 1e-5 * (high - low)  # decoders clip to the range; float32 rounding only
        if images.size and (float(images.min()) < low - slack or float(images.max()) > high + slack):
            raise ProtocolError(
                ErrorCode.BAD_REPLY,
                f"images in [{float(images.min()):g}, {float(images.max()):g}], outside the range [{low:g}, {high:g}]",
            )
        if self.image_shape is None:  # what the decoders produce: the images a client gets
            self.image_shape = shape
            if self.image_value_range is None:
                self.image_value_range = DEFAULT_IMAGE_VALUE_RANGE
        return images

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
