"""The coordinator service: job intake, cancel and status over NATS, around the engine loop.

    async with Coordinator(router, num_experts=2, class_to_expert=[0]*5 + [1]*5,
                           nats_url="nats://127.0.0.1:4222") as coord:
        ...   # serves until the block exits

Subjects (see `schemas.subjects`; `<c>` is the client token, the job's owner):
* `ddm.v1.c.<c>.jobs.submit`        JobRequest -> JobAccepted | JobRejected (validation and
                                    admission errors carry their ErrorCode); queue group
                                    `ddm.v1.coordinators`, so several coordinators share the load.
                                    The job is owned by `<c>`; its fairness key is "<c>" or
                                    "<c>/<session>" (JobRequest.session). A job with digit -1
                                    rows (label unknown) is refused `bad_request` when an expert
                                    has no null label (a one-row probe per expert, kept
                                    NULL_LABEL_TTL_S).
* `ddm.v1.c.<c>.jobs.<id>.cancel`   CancelRequest (or empty body) -> CancelReply
* `ddm.v1.c.<c>.jobs.<id>.status`   anything -> JobStatus (queued | running | done | failed | unknown);
                                    for a job that finished recently the terminal event is published
                                    again first, for a client that missed it (e.g. across a reconnect)
* `ddm.v1.c.<c>.jobs.<id>.events`   published: JobAccepted, FrameEvent*, DoneEvent | FailedEvent
* `ddm.v1.fleet.status`             anything -> FleetStatus

Ownership: a cancel or status request in a namespace `<c>` that does not own the job is
answered exactly as for an unknown job (same reply, same delay) and never acted on.
Replies go only to reply subjects under `_INBOX` (`_INBOX.…`, or `_INBOX_<c>.…` for a request
in `<c>`'s namespace); a request with any other reply subject is dropped (rate-limited log line).
A cancel / status request whose `<id>` token is not a job id (over 64 characters, or outside
[A-Za-z0-9_-]) is answered with ErrorReply(bad_request) at once.
With `metrics_port`, GET /metrics serves `coordinator.metrics.CoordinatorMetrics` (Prometheus text).
A bad request never takes the coordinator down: it gets an error reply, and the loop goes on.
Leaving the context (SIGTERM for `ddm-fleet coordinator`) fails every queued or running job with
`unavailable` ("coordinator shutting down"). A coordinator that crashed and was restarted answers
`unknown` for the jobs it lost, which is how `client.run_job` tells its caller at once.
Every `accepted` and `job_status` names the answering coordinator (`name`, stable across restarts:
give each coordinator sharing a bus its own) and its run (`instance`, new at each start), so a
client believes `unknown` only from the job's own coordinator, not from the others that all answer.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import time
from collections import OrderedDict
from typing import Any, Sequence

import numpy as np

from bus.ratelimited_log import RateLimitedLog
from schemas import (
    CancelReply,
    CancelRequest,
    ErrorCode,
    ErrorReply,
    FleetStatus,
    JobAccepted,
    JobRejected,
    JobRequest,
    JobStatus,
    ProtocolError,
    pack,
    subjects,
    unpack,
)
from schemas.errors import shown
from schemas.messages import MAX_COORDINATOR_NAME_LEN

from .snapshot import decode as decode_checkpoint
from .snapshot import encode as encode_checkpoint
from .durable import DEFAULT_CHECKPOINT_EVERY, DEFAULT_LEASE_S, CheckpointingScheduler, JobLost, JobStore
from .engine import AUTO_COHORTS, Engine, RouterLike, Transport, check_cohorts
from .scheduler import Rejected, Scheduler, SchedulerConfig

log = logging.getLogger(__name__)

COORDINATOR_QUEUE = f"{subjects.PREFIX}.coordinators"


class EngineDied(RuntimeError):
    """The coordinator's engine loop died; every job failed with `internal` and submits are refused."""

#: Seconds a coordinator that does not own a job waits before answering cancel / status with
#: "unknown", so that the owner (if another coordinator runs it) answers first.
NOT_MINE_DELAY = 0.25
#: Most delayed "unknown" answers pending at once; beyond it they are sent at once (a flood of
#: probes must not grow the task set without bound).
MAX_DELAYED_REPLIES = 1024
#: The reason of a cancel that is not acted on: no such job in the requester's namespace
#: (never had it, finished, cancelled, or another client's: indistinguishable on purpose).
UNKNOWN_JOB = "unknown job"
#: Seconds a coordinator trusts what a probe told it about an expert's null label (see
#: Coordinator._refuse_unconditional); then it asks again, so a redeployed expert is seen.
NULL_LABEL_TTL_S = 30.0
#: Longest wait for one expert's answer to that probe (at most the step timeout).
NULL_LABEL_PROBE_S = 2.0
#: Seconds an unclear probe (no answer, timeout, another error) is remembered as "unknown" before
#: the expert is asked again: submits are handled one at a time, so a stream of unconditional
#: submits to a stalled expert must not each wait NULL_LABEL_PROBE_S.
NULL_LABEL_UNKNOWN_TTL_S = 5.0


