"""The coordinator service: job intake, cancel and status over NATS, around the engine loop.

    async with Coordinator(router, CoordinatorConfig(nats="nats://127.0.0.1:4222"), num_experts=2,
                           class_to_expert=[0]*5 + [1]*5) as coord:
        ...   # serves until the block exits

The parts, each with one job: `coordinator.intake` (the NATS handlers below), `coordinator.ledger`
(owners, progress, recently finished jobs), `coordinator.events` (publishing each job's events),
`coordinator.decoding` (a latent fleet's decode stage), `coordinator.durable_wiring` and
`coordinator.durable_jobs` (--durable), `coordinator.status_answers` (fleet and job status),
`coordinator.null_labels` (the null-label probes) and `coordinator.metrics_endpoint` (GET /metrics);
this module wires them to the engine and offers the in-process API (submit, cancel, job_status, status).

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

from bus.connect import flushed
from bus.inbox import request_inbox_prefix
from schemas import FleetStatus, JobAccepted, JobRequest, JobStatus, subjects
from schemas.limits import MAX_PAYLOAD_BYTES
from schemas.spec import ModelSpec, legacy_spec

from . import status_answers
from .admission import check_event_sizes
from .config import CoordinatorConfig
from .decoding import DECODE_STOP_WAIT_S, DecodeStage
from .durable_jobs import DurableJobs
from .durable_store import JobStore
from .durable_wiring import open_durable_jobs
from .engine import Engine, RouterLike, Transport
from .engine_run import WORKER_CHECK_S, EngineDied, EngineRun  # noqa: F401 (EngineDied re-exported)
from .events import EventPublisher, as_client
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
        self.scheduler_config = cfg.scheduler_config(num_experts, class_to_expert, spec=self.spec)
        self.router, self.transport = router, transport
        self.nc, self._own_nc, self.nats_url = nc, nc is None, nats_url or cfg.nats
        self.name = cfg.name
        # this run of the coordinator: a restart (same name) has another instance
        self.instance = new_instance_id()
        self.engine: Engine | None = None
        self.running: EngineRun | None = None  # the engine's task and the worker discovery, once serving
        self.worker_check_s = WORKER_CHECK_S
        self._subs: list = []
        kept = cfg.finished
        self.ledger = JobLedger(
            keep_finished=kept.keep_finished,
            keep_finished_bytes=int(kept.keep_finished_mb * 2**20),
            keep_finished_s=kept.keep_finished_s,
        )
        self.events = EventPublisher(nc, self.ledger)
        self.intake = Intake(self)
        self.null_labels = NullLabelProbes(nc, num_experts, self.scheduler_config.image_shape, cfg.step_timeout)
        self.endpoint = MetricsEndpoint(cfg.metrics_port, cfg.metrics_host, cfg.metrics_optional)
        self.metrics = None  # CoordinatorMetrics, once entered
        self.store: JobStore | None = None
        self.durable_jobs: DurableJobs | None = None  # durable jobs (coordinator.durable_jobs): --durable only
        # set once this run knows every job it will ever resume at start (--durable: after the orphans'
        # restore): status and cancel requests wait for it, so a restarted coordinator never answers
        # "unknown" for a job it is about to resume
        self.jobs_restored = asyncio.Event()
        self.decode_stage: DecodeStage | None = None  # a latent fleet's, once entered (coordinator.decoding)
        self.decode_stop_wait_s = DECODE_STOP_WAIT_S  # its wait for the images being decoded, at stop

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
    _task = property(lambda self: self.running.task if self.running else None)  # fuzzing/targets/coordinator.py

    def _discard_unsent(self, fenced: list[tuple[str, str]], lapsed: bool) -> str:
        """Durable jobs were fenced: no event of the `fenced` jobs (client, job id) that the bus connection
        has not sent yet goes out (see discard_unsent). Only after a lapse (a freeze, a cut link) may the
        connection be dropped for bytes its socket holds back; a take-over seen by a working link only
        takes the events out of the client's buffer."""
        from bus.connect import discard_unsent

        recalled = {subjects.job_events(client, job_id).encode() for client, job_id in fenced}
        return discard_unsent(self.nc, recalled.__contains__, drop=lapsed)

    jobs_resumed = property(lambda self: self.durable_jobs.jobs_resumed if self.durable_jobs else 0)
    decoder = property(lambda self: self.decode_stage.decoder if self.decode_stage else None)  # a DecoderClient

    @property
    def lease_s(self) -> float:
        return self.store.lease_s if self.store is not None else self.settings.lease_s

    # ------------------------------------------------------------ lifecycle
    async def __aenter__(self) -> Coordinator:
        """Start: connect (unless given a connection), check the fleet's spec against its workers, open the
        transport, the durable store and the engine, the decode stage (latent fleets) and the metrics,
        subscribe, restore the previous run's jobs (`--durable`) and start ticking. A failure at any step
        undoes the steps before it (`_undo_start`) and raises."""
        from bus.connect import connect

        if self.nc is None:
            self.nc = await connect(self.nats_url, name=self.name, reconnect="forever", pending_size=64 * 1024 * 1024)
            self.null_labels.nc = self.events.nc = self.nc
        try:
            odd = await self._check_fleet_spec()
            self._open_transport()
            await self._open_engine()
            self._open_decode_stage()
            await self._open_metrics()
            await self._subscribe()
            await self._start_serving(odd)
        except BaseException:
            await self._undo_start()
            raise
        log.info(
            "coordinator up: %d experts, max %d rows, %d queued jobs",
            self.scheduler_config.num_experts,
            self.scheduler_config.max_rows,
            self.scheduler_config.max_queued_jobs,
        )
        return self

    async def _check_fleet_spec(self) -> dict[str, str]:
        """The router's spec is the fleet's: the workers that differ ({name: what differs}) are named and
        not used (coordinator/fleet_spec.py)."""
        if not self.check_spec:
            return {}
        self.spec, odd = await check_fleet_spec(self.nc, self.spec)
        return odd

    def _open_transport(self) -> None:
        from .transport import NatsTransport

        if self.transport is None:
            self.transport = NatsTransport.from_settings(self.nc, self.settings.transport)
        self.null_labels.transport = self.transport  # which workers serve guidance (a guided job's admission)

    async def _open_engine(self) -> None:
        """The scheduler (checkpointing, with the durable store, under `--durable`) and the engine."""
        cfg = self.settings
        if cfg.durable:
            self.store, self.durable_jobs, sched = await open_durable_jobs(
                self.nc,
                cfg.durability,
                self.scheduler_config,
                self.ledger,
                name=self.name,
                instance=self.instance,
                on_fence=self._discard_unsent,
            )
            self.events.durable_jobs = self.durable_jobs
        else:
            sched = Scheduler(self.scheduler_config)
        rows_per = getattr(self.transport, "rows_per_request", None)  # keep expert requests whole
        sample = np.zeros((1, *self.scheduler_config.image_shape), np.float32)
        self.engine = Engine.from_settings(
            sched,
            self.router,
            self.transport,
            self.events.publish,
            cfg.engine,
            request_rows=rows_per(sample) if callable(rows_per) else None,
        )

    def _open_decode_stage(self) -> None:
        """A latent fleet's decode stage (its spec must name the autoencoder by content hash)."""
        if self.spec.space != "latent":
            return
        requests = self.settings.transport  # decode requests wait and retry as expert requests do
        self.decode_stage = self.events.decode_stage = DecodeStage.open(
            self.nc,
            self.spec,
            timeout=requests.step_timeout,
            retries=requests.retries,
            publish=self.events.publish_now,
            stats=self.engine.scheduler.stats,
            stop_wait_s=self.decode_stop_wait_s,
        )

    async def _open_metrics(self) -> None:
        """The engine's metrics, watching the transport, the durable store and the bad replies; GET /metrics."""
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
        await flushed(self.nc)  # the server has every subscription: clients find us at once

    async def _unsubscribe(self) -> None:
        for sub in self._subs:
            try:
                await sub.unsubscribe()
            except Exception:
                pass
        self._subs = []

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
        # later workers' specs are checked, and what they can run ahead learned, as they are discovered
        watch = (self.check_spec or cfg.run_ahead > 0) and hasattr(self.transport, "refresh_workers")
        self.running = EngineRun(self.engine, self.transport, watch_workers=watch, check_s=self.worker_check_s)

    async def _undo_start(self) -> None:
        """A start that failed part-way: stop what it started (subscriptions, the durable loops, the
        metrics endpoint, the decoder's lookup) and close the connection if it is ours."""
        await self._unsubscribe()
        if self.durable_jobs is not None:
            try:
                await self.durable_jobs.hand_over()
            except Exception:
                log.exception("durable jobs: handing over after a failed start")
        if self.decode_stage is not None:
            await self.decode_stage.stop_lookup()
        try:
            await self.endpoint.stop()
        except Exception:
            pass
        if self._own_nc and self.nc is not None:
            await self.nc.close()

    def own_inbox_prefixes(self) -> list[str]:
        """The prefixes of this coordinator's own reply inboxes, where its experts answer it (nats-py's
        request replies, the transport's): no request may direct its reply there."""
        own = [request_inbox_prefix(self.nc), getattr(self.transport, "reply_prefix", None)]
        return [prefix for prefix in own if prefix]

    def rejected_workers(self) -> list:
        """The workers on the bus (at the last discovery) whose model spec differs from the fleet's."""
        return status_answers.rejected_workers(self)

    async def __aexit__(self, *exc) -> None:
        if self.running is not None:
            await self.running.stop_watch()
        await self._unsubscribe()
        self.intake.close()
        if self.durable_jobs is not None:
            await self.durable_jobs.hand_over()
        if self.engine is not None:
            await self.engine.stop()
        # the engine's last tick and the decode stage wind down side by side (one stop, not their sum)
        ending = [self.running.end()] if self.running is not None else []
        if self.decode_stage is not None:
            ending.append(self.decode_stage.close())
        await asyncio.gather(*ending)
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
        assert self.running is not None, "enter the context first"
        await self.running.task

    @property
    def engine_error(self) -> str | None:
        """Why the engine loop died ("coordinator engine stopped: ..."), or None while it is healthy."""
        return self.engine.dead if self.engine is not None else None

    async def serve_until(self, stop: asyncio.Event) -> None:
        """Serve until `stop` is set. Raises EngineDied if the engine loop dies first (its jobs have
        failed with `internal`): the caller should exit non-zero so a supervisor restarts it."""
        assert self.running is not None, "enter the context first"
        await self.running.serve_until(stop)

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
        self._check_event_sizes(request)
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
        # checkpoint, coordinator.durable_store), 0 for a job that is not durable
        self.ledger.admit(
            internal,
            client,
            job_id or internal,
            steps=request.steps,
            epoch=1 if self.durable_jobs is not None else 0,
            report_epoch=request.report_epoch,
            image_parts=request.image_parts,
        )
        accepted = self.ledger.stamp(internal, accepted)
        self.ledger.prune(
            self.engine.scheduler.knows,
            internal,
            2 * (self.scheduler_config.max_queued_jobs + self.scheduler_config.max_rows) + 64,
        )
        if self.durable_jobs is not None:
            self.durable_jobs.op("adopt", internal)
        if self.decode_stage is not None:
            self.decode_stage.admit(internal, request)
        publish = self.events.publish(accepted)
        return as_client(accepted, client, job_id or internal), publish

    def _check_event_sizes(self, request: JobRequest) -> None:
        """Rejected (`too_large`) for a job whose frames or `done` could not go out in one message: the images
        clients get are a pixel fleet's samples, or a latent fleet's decoded images once a decoder said their
        shape (`admission.check_event_sizes`)."""
        cfg = self.scheduler_config
        images = getattr(self.decoder, "image_shape", None) if cfg.latent else cfg.image_shape
        check_event_sizes(request, cfg.image_shape, images, cfg.num_experts, cfg.latent, MAX_PAYLOAD_BYTES)

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
        """The fleet status snapshot (`status_answers.fleet_status`)."""
        assert self.engine is not None, "enter the context first"
        return status_answers.fleet_status(self, include_spec, include_images)

    def reported_spec(self, include_images: bool = False) -> ModelSpec:
        """The fleet's spec as `fleet.status` reports it (`status_answers.reported_spec`)."""
        return status_answers.reported_spec(self, include_images)

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
        """What this coordinator knows of a job (`status_answers.job_status`); None if nothing, or, with
        `client`, if the job is not that client's."""
        assert self.engine is not None, "enter the context first"
        return await status_answers.job_status(self, job_id, client)

    async def send_event(self, client: str, event) -> None:
        """Publish `event` (its job id as `client` knows it) on the job's events subject."""
        await self.events.send(client, event)


def new_instance_id() -> str:
    """An id for one run of a coordinator: its UTC start time and 6 random hex digits,
    e.g. "20261126T085649Z-3fa2c1"."""
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + secrets.token_hex(3)


def fairness_key(client: str, request: JobRequest) -> str:
    """The scheduler's fairness key of a job: "<client>", or "<client>/<session>" with a session."""
    return f"{client}/{request.session}" if request.session else client
