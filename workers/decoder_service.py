"""A decoder worker: one autoencoder's decoder served over NATS as a `nats.micro` service.

A latent fleet's experts denoise latents; the coordinator asks a decoder for the pixels of each
job's final latents (and of its preview frames). The worker answers `DecodeRequest`s on
`schemas.subjects.decoder_decode(H)` in the queue group `decoder_queue_group(H)`, H the
autoencoder's content hash, so every decoder process of that autoencoder shares the load and
another one adds capacity with no configuration (as expert workers do).

    async with DecoderWorker("runs/colour-latent/autoencoder.safetensors", nats_url=url) as dec:
        ...   # serving; dec.subject, dec.content_hash
    DecoderWorker("vae/sd-vae-ft-mse", nats_url=url)   # a diffusers AutoencoderKL (the pretrained extra)

Replies: `DecodeReply` (images [B, C, H, W] float32 in the autoencoder's value range, in request
row order) or `ErrorReply` with a stable code; every request with an inbox to answer gets one of
them. Bad input never stops the worker: undecodable bytes, another autoencoder's hash, latents of
the wrong shape, NaN / Inf (`non_finite`), more rows than `max_request_rows` (`too_large`), an
expired deadline (never computed), NaN / Inf images (`non_finite` for absurd finite latents, |z| over
`SANE_ABS_X`, as 1e30; else `internal`), a reply over the payload limit (`too_large`) and decoder
failures (`internal`) each get an error reply. Requests run one at a time in a worker thread (the
asyncio loop keeps answering `$SRV.*`); a request that arrives while `max_queued` are waiting is
answered `overloaded` at once. Replies go only to reply subjects under `_INBOX`, discovery replies
too (`workers.discovery.InboxGuard`, as expert workers): a request naming any other reply subject
is dropped unanswered, counted (`dropped_requests`, STATS `dropped`) and logged at most every
`DROP_LOG_EVERY_S` seconds.

Service discovery: name `ddm-decoder`, endpoint `decode`; metadata has decoder (the content hash),
latent_shape, image_shape, image_value_range, device, worker_id, host, pid, checkpoint, subject,
max_request_rows, protocol (docs/PROTOCOL.md section 2.2 lists each with its format).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid
from typing import Any

import numpy as np

from bus.connect import flushed
from schemas import DecodeReply, DecodeRequest, ErrorCode, ErrorReply, ProtocolError, pack, subjects, unpack
from schemas.limits import MAX_STEP_ROWS

from .advertise import package_version
from .discovery import InboxGuard, add_inbox_only_service
from .micro_endpoints import reply_subject
from .replies import SANE_ABS_X
from .step_validation import peek_request_id

log = logging.getLogger(__name__)

SERVICE_NAME = "ddm-decoder"
ENDPOINT_NAME = "decode"
#: Requests waiting for the decoder thread before new ones are answered `overloaded`.
DEFAULT_MAX_QUEUED = 64


class DecoderWorker:
    """Serve one autoencoder's decoder over NATS (see module docstring). Async context manager.

    `checkpoint`: our autoencoder's checkpoint or a diffusers AutoencoderKL directory (models/codec.py);
    `codec`: an already-loaded codec of either backend (then `checkpoint` may be None);
    `max_request_rows`: requests with more latent rows are refused `too_large` (at most the protocol's
    MAX_STEP_ROWS, as expert workers' `max_request_rows`)."""

    def __init__(
        self,
        checkpoint: str | os.PathLike | None = None,
        *,
        codec: Any = None,
        nats_url: str = "nats://127.0.0.1:4222",
        nc: Any = None,
        device: str = "cpu",
        worker_id: str | None = None,
        max_queued: int = DEFAULT_MAX_QUEUED,
        max_request_rows: int = MAX_STEP_ROWS,
        connect_attempts: int = 3,
    ):
        if codec is None and checkpoint is None:
            raise ValueError("give a decoder checkpoint (an autoencoder's .safetensors) or a loaded codec")
        if max_queued < 1:
            raise ValueError(f"max_queued must be >= 1, got {max_queued}")
        if isinstance(max_request_rows, bool) or not isinstance(max_request_rows, int) or max_request_rows < 1:
            raise ValueError(f"max_request_rows must be a positive int, got {max_request_rows!r}")
        self.max_request_rows = min(max_request_rows, MAX_STEP_ROWS)  # more is never sent: the protocol's limit
        self.checkpoint, self.codec, self.device = checkpoint, codec, device
        self.nats_url, self.nc, self._own_nc = nats_url, nc, nc is None
        self.worker_id = worker_id or f"{socket.gethostname()}-{os.getpid()}-decoder-{uuid.uuid4().hex[:6]}"
        self.max_queued, self.connect_attempts = max_queued, connect_attempts
        self._service = None
        self._lock = asyncio.Lock()  # one decode at a time (the model runs in a thread)
        self._waiting = 0
        self._inflight: set[asyncio.Task] = set()
        self.requests = self.errors = self.rows = 0
        # requests with a reply subject outside _INBOX: dropped, never answered (counted, logged)
        self._inbox_guard = InboxGuard(log, "decode request")

    @property
    def dropped_requests(self) -> int:
        """Requests dropped unanswered: their reply subject is outside _INBOX (discovery ones too)."""
        return self._inbox_guard.dropped

    @property
    def content_hash(self) -> str:
        return self.codec.content_hash

    @property
    def service_id(self) -> str | None:
        return self._service.id if self._service is not None else None

    @property
    def subject(self) -> str:
        return subjects.decoder_decode(self.content_hash)

    async def __aenter__(self) -> DecoderWorker:
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    async def start(self) -> None:
        """Connect, load the decoder (and run it once), then subscribe last."""
        from bus.connect import connect

        try:
            if self.nc is None:
                self.nc = await connect(
                    self.nats_url,
                    name="ddm-decoder",
                    reconnect="forever",
                    first_connect_attempts=max(1, self.connect_attempts),
                    pending_size=64 * 1024 * 1024,
                )
            if self.codec is None:
                self.codec = await asyncio.to_thread(self._load)
            await asyncio.to_thread(self.codec.decode, np.zeros((1, *self._warm_shape()), np.float32))
            await self._advertise()
        except BaseException:
            await self._close_nc()
            raise
        log.info("decoder %s serving %s (%s)", self.worker_id, self.subject, self.device)

    def _warm_shape(self) -> tuple[int, ...]:
        """The latents of the first (warm-up) decode: at most 8x8 when the codec takes any size (a diffusers
        VAE's default shape is its config's sample size, 64x64 latents for 512 px, slow on a CPU)."""
        c, h, w = self.codec.latent_shape
        small = (c, min(h, 8), min(w, 8))
        return small if self.codec.latent_shape_error(small) is None else (c, h, w)

    def _load(self):
        from models.codec import load_codec

        return load_codec(self.checkpoint, device=self.device)

    def metadata(self) -> dict[str, str]:
        return {
            "decoder": self.content_hash,
            "latent_shape": ",".join(map(str, self.codec.latent_shape)),
            "image_shape": ",".join(map(str, self.codec.image_shape)),
            # the range its images are clipped to ("low,high"; a decoder without the key: -1,1)
            "image_value_range": ",".join(f"{float(v):g}" for v in getattr(self.codec, "value_range", (-1.0, 1.0))),
            "device": str(self.device),
            "worker_id": self.worker_id,
            "host": socket.gethostname(),
            "pid": str(os.getpid()),
            "checkpoint": str(self.checkpoint or ""),
            "subject": self.subject,
            "max_request_rows": str(self.max_request_rows),
            "protocol": str(subjects.PREFIX),
        }

    async def _advertise(self) -> None:
        version = package_version()
        self._service = await add_inbox_only_service(
            self.nc,
            self._inbox_guard.drop,
            name=SERVICE_NAME,
            version=version if version.count(".") == 2 else "0.0.0",
            description="ddm-fleet latent decoder",
            metadata=self.metadata(),
            stats_handler=lambda _endpoint: {
                "requests": self.requests,
                "rows": self.rows,
                "errors": self.errors,
                "dropped": self.dropped_requests,
            },
        )
        await self._service.add_endpoint(
            name=ENDPOINT_NAME,
            subject=self.subject,
            queue_group=subjects.decoder_queue_group(self.content_hash),
            handler=self._on_request,
            metadata={"decoder": self.content_hash, "request": "DecodeRequest", "reply": "DecodeReply|ErrorReply"},
        )
        await flushed(self.nc)  # the server has the queue subscription before this returns

    async def stop(self) -> None:
        """Stop taking requests, answer the ones held, close the connection (if ours)."""
        if self._service is not None:
            try:
                await self._service.stop()
            except Exception as err:
                log.warning("stopping the micro service: %s", err)
            self._service = None
        if self._inflight:
            await asyncio.gather(*list(self._inflight), return_exceptions=True)
        await self._close_nc()

    async def _close_nc(self) -> None:
        if self._own_nc:  # (drain_or_close: nothing to do for no connection or a closed one)
            from bus.connect import drain_or_close

            await drain_or_close(self.nc)

    # ------------------------------------------------------------------ requests
    async def _on_request(self, req) -> None:
        """micro handler: check the reply subject and queue the work (callbacks are serial). Never raises."""
        if not self._inbox_guard.allows(reply_subject(req)):
            return
        try:
            if self._waiting >= self.max_queued:
                await self._reply_error(
                    req, ErrorCode.OVERLOADED, f"decoder holds {self._waiting} requests; retry or start another decoder"
                )
                return
            task = asyncio.create_task(self._serve(req))  # runs from the next await: counted first
            self._waiting += 1
        except Exception as err:  # a bug here must not kill the subscription
            log.exception("unexpected error while queueing a decode request")
            await self._reply_error(req, ErrorCode.INTERNAL, f"{type(err).__name__}: {err}")
            return
        self._inflight.add(task)
        task.add_done_callback(self._inflight.discard)

    async def _serve(self, req) -> None:
        """Decode one request and answer it: a `DecodeReply`, or an `ErrorReply` for whatever went wrong
        (nothing raises out of here: the requester always gets an answer)."""
        try:
            try:
                data = await self._decode(req)
            except ProtocolError as err:
                await self._reply_error(req, err.code, err.message, peek_request_id(req.data))
                return
            except Exception as err:  # a bug in validation must not kill the subscription
                log.exception("unexpected error while serving a decode request")
                await self._reply_error(req, ErrorCode.INTERNAL, f"{type(err).__name__}: {err}")
                return
            await self._send(req, data)
        except Exception:  # _reply_error / _send catch their own; this is a last guard
            log.exception("could not answer a decode request")
        finally:
            self._waiting -= 1

    async def _decode(self, req) -> bytes:
        """request bytes -> the packed `DecodeReply`; ProtocolError for anything the request gets wrong."""
        msg = unpack(req.data, DecodeRequest)
        z = self._check(msg)
        async with self._lock:
            if msg.deadline is not None and time.time() > msg.deadline:
                raise ProtocolError(ErrorCode.DEADLINE_EXCEEDED, "the request's deadline passed before decoding")
            start = time.perf_counter()
            try:
                images = await asyncio.to_thread(self.codec.decode, z)
            except Exception as err:
                log.exception("decoding failed")
                raise ProtocolError(ErrorCode.INTERNAL, f"decoder failed: {type(err).__name__}: {err}") from None
            ms = (time.perf_counter() - start) * 1000.0
        images = np.asarray(images)
        if images.dtype.kind == "f" and not np.isfinite(images).all():
            peak = float(np.abs(z).max())
            if peak > SANE_ABS_X:  # the input's fault: another decoder would do the same
                raise ProtocolError(
                    ErrorCode.NON_FINITE,
                    f"decoding latents with values up to {peak:.3g} gives NaN/Inf images (float32 overflow); "
                    f"an autoencoder's latents stay within a few units of 0",
                )
            raise ProtocolError(ErrorCode.INTERNAL, "the decoder produced NaN/Inf images for this request")
        reply = DecodeReply(
            decoder=self.content_hash, images=images, worker_id=self.worker_id, device=str(self.device), compute_ms=ms
        )
        data = pack(reply)  # ProtocolError(too_large) for images over the payload limit
        self.requests += 1
        self.rows += len(z)
        return data

    def _check(self, msg: DecodeRequest) -> np.ndarray:
        if msg.decoder != self.content_hash:
            raise ProtocolError(
                ErrorCode.BAD_REQUEST,
                f"this decoder serves autoencoder {self.content_hash[:12]}…, not {msg.decoder[:12]}…",
            )
        z = msg.latents
        wrong = self.codec.latent_shape_error(tuple(z.shape[1:])) if z.ndim == 4 else "latents must be [B, c, h, w]"
        if wrong:
            raise ProtocolError(ErrorCode.BAD_SHAPE, f"{wrong}, got {list(z.shape)}")
        if len(z) > self.max_request_rows:
            raise ProtocolError(
                ErrorCode.TOO_LARGE,
                f"{len(z)} latent rows exceed this decoder's limit of {self.max_request_rows} per request "
                f"(--max-request-rows); send fewer rows per request",
            )
        with np.errstate(over="ignore"):  # a float64 beyond float32's range becomes Inf: refused below
            z = np.array(z, dtype=np.float32)  # a writable copy (the wire's arrays are read-only views)
        if not np.isfinite(z).all():  # the schema refuses them already; float32 may overflow a wider dtype
            raise ProtocolError(ErrorCode.NON_FINITE, "latents hold NaN or Inf values")
        return z

    async def _reply_error(self, req, code: ErrorCode, message: str, request_id: str | None = None) -> None:
        self.errors += 1
        try:
            data = pack(ErrorReply(code=code, message=message, request_id=request_id))
        except Exception:
            data = pack(ErrorReply(code=code, message=message))
        headers = {"Nats-Service-Error": message[:512].replace("\n", " "), "Nats-Service-Error-Code": code.value}
        await self._send(req, data, headers)

    async def _send(self, req, data: bytes, headers: dict | None = None) -> None:
        try:
            await req.respond(data, headers=headers)
        except Exception as err:
            log.warning("could not send a decode reply: %s: %s", type(err).__name__, err)
