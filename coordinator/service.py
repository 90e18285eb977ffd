"""The coordinator service: job intake, cancel and status over NATS, around the engine loop.

    async with Coordinator(router, CoordinatorConfig(nats="nats://127.0.0.1:4222"), num_experts=2,
                           class_to_expert=[0]*5 + [1]*5) as coord:
        ...   # serves until the block exits

The parts, each with one job: `coordinator.intake` (the NATS handlers below), `coordinator.ledger`
(owners, progress, recently finished jobs), `coordinator.durable_jobs` (--durable), `coordinator.
null_labels` (the null-label probes) and `coordinator.metrics_endpoint` (GET /metrics); this module
wires them to the engine and offers the in-process API (submit, cancel, job_status, status).

The NATS subjects and the rules of every answer (client namespaces, per-client job ids, reply
inboxes, bad requests): `coordinator.intake`.
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
import secrets
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from bus.cancel import cancel_and_wait
from bus.inbox import request_inbox_prefix
from schemas import (
    ErrorCode,
    FailedEvent,
    FleetStatus,
    JobAccepted,
    JobRequest,
    JobStatus,
    ProtocolError,
    pack,
    subjects,
)
from schemas.messages import RejectedWorkerInfo
from schemas.spec import ModelSpec, legacy_spec

from .config import CoordinatorConfig
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
from .durable import CheckpointingScheduler, JobStore
from .durable_jobs import DurableJobs
from .engine import Engine, RouterLike, Transport
from .fleet_spec import check_fleet_spec
from .intake import (  # noqa: F401 (re-exported)
    INTAKE_PENDING_MSGS,
    MAX_DELAYED_REPLIES,
    NOT_MINE_DELAY,
    UNKNOWN_JOB,
    Intake,
)
from .ledger import JobLedger
from .metrics_endpoint import MetricsEndpoint
from .null_labels import NULL_LABEL_PROBE_S, NULL_LABEL_TTL_S, NULL_LABEL_UNKNOWN_TTL_S, NullLabelProbes, probe_step  # noqa: F401
from .scheduler import Rejected, Scheduler
from .startup import load_router_and_partition, router_spec, wait_for_experts  # noqa: F401 (re-exported)

log = logging.getLogger(__name__)

COORDINATOR_QUEUE = f"{subjects.PREFIX}.coordinators"
#: The `arch` a fleet reports for a router that does not name its network (router_arch).
DEFAULT_ROUTER_ARCH = "router"
#: Seconds between two discoveries of the expert workers, whose specs are checked against the fleet's.
WORKER_CHECK_S = 5.0
#: Seconds a stopping coordinator lets its last tick finish before cancelling it (its jobs have failed
#: with `unavailable`, or been handed over, already).
STOP_GRACE_S = 3.0
#: Seconds a stopping coordinator waits for the images of jobs in its decode stage (decoders answer in
#: milliseconds; a hung one is asked for up to the step timeout x (retries + 1)) before failing those jobs
#: `unavailable`: within `ddm-fleet up`'s 20 s stop timeout.
DECODE_STOP_WAIT_S = 8.0


class EngineDied(RuntimeError):
    """The coordinator's engine loop died; every job failed with `internal` and submits are refused."""


def router_arch(router) -> str:
    """The `arch` of a fleet's reported spec: the network that routes it, by one rule for every fleet. A
    router names it in its `arch` attribute (`models.router.Router`: "router", every trained router's
    network; `LabelRouter`: "label", the class-table stand-in); one that does not say is "router". A
    router checkpoint's stored spec may name anything there (older ones name an expert architecture,
    "unet", or imply it), so it is not used."""
    arch = getattr(router, "arch", None)
    if isinstance(arch, str) and 1 <= len(arch) <= 64:
        return arch
    return DEFAULT_ROUTER_ARCH