def load_router_and_partition(router_path: str | os.PathLike, partition_path: str | os.PathLike):
    """(router with .weights(x, t, y) -> [B, K], num_experts, class_to_expert list[10]) from files."""
    from dataset.partition import load_manifest
    from models.router import Router

    for p, what in ((router_path, "router"), (partition_path, "partition manifest")):
        if not os.path.exists(p):
            raise FileNotFoundError(f"{what} {os.fspath(p)!r} does not exist")
    manifest = load_manifest(partition_path)
    router = Router.load(router_path)
    rk = getattr(router, "num_experts", manifest.num_experts)
    if rk != manifest.num_experts:
        raise ValueError(f"router {os.fspath(router_path)!r} weighs {rk} experts but partition "
                         f"{os.fspath(partition_path)!r} has {manifest.num_experts}: use files from the same run")
    c2e = [int(manifest.class_to_expert(y)) for y in range(10)]
    return router, int(manifest.num_experts), c2e


class Coordinator:
    """Router + scheduler + engine + NATS endpoints, as an async context manager.

    Give `nc` (an open nats-py connection, not closed on exit) or `nats_url` (connected and
    drained here). `transport` defaults to `NatsTransport(nc, step_timeout, retries, request_rows)`:
    request_rows (<= MAX_STEP_ROWS) caps the rows of one expert request, so an expert's batch is split
    into concurrent requests that the queue group spreads over that expert's workers;
    bad_reply_retries: extra tries of an expert request after unusable replies (NaN, wrong shape, ...).
    wire_dtype ("float32" | "float16" | "bfloat16"), hedge ("auto" | "off"), hedge_after_s and dispatch
    ("direct" | "queue") go to the default NatsTransport: the precision of x_t and the velocity on the
    wire, hedged requests, and join-shortest-queue over the workers' direct subjects or the queue
    group alone (see coordinator.transport). cohorts: batches the engine keeps out at once (see
    Scheduler.schedule; 1 is the lock-step tick; "auto", the default: 2, or 3 / 4 once an expert
    has 4 / 8 known workers, see engine.cohorts_for_workers). route_every: ask the router every N evaluations of
    a job and reuse its weights in between (1: every evaluation; see Batch.routing_plan). speculate: send
    each row's likely expert requests while the router runs (see coordinator.engine; the default).
    The terminal events of the last `keep_finished` jobs (at most `keep_finished_mb` MiB, at most
    `keep_finished_s` seconds old) are kept so a status request can publish them again.
    name: this coordinator's name (1-128 characters), in every `accepted`, `job_status` and
    `fleet_status`; keep it across restarts and give each coordinator on a bus its own (a client
    believes "unknown" only from the name that accepted its job).
    metrics_port: serve Prometheus metrics (`coordinator.metrics`) on http://metrics_host:P/metrics
    (None: don't; 0: any free port, read back from `metrics_port`); metrics_optional: a taken port
    is a warning, not an error."""

    def __init__(self, router: RouterLike, *, num_experts: int, class_to_expert: Sequence[int] | None = None,
                 nc: Any = None, nats_url: str | None = None, max_rows: int = 1024, max_queued_jobs: int = 256,
                 step_timeout: float = 10.0, retries: int = 2, request_rows: int | None = None,
                 bad_reply_retries: int = 4, transport: Transport | None = None,
                 image_shape: tuple[int, int, int] = (1, 32, 32), name: str = "coordinator",
                 keep_finished: int = 256, keep_finished_mb: float = 64.0, keep_finished_s: float = 600.0,
                 metrics_port: int | None = None, metrics_host: str = "127.0.0.1", metrics_optional: bool = False,
                 max_client_rows: int | None = None, max_client_queued_jobs: int = 64,
                 max_job_cost: int | None = 256_000, max_job_run_s: float | None = 600.0,
                 wire_dtype: str = "float32", hedge: str = "auto", hedge_after_s: float | None = None,
                 dispatch: str = "direct", cohorts: int | str = AUTO_COHORTS, route_every: int = 1, speculate: bool = True,
                 durable: bool = False,
                 checkpoint_every: int = DEFAULT_CHECKPOINT_EVERY, lease_s: float = DEFAULT_LEASE_S,
                 js_replicas: int = 1):
        if nc is None and nats_url is None:
            raise ValueError("give nc (a nats-py connection) or nats_url")
        if not isinstance(name, str) or not 1 <= len(name) <= MAX_COORDINATOR_NAME_LEN:
            raise ValueError(f"a coordinator name is 1-{MAX_COORDINATOR_NAME_LEN} characters, got {name!r:.80}")
        # fair-sharing limits: passed through to the scheduler (see coordinator.scheduler)
        self.config = SchedulerConfig(num_experts=num_experts, max_rows=max_rows, max_queued_jobs=max_queued_jobs,
                                      image_shape=tuple(image_shape), class_to_expert=class_to_expert,
                                      max_client_rows=max_client_rows, max_client_queued_jobs=max_client_queued_jobs,
                                      max_job_cost=max_job_cost, max_job_run_s=max_job_run_s)
        self.router = router
        self.nc = nc
        self._own_nc = nc is None
        self.nats_url = nats_url
        self.step_timeout = step_timeout
        self.retries = retries
        self.request_rows = request_rows
        self.bad_reply_retries = bad_reply_retries
        self.wire_dtype, self.hedge, self.hedge_after_s = wire_dtype, hedge, hedge_after_s
        self.dispatch = dispatch
        self.cohorts = check_cohorts(cohorts)
        self.route_every = route_every
        self.speculate = speculate
        self.transport = transport
        self.name = name
        # this run of the coordinator: a restart (same name) has another instance
        self.instance = new_instance_id()
        self.engine: Engine | None = None
        self._task: asyncio.Task | None = None
        self._subs: list = []
        self._bg: set[asyncio.Task] = set()
        self.keep_finished, self.keep_finished_s = keep_finished, keep_finished_s
        self.keep_finished_bytes = int(keep_finished_mb * 1024 * 1024)
        # job id -> (t, terminal event, bytes, (step, steps) reached, owner client token)
        self._finished: OrderedDict[str, tuple[float, Any, int, tuple[int, int], str]] = OrderedDict()
        self._finished_bytes = 0
        self._progress: dict[str, tuple[int, int]] = {}  # live job id -> (step, steps) last known
        # live job id -> owner client token, until its terminal event (then kept in _finished)
        self._owners: dict[str, str] = {}
        self.rejected_unread = 0  # submits rejected before the scheduler saw them (undecodable, invalid, internal)
        # expert -> (has a null label, the worker's refusal message, monotonic time the answer expires)
        self._null_label: dict[int, tuple[bool, str, float]] = {}
        self._dropped_log = RateLimitedLog(log)  # requests whose reply subject is outside _INBOX
        self.replies_dropped = 0
        self.republished = 0  # terminal events published again for status requests
        self.metrics_port, self.metrics_host, self.metrics_optional = metrics_port, metrics_host, metrics_optional
        self.metrics = None  # CoordinatorMetrics, once entered
        self._metrics_runner = None
        # durable jobs (coordinator.durable): off unless durable=True
        if durable and (not isinstance(checkpoint_every, int) or checkpoint_every < 1):
            raise ValueError(f"checkpoint_every must be an int >= 1 (solver steps), got {checkpoint_every!r}")
        self.durable, self.checkpoint_every, self.lease_s = bool(durable), checkpoint_every, lease_s
        self.js_replicas = js_replicas  # copies of each KV bucket in a JetStream cluster (coordinator.durable)
        self.store: JobStore | None = None
        self._durable_ops: list[tuple[str, str]] = []  # ("adopt" | "release", job id), in order
        self._durable_wake: asyncio.Event | None = None
        self._durable_task: asyncio.Task | None = None
        self._fenced: OrderedDict[str, None] = OrderedDict()  # jobs lost to another coordinator: publish nothing
        self.jobs_resumed = 0

    @classmethod
    def from_files(cls, router_path, partition_path, **kw) -> "Coordinator":
        router, k, c2e = load_router_and_partition(router_path, partition_path)
        return cls(router, num_experts=k, class_to_expert=c2e, **kw)

    # ------------------------------------------------------------ lifecycle
    async def __aenter__(self) -> "Coordinator":
        import nats

        from .transport import NatsTransport

        if self.nc is None:
            async def on_error(err: Exception) -> None:  # one line per bus hiccup, not a traceback
                log.warning("nats: %s: %s", type(err).__name__, err)

            self.nc = await nats.connect(self.nats_url, name=self.name, max_reconnect_attempts=-1,
                                         reconnect_time_wait=1, pending_size=64 * 1024 * 1024, error_cb=on_error)
        if self.transport is None:
            opts = {"max_rows": self.request_rows} if self.request_rows else {}
            self.transport = NatsTransport(self.nc, step_timeout=self.step_timeout, retries=self.retries,
                                           bad_reply_retries=self.bad_reply_retries, wire_dtype=self.wire_dtype,
                                           hedge=self.hedge, hedge_after_s=self.hedge_after_s,
                                           dispatch=self.dispatch, **opts)
        if self.durable:
            try:
                self.store = await JobStore(self.nc, self.name, self.instance, lease_s=self.lease_s,
                                            replicas=self.js_replicas).open()
                self.lease_s = self.store.lease_s  # the owners bucket's TTL, if another coordinator set it
            except Exception:
                if self._own_nc:
                    await self.nc.close()
                raise
            self._durable_wake = asyncio.Event()
            sched = CheckpointingScheduler(self.config, self.checkpoint_every, on_due=self._durable_wake.set)
        else:
            sched = Scheduler(self.config)
        rows_per = getattr(self.transport, "rows_per_request", None)  # keep expert requests whole
        self.engine = Engine(sched, self.router, self.transport, self._publish, cohorts=self.cohorts,
                             route_every=self.route_every, speculate=self.speculate,
                             request_rows=(rows_per(np.zeros((1, *self.config.image_shape), np.float32))
                                           if callable(rows_per) else None))
        self.metrics = self.engine.metrics
        if hasattr(self.transport, "hedge_counts"):
            self.metrics.watch_transport(self.transport)
        if self.store is not None:
            self.metrics.watch_store(self.store)
        await self._serve_metrics()
        self._subs = [
            await self.nc.subscribe(subjects.ALL_JOBS_SUBMIT, queue=COORDINATOR_QUEUE, cb=self._on_submit),
            await self.nc.subscribe(subjects.ALL_JOB_CANCELS, cb=self._on_cancel),
            await self.nc.subscribe(subjects.ALL_JOB_STATUS, cb=self._on_job_status),
            await self.nc.subscribe(subjects.FLEET_STATUS, cb=self._on_status),
        ]
        # nats-py writes a flush's PING straight to the socket, possibly ahead of SUBs still in its
        # buffer; by the time that PONG is back the flusher task has written them, so a second
        # round trip proves the server has every subscription (and clients find us at once).
        await self.nc.flush()
        await self.nc.flush()
        if self.durable:  # before serving status: a job of this name's previous run is never "unknown"
            await self._resume_orphans()
            self._durable_task = asyncio.create_task(self._durable_loop(), name="coordinator-durable")
        self._task = asyncio.create_task(self.engine.run(), name="coordinator-engine")
        self._task.add_done_callback(self._engine_ended)
        log.info("coordinator up: %d experts, max %d rows, %d queued jobs", self.config.num_experts,
                 self.config.max_rows, self.config.max_queued_jobs)
        return self

    async def _serve_metrics(self) -> None:
        """Start GET /metrics when metrics_port is set (0: any free port, read back from metrics_port).
        A taken port raises OSError, or with metrics_optional logs a warning and serves without it."""
        if self.metrics_port is None:
            return
        from workers.metrics_http import bound_port, serve_metrics

        try:
            self._metrics_runner = await serve_metrics(self.metrics, self.metrics_port, self.metrics_host)
        except OSError as err:
            if not self.metrics_optional:
                if self._own_nc:
                    await self.nc.close()
                raise
            log.warning("%s; serving without /metrics", err)
            self.metrics_port = None
            return
        self.metrics_port = bound_port(self._metrics_runner)

    async def __aexit__(self, *exc) -> None:
        for sub in self._subs:
            try:
                await sub.unsubscribe()
            except Exception:
                pass
        self._subs = []
        for task in list(self._bg):
            task.cancel()
        if self.durable:
            await self._hand_over()
        if self.engine is not None:
            await self.engine.stop()
        if self._task is not None:
            try:
                await asyncio.wait_for(self._task, timeout=self.step_timeout * (self.retries + 1) + 5)
            except (asyncio.TimeoutError, asyncio.CancelledError):
                self._task.cancel()
            except Exception:
                log.exception("engine ended with an error")
        if self.nc is not None:
            try:
                await self.nc.flush(timeout=2)
            except Exception:
                pass
            if self._own_nc:
                await self.nc.drain()
        if self._metrics_runner is not None:
            await self._metrics_runner.cleanup()
            self._metrics_runner = None

    async def serve_forever(self) -> None:
        """Wait until the engine task ends (it does not, unless stopped); raises its error if it died."""
        assert self._task is not None, "enter the context first"
        await self._task

    # ------------------------------------------------------------ engine supervision
    def _engine_ended(self, task: asyncio.Task) -> None:
        """Done-callback of the engine task: a loop that died has already failed every job with
        `internal` and refuses submits (`unavailable`); say so loudly here."""
        if not task.cancelled() and task.exception() is not None:
            log.critical("coordinator engine died (%s): every job failed, submits are refused; "
                         "the process should exit and be restarted", self.engine_error)

    @property
    def engine_error(self) -> str | None:
        """Why the engine loop died ("coordinator engine stopped: ..."), or None while it is healthy."""
        return self.engine.dead if self.engine is not None else None

    async def serve_until(self, stop: asyncio.Event) -> None:
        """Serve until `stop` is set. Raises EngineDied if the engine loop dies first (its jobs have
        failed with `internal`): the caller should exit non-zero so a supervisor restarts it."""
        assert self._task is not None, "enter the context first"
        stopper = asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait({stopper, self._task}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopper.cancel()
        if self._task.done() and not stop.is_set():
            raise EngineDied(self.engine_error or "coordinator engine stopped")

    # ------------------------------------------------------------ in-process API
    async def submit(self, request: JobRequest, client: str = subjects.DEFAULT_CLIENT):
        """Queue a job of `client` without NATS for the request (events still go to its events
        subject, in `client`'s namespace). Returns JobAccepted; raises scheduler.Rejected."""
        assert self.engine is not None, "enter the context first"
        await self._refuse_unconditional(request)
        accepted = self._signed(self.engine.submit(request, client=fairness_key(subjects.check_client(client),
                                                                                request)))
        self._own(accepted.job_id, client)
        self._progress[accepted.job_id] = (0, request.steps)
        if self.durable:
            self._durable_op("adopt", accepted.job_id)
        await self._publish(accepted)
        return accepted

    async def cancel(self, job_id: str, client: str | None = None) -> bool:
        """Cancel a queued or running job; with `client`, only if that client owns it."""
        assert self.engine is not None, "enter the context first"
        if client is not None and self.owner_of(job_id) != client:
            return False
        self._note_progress(job_id)
        return await self.engine.cancel(job_id)

    def status(self) -> FleetStatus:
        assert self.engine is not None, "enter the context first"
        st = self.engine.status()
        st["jobs_rejected"] = st.get("jobs_rejected", 0) + self.rejected_unread  # every submit answered `rejected`
        return FleetStatus(coordinator=self.name, **st)

    def _signed(self, accepted: JobAccepted) -> JobAccepted:
        """`accepted` naming this coordinator and its run, so the client can tell its answers from
        other coordinators' (whose `unknown` says nothing about this job)."""
        return accepted.model_copy(update={"coordinator": self.name, "instance": self.instance})

    # ------------------------------------------------------------ durable jobs (durable=True only)
    def _durable_op(self, op: str, job_id: str) -> None:
        """Queue a bucket write for the durable loop: "adopt" (a job admitted here) or "release"."""
        self._durable_ops.append((op, job_id))
        self._durable_wake.set()

    def _encoded(self, job_id: str) -> bytes | None:
        """The job's checkpoint bytes now, or None if the scheduler no longer holds it."""
        cp = self.engine.scheduler.checkpoint(job_id)
        return None if cp is None else encode_checkpoint(cp, owner=self.name, written_at=time.time())

    async def _durable_loop(self) -> None:
        """Write checkpoints (admission, every checkpoint_every steps), delete them when jobs end,
        renew this run's leases every lease_s / 3 and take over orphaned jobs as often."""
        period = self.lease_s / 3
        next_renew = next_scan = time.monotonic() + period
        while True:
            try:
                await asyncio.wait_for(self._durable_wake.wait(),
                                       timeout=max(min(next_renew, next_scan) - time.monotonic(), 0.01))
            except asyncio.TimeoutError:
                pass
            self._durable_wake.clear()
            try:
                await self._durable_round()
                now = time.monotonic()
                if now >= next_renew:
                    next_renew = now + period
                    for job_id in await self.store.renew():
                        self._fence(job_id, "another coordinator took over its lease")
                    if self.store.expired():
                        for job_id in self.store.held:
                            self.store.forget(job_id)
                            self._fence(job_id, f"its lease could not be renewed for {self.lease_s:g} s")
                if now >= next_scan:
                    next_scan = now + period
                    await self._resume_orphans()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("durable jobs: a round of bucket writes failed")
                await asyncio.sleep(min(period, 1.0))

    async def _durable_round(self) -> None:
        ops, self._durable_ops = self._durable_ops, []
        store, sched = self.store, self.engine.scheduler
        for op, job_id in ops:
            try:
                if op == "adopt":
                    data = self._encoded(job_id)
                    if data is not None:
                        await store.adopt(job_id, data)
                elif store.holds(job_id):
                    await store.release(job_id)
            except Exception as err:  # e.g. the bucket is full: the job runs on, not durable
                log.warning("durable jobs: %s of job %s failed: %r", op, job_id, err)
        for job_id in sched.take_due():
            data = self._encoded(job_id) if store.holds(job_id) else None
            if data is None:
                continue
            try:
                await store.save(job_id, data)
            except JobLost as err:
                self._fence(job_id, str(err))
            except Exception as err:
                log.warning("durable jobs: checkpoint of job %s failed: %r", job_id, err)

    def _fence(self, job_id: str, why: str) -> None:
        """This run lost the job to another coordinator: forget it and publish nothing more for it."""
        self.engine.scheduler.drop(job_id)
        self._fenced[job_id] = None
        while len(self._fenced) > 4096:
            self._fenced.popitem(last=False)
        self._owners.pop(job_id, None)
        self._progress.pop(job_id, None)
        log.warning("job %s: %s; this coordinator stops publishing for it", job_id, why)

    async def _resume_orphans(self) -> int:
        """Take over and resume every checkpointed job nobody else owns (see coordinator.durable);
        returns how many were resumed."""
        sched, resumed = self.engine.scheduler, 0
        for job_id, owner_rev in await self.store.orphans():
            if sched.knows(job_id):
                continue
            data = await self.store.take(job_id, owner_rev)
            if data is None:
                continue
            try:
                cp, rec = decode_checkpoint(data)
                owner = cp.client.split("/", 1)[0]
                if cp.job_id != job_id or not subjects.is_token(owner):
                    raise ProtocolError(ErrorCode.BAD_REQUEST, f"checkpoint names job {cp.job_id!r} of {owner!r}")
                sched.restore(cp, self.engine.clock())
            except (ProtocolError, Rejected) as err:
                why = getattr(err, "reason", None) or getattr(err, "message", str(err))
                log.error("job %s: cannot resume its checkpoint here (%s); left for another coordinator", job_id, why)
                await self.store.release(job_id, keep_checkpoint=True)
                continue
            self._fenced.pop(job_id, None)
            self._own(job_id, owner)
            self._progress[job_id] = (int(cp.step), int(cp.request.steps))
            self.jobs_resumed += 1
            resumed += 1
            log.info("job %s resumed at step %d/%d from the checkpoint of %s", job_id, cp.step, cp.request.steps,
                     rec.owner or "?")
        if resumed:
            self.engine._poke()  # wake idle engine lanes (submit does the same)
        return resumed

    async def _hand_over(self) -> None:
        """Clean exit of a durable coordinator: write a last checkpoint of every job it owns, give up
        their leases and forget them (no `failed` event), so that its restart or another coordinator
        goes on with them."""
        if self._durable_task is not None:
            self._durable_task.cancel()
            try:
                await self._durable_task
            except BaseException:
                pass
            self._durable_task = None
        if self.store is None or self.engine is None:
            return
        try:
            await self._durable_round()
        except Exception as err:
            log.warning("durable jobs: last round failed: %r", err)
        handed = 0
        for job_id in self.store.held:
            data = self._encoded(job_id)
            try:
                if data is not None:
                    await self.store.save(job_id, data)
                await self.store.release(job_id, keep_checkpoint=data is not None)
            except JobLost as err:
                self._fence(job_id, str(err))
                continue
            except Exception as err:
                log.warning("durable jobs: handing over job %s failed: %r", job_id, err)
                continue
            self.engine.scheduler.drop(job_id)
            self._owners.pop(job_id, None)
            handed += 1
        if handed:
            log.info("handed over %d durable jobs (checkpoints kept in JetStream)", handed)

    # ------------------------------------------------------------ finished jobs
    def _note_progress(self, job_id: str) -> None:
        """Record how far a live job got (before a cancel removes it from the scheduler)."""
        state = self.engine.job_state(job_id) if self.engine is not None else None
        if state is not None:
            self._progress[job_id] = (int(state["step"]), int(state["steps"]))

    def owner_of(self, job_id: str) -> str | None:
        """The client token that owns a live or recently finished job, else None."""
        owner = self._owners.get(job_id)
        if owner is None:
            item = self._finished.get(job_id)
            owner = item[4] if item else None
        return owner

    def _own(self, job_id: str, client: str) -> None:
        """Record the owner of a job just admitted. The map holds live jobs only (each leaves with its
        terminal event); should one ever leave without one, entries the scheduler no longer knows are
        dropped once the map outgrows the scheduler's limits."""
        self._owners[job_id] = client
        if len(self._owners) > 2 * (self.config.max_queued_jobs + self.config.max_rows) + 64:
            sched = self.engine.scheduler
            for stale in [j for j in self._owners if sched.owner_of(j) is None and j != job_id]:
                del self._owners[stale]

    def _remember(self, event) -> None:
        """Keep a terminal event (bounded by count, bytes and age) for status requests, with the
        (step, steps) the job reached: all of them for `done`; for `failed` the step completed when it
        was cancelled, else the last step a frame reported (0 without frames)."""
        job_id = event.job_id
        owner = self._owners.pop(job_id, None) or self.owner_of(job_id)
        old = self._finished.pop(job_id, None)
        if old is not None:
            self._finished_bytes -= old[2]
        size = sum(int(getattr(event, f).nbytes) for f in ("images", "usage") if hasattr(event, f)) + 256
        reached = self._progress.pop(job_id, None)
        if event.kind == "done":
            reached = (int(event.steps), int(event.steps))
        self._finished[job_id] = (time.monotonic(), event, size, reached or (0, 0), owner)
        self._finished_bytes += size
        self._forget_old()

    def _forget_old(self) -> None:
        now = time.monotonic()
        while self._finished:
            t, _, size = next(iter(self._finished.values()))[:3]
            if (len(self._finished) <= self.keep_finished and self._finished_bytes <= self.keep_finished_bytes
                    and now - t <= self.keep_finished_s):
                break
            self._finished.popitem(last=False)
            self._finished_bytes -= size

    def finished_event(self, job_id: str):
        """The DoneEvent / FailedEvent of a job that finished recently, or None."""
        self._forget_old()
        item = self._finished.get(job_id)
        return item[1] if item else None

    async def job_status(self, job_id: str, client: str | None = None) -> JobStatus | None:
        """What this coordinator knows of a job; None if nothing (never had it, or forgot it), or,
        with `client`, if the job is not that client's."""
        assert self.engine is not None, "enter the context first"
        if client is not None and self.owner_of(job_id) not in (client, None):
            return None
        state = self.engine.job_state(job_id)
        if state is None and self.finished_event(job_id) is None:
            # A tick may have finished the job and still be publishing its events: wait for that.
            await self.engine.flush_events()
            state = self.engine.job_state(job_id)
        if state is not None:
            return JobStatus(job_id=job_id, coordinator=self.name, instance=self.instance, **state)
        ev = self.finished_event(job_id)
        if ev is None or (client is not None and self._finished[job_id][4] != client):
            return None
        step, steps = self._finished[job_id][3]
        return JobStatus(job_id=job_id, state="done" if ev.kind == "done" else "failed", step=step, steps=steps,
                         coordinator=self.name, instance=self.instance)

    # ------------------------------------------------------------ NATS handlers
    async def _publish(self, event) -> None:
        if self.durable and event.job_id in self._fenced:
            return  # another coordinator runs this job now
        if self.durable and self.store.holds(event.job_id) and self.store.expired():
            # this run could not renew its leases for lease_s (it was stopped, e.g. SIGSTOP, or cut
            # off): another coordinator may run the job already; publish nothing, let the lease lapse
            self.store.forget(event.job_id)
            self._fence(event.job_id, f"its lease could not be renewed for {self.lease_s:g} s")
            return
        if self.durable and event.kind in ("done", "failed"):
            self._durable_op("release", event.job_id)
        if event.kind == "frame" and event.job_id in self._progress:
            self._progress[event.job_id] = (int(event.step), int(event.steps))
        if event.kind in ("done", "failed"):
            self._remember(event)
        await self._send_event(event)

    async def _send_event(self, event) -> None:
        owner = self.owner_of(event.job_id)
        if owner is None:  # cannot happen for a job this coordinator admitted; never guess a namespace
            log.error("not publishing %s for job %s: its owner is not known", event.kind, event.job_id)
            return
        try:
            await self.nc.publish(subjects.job_events(owner, event.job_id), pack(event))
        except ProtocolError as err:
            log.error("cannot publish %s for job %s: %s", event.kind, event.job_id, err.message)
        except Exception as err:  # connection trouble: the client will time out; keep serving
            log.error("cannot publish %s for job %s: %r", event.kind, event.job_id, err)

    def _may_reply(self, msg, client: str | None = None) -> bool:
        """True if `msg` wants a reply and its reply subject is an inbox (`_INBOX.…`, or with
        `client` also `_INBOX_<client>.…`; without, any `_INBOX_<token>.…`); a request with any
        other reply subject is dropped, with a rate-limited log line."""
        if not msg.reply:
            return False
        if subjects.is_reply_inbox(msg.reply, client) and not self._is_own_inbox(msg.reply):
            return True
        self.replies_dropped += 1
        self._dropped_log.warning("dropped a request on %s: its reply subject %s is not an inbox of the requester "
                                  "(replies go only to _INBOX.… or _INBOX_<client>.…)", shown(msg.subject),
                                  shown(msg.reply))
        return False

    def _is_own_inbox(self, reply: str) -> bool:
        """True if `reply` is under one of this coordinator's own reply inboxes (where experts answer
        it): nobody may direct a reply there."""
        own = [getattr(self.nc, "_resp_sub_prefix", None), getattr(self.transport, "_prefix", None)]
        for prefix in own:
            if prefix:
                text = bytes(prefix).decode() if isinstance(prefix, (bytes, bytearray)) else str(prefix)
                if reply.startswith(text.rstrip(".") + "."):
                    return True
        return False

    async def _reply(self, msg, message) -> None:
        if msg.reply:
            try:
                await msg.respond(pack(message))
            except Exception:
                log.exception("reply failed")

    async def _on_submit(self, msg) -> None:
        # Every submit is answered `accepted` or `rejected`; each `rejected` counts in jobs_rejected
        # (the scheduler counts its own refusals, this service the rest).
        client = subjects.parse_submit_subject(msg.subject)
        if msg.reply and not self._may_reply(msg, client):
            return  # a reply subject outside _INBOX: not even the job is taken
        if client is None:
            self.rejected_unread += 1
            self.metrics.rejected(ErrorCode.BAD_REQUEST)
            await self._reply(msg, JobRejected(code=ErrorCode.BAD_REQUEST, reason=(
                f"the client name in the subject {shown(msg.subject)} is not valid: use 1-64 characters of "
                "[A-Za-z0-9_-]")))
            return
        try:
            request = unpack(msg.data, JobRequest)
        except ProtocolError as err:
            self.rejected_unread += 1
            self.metrics.rejected(err.code)
            await self._reply(msg, JobRejected(code=err.code, reason=err.message))
            return
        try:
            await self._refuse_unconditional(request)
        except Rejected as err:
            self.rejected_unread += 1
            self.metrics.rejected(err.code)
            await self._reply(msg, JobRejected(code=err.code, reason=err.reason))
            return
        except Exception:  # a failed probe never costs the job: its rows meet the workers' own check
            log.exception("null-label probe failed")
        try:
            # submit + the accepted event are queued before any await, so the event
            # precedes every frame of this job on the events subject
            accepted = self._signed(self.engine.submit(request, client=fairness_key(client, request)))
            self._own(accepted.job_id, client)
            self._progress[accepted.job_id] = (0, request.steps)
            if self.durable:
                self._durable_op("adopt", accepted.job_id)
            publish = self._publish(accepted)
        except Rejected as err:
            await self._reply(msg, JobRejected(code=err.code, reason=err.reason))
            return
        except Exception as err:  # never die of one request
            self.rejected_unread += 1
            self.metrics.rejected(ErrorCode.INTERNAL)
            log.exception("submit failed")
            await self._reply(msg, JobRejected(code=ErrorCode.INTERNAL, reason=f"{type(err).__name__}: {err}"))
            return
        await publish
        await self._reply(msg, accepted)

    async def _refuse_unconditional(self, request: JobRequest) -> None:
        """Admission of a job with unconditional rows (digit -1, label unknown): raise
        Rejected(bad_request) when some expert's workers have no null label. Such a worker refuses a
        whole step request that carries y = -1, which would fail the tick for every job sharing that
        request, so the rows must not reach it. Each expert is probed with a one-row y = -1 step at most
        once per NULL_LABEL_TTL_S (concurrently); an expert that does not answer, or answers anything
        but a step or `bad_request`, is not held against the job (its rows go to the others as usual),
        and is asked again only after NULL_LABEL_UNKNOWN_TTL_S."""
        if not request.n_unconditional or self.nc is None:
            return
        now = time.monotonic()
        stale = [k for k in range(self.config.num_experts)
                 if k not in self._null_label or self._null_label[k][2] <= now]
        if stale:
            found = await asyncio.gather(*(self._probe_null_label(k) for k in stale))
            for k, got in zip(stale, found):
                if got is None:  # unknown: not held against the job, asked again after a short while
                    self._null_label[k] = (None, "", time.monotonic() + NULL_LABEL_UNKNOWN_TTL_S)
                else:
                    self._null_label[k] = (got[0], got[1], time.monotonic() + NULL_LABEL_TTL_S)
        lacking = sorted(k for k, (has, _, _) in self._null_label.items() if has is False)
        if lacking:
            raise Rejected(ErrorCode.BAD_REQUEST, (
                f"{request.n_unconditional} of {request.n_images} digits are -1 (label unknown), but expert"
                f"{'s' * (len(lacking) > 1)} {', '.join(map(str, lacking))} of this fleet "
                f"{'have' if len(lacking) > 1 else 'has'} no null label (its worker said: "
                f"{self._null_label[lacking[0]][1]}): ask for digits 0-9, or serve experts trained with "
                "train-expert --label-dropout > 0"))

    async def _probe_null_label(self, expert: int) -> tuple[bool, str] | None:
        """Ask one worker of `expert` for a one-row y = -1 step: (True, "") when it serves it,
        (False, its message) when it refuses with `bad_request`, None when it cannot tell."""
        from schemas import UNCONDITIONAL, StepReply, StepResult

        probe = probe_step(expert, UNCONDITIONAL, self.config.image_shape)
        try:
            msg = await self.nc.request(subjects.expert_velocity(expert), probe,
                                        timeout=min(self.step_timeout, NULL_LABEL_PROBE_S))
            reply = unpack(msg.data, StepResult)
        except Exception:  # no responders, timeout, an undecodable reply: unknown
            return None
        if isinstance(reply, StepReply):
            return True, ""
        if reply.code == ErrorCode.BAD_REQUEST:
            return False, reply.message
        return None

    async def _not_a_job_id(self, msg, what: str) -> None:
        """Answer a cancel / status request on `ddm.v1.c.<client>.jobs.<token>.<verb>` whose client
        or job token is not valid."""
        found = subjects.parse_job_namespace(msg.subject)
        what_token, token = ("job id", found[1]) if found else ("client name", msg.subject.split(".")[3]
                                                                 if msg.subject.count(".") >= 3 else msg.subject)
        await self._reply(msg, ErrorReply(code=ErrorCode.BAD_REQUEST, message=(
            f"{what}: the {what_token} in the subject, {shown(token)} ({len(token)} "
            f"character{'s' * (len(token) != 1)}), is not valid: use 1-64 characters of [A-Za-z0-9_-]")))

    async def _on_cancel(self, msg) -> None:
        parsed = subjects.parse_job_subject(msg.subject)
        found = subjects.parse_job_namespace(msg.subject)
        if msg.reply and not self._may_reply(msg, found[0] if found else None):
            return  # a reply subject outside _INBOX: not acted on either
        if parsed is None:
            await self._not_a_job_id(msg, "cancel")
            return
        client, job_id = parsed.client, parsed.job_id
        if msg.data:
            try:
                req = unpack(msg.data, CancelRequest)
            except ProtocolError as err:
                await self._reply(msg, CancelReply(job_id=job_id, cancelled=False, reason=f"{err.code.value}: {err.message}"))
                return
            if req.job_id != job_id:
                await self._reply(msg, CancelReply(job_id=job_id, cancelled=False,
                                                   reason=f"body job_id {req.job_id!r} does not match the subject"))
                return
        ok = await self.cancel(job_id, client=client)  # another client's job: not acted on, "unknown"
        if ok:
            await self._reply(msg, CancelReply(job_id=job_id, cancelled=True))
        else:  # answer "unknown" a little later, so the coordinator that owns the job (if any) answers first
            self._reply_later(msg, CancelReply(job_id=job_id, cancelled=False, reason=UNKNOWN_JOB))

    def _reply_later(self, msg, message, delay: float = NOT_MINE_DELAY) -> None:
        if not msg.reply:
            return
        if len(self._bg) >= MAX_DELAYED_REPLIES:  # flooded: answer at once rather than hold more tasks
            delay = 0.0

        async def later() -> None:
            await asyncio.sleep(delay)
            await self._reply(msg, message)

        task = asyncio.create_task(later())
        self._bg.add(task)
        task.add_done_callback(self._bg.discard)

    async def _on_job_status(self, msg) -> None:
        parsed = subjects.parse_job_subject(msg.subject)
        found = subjects.parse_job_namespace(msg.subject)
        if not self._may_reply(msg, found[0] if found else None):
            return
        if parsed is None:
            await self._not_a_job_id(msg, "job status")
            return
        client, job_id = parsed.client, parsed.job_id
        if self.durable and job_id in self._fenced:
            return  # another coordinator took the job over: its answer counts, not our "unknown"
        try:
            status = await self.job_status(job_id, client=client)
            # not ours, not this client's, or lost in a restart: "unknown", after the owner had its chance
            if status is None:
                self._reply_later(msg, JobStatus(job_id=job_id, state="unknown", coordinator=self.name,
                                                 instance=self.instance),
                                  delay=2 * NOT_MINE_DELAY)
                return
            if status.state in ("done", "failed"):  # publish the result again, then say so
                ev = self.finished_event(job_id)
                if ev is not None:
                    self.republished += 1
                    await self._send_event(ev)
            await self._reply(msg, status)
        except Exception:
            log.exception("job status failed")

    async def _on_status(self, msg) -> None:
        if not self._may_reply(msg):
            return
        try:
            await self._reply(msg, self.status())
        except Exception:
            log.exception("status failed")


def new_instance_id() -> str:
    """An id for one run of a coordinator: its UTC start time and 6 random hex digits,
    e.g. "20261126T085649Z-3fa2c1"."""
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + secrets.token_hex(3)


def fairness_key(client: str, request: JobRequest) -> str:
    """The scheduler's fairness key of a job: "<client>", or "<client>/<session>" with a session."""
    return f"{client}/{request.session}" if request.session else client


def probe_step(expert: int, y: int = 0, image_shape: tuple[int, ...] = (1, 32, 32)) -> bytes:
    """A packed one-row StepRequest for `expert` (zeros at t = 0, label `y`): asks a worker whether it
    serves (readiness) or whether it serves that label (the null-label check)."""
    import numpy as np

    from schemas import StepRequest

    return pack(StepRequest(expert=expert, x_t=np.zeros((1, *image_shape), np.float32), t=np.zeros(1, np.float32),
                            y=np.full(1, y, np.int64)))


async def wait_for_experts(nc, num_experts: int, timeout: float = 30.0) -> None:
    """Block until every expert subject has at least one responder (or raise TimeoutError)."""
    import nats.errors

    probe = {k: probe_step(k) for k in range(num_experts)}
    deadline = time.monotonic() + timeout
    missing = set(range(num_experts))
    while missing:
        for k in sorted(missing):
            try:
                await nc.request(subjects.expert_velocity(k), probe[k], timeout=max(1.0, min(10.0, timeout)))
                missing.discard(k)
            except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
                pass
        if missing:
            if time.monotonic() > deadline:
                raise TimeoutError(f"experts {sorted(missing)} have no workers after {timeout:g} s")
            await asyncio.sleep(0.2)
