"""An expert worker: one expert model, one backend, served over NATS as a `nats.micro` service.

The worker answers `StepRequest`s on `schemas.subjects.expert_velocity(K)` in the queue group
`expert_queue_group(K)`, so every worker process of expert K shares the load and a new one adds
capacity with no configuration. It also serves the same handler on a direct subject of its own,
`expert_direct(K, worker_token(worker_id))` (endpoint `direct`), where a coordinator that balances
its requests itself (join-shortest-queue, coordinator/dispatch.py) reaches this one worker; both
subscriptions come and go together (a stop drains the direct one first). Requests that arrive
while the model is busy are batched (`workers.batcher`), padded to a bucket size (unless the backend
runs any shape: torch on a CPU) and run in one forward pass in a worker thread; the asyncio loop
keeps answering `$SRV.PING/INFO/STATS` meanwhile. Every bucket is warmed before the endpoint is
subscribed.

Embedding a worker (what `ddm-fleet worker` runs, and what `generate --local` / tests use):

    from workers.service import ExpertWorker

    async with ExpertWorker(expert=0, checkpoint="checkpoints/expert0.safetensors",
                            backend="torch", nats_url="nats://127.0.0.1:4222",
                            buckets=(1, 2, 4, 8, 16, 32, 64), dtype="auto") as worker:
        ...                      # serving; worker.metrics, worker.info(), worker.service_id
    # leaving the block: stop taking work, answer what is held, drain, close

`backend` is a name ("torch" | "xla" | "jax") or an already-loaded `Backend` object (then
`checkpoint` may be None). Pass `nc=` to share an existing NATS connection (it is not closed).

Replies: `StepReply` (velocity [B, C, H, W] float32, in request row order) or `ErrorReply` with a
stable `ErrorCode`; error replies also carry the micro `Nats-Service-Error(-Code)` headers. A request
may carry `x_t` as float16 or bfloat16 and ask for the velocity back in `reply_dtype` (float16 /
bfloat16): the model still runs in its own precision on float32 inputs, and the velocity is cast on
reply; one that does not fit float16 (|v| > 65504) is answered `non_finite` with the peak value.
Bad input never stops the worker: undecodable bytes, wrong version, wrong expert, shapes that do
not fit the model, NaN, too many rows, labels out of range (y = -1, label unknown, is served only by
a model with a null label: `train-expert --label-dropout`), expired deadline (never computed), a
NaN/Inf velocity from absurd finite inputs (|x_t| over `SANE_ABS_X`: `non_finite`), and model
failures (`internal`) each get an error reply. A full queue (`max_queue_rows` rows waiting, or
`max_inflight` requests held) answers `overloaded` at once, so a client can retry elsewhere
instead of waiting. Replies go only to reply subjects under `_INBOX` (`_INBOX.` or
`_INBOX_<token>.`, what NATS clients use), discovery replies too (`workers.discovery`); a request
naming any other reply subject (e.g. another client's job events) is dropped unanswered and logged
at most every `DROP_LOG_EVERY_S` seconds (`workers.discovery.InboxGuard`).
Metrics (`metrics_port`) bind `metrics_host`, loopback by default.

Service discovery: name `ddm-expert`; metadata has expert, backend, device, dtype (what the expert
computes in: float32 or bfloat16; `precision` is its older name), buckets,
max_batch, input_shape, num_classes, null_label ("true" only when the model has one), protocol, version,
worker_id, host, pid, checkpoint, subject, direct_subject, run_ahead (the most further steps one request
may ask it to run ahead: `StepRequest.ahead_t`, answered with up to that many more replies), guidance
("true": it serves `StepRequest.guidance`, classifier-free guidance), batch_quantum (only when it runs
batch-invariant, `--batch-invariant`: every forward computes a multiple of that many rows). Every value
is a string (the micro protocol's metadata is a map of strings); docs/PROTOCOL.md section 2.2 gives each
key's format.

Classifier-free guidance (`StepRequest.guidance`, a scale per row): each row with a scale other than 1
and a known label rides in the same forward pass as a twin of itself with y = -1 (the null label), and
the reply carries v(x, -1) + s (v(x, y) - v(x, -1)) (`flow.guidance`), cast to `reply_dtype` after; rows
run ahead are guided the same way. The twins count against `max_request_rows` and `max_queue_rows`. A
model without a null label refuses such a request (`bad_request`).
STATS endpoint `data` holds `WorkerMetrics.snapshot()`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import socket
import time
import uuid
from importlib import metadata as _md
from typing import Any

import numpy as np

from flow.guidance import add_null_twins, fold_twins, guided_rows
from flow.solver import euler_update
from schemas import UNCONDITIONAL, ErrorCode, ErrorReply, ProtocolError, StepReply, StepRequest, pack, subjects, unpack
from schemas.limits import MAX_RUN_AHEAD
from schemas.tensor import as_received, to_wire_dtype, widen_float32
from schemas.version import PROTOCOL_VERSION

from .batcher import Batcher, BatcherClosed, DeadlineExceeded, ModelError
from .config import DEFAULT_MAX_INFLIGHT, WorkerConfig  # noqa: F401 (DEFAULT_MAX_INFLIGHT: re-exported)
from .discovery import DROP_LOG_EVERY_S, InboxGuard, add_inbox_only_service  # noqa: F401 (DROP_LOG_EVERY_S: re-exported)
from .metrics import WorkerMetrics, serve_metrics

log = logging.getLogger(__name__)

SERVICE_NAME = "ddm-expert"
ENDPOINT_NAME = "velocity"
DIRECT_ENDPOINT_NAME = "direct"

#: |x_t| above this is no diffusion sample (x_t = (1 - t) * noise + t * data stays within a few
#: units). A NaN/Inf velocity for such an input is answered `non_finite` (the request's fault),
#: not `internal`. Finite inputs up to ~1e19 are computed as usual; past that float32 overflows.
SANE_ABS_X = 1e4


def package_version() -> str:
    try:
        return _md.version("ddm-fleet")
    except _md.PackageNotFoundError:  # running from a source tree that is not installed
        return "0.0.0"


class ExpertWorker:
    """Serve one expert over NATS (see module docstring). Async context manager."""

    def __init__(
        self,
        expert: int,
        checkpoint: str | os.PathLike | None = None,
        backend: Any = None,
        *,
        config: WorkerConfig | None = None,
        nats_url: str = "nats://127.0.0.1:4222",
        nc: Any = None,
        backend_options: dict | None = None,
        worker_id: str | None = None,
        reconnect_wait: float | None = None,
        **serving: Any,
    ):
        """`backend`: a name (default `config.backend`, "torch") or a loaded `Backend` object.
        `config`: the serving options (`WorkerConfig`); any of its fields may also be given as keyword
        arguments (`buckets=`, `max_batch=`, `dtype=`, `merge=`, `max_queue_rows=`, ...), which override it.
        `reconnect_wait`: the older name of `reconnect_wait_s`. Raises ValueError (saying what to fix) for
        out-of-range options."""
        if reconnect_wait is not None:
            serving["reconnect_wait_s"] = reconnect_wait
        if "bf16" in serving:  # the older spelling of dtype
            serving["dtype"] = "bfloat16" if serving.pop("bf16") else "float32"
        unknown = set(serving) - {f.name for f in dataclasses.fields(WorkerConfig)}
        if unknown:
            raise TypeError(f"ExpertWorker() got unexpected keyword argument(s) {', '.join(sorted(unknown))}")
        if isinstance(backend, str):
            serving["backend"] = backend
        config = (config or WorkerConfig()).replace(**serving)
        self.config = config
        self.merge = config.merge
        if not isinstance(expert, int) or isinstance(expert, bool) or expert < 0:
            raise ValueError(f"expert must be a non-negative int, got {expert!r}")
        self.expert = expert
        self.buckets, self.max_batch = config.plan()
        self.max_request_rows = config.max_request_rows
        self.max_queue_rows = config.max_queue_rows
        self.max_inflight = config.max_inflight
        if backend is None:
            backend = config.backend
        if isinstance(backend, str):
            backend_options = {**config.backend_options(), **(backend_options or {})}
        # requests with a reply subject outside _INBOX: dropped, never answered (counted, logged)
        self._inbox_guard = InboxGuard(log, "request", on_drop=lambda: self.metrics.dropped())
        if isinstance(backend, str):
            if checkpoint is None:
                raise ValueError("give checkpoint=PATH (the .safetensors file) when backend is a name")
            self._backend_name = backend
            self.backend = None
        else:
            self._backend_name = getattr(backend, "name", type(backend).__name__)
            self.backend = backend
        self.checkpoint = os.fspath(checkpoint) if checkpoint is not None else None
        self.device = config.device
        self.dtype = config.dtype  # as asked ("auto" resolved by the backend: `self.backend.dtype`)
        self.backend_options = dict(backend_options or {})
        self.nats_url = nats_url
        self.metrics_port = config.metrics_port
        self.metrics_host = config.metrics_host
        self.reconnect_wait = config.reconnect_wait_s
        self.connect_attempts = config.connect_attempts
        self.worker_id = worker_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        #: where this worker alone is reached (besides the queue group): ddm.v1.expert.<K>.velocity.<token>
        self.direct_subject = subjects.expert_direct(expert, subjects.worker_token(self.worker_id))
        self.metrics = WorkerMetrics(
            labels={"expert": str(expert), "backend": self._backend_name}, batch_bounds=self.buckets
        )
        self.nc = nc
        self._own_nc = nc is None
        self._service = None
        self._batcher: Batcher | None = None
        self._metrics_runner = None
        self._inflight: set[asyncio.Task] = set()
        self._started = False
        self._stopping = False
        self._stopped = asyncio.Event()

    # ------------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> ExpertWorker:
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    async def start(self) -> None:
        """Connect, load and warm the model, then subscribe (advertise) last."""
        if self._started:
            return
        # Connect first (a wrong URL fails in seconds, not after a long compile), then load and
        # warm every bucket in a thread (the connection stays alive), then advertise.
        try:
            if self.nc is None:
                self.nc = await self._connect()
            await asyncio.to_thread(self._prepare_backend)
            self._batcher = Batcher(
                self.backend.forward,
                self.buckets,
                self.max_batch,
                observer=self.metrics.batch,
                forward_s=getattr(self.backend, "warmup_s", None),
                merge=self.merge,
                pad=bool(getattr(self.backend, "pads_to_buckets", True)),
                quantum=int(getattr(self.backend, "batch_quantum", 0) or 1),
            )
            await self._batcher.start()
            if self.metrics_port is not None:
                self._metrics_runner = await serve_metrics(self.metrics, self.metrics_port, self.metrics_host)
            await self._advertise()
        except BaseException:
            await self._teardown()
            raise
        self._started = True
        log.info(
            "expert %d worker %s serving %s and %s (%s on %s, buckets %s%s, merge %s)",
            self.expert,
            self.worker_id,
            subjects.expert_velocity(self.expert),
            self.direct_subject,
            self.backend.name,
            self.backend.device,
            ",".join(map(str, self.buckets)),
            "" if self._batcher.pad else " as limits, batches not padded",
            self.merge,
        )

    def _prepare_backend(self) -> None:
        from .backends import get_backend

        if self.backend is None:
            self.backend = get_backend(self._backend_name, device=self.device, dtype=self.dtype, **self.backend_options)
        if not getattr(self.backend, "loaded", self.checkpoint is None):
            if self.checkpoint is None:
                raise ValueError("the backend object is not loaded and no checkpoint was given")
            self.backend.load(self.checkpoint)
        ck_expert = getattr(self.backend, "expert", None)
        if ck_expert is not None and ck_expert != self.expert:
            raise ValueError(
                f"checkpoint {self.checkpoint} is for expert {ck_expert}, not expert {self.expert}; "
                f"pass --expert {ck_expert} or the right checkpoint"
            )
        if self.config.batch_quantum:
            make = getattr(self.backend, "make_batch_invariant", None)
            if make is None:
                raise ValueError(f"the {self._backend_name} backend object cannot be made batch-invariant")
            make(self.config.batch_quantum)
        self.backend.warmup(self.buckets)

    async def _connect(self):
        """Connect to the bus (`bus.connect`): `connect_attempts` tries at first, so a wrong URL fails
        in seconds with BusUnavailable (a ConnectionError), then reconnect forever."""
        from bus.connect import connect, without_credentials

        async def on_error(err: Exception) -> None:
            log.warning("nats: %s: %s", type(err).__name__, err)

        async def on_disconnect() -> None:
            if self._stopping:
                return
            log.warning("nats: disconnected from %s; reconnecting", without_credentials(self.nats_url))

        async def on_reconnect() -> None:
            log.warning(
                "nats: reconnected to %s",
                self.nc.connected_url.netloc.rsplit("@", 1)[-1] if self.nc.connected_url else "?",
            )

        return await connect(
            self.nats_url,
            name=f"ddm-worker-e{self.expert}-{self._backend_name}",
            reconnect="forever",
            first_connect_attempts=max(1, self.connect_attempts),
            reconnect_wait_s=self.reconnect_wait,
            pending_size=64 * 1024 * 1024,
            error_cb=on_error,
            disconnected_cb=on_disconnect,
            reconnected_cb=on_reconnect,
        )

    def metadata(self) -> dict[str, str]:
        be = self.backend
        meta = {
            "expert": str(self.expert),
            "buckets": ",".join(map(str, self.buckets)),
            "max_batch": str(self.max_batch),
            "max_request_rows": str(self.max_request_rows),
            "max_queue_rows": str(self.max_queue_rows or ""),
            "protocol": str(PROTOCOL_VERSION),
            "version": package_version(),
            "worker_id": self.worker_id,
            "host": socket.gethostname(),
            "pid": str(os.getpid()),
            "checkpoint": os.path.basename(self.checkpoint or getattr(be, "checkpoint_path", "") or ""),
            "subject": subjects.expert_velocity(self.expert),
            "direct_subject": self.direct_subject,
            "run_ahead": str(MAX_RUN_AHEAD),  # most further steps one request may ask for (StepRequest.ahead_t)
            "guidance": "true",  # serves StepRequest.guidance (a model without a null label still refuses it)
        }
        if hasattr(be, "describe"):
            meta.update(be.describe())
        else:
            meta.update(backend=str(be.name), device=str(be.device))
        shape = getattr(be, "input_shape", None)
        if shape:
            meta["input_shape"] = ",".join(map(str, shape))
        classes = getattr(be, "num_classes", None)
        if classes:
            meta["num_classes"] = str(classes)
        if getattr(be, "null_label", False):  # serves y = -1 (label unknown); absent: it does not
            meta["null_label"] = "true"
        spec = getattr(be, "spec", None)
        if spec is not None:  # the model spec as compact JSON (schemas.spec.ModelSpec)
            meta["spec"] = json.dumps(spec.to_json(), separators=(",", ":"))
        return meta

    async def _advertise(self) -> None:
        version = package_version()
        self._service = await add_inbox_only_service(
            self.nc,
            self._inbox_guard.drop,
            name=SERVICE_NAME,
            version=version if version.count(".") == 2 else "0.0.0",
            description=f"ddm-fleet expert {self.expert} velocity worker",
            metadata=self.metadata(),
            stats_handler=lambda _endpoint: self.metrics.snapshot(),
        )
        await self._service.add_endpoint(
            name=ENDPOINT_NAME,
            subject=subjects.expert_velocity(self.expert),
            queue_group=subjects.expert_queue_group(self.expert),
            handler=self._on_request,
            metadata={"expert": str(self.expert), "request": "StepRequest", "reply": "StepReply|ErrorReply"},
        )
        # the same handler on this worker's own subject (join-shortest-queue coordinators); its queue
        # group only matters if two workers ever shared a worker id
        await self._service.add_endpoint(
            name=DIRECT_ENDPOINT_NAME,
            subject=self.direct_subject,
            queue_group=subjects.expert_queue_group(self.expert),
            handler=self._on_request,
            metadata={
                "expert": str(self.expert),
                "request": "StepRequest",
                "reply": "StepReply|ErrorReply",
                "worker_id": self.worker_id,
            },
        )
        # Two round trips: with nats-py a single flush() was seen to return before the server had the
        # queue subscription (a request right after start() then met "no responders" on a loaded box).
        await self.nc.flush()
        await self.nc.flush()

    @property
    def service_id(self) -> str | None:
        return self._service.id if self._service is not None else None

    def info(self) -> dict:
        """The micro INFO document of this worker."""
        return self._service.info().to_dict() if self._service is not None else {}

    async def wait_stopped(self) -> None:
        await self._stopped.wait()

    async def stop(self, timeout: float = 30.0) -> None:
        """Graceful: stop intake, answer every held request, drain the connection."""
        if self._stopping:
            await self._stopped.wait()
            return
        self._stopping = True
        try:
            await asyncio.wait_for(self._shutdown(), timeout)
        except TimeoutError:
            log.error("graceful stop took over %.0f s; closing anyway", timeout)
        finally:
            await self._teardown()
            self._stopped.set()

    async def _shutdown(self) -> None:
        # 1. no new work: drain the endpoint subscriptions (already-received messages are still
        #    handed to _on_request, which queues them); the queue group sends new ones elsewhere, and
        #    a direct request meets "no responders" (the coordinator resends it to the queue group).
        if self._service is not None and self.nc is not None and self.nc.is_connected:
            subs = [
                sub
                for ep in reversed(list(getattr(self._service, "_endpoints", [])))  # direct first
                if (sub := getattr(ep, "_subscription", None)) is not None
            ]
            await self._unsubscribe_first(subs)
            for sub in subs:
                try:
                    await sub.drain()
                except Exception as err:
                    log.warning("draining the endpoint subscription failed: %s", err)
            # micro's stop() would unsubscribe the drained endpoint again and fail; forget it.
            self._service._endpoints = []
        # 2. finish every queued batch and send every reply.
        if self._batcher is not None:
            await self._batcher.close()
        if self._inflight:
            await asyncio.gather(*list(self._inflight), return_exceptions=True)
        # 3. leave $SRV, flush replies.
        if self._service is not None:
            try:
                await self._service.stop()
            except Exception as err:
                log.warning("stopping the micro service: %s", err)
            self._service = None
        if self.nc is not None and self.nc.is_connected:
            try:
                await self.nc.flush(timeout=5)
            except Exception as err:
                log.warning("flush on shutdown failed: %s", err)

    async def _unsubscribe_first(self, subs: list) -> None:
        """Make sure the server has the UNSUB of every endpoint before draining them. nats-py's
        Subscription.drain() queues its UNSUB in the write buffer but writes its flush PING straight
        to the socket, so its PONG can come back before the server has the UNSUB; a request the
        server still routes here afterwards is dropped with the subscription (the sender times out).
        So: every UNSUB first (the direct subject's before the queue group's, in one write), then two
        round trips (the second PING follows them); drain() then only answers what has arrived.
        Best effort: on any error the drains go on as before."""
        try:
            for sub in subs:
                await self.nc._send_unsubscribe(sub._id)
            await self.nc.flush(timeout=5)
            await self.nc.flush(timeout=5)
        except Exception as err:
            log.warning("unsubscribing the endpoints before draining them failed: %s", err)

    async def _teardown(self) -> None:
        if self._service is not None:  # start failed after advertising, or a graceful stop timed out
            try:
                await self._service.stop()
            except Exception as err:
                log.warning("stopping the micro service: %s", err)
            self._service = None
        if self._batcher is not None:
            try:
                await self._batcher.close()
            except Exception:  # pragma: no cover - best effort
                log.exception("closing the batcher")
            self._batcher = None
        if self._metrics_runner is not None:
            await self._metrics_runner.cleanup()
            self._metrics_runner = None
        if self._own_nc:  # (drain_or_close: nothing to do for no connection or a closed one)
            from bus.connect import drain_or_close

            await drain_or_close(self.nc)
        self._started = False

    # ------------------------------------------------------------------ requests

    async def _on_request(self, req) -> None:
        """micro handler: validate and queue; never waits for the model (callbacks are serial)."""
        received = time.perf_counter()
        if not self._inbox_guard.allows(req._msg.reply):  # a NATS client's inbox, the rule the coordinator keeps too
            return
        try:
            if len(self._inflight) >= self.max_inflight:
                raise ProtocolError(
                    ErrorCode.OVERLOADED,
                    f"worker holds {len(self._inflight)} requests (limit {self.max_inflight}); "
                    f"retry or send to another worker",
                )
            step, x, t, y, twins = self._decode(req.data)
            rows = x.shape[0] + len(twins)  # the rows this request puts through the model
            if self.max_queue_rows is not None and self._batcher.queued_rows + rows > self.max_queue_rows:
                raise ProtocolError(
                    ErrorCode.OVERLOADED,
                    f"worker queue is full ({self._batcher.queued_rows} rows waiting, limit "
                    f"{self.max_queue_rows}); retry or send to another worker",
                )
            # a request that runs ahead carries x in float32; the model sees it as it would have travelled
            x_in = as_received(to_wire_dtype(x, step.input_dtype, name="x_t")) if step.input_dtype else x
            fut = self._batcher.submit(*add_null_twins(x_in, t, y, twins), deadline=step.deadline)
        except ProtocolError as err:
            await self._reply_error(req, err.code, err.message, _peek_request_id(req.data))
            return
        except BatcherClosed as err:
            await self._reply_error(req, ErrorCode.UNAVAILABLE, str(err), _peek_request_id(req.data))
            return
        except Exception as err:  # a bug in validation must not kill the subscription
            log.exception("unexpected error while decoding a request")
            await self._reply_error(req, ErrorCode.INTERNAL, f"{type(err).__name__}: {err}", _peek_request_id(req.data))
            return
        self.metrics.request(rows)
        task = asyncio.create_task(self._complete(req, step, fut, received, x, y, twins))
        self._inflight.add(task)
        task.add_done_callback(self._inflight.discard)

    @property
    def dropped_requests(self) -> int:
        """Requests dropped unanswered: their reply subject is outside _INBOX (discovery ones too)."""
        return self._inbox_guard.dropped

    def _decode(self, data: bytes) -> tuple[StepRequest, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """bytes -> (request, x float32 [B,C,H,W], t float32 [B], y int64 [B], twins int64 [G]: the rows
        guidance doubles, `_twins`); ProtocolError if bad.

        float32 x_t / t are read-only views over the received bytes (no copy; the batcher and
        backends only read them); float16 x_t is widened to float32 here (one pass)."""
        step = unpack(data, StepRequest)
        if step.expert != self.expert:
            raise ProtocolError(
                ErrorCode.UNKNOWN_EXPERT,
                f"this worker serves expert {self.expert}; the request is for expert {step.expert}",
            )
        b = step.x_t.shape[0]
        want = tuple(getattr(self.backend, "input_shape", step.x_t.shape[1:]))
        if tuple(step.x_t.shape[1:]) != want:
            raise ProtocolError(
                ErrorCode.BAD_SHAPE,
                f"x_t rows must be [C, H, W] = {list(want)} for this model, got {list(step.x_t.shape[1:])}",
            )
        twins = self._twins(step, step.y)
        if b + len(twins) > self.max_request_rows:
            doubled = f" ({b} and {len(twins)} null-label twins of its guided rows)" if len(twins) else ""
            raise ProtocolError(
                ErrorCode.TOO_LARGE,
                f"request has {b + len(twins)} rows{doubled}; this worker accepts at most {self.max_request_rows} "
                "per request",
            )
        classes = getattr(self.backend, "num_classes", None)
        if classes is not None and b:
            self._check_labels(step.y, classes)
        if len(twins):
            self._check_guidance()
        if step.deadline is not None and time.time() > step.deadline:
            raise ProtocolError(
                ErrorCode.DEADLINE_EXCEEDED,
                f"deadline passed {time.time() - step.deadline:.3f} s before the request arrived",
            )
        x = widen_float32(step.x_t)
        t = np.asarray(step.t, dtype=np.float32)
        y = np.asarray(step.y, dtype=np.int64)
        return step, x, t, y, twins

    @staticmethod
    def _twins(step: StepRequest, y: np.ndarray) -> np.ndarray:
        """[G] the rows of the request that classifier-free guidance doubles (`flow.guidance.guided_rows`):
        a scale other than 1 and a known label; none without `guidance`."""
        if step.guidance is None:
            return np.zeros(0, np.int64)
        return guided_rows(y, step.guidance)

    def _check_guidance(self) -> None:
        """A request with guided rows needs the null label (each row's twin is evaluated at y = -1);
        ProtocolError(bad_request) saying so when the model has none."""
        if not getattr(self.backend, "null_label", False):
            raise ProtocolError(
                ErrorCode.BAD_REQUEST,
                (
                    f"classifier-free guidance (a guidance scale other than 1) needs an expert trained with a null "
                    f"label (train-expert --label-dropout > 0); expert {self.expert}'s model on this worker has none: "
                    "send the job with guidance_scale 1, or serve a checkpoint that has a null label"
                ),
            )

    def _check_labels(self, y: np.ndarray, classes: int) -> None:
        """y [B] int: each label in [0, classes), or -1 (label unknown) when the model has a null
        label; ProtocolError(bad_request) saying which otherwise."""
        lo, hi = int(y.min()), int(y.max())
        has_null = bool(getattr(self.backend, "null_label", False))
        if lo == UNCONDITIONAL and hi < classes and not has_null:
            raise ProtocolError(
                ErrorCode.BAD_REQUEST,
                (
                    f"y = {UNCONDITIONAL} (label unknown: an unconditional row) needs an expert trained with a null "
                    f"label (train-expert --label-dropout > 0); expert {self.expert}'s model on this worker has none: "
                    f"send class labels 0-{classes - 1}, or serve a checkpoint that has a null label"
                ),
            )
        if lo < (UNCONDITIONAL if has_null else 0) or hi >= classes:
            allowed = f"[0, {classes - 1}]" + (f" or {UNCONDITIONAL} (label unknown)" if has_null else "")
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"class labels y must lie in {allowed}, got min {lo} max {hi}")

    async def _complete(
        self,
        req,
        step: StepRequest,
        fut: asyncio.Future,
        received: float,
        x: np.ndarray,
        y: np.ndarray,
        twins: np.ndarray,
    ) -> None:
        """Answer the request once its forward pass is done: x [B, C, H, W], y [B] as received, `twins` [G]
        the rows whose null twins follow them in the pass (guided: combined here, before the cast)."""
        try:
            result = await fut
        except DeadlineExceeded as err:
            await self._reply_error(req, ErrorCode.DEADLINE_EXCEEDED, str(err), step.request_id)
            return
        except ModelError as err:
            await self._reply_error(req, ErrorCode.INTERNAL, f"model failed: {err}", step.request_id)
            return
        except Exception as err:
            log.exception("request failed")
            await self._reply_error(req, ErrorCode.INTERNAL, f"{type(err).__name__}: {err}", step.request_id)
            return
        try:
            if not np.isfinite(result.velocity).all():
                peak = float(np.abs(step.x_t).max()) if step.x_t.size else 0.0
                if peak > SANE_ABS_X:  # the input's fault, not ours: a retry elsewhere would get the same
                    raise ProtocolError(
                        ErrorCode.NON_FINITE,
                        f"the model's velocity is NaN/Inf for x_t values up to {peak:.3g} (float32 "
                        f"overflow); a sample x_t stays within a few units of 0",
                    )
                raise ProtocolError(ErrorCode.INTERNAL, "the model produced NaN/Inf velocities for this request")
            # guided rows combined in float32, then float32 or the precision the request asked for (float16
            # overflow: `non_finite`, saying so)
            velocity = to_wire_dtype(self._guided(result.velocity, step, twins), step.reply_dtype, name="velocity")
            data = self._step_reply(step, velocity, result)
        except ProtocolError as err:
            await self._reply_error(
                req, err.code if err.code != ErrorCode.BAD_REQUEST else ErrorCode.INTERNAL, err.message, step.request_id
            )
            return
        except Exception as err:
            await self._reply_error(req, ErrorCode.INTERNAL, f"cannot build the reply: {err}", step.request_id)
            return
        if await self._send(req, data):
            self.metrics.reply(time.perf_counter() - received)
            if step.ahead:
                await self._run_ahead(req, step, x, y, velocity, twins)

    @staticmethod
    def _guided(v: np.ndarray, step: StepRequest, twins: np.ndarray) -> np.ndarray:
        """The forward's velocities [B + G, C, H, W] -> the request's [B, C, H, W]: guided rows combined with
        their twins (`flow.guidance.fold_twins`), every other row as the model gave it. NaN/Inf (an overflow
        of the combination) is refused as the model's would be."""
        if not len(twins):
            return v
        out = fold_twins(v, twins, step.guidance)
        if not np.isfinite(out).all():
            raise ProtocolError(ErrorCode.INTERNAL, "the guided velocity overflowed (NaN/Inf) for this request")
        return out

    def _step_reply(self, step: StepRequest, velocity: np.ndarray, result, ahead_index: int = 0) -> bytes:
        """The packed StepReply of `velocity` (already in the wire dtype) computed in `result`'s pass."""
        return pack(
            StepReply(
                expert=self.expert,
                velocity=velocity,
                row_ids=list(step.row_ids),
                backend=self.backend.name,
                device=str(self.backend.device),
                worker_id=self.worker_id,
                compute_ms=round(result.info.compute_s * 1000.0, 3),
                batch_rows=result.info.bucket,
                ahead_index=ahead_index,
            )
        )

    async def _run_ahead(
        self, req, step: StepRequest, x: np.ndarray, y: np.ndarray, velocity: np.ndarray, twins: np.ndarray
    ) -> None:
        """The request's further steps (`StepRequest.ahead_t`): x' = x + dt * v with v as the coordinator
        received it (guided, for a guided request), the model at x' as it would have travelled (with the
        null twins of the `twins` rows, combined as in the first reply); each velocity answered on the
        request's reply subject as soon as it is computed. A failure is answered there as an ErrorReply and
        ends the run (so does a reply that cannot be sent: nobody would read the rest)."""
        assert step.ahead_t is not None and step.ahead_dt is not None
        n = x.shape[0]
        for a in range(step.ahead):
            try:
                x = euler_update(x, step.ahead_dt[a], as_received(velocity))
                if not np.isfinite(x).all():
                    raise ProtocolError(ErrorCode.NON_FINITE, f"x diverged (NaN/Inf) at step {a + 1} ahead")
                x_in = as_received(to_wire_dtype(x, step.input_dtype, name="x_t"))
                t = np.ascontiguousarray(step.ahead_t[a], dtype=np.float32)
                self.metrics.request(n + len(twins))
                result = await self._batcher.submit(
                    *add_null_twins(x_in, t, y, twins), deadline=step.deadline, solo=True
                )
                if not np.isfinite(result.velocity).all():
                    raise ProtocolError(ErrorCode.INTERNAL, "the model produced NaN/Inf velocities for this request")
                velocity = to_wire_dtype(self._guided(result.velocity, step, twins), step.reply_dtype, name="velocity")
                if not await self._send(req, self._step_reply(step, velocity, result, ahead_index=a + 1)):
                    return
            except asyncio.CancelledError:
                raise
            except Exception as err:
                if isinstance(err, ProtocolError):
                    code, message = err.code, err.message
                elif isinstance(err, DeadlineExceeded):
                    code, message = ErrorCode.DEADLINE_EXCEEDED, str(err)
                elif isinstance(err, BatcherClosed):
                    code, message = ErrorCode.UNAVAILABLE, str(err)
                else:
                    code, message = ErrorCode.INTERNAL, f"{type(err).__name__}: {err}"
                log.debug("running ahead stopped at step %d: %s", a + 1, message)
                await self._reply_error(req, code, message, step.request_id)
                return

    async def _reply_error(self, req, code: ErrorCode | str, message: str, request_id: str | None = None) -> None:
        code = ErrorCode(code)
        self.metrics.error(code.value)
        log.debug("error reply %s: %s", code.value, message)
        try:
            data = pack(ErrorReply(code=code, message=message, request_id=request_id))
        except Exception:  # e.g. a request_id that is not a valid Id
            data = pack(ErrorReply(code=code, message=message))
        headers = {
            "Nats-Service-Error": message[:512].replace("\r", " ").replace("\n", " "),
            "Nats-Service-Error-Code": code.value,
        }
        await self._send(req, data, headers)

    async def _send(self, req, data: bytes, headers: dict | None = None) -> bool:
        try:
            await req.respond(data, headers=headers)
            return True
        except ValueError:  # published without a reply subject: nobody to answer
            return False
        except Exception as err:
            log.warning("could not send a reply: %s: %s", type(err).__name__, err)
            return False


def _peek_request_id(data: bytes) -> str | None:
    """Best-effort request_id from bytes that failed validation (for the error reply)."""
    try:
        from schemas import loads

        obj = loads(data)
        rid = obj.get("request_id") if isinstance(obj, dict) else None
        return rid if isinstance(rid, str) and 0 < len(rid) <= 128 else None
    except Exception:
        return None
