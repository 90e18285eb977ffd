"""An expert worker: one expert model, one backend, served over NATS as a `nats.micro` service.

The worker answers `StepRequest`s on `schemas.subjects.expert_velocity(K)` in the queue group
`expert_queue_group(K)`, so every worker process of expert K shares the load and a new one adds
capacity with no configuration. It also serves the same handler on a direct subject of its own,
`expert_direct(K, worker_token(worker_id))` (endpoint `direct`), where a coordinator that balances
its requests itself (join-shortest-queue, coordinator/dispatch.py) reaches this one worker. With a direct
scope (`--direct-scope NAME`: the worker id becomes "NAME:<id>") that subject is
`ddm.v1.expert.<K>.velocity.NAME.<token>`, which NATS permissions can give to this host's user alone
(infra/nats/permissions.conf). Both subscriptions come and go together (a stop drains the direct one
first). Requests that arrive while the model is busy are batched (`workers.batcher`), padded to a
bucket size (unless the backend runs any shape: torch on a CPU) and run in one forward pass in a
worker thread; the asyncio loop keeps answering `$SRV.PING/INFO/STATS` meanwhile. Every bucket is
warmed before the endpoint is subscribed.

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
NaN/Inf velocity from absurd finite inputs (|x_t| over `workers.replies.SANE_ABS_X`: `non_finite`), and model
failures (`internal`) each get an error reply. A full queue (`max_queue_rows` rows waiting, or
`max_inflight` requests held) answers `overloaded` at once, so a client can retry elsewhere
instead of waiting. Replies go only to reply subjects under `_INBOX` (`_INBOX.` or
`_INBOX_<token>.`, what NATS clients use), discovery replies too (`workers.discovery`); a request
naming any other reply subject (e.g. another client's job events) is dropped unanswered and logged
at most every `DROP_LOG_EVERY_S` seconds (`workers.discovery.InboxGuard`).
Metrics (`metrics_port`) bind `metrics_host`, loopback by default.

Service discovery: name `ddm-expert`, endpoints `velocity` (the queue group) and `direct`; the metadata
(expert, backend, dtype, buckets, input_shape, run_ahead, guidance, ...) is `workers.advertise`'s.

Classifier-free guidance (`StepRequest.guidance`, a scale per row): each row with a scale other than 1
and a known label rides in the same forward pass as a twin of itself with y = -1 (the null label), and
the reply carries v(x, -1) + s (v(x, y) - v(x, -1)) (`flow.guidance`), cast to `reply_dtype` after; rows
run ahead are guided the same way. The twins count against `max_request_rows` and `max_queue_rows`. A
model without a null label refuses such a request (`bad_request`).
STATS endpoint `data` holds `WorkerMetrics.snapshot()`.

The parts: `workers.step_validation` checks and decodes a request, `workers.batcher` runs it,
`workers.replies` encodes the answer, `workers.advertise` registers the service and its metadata,
`workers.micro_endpoints` stops the endpoints on a graceful stop; this module runs them together.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import socket
import time
import uuid
from typing import Any

import numpy as np

from flow.guidance import add_null_twins
from flow.solver import euler_update
from schemas import ErrorCode, ProtocolError, StepRequest, subjects
from schemas.tensor import as_received, to_wire_dtype

from .advertise import SERVICE_NAME, add_expert_endpoints, start_expert_service, worker_metadata  # noqa: F401 (SERVICE_NAME: re-exported)
from .batcher import Batcher, BatcherClosed, DeadlineExceeded, ModelError
from .config import DEFAULT_MAX_INFLIGHT, WorkerConfig  # noqa: F401 (DEFAULT_MAX_INFLIGHT: re-exported)
from .discovery import DROP_LOG_EVERY_S, InboxGuard  # noqa: F401 (DROP_LOG_EVERY_S: re-exported)
from .metrics import WorkerMetrics, serve_metrics
from .micro_endpoints import reply_subject, stop_endpoints
from .replies import error_reply, reply_velocity, step_reply
from .step_validation import DecodedStep, decode_step, peek_request_id

log = logging.getLogger(__name__)


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
        if config.direct_scope and subjects.worker_scope(self.worker_id) != config.direct_scope:
            self.worker_id = subjects.scoped_worker_id(config.direct_scope, self.worker_id)
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
                inline_max_s=self.config.inline_forward_ms / 1000.0,
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
        """The service metadata this worker advertises (`workers.advertise.worker_metadata`)."""
        return worker_metadata(
            expert=self.expert,
            backend=self.backend,
            buckets=self.buckets,
            max_batch=self.max_batch,
            max_request_rows=self.max_request_rows,
            max_queue_rows=self.max_queue_rows,
            worker_id=self.worker_id,
            checkpoint=self.checkpoint,
            direct_subject=self.direct_subject,
        )

    async def _advertise(self) -> None:
        """Register the micro service, then subscribe its endpoints (last: the model is warm by then)."""
        self._service = await start_expert_service(
            self.nc,
            expert=self.expert,
            metadata=self.metadata(),
            on_drop=self._inbox_guard.drop,
            stats=self.metrics.snapshot,
        )
        await add_expert_endpoints(
            self._service,
            self.nc,
            expert=self.expert,
            worker_id=self.worker_id,
            direct_subject=self.direct_subject,
            handler=self._on_request,
        )

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
            await stop_endpoints(self._service, self.nc)  # the direct one first
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
        # replies go only to a NATS client's inbox, the rule the coordinator keeps too
        if not self._inbox_guard.allows(reply_subject(req)):
            return
        try:
            if len(self._inflight) >= self.max_inflight:
                raise ProtocolError(
                    ErrorCode.OVERLOADED,
                    f"worker holds {len(self._inflight)} requests (limit {self.max_inflight}); "
                    f"retry or send to another worker",
                )
            step = decode_step(
                req.data, expert=self.expert, backend=self.backend, max_request_rows=self.max_request_rows
            )
            if self.max_queue_rows is not None and self._batcher.queued_rows + step.rows > self.max_queue_rows:
                raise ProtocolError(
                    ErrorCode.OVERLOADED,
                    f"worker queue is full ({self._batcher.queued_rows} rows waiting, limit "
                    f"{self.max_queue_rows}); retry or send to another worker",
                )
            fut = self._batcher.submit(*self._forward_rows(step, step.x), deadline=step.request.deadline)
        except ProtocolError as err:
            await self._reply_error(req, err.code, err.message, peek_request_id(req.data))
            return
        except BatcherClosed as err:
            await self._reply_error(req, ErrorCode.UNAVAILABLE, str(err), peek_request_id(req.data))
            return
        except Exception as err:  # a bug in validation must not kill the subscription
            log.exception("unexpected error while decoding a request")
            await self._reply_error(req, ErrorCode.INTERNAL, f"{type(err).__name__}: {err}", peek_request_id(req.data))
            return
        self.metrics.request(step.rows)
        task = asyncio.create_task(self._complete(req, step, fut, received))
        self._inflight.add(task)
        task.add_done_callback(self._inflight.discard)

    @property
    def dropped_requests(self) -> int:
        """Requests dropped unanswered: their reply subject is outside _INBOX (discovery ones too)."""
        return self._inbox_guard.dropped

    @staticmethod
    def _forward_rows(step: DecodedStep, x: np.ndarray, t: np.ndarray | None = None) -> tuple:
        """(x, t, y) the model computes for `step` at `x` [B, C, H, W] and `t` (default the request's): x as
        it would have travelled in the request's `input_dtype` (a request that runs ahead carries x in
        float32), followed by the null twins of its guided rows (`flow.guidance.add_null_twins`)."""
        dtype = step.request.input_dtype
        x_in = as_received(to_wire_dtype(x, dtype, name="x_t")) if dtype else x
        return add_null_twins(x_in, step.t if t is None else t, step.y, step.twins)

    async def _complete(self, req, step: DecodedStep, fut: asyncio.Future, received: float) -> None:
        """Answer the request once its forward pass is done (guided rows combined with their twins, then
        cast to the reply dtype: `workers.replies.reply_velocity`), then run it ahead if it asks."""
        request = step.request
        try:
            result = await fut
        except DeadlineExceeded as err:
            await self._reply_error(req, ErrorCode.DEADLINE_EXCEEDED, str(err), request.request_id)
            return
        except ModelError as err:
            await self._reply_error(req, ErrorCode.INTERNAL, f"model failed: {err}", request.request_id)
            return
        except Exception as err:
            log.exception("request failed")
            await self._reply_error(req, ErrorCode.INTERNAL, f"{type(err).__name__}: {err}", request.request_id)
            return
        try:
            velocity = reply_velocity(result.velocity, request, step.twins, x_t=request.x_t)
            data = self._step_reply(request, velocity, result)
        except ProtocolError as err:
            code = err.code if err.code != ErrorCode.BAD_REQUEST else ErrorCode.INTERNAL
            await self._reply_error(req, code, err.message, request.request_id)
            return
        except Exception as err:
            await self._reply_error(req, ErrorCode.INTERNAL, f"cannot build the reply: {err}", request.request_id)
            return
        if await self._send(req, data):
            self.metrics.reply(time.perf_counter() - received)
            if request.ahead:
                await self._run_ahead(req, step, velocity)

    def _step_reply(self, request: StepRequest, velocity: np.ndarray, result, ahead_index: int = 0) -> bytes:
        return step_reply(
            request,
            velocity,
            result,
            expert=self.expert,
            backend=self.backend,
            worker_id=self.worker_id,
            ahead_index=ahead_index,
        )

    async def _run_ahead(self, req, step: DecodedStep, velocity: np.ndarray) -> None:
        """The request's further steps (`StepRequest.ahead_t`): x' = x + dt * v with v as the coordinator
        received it (guided, for a guided request), the model at x' as it would have travelled (with the
        null twins of the guided rows, combined as in the first reply); each velocity answered on the
        request's reply subject as soon as it is computed. A failure is answered there as an ErrorReply and
        ends the run (so does a reply that cannot be sent: nobody would read the rest)."""
        request, x = step.request, step.x
        assert request.ahead_t is not None and request.ahead_dt is not None
        for a in range(request.ahead):
            try:
                x = euler_update(x, request.ahead_dt[a], as_received(velocity))
                if not np.isfinite(x).all():
                    raise ProtocolError(ErrorCode.NON_FINITE, f"x diverged (NaN/Inf) at step {a + 1} ahead")
                rows = self._forward_rows(step, x, np.ascontiguousarray(request.ahead_t[a], dtype=np.float32))
                self.metrics.request(step.rows)
                result = await self._batcher.submit(*rows, deadline=request.deadline, solo=True)
                velocity = reply_velocity(result.velocity, request, step.twins)
                if not await self._send(req, self._step_reply(request, velocity, result, ahead_index=a + 1)):
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
                await self._reply_error(req, code, message, request.request_id)
                return

    async def _reply_error(self, req, code: ErrorCode | str, message: str, request_id: str | None = None) -> None:
        code = ErrorCode(code)
        self.metrics.error(code.value)
        log.debug("error reply %s: %s", code.value, message)
        await self._send(req, *error_reply(code, message, request_id))

    async def _send(self, req, data: bytes, headers: dict | None = None) -> bool:
        try:
            await req.respond(data, headers=headers)
            return True
        except ValueError:  # published without a reply subject: nobody to answer
            return False
        except Exception as err:
            log.warning("could not send a reply: %s: %s", type(err).__name__, err)
            return False