class Coordinator:
    """Router + scheduler + engine + NATS endpoints, as an async context manager.

    `config` (`CoordinatorConfig`) holds every setting; keyword `settings` (its field names, e.g.
    max_rows=8, step_timeout=5.0) change single ones. Give `nc` (an open nats-py connection, not
    closed on exit) or a URL (`nats_url`, or `config.nats`: connected and drained here). `transport`
    defaults to a `NatsTransport` of the config's expert-request settings."""

    def __init__(
        self,
        router: RouterLike,
        config: CoordinatorConfig | None = None,
        *,
        num_experts: int,
        class_to_expert: Sequence[int] | None = None,
        nc: Any = None,
        nats_url: str | None = None,
        transport: Transport | None = None,
        spec: ModelSpec | None = None,
        fleet_guidance: float = 1.0,
        **settings: Any,
    ):
        cfg = config or CoordinatorConfig()
        self.settings = cfg = cfg.replace(**settings) if settings else cfg
        # the guidance scale of jobs that set none: --default-guidance, else the fleet's (its router JSON's)
        self.default_guidance = float(cfg.default_guidance if cfg.default_guidance is not None else fleet_guidance)
        if nc is None and nats_url is None and cfg.nats is None:
            raise ValueError("give nc (a nats-py connection) or nats_url")
        # The fleet's model spec: given (from the router checkpoint: checked against every worker at
        # start), else the one the configured image shape implies (10 classes), not checked.
        self.check_spec = spec is not None
        self.spec = (
            spec if spec is not None else legacy_spec(in_channels=cfg.image_shape[0], image_size=cfg.image_shape[1])
        )
        # the spec's `arch` names what routes this fleet (router_arch), whatever its checkpoint stored there
        self.spec = self.spec.model_copy(update={"arch": router_arch(router)})
        # fair-sharing limits: passed through to the scheduler (see coordinator.scheduler)
        self.config = cfg.scheduler_config(num_experts, class_to_expert, spec=self.spec)
        self.router, self.transport = router, transport
        self.nc, self._own_nc, self.nats_url = nc, nc is None, nats_url or cfg.nats
        self.name, self.step_timeout, self.retries = cfg.name, cfg.step_timeout, cfg.retries
        self.durable = cfg.durable
        # this run of the coordinator: a restart (same name) has another instance
        self.instance = new_instance_id()
        self.engine: Engine | None = None
        self._task: asyncio.Task | None = None
        self._worker_watch: asyncio.Task | None = None
        self._watching = True  # False once closing: the worker watch loop ends
        self.worker_check_s = WORKER_CHECK_S
        self._subs: list = []
        self.ledger = JobLedger(
            keep_finished=cfg.keep_finished,
            keep_finished_bytes=int(cfg.keep_finished_mb * 2**20),
            keep_finished_s=cfg.keep_finished_s,
        )
        self.intake = Intake(self)
        self.null_labels = NullLabelProbes(nc, num_experts, self.config.image_shape, cfg.step_timeout)
        self.endpoint = MetricsEndpoint(cfg.metrics_port, cfg.metrics_host, cfg.metrics_optional)
        self.metrics = None  # CoordinatorMetrics, once entered
        self.store: JobStore | None = None
        self.durable_jobs: DurableJobs | None = None  # durable jobs (coordinator.durable_jobs): --durable only
        # set once this run knows every job it will ever resume at start (--durable: after the orphans'
        # restore): status and cancel requests wait for it, so a restarted coordinator never answers
        # "unknown" for a job it is about to resume
        self.jobs_restored = asyncio.Event()
        # latent fleets: the decoder stage (coordinator.decode_stage; calls in coordinator.decoder_client)
        self.decoder = None  # a DecoderClient, once entered, when the spec says space latent
        self._latent_opts: dict[str, LatentOptions] = {}  # internal id -> what the job asked of the decoder
        self._decoding: dict[str, asyncio.Task] = {}  # internal id -> the last event of the job in the stage
        self._image_lookup: asyncio.Future | None = None  # the decoders' image shape, looked up at start
        self._stage_tasks: set[asyncio.Task] = set()  # every event in the stage
        self._stage_ends: dict[str, Any] = {}  # internal id -> its done / failed, in the stage, not yet published
        self.decode_stop_wait_s = DECODE_STOP_WAIT_S

    @classmethod
    def from_files(cls, router_path, partition_path, config: CoordinatorConfig | None = None, **kw) -> Coordinator:
        """A coordinator of the router and partition files, serving the router's model spec."""
        from models.fleet_guidance import fleet_default_guidance

        router, k, c2e = load_router_and_partition(router_path, partition_path)
        kw.setdefault("spec", router_spec(router_path))
        kw.setdefault("fleet_guidance", fleet_default_guidance(router_path))
        return cls(router, config, num_experts=k, class_to_expert=c2e, **kw)

    # the parts' counters and settings, under their old names
    metrics_port = property(lambda self: self.endpoint.port)
    replies_dropped = property(lambda self: self.intake.replies_dropped)
    republished = property(lambda self: self.intake.republished)
    rejected_unread = property(lambda self: self.intake.rejected_unread)

    def _discard_unsent(self) -> bool:
        """Drop the bus connection with what it still holds unsent (durable leases lapsed)."""
        from bus.connect import discard_unsent

        return discard_unsent(self.nc)

    jobs_resumed = property(lambda self: self.durable_jobs.jobs_resumed if self.durable_jobs else 0)

    @property
    def lease_s(self) -> float:
        return self.store.lease_s if self.store is not None else self.settings.lease_s

    # ------------------------------------------------------------ lifecycle
    async def __aenter__(self) -> Coordinator:
        """Start: connect (unless given a connection), check the fleet's spec against its workers, open the
        decoder client (latent fleets), the transport, the durable store and the engine, subscribe, restore
        the previous run's jobs (`--durable`) and start ticking. A failure at any step undoes the steps
        before it (`_undo_start`) and raises."""
        from bus.connect import connect

        if self.nc is None:
            self.nc = await connect(self.nats_url, name=self.name, reconnect="forever", pending_size=64 * 1024 * 1024)
            self.null_labels.nc = self.nc
        try:
            odd = await self._check_fleet_spec()
            self._open_decoder()
            self._open_transport()
            await self._open_engine()
            await self._subscribe()
            await self._start_serving(odd)
        except BaseException:
            await self._undo_start()
            raise
        log.info(
            "coordinator up: %d experts, max %d rows, %d queued jobs",
            self.config.num_experts,
            self.config.max_rows,
            self.config.max_queued_jobs,
        )
        return self

    async def _check_fleet_spec(self) -> dict[str, str]:
        """The router's spec is the fleet's: the workers that differ ({name: what differs}) are named and
        not used (coordinator/fleet_spec.py)."""
        if not self.check_spec:
            return {}
        self.spec, odd = await check_fleet_spec(self.nc, self.spec)
        return odd

    def _open_decoder(self) -> None:
        """A latent fleet's decoder client (its spec must name the autoencoder by content hash)."""
        if self.spec.space != "latent":
            return
        from models.autoencoder import content_hash_of

        from .decoder_client import DecoderClient

        cfg = self.settings
        digest = content_hash_of(self.spec.decoder or "")
        if digest is None or not subjects.is_content_hash(digest):
            raise ValueError(
                f"the fleet's spec says space latent with decoder {self.spec.decoder!r}, which names no "
                "autoencoder ('autoencoder@sha256:<content hash>'): no decoder can serve it"
            )
        self.decoder = DecoderClient(self.nc, digest, timeout=cfg.step_timeout, retries=cfg.retries)
        # what its decoders produce, for the fleet's reported spec: looked up now, in the background
        self._image_lookup = asyncio.ensure_future(self.decoder.learn_images())

    def _open_transport(self) -> None:
        from .transport import NatsTransport

        cfg = self.settings
        if self.transport is None:
            self.transport = NatsTransport(
                self.nc,
                step_timeout=cfg.step_timeout,
                retries=cfg.retries,
                bad_reply_retries=cfg.bad_reply_retries,
                wire_dtype=cfg.wire_dtype,
                hedge=cfg.hedge,
                hedge_after_s=cfg.hedge_after_s,
                dispatch=cfg.dispatch,
                max_rows=cfg.request_rows,
            )
        self.null_labels.transport = self.transport  # which workers serve guidance (a guided job's admission)

    async def _open_engine(self) -> None:
        """The scheduler (checkpointing, with the durable store, under `--durable`), the engine, its metrics."""
        cfg = self.settings
        if cfg.durable:
            self.store = await JobStore(
                self.nc, self.name, self.instance, lease_s=cfg.lease_s, replicas=cfg.js_replicas
            ).open()
            self.durable_jobs = DurableJobs(
                self.store,
                self.ledger,
                name=self.name,
                checkpoint_every=cfg.checkpoint_every,
                on_lapse=self._discard_unsent,
            )
            sched = CheckpointingScheduler(self.config, cfg.checkpoint_every, on_due=self.durable_jobs.wake.set)
        else:
            sched = Scheduler(self.config)
        rows_per = getattr(self.transport, "rows_per_request", None)  # keep expert requests whole
        self.engine = Engine(
            sched,
            self.router,
            self.transport,
            self._publish,
            cohorts=cfg.cohorts,
            route_every=cfg.route_every,
            speculate=cfg.speculate,
            run_ahead=cfg.run_ahead,
            run_ahead_rows=cfg.run_ahead_rows,
            request_rows=(
                rows_per(np.zeros((1, *self.config.image_shape), np.float32)) if callable(rows_per) else None
            ),
        )
        self.metrics = self.engine.metrics
        if hasattr(self.transport, "hedge_counts"):
            self.metrics.watch_transport(self.transport)
        if self.store is not None:
            self.metrics.watch_store(self.store)
        self.metrics.watch_bad_replies(null_label_probe=self.null_labels, decode=self.decoder)
        await self.endpoint.start(self.metrics)

    async def _subscribe(self) -> None:
        """The intake's subjects; returns once the server has every subscription."""
        intake = self.intake
        self._subs = [
            await self.nc.subscribe(subjects.ALL_JOBS_SUBMIT, queue=COORDINATOR_QUEUE, cb=intake.on_submit),
            await self.nc.subscribe(
                subjects.ALL_JOB_CANCELS, cb=intake.on_cancel, pending_msgs_limit=INTAKE_PENDING_MSGS
            ),
            await self.nc.subscribe(
                subjects.ALL_JOB_STATUS, cb=intake.on_job_status, pending_msgs_limit=INTAKE_PENDING_MSGS
            ),
            await self.nc.subscribe(subjects.FLEET_STATUS, cb=intake.on_status, pending_msgs_limit=INTAKE_PENDING_MSGS),
        ]
        intake.submit_sub = self._subs[0]  # its backlog tells whether a cancel may overtake a submit
        # nats-py writes a flush's PING straight to the socket, possibly ahead of SUBs still in its
        # buffer; by the time that PONG is back the flusher task has written them, so a second
        # round trip proves the server has every subscription (and clients find us at once).
        await self.nc.flush()
        await self.nc.flush()

    async def _start_serving(self, odd: dict[str, str]) -> None:
        """Restore the previous run's jobs (`--durable`), reject the odd workers, start the engine and the
        periodic worker discovery."""
        cfg = self.settings
        if self.durable_jobs is not None:  # status/cancel wait for this: a job of the previous run is never "unknown"
            await self.durable_jobs.start(self.engine)
        self.jobs_restored.set()
        if self.check_spec and hasattr(self.transport, "refresh_workers"):
            self.transport.fleet_spec = self.spec
            if odd:  # rejected by name before the first expert call: their experts use the matching workers
                await self.transport.refresh_workers()
        self._task = asyncio.create_task(self.engine.run(), name="coordinator-engine")
        self._task.add_done_callback(self._engine_ended)
        if (self.check_spec or cfg.run_ahead) and hasattr(self.transport, "refresh_workers"):
            # workers that join later are checked as they are discovered (coordinator/fleet_spec.py), and
            # what each expert's workers can run ahead is learned (coordinator/run_ahead.py)
            self._worker_watch = asyncio.create_task(self._watch_workers(), name="coordinator-worker-specs")

    async def _undo_start(self) -> None:
        """A start that failed part-way: stop what it started (subscriptions, the durable loops, the
        metrics endpoint, the decoder's lookup) and close the connection if it is ours."""
        for sub in self._subs:
            try:
                await sub.unsubscribe()
            except Exception:
                pass
        self._subs = []
        if self.durable_jobs is not None:
            try:
                await self.durable_jobs.hand_over()
            except Exception:
                log.exception("durable jobs: handing over after a failed start")
        if self._image_lookup is not None and not self._image_lookup.done():
            await cancel_and_wait([self._image_lookup], 2.0)
        try:
            await self.endpoint.stop()
        except Exception:
            pass
        if self._own_nc and self.nc is not None:
            await self.nc.close()

    async def _watch_workers(self) -> None:
        """Every WORKER_CHECK_S: discover the expert workers and reject those whose spec differs from the
        fleet's (the transport logs each by name, stops addressing it and refuses its replies)."""
        # The loop also ends on `_watching` going False: a cancel can be lost inside nats-py (a cancelled
        # next_msg reads as ConnectionClosedError on a closed connection; 3.11's wait_for may swallow one),
        # and a task that outlives a lost cancel would hang asyncio.run's shutdown.
        while self._watching:
            try:
                await self.transport.refresh_workers()
            except Exception as err:  # never let discovery take the coordinator down
                log.warning("worker discovery failed: %r", err)
            if self._watching:
                await asyncio.sleep(self.worker_check_s)

    def own_inbox_prefixes(self) -> list[str]:
        """The prefixes of this coordinator's own reply inboxes, where its experts answer it (nats-py's
        request replies, the transport's): no request may direct its reply there."""
        own = [request_inbox_prefix(self.nc), getattr(self.transport, "reply_prefix", None)]
        return [prefix for prefix in own if prefix]

    def rejected_workers(self) -> list:
        """The workers on the bus (at the last discovery) whose model spec differs from the fleet's."""
        rejected = getattr(self.transport, "rejected_workers", None) or {}
        return sorted(rejected.values(), key=lambda w: (w.expert, w.worker_id))

    async def __aexit__(self, *exc) -> None:
        if self._worker_watch is not None:
            self._watching = False
            await cancel_and_wait([self._worker_watch], 2.0)  # at most one discovery window
            self._worker_watch = None
        for sub in self._subs:
            try:
                await sub.unsubscribe()
            except Exception:
                pass
        self._subs = []
        self.intake.close()
        if self.durable_jobs is not None:
            await self.durable_jobs.hand_over()
        if self.engine is not None:
            await self.engine.stop()
        # the engine's last tick and the decode stage wind down side by side (one stop, not their sum)
        await asyncio.gather(self._end_engine_task(), self._close_decode_stage())
        if self.nc is not None:
            try:
                await self.nc.flush(timeout=2)
            except Exception:
                pass
            if self._own_nc:
                from bus.connect import drain_or_close

                await drain_or_close(self.nc)
        await self.endpoint.stop()

    async def serve_forever(self) -> None:
        """Wait until the engine task ends (it does not, unless stopped); raises its error if it died."""
        assert self._task is not None, "enter the context first"
        await self._task

    def _engine_ended(self, task: asyncio.Task) -> None:
        """Done-callback of the engine task: a loop that died has already failed every job with
        `internal` and refuses submits (`unavailable`); say so loudly here."""
        if not task.cancelled() and task.exception() is not None:
            log.critical(
                "coordinator engine died (%s): every job failed, submits are refused; "
                "the process should exit and be restarted",
                self.engine_error,
            )

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
    async def submit(self, request: JobRequest, client: str = subjects.DEFAULT_CLIENT) -> JobAccepted:
        """Queue a job of `client` without NATS for the request (events still go to its events
        subject, in `client`'s namespace). Returns JobAccepted; raises scheduler.Rejected."""
        assert self.engine is not None, "enter the context first"
        request = self.with_fleet_defaults(request)
        await self.null_labels.check(request)
        accepted, publish = self.admit(request, subjects.check_client(client))
        await publish
        return accepted

    def with_fleet_defaults(self, request: JobRequest) -> JobRequest:
        """`request` with what it leaves to the fleet filled in: a job without a guidance_scale gets the
        fleet's default (when that is not 1), which is then part of the job (its durable snapshot too)."""
        if request.guidance_scale is None and self.default_guidance != 1.0:
            return request.model_copy(update={"guidance_scale": self.default_guidance})
        return request

    def admit(self, request: JobRequest, client: str):
        """Admit `client`'s job now (no await): (JobAccepted as the client sees it, the awaitable that
        publishes it). Raises scheduler.Rejected."""
        job_id = request.job_id
        internal = self.ledger.internal_id_for(client, job_id, self.engine.scheduler.knows)
        if job_id is not None and self.ledger.is_live(client, job_id):
            internal = self.ledger.internal(client, job_id)  # the scheduler refuses its own id again
        try:
            accepted = self.engine.submit(request, client=fairness_key(client, request), job_id=internal)
        except Rejected as err:  # never show another client's (internal) id
            if internal is not None and internal != job_id:
                raise Rejected(err.code, err.reason.replace(repr(internal), repr(job_id)), err.limit) from None
            raise
        accepted = accepted.model_copy(update={"coordinator": self.name, "instance": self.instance})
        internal = accepted.job_id
        # owner epoch: 1 for a durable job's first owner (a take-over writes one more into its
        # checkpoint, coordinator.durable), 0 for a job that is not durable
        self.ledger.admit(
            internal,
            client,
            job_id or internal,
            steps=request.steps,
            epoch=1 if self.durable_jobs is not None else 0,
            report_epoch=request.report_epoch,
        )
        accepted = self.ledger.stamp(internal, accepted)
        self.ledger.prune(
            self.engine.scheduler.knows, internal, 2 * (self.config.max_queued_jobs + self.config.max_rows) + 64
        )
        if self.durable_jobs is not None:
            self.durable_jobs.op("adopt", internal)
        if self.decoder is not None:
            self._latent_opts[internal] = LatentOptions.of(request)
        publish = self._publish(accepted)
        return self._as_client(accepted, client, job_id or internal), publish

    def _as_client(self, event, client: str, job_id: str):
        """`event` under the job id its client knows (the same object when that is the internal id)."""
        if event.job_id == job_id:
            return event
        update: dict[str, Any] = {"job_id": job_id}
        if event.kind == "accepted":
            update["events_subject"] = subjects.job_events(client, job_id)
        return event.model_copy(update=update)

    async def cancel(self, job_id: str, client: str | None = None) -> bool:
        """Cancel a queued or running job; with `client`, only that client's job `job_id`."""
        assert self.engine is not None, "enter the context first"
        internal = self.ledger.find(job_id, client)
        if internal is None:
            return False
        state = self.engine.job_state(internal)  # how far it got, before the cancel removes it
        if state is not None:
            self.ledger.note_progress(internal, state["step"], state["steps"])
        return await self.engine.cancel(internal)

    def status(self, include_spec: bool = False, include_images: bool = False) -> FleetStatus:
        """The fleet status snapshot; with `include_spec`, the fleet's model spec too, and with
        `include_images` as well, the spec names the images clients get (`reported_spec`)."""
        assert self.engine is not None, "enter the context first"
        st = self.engine.status()
        st["jobs_rejected"] = (
            st.get("jobs_rejected", 0) + self.intake.rejected_unread
        )  # every submit answered `rejected`
        rejected = [RejectedWorkerInfo(**w.to_json()) for w in self.rejected_workers()] if include_spec else None
        spec = self.reported_spec(include_images) if include_spec else None
        guidance = self.default_guidance if include_spec else None
        return FleetStatus(
            coordinator=self.name, spec=spec, rejected_workers=rejected, default_guidance_scale=guidance, **st
        )

    def reported_spec(self, include_images: bool = False) -> ModelSpec:
        """The fleet's spec as `fleet.status` reports it; with `include_images`, naming the images clients
        get (`image_shape`, `image_value_range`): a pixel fleet's samples, a latent fleet's decoded
        images (left out while no decoder of its autoencoder has been found: `learn_images`)."""
        if not include_images:
            return self.spec
        if self.spec.space == "latent":
            dec = self.decoder
            return self.spec.with_images(getattr(dec, "image_shape", None), getattr(dec, "image_value_range", None))
        return self.spec.with_images()

    async def learn_images(self) -> None:
        """A latent fleet: look its decoders' image shape up when not known yet (at most one discovery
        every few seconds, `DecoderClient.learn_images`); nothing for a pixel fleet."""
        if self.decoder is not None:
            await self.decoder.learn_images()

    def owner_of(self, job_id: str) -> str | None:
        """The client token that owns a live or recently finished job `job_id` (any client's), else None."""
        internal = self.ledger.find(job_id)
        if internal is not None:
            return self.ledger.name_of(internal)[0]
        found = self.ledger.find_finished(job_id)
        return found[0][0] if found else None

    def finished_event(self, job_id: str, client: str | None = None):
        """The DoneEvent / FailedEvent of a job that finished recently, or None."""
        found = self.ledger.find_finished(job_id, client)
        return found[1] if found else None

    async def job_status(self, job_id: str, client: str | None = None) -> JobStatus | None:
        """What this coordinator knows of a job; None if nothing (never had it, or forgot it), or,
        with `client`, if the job is not that client's."""
        assert self.engine is not None, "enter the context first"
        internal = self.ledger.find(job_id, client)
        if internal is None and self.ledger.find_finished(job_id, client) is None:
            # A tick may have finished the job and still be publishing its events: wait for that.
            await self.engine.flush_events()
            internal = self.ledger.find(job_id, client)
        state = self.engine.job_state(internal) if internal is not None else None
        if state is None and internal is not None and internal in self._decoding:  # its images are being decoded
            step, steps = self.ledger.progress(internal) or (0, 0)
            state = {"state": "running", "step": step, "steps": steps}
        if state is not None:
            st = JobStatus(job_id=job_id, coordinator=self.name, instance=self.instance, **state)
            return self.ledger.stamp(internal, st)
        found = self.ledger.find_finished(job_id, client)
        if found is None:
            return None
        _, ev, (step, steps) = found
        return JobStatus(
            job_id=job_id,
            state="done" if ev.kind == "done" else "failed",
            step=step,
            steps=steps,
            coordinator=self.name,
            instance=self.instance,
            expert_dtypes=getattr(ev, "expert_dtypes", None),  # a done job that asked for them
            epoch=getattr(ev, "epoch", None),  # a job that asked for it: the epoch its result was published at
        )

    # ------------------------------------------------------------ events
    async def _publish(self, event) -> None:
        """The engine's events, to their job's owner under the job id it knows. A latent fleet's
        `done` and preview frames go through the decode stage first (`_decode_then_publish`), in the
        job's order, without holding up the engine."""
        if self.durable_jobs is not None and not self.durable_jobs.before_publish(event):
            return  # another coordinator runs this job now
        internal = event.job_id
        if self.decoder is not None and event.kind != "accepted":
            opts = self._latent_opts.get(internal, LatentOptions())
            staged = event.kind == "done" or (event.kind == "frame" and wants_preview(opts, event))
            if staged or internal in self._decoding:
                if event.kind in ("done", "failed"):
                    self._latent_opts.pop(internal, None)
                    self._stage_ends[internal] = event
                before = self._decoding.get(internal)
                task = asyncio.ensure_future(self._decode_then_publish(event, opts, before))
                self._decoding[internal] = task
                self._stage_tasks.add(task)
                task.add_done_callback(self._stage_tasks.discard)
                task.add_done_callback(
                    lambda t, i=internal: self._decoding.pop(i, None) if self._decoding.get(i) is t else None
                )
                return
            if event.kind == "failed":
                self._latent_opts.pop(internal, None)
        await self._publish_now(event)

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
                    self._done_failed_after_all(event)
                    event = decoder_failed(event.job_id, str(err))
            elif event.kind == "frame" and wants_preview(opts, event):
                try:
                    if self.decoder.previews_paused:  # do not hold the frames of every job on a dead decoder
                        raise DecoderUnavailable("a decode failed in the last seconds; previews resume after a pause")
                    event = with_preview(event, await self.decoder.decode(frame_latents(event)))
                except DecoderUnavailable as err:
                    event = without_preview(event, err.reason)
            # the job's end leaves the stage's books before the publish: a cancel at shutdown that lands in
            # it must not have `_close_decode_stage` publish the end a second time
            if event.kind in ("done", "failed"):
                self._stage_ends.pop(event.job_id, None)
            await self._publish_now(event)
        except Exception:  # never lose the event to a bug in the stage
            log.exception("decode stage failed for %s of job %s", event.kind, event.job_id)
            if event.kind in ("done", "failed"):
                self._stage_ends.pop(event.job_id, None)
                await self._publish_now(decoder_failed(event.job_id, "internal error in the decode stage"))

    async def _end_engine_task(self) -> None:
        """Every job has failed or been handed over by now: a tick still waiting on an expert (up to the step
        timeout and its retries) has nothing left to deliver, so it gets a moment, not that long."""
        if self._task is None:
            return
        await asyncio.wait({self._task}, timeout=STOP_GRACE_S)
        if not self._task.done():
            log.info("stopping: cancelling the tick still waiting on the experts")
            await cancel_and_wait([self._task], STOP_GRACE_S)
        elif not self._task.cancelled() and self._task.exception() is not None:
            log.error("engine ended with an error", exc_info=self._task.exception())

    def _done_failed_after_all(self, done) -> None:
        """A `done` that will not reach its client as such: count the job as failed."""
        stats = self.engine.scheduler.stats
        stats.jobs_done, stats.jobs_failed = stats.jobs_done - 1, stats.jobs_failed + 1
        stats.images_done -= len(done.images)

    async def _close_decode_stage(self) -> None:
        """Stopping: jobs whose images are being decoded get `decode_stop_wait_s` seconds; then the stage is
        cancelled, and each job whose last event had not gone out gets it now without decoding: a `failed`
        as it was, a `done` as `failed` / `unavailable` (its images were never decoded). Previews still in
        the stage are dropped."""
        pending = [t for t in self._stage_tasks if not t.done()]
        if pending:
            await asyncio.wait(pending, timeout=self.decode_stop_wait_s)
        if self._image_lookup is not None:
            self._image_lookup.cancel()
            self._image_lookup = None
        if self.decoder is not None:  # a decode still asked of a hung decoder is not waited for either
            await self.decoder.close()
        if all(t.done() for t in pending):
            return
        await cancel_and_wait(pending, 1.0)
        ends, self._stage_ends = self._stage_ends, {}
        if ends:
            log.warning(
                "stopping: %d jobs still in the decode stage after %g s; publishing their end without images",
                len(ends),
                self.decode_stop_wait_s,
            )
        for internal, event in ends.items():
            try:
                if event.kind == "done":
                    self._done_failed_after_all(event)
                    event = FailedEvent(
                        job_id=internal,
                        code=ErrorCode.UNAVAILABLE,
                        reason="the coordinator stopped while the job's images were being decoded; submit it again",
                    )
                await self._publish_now(event)
            except Exception:  # pragma: no cover - a bug here must not stop the others' ends
                log.exception("publishing the end of job %s at shutdown failed", internal)

    async def _publish_now(self, event) -> None:
        internal = event.job_id
        name = self.ledger.name_of(internal)
        if name is None:  # cannot happen for a job this coordinator admitted; never guess a namespace
            log.error("not publishing %s for job %s: its owner is not known", event.kind, internal)
            return
        if event.kind == "frame":
            self.ledger.note_progress(internal, event.step, event.steps)
        event = self.ledger.stamp(internal, self._as_client(event, *name))
        if event.kind in ("done", "failed"):
            self.ledger.remember(internal, event)
        await self.send_event(name[0], event)

    async def send_event(self, client: str, event) -> None:
        """Publish `event` (its job id as `client` knows it) on the job's events subject."""
        try:
            await self.nc.publish(subjects.job_events(client, event.job_id), pack(event))
        except ProtocolError as err:
            log.error("cannot publish %s for job %s: %s", event.kind, event.job_id, err.message)
        except Exception as err:  # connection trouble: the client will time out; keep serving
            log.error("cannot publish %s for job %s: %r", event.kind, event.job_id, err)


def new_instance_id() -> str:
    """An id for one run of a coordinator: its UTC start time and 6 random hex digits,
    e.g. "20261126T085649Z-3fa2c1"."""
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + secrets.token_hex(3)


def fairness_key(client: str, request: JobRequest) -> str:
    """The scheduler's fairness key of a job: "<client>", or "<client>/<session>" with a session."""
    return f"{client}/{request.session}" if request.session else client
