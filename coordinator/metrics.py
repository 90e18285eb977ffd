"""Coordinator metrics with prometheus_client (a private registry per coordinator), for GET /metrics.

    metrics = CoordinatorMetrics(scheduler)      # the engine makes one: engine.metrics
    metrics.rejected(code, limit=None)           # a job refused at submit (scheduler or bad request)
    metrics.expert_call(k, seconds)              # one expert's velocity call of one tick
    metrics.expert_error(k, code)                # ... that failed (after the transport's retries)
    metrics.watch_transport(transport)           # the NATS transport's request and hedge counters
    metrics.watch_engine(engine)                 # the engine's cohorts (Engine does this itself)
    metrics.watch_store(store)                   # --durable: the JobStore's checkpoint and lease counters
    runner = await serve_metrics(metrics, port)  # workers.metrics_http, shared with the worker

Series (counters end in _total; rates with rate(), e.g. rows/s = rate(ddm_coordinator_rows_stepped_total[1m])):

    ddm_coordinator_ticks_total                         counter    ticks that stepped rows
    ddm_coordinator_rows_stepped_total                  counter    row evaluations applied (one per row per tick)
    ddm_coordinator_row_fallbacks_total                 counter    row evaluations whose experts were not the
                                                                   all-experts-up choice (fallback, or none left)
    ddm_coordinator_jobs_accepted_total                 counter    jobs accepted at submit
    ddm_coordinator_jobs_rejected_total{code}           counter    jobs refused at submit, by ErrorCode
    ddm_coordinator_jobs_rejected_by_limit_total{limit} counter    ... of those, refused by an admission limit
                                                                   (max_rows, max_queued_jobs, max_client_rows,
                                                                   max_client_queued_jobs, max_session_rows,
                                                                   max_session_queued_jobs, max_job_cost)
    ddm_coordinator_requests_rate_limited_total{kind}   counter    requests answered `rate_limited`, by kind:
                                                                   submit (also counted in jobs_rejected), status,
                                                                   republish (a finished job's result asked
                                                                   again over its client's rate)
    ddm_coordinator_jobs_over_run_time_total            counter    jobs failed for running past max_job_run_s
    ddm_coordinator_jobs_finished_total{outcome}        counter    done | failed | cancelled
    ddm_coordinator_queued_jobs                         gauge      jobs waiting for rows (queue depth)
    ddm_coordinator_active_jobs                         gauge      jobs running
    ddm_coordinator_active_rows                         gauge      images being denoised
    ddm_coordinator_cohorts                             gauge      batches of rows the engine keeps out at once
                                                                   (--cohorts; "auto" picks it from the workers
                                                                   per expert), once an engine is watched
    ddm_coordinator_batches_out                         gauge      batches out now (between schedule and update)
    ddm_coordinator_expert_request_seconds{expert}      histogram  one expert's velocity call per tick (all of
                                                                   its requests, retries included)
    ddm_coordinator_expert_errors_total{expert,code}    counter    expert calls that failed, by ErrorCode
    ddm_coordinator_expert_requests_total{expert}       counter    expert requests sent (tries; hedge copies not
                                                                   counted), once a transport is watched
    ddm_coordinator_expert_hedges_total{expert,outcome} counter    hedged tries (a second copy sent), by outcome:
                                                                   won (the copy answered first), lost (the
                                                                   original did), failed (neither usable);
                                                                   hedges sent = the sum; hedge rate = that /
                                                                   requests
    ddm_coordinator_expert_stray_replies_total          counter    replies dropped: no request of this coordinator
                                                                   waits on their subject (forged, duplicate, or
                                                                   late after a time-out), once a transport is watched
    ddm_coordinator_expert_late_replies_total           counter    replies of hedge legs that lost (dropped quietly)
    ddm_coordinator_tick_seconds_total                  counter    seconds in ticks (schedule to solver update:
                                                                   routing, expert calls, update); / ticks =
                                                                   mean tick time
    ddm_coordinator_router_seconds_total                counter    seconds of router forwards (overlapping guessed
                                                                   expert calls under --speculate)
    ddm_coordinator_run_ahead_requests_total            counter    expert requests sent to run ahead (--run-ahead)
    ddm_coordinator_rows_run_ahead_total                counter    row evaluations answered by a run ahead instead of
                                                                   a request
    ddm_coordinator_run_ahead_steps_wasted_total        counter    steps run ahead that were never used (the routing
                                                                   moved the rows, the job ended or failed)
    ddm_coordinator_rejected_workers                    gauge      expert workers on the bus whose model spec differs
                                                                   from the fleet's (not used), at the last discovery
    ddm_coordinator_workers_rejected_total              counter    distinct workers ever rejected for their spec
    ddm_coordinator_rejected_replies_total              counter    replies refused as from a worker of another spec
                                                                   (bad_shape, or a rejected worker's); sent again
    ddm_coordinator_checkpoints_written_total           counter    --durable: job checkpoints written to JetStream
                                                                   (admission, every --checkpoint-every steps,
                                                                   take-over, hand-over)
    ddm_coordinator_checkpoint_bytes_total              counter    --durable: bytes of those checkpoints
    ddm_coordinator_job_takeovers_total                 counter    --durable: jobs this coordinator took from another
                                                                   run (a dead or stalled owner, or its own restart)
    ddm_coordinator_job_leases_lost_total               counter    --durable: jobs it lost (another coordinator took
                                                                   them, or it could not renew their leases in time)

The scheduler's counters and gauges are read at scrape time (`Scheduler.stats`, `queued_jobs`, ...),
so they are never counted twice; the scrape runs on the event loop, between ticks' steps.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from schemas import ErrorCode

from .scheduler import Scheduler

#: Expert call time bounds (seconds): a fast local tick to several step time-outs.
REQUEST_BOUNDS: tuple[float, ...] = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class _SchedulerCollector:
    """Scrape-time view of a scheduler's counters and queue state."""

    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler

    def collect(self):
        sched = self.scheduler
        st = sched.stats
        yield CounterMetricFamily("ddm_coordinator_ticks", "Ticks that stepped rows.", value=st.ticks)
        yield CounterMetricFamily(
            "ddm_coordinator_rows_stepped", "Row evaluations applied (one per row per tick).", value=st.row_evals
        )
        yield CounterMetricFamily(
            "ddm_coordinator_row_fallbacks",
            "Row evaluations whose experts were not the all-experts-up choice.",
            value=st.row_fallbacks,
        )
        yield CounterMetricFamily("ddm_coordinator_jobs_accepted", "Jobs accepted at submit.", value=st.jobs_submitted)
        yield CounterMetricFamily(
            "ddm_coordinator_jobs_over_run_time",
            "Jobs failed with deadline_exceeded for running longer than max_job_run_s.",
            value=st.jobs_over_run_time,
        )
        finished = CounterMetricFamily(
            "ddm_coordinator_jobs_finished", "Jobs that ended, by outcome.", labels=["outcome"]
        )
        for outcome, n in (("done", st.jobs_done), ("failed", st.jobs_failed), ("cancelled", st.jobs_cancelled)):
            finished.add_metric([outcome], n)
        yield finished
        yield GaugeMetricFamily(
            "ddm_coordinator_queued_jobs", "Jobs waiting for rows (queue depth).", value=sched.queued_jobs
        )
        yield GaugeMetricFamily("ddm_coordinator_active_jobs", "Jobs running.", value=sched.active_jobs)
        yield GaugeMetricFamily("ddm_coordinator_active_rows", "Images being denoised.", value=sched.active_rows)


class _TransportCollector:
    """Scrape-time view of a transport's `requests_sent`, `hedge_counts`, `dispatch_counts`,
    `direct_fallbacks` and its dispatcher's known workers (coordinator.transport)."""

    def __init__(self, transport):
        self.transport = transport

    def collect(self):
        requests = CounterMetricFamily(
            "ddm_coordinator_expert_requests",
            "Expert requests sent (tries; hedge copies not counted).",
            labels=["expert"],
        )
        for expert, n in sorted(dict(getattr(self.transport, "requests_sent", {})).items()):
            requests.add_metric([str(expert)], n)
        yield requests
        hedges = CounterMetricFamily(
            "ddm_coordinator_expert_hedges",
            "Hedged expert requests (a second copy sent), by outcome: won, lost, failed.",
            labels=["expert", "outcome"],
        )
        for (expert, outcome), n in sorted(dict(getattr(self.transport, "hedge_counts", {})).items()):
            hedges.add_metric([str(expert), outcome], n)
        yield hedges
        legs = CounterMetricFamily(
            "ddm_coordinator_expert_dispatch",
            "Expert request legs sent, by route: direct (to one worker picked by "
            "join-shortest-queue) or queue (the expert's queue group).",
            labels=["expert", "route"],
        )
        for (expert, route), n in sorted(dict(getattr(self.transport, "dispatch_counts", {})).items()):
            legs.add_metric([str(expert), route], n)
        yield legs
        yield CounterMetricFamily(
            "ddm_coordinator_expert_stray_replies",
            "Replies dropped on the expert reply subscription: no request of ours waits on that subject "
            "(forged, duplicate or late after a time-out).",
            value=int(getattr(self.transport, "stray_replies", 0)),
        )
        yield CounterMetricFamily(
            "ddm_coordinator_expert_late_replies",
            "Replies of a hedge leg cancelled because the other leg answered first (expected, dropped quietly).",
            value=int(getattr(self.transport, "late_replies", 0)),
        )
        yield CounterMetricFamily(
            "ddm_coordinator_direct_fallbacks",
            "Direct legs answered 'no responders' (the worker is gone) and sent to the queue group instead.",
            value=int(getattr(self.transport, "direct_fallbacks", 0)),
        )
        yield GaugeMetricFamily(
            "ddm_coordinator_rejected_workers",
            "Expert workers on the bus (at the last discovery) whose model spec differs from the fleet's: not used.",
            value=len(getattr(self.transport, "rejected_workers", None) or {}),
        )
        yield CounterMetricFamily(
            "ddm_coordinator_workers_rejected",
            "Distinct expert workers found with a model spec that differs from the fleet's (each counted once).",
            value=int(getattr(self.transport, "workers_rejected_total", 0)),
        )
        yield CounterMetricFamily(
            "ddm_coordinator_rejected_replies",
            "Expert replies refused because their worker serves another model spec (bad_shape, or a rejected "
            "worker's reply); each request was sent again.",
            value=int(getattr(self.transport, "rejected_replies", 0)),
        )
        dispatcher = getattr(self.transport, "dispatcher", None)
        known = GaugeMetricFamily(
            "ddm_coordinator_known_workers",
            "Workers of each expert that direct dispatch knows (seen in a good reply within the last 30 s).",
            labels=["expert"],
        )
        if dispatcher is not None:
            for expert, workers in dispatcher.snapshot().items():
                known.add_metric([str(expert)], len(workers))
        yield known


class _EngineCollector:
    """Scrape-time view of an engine's cohorts (`cohorts_now()`), batches out and guessed rows."""

    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        yield GaugeMetricFamily(
            "ddm_coordinator_cohorts",
            "Batches of rows the engine keeps out at once (--cohorts; auto: 2, 3 from 4 workers per expert, 4 from 8).",
            value=self.engine.cohorts_now(),
        )
        yield GaugeMetricFamily(
            "ddm_coordinator_batches_out",
            "Batches out now (between schedule and update).",
            value=self.engine.batches_out,
        )
        yield CounterMetricFamily(
            "ddm_coordinator_rows_guessed",
            "Rows sent to an expert before the router weighed them (--speculate).",
            value=self.engine.rows_guessed,
        )
        yield CounterMetricFamily(
            "ddm_coordinator_rows_guessed_unused",
            "Guessed rows whose answer the routing did not need (work the experts did in vain).",
            value=self.engine.rows_guessed_unused,
        )
        ahead = self.engine.ahead
        yield CounterMetricFamily(
            "ddm_coordinator_run_ahead_requests",
            "Expert requests sent to run ahead (--run-ahead).",
            value=ahead.runs,
        )
        yield CounterMetricFamily(
            "ddm_coordinator_rows_run_ahead",
            "Row evaluations answered by a run ahead instead of a request (--run-ahead).",
            value=ahead.rows_taken,
        )
        yield CounterMetricFamily(
            "ddm_coordinator_run_ahead_steps_wasted",
            "Steps run ahead on a worker that were never used (the routing moved the rows, the job ended).",
            value=ahead.steps_wasted,
        )
        yield CounterMetricFamily(
            "ddm_coordinator_tick_seconds",
            "Seconds spent in ticks: from a batch's scheduling to its solver update (routing, expert calls, update).",
            value=self.engine.tick_s_total,
        )
        yield CounterMetricFamily(
            "ddm_coordinator_router_seconds",
            "Seconds the router's forward took (it may overlap guessed expert calls, --speculate).",
            value=self.engine.router_s_total,
        )


class _StoreCollector:
    """Scrape-time view of a durable JobStore's counters (coordinator.durable_store): `writes`,
    `bytes_written`, `takeovers`, `leases_lost`."""

    SERIES = (
        ("ddm_coordinator_checkpoints_written", "writes", "Job checkpoints written to JetStream."),
        ("ddm_coordinator_checkpoint_bytes", "bytes_written", "Bytes of the job checkpoints written."),
        ("ddm_coordinator_job_takeovers", "takeovers", "Jobs taken over from another coordinator run."),
        (
            "ddm_coordinator_job_leases_lost",
            "leases_lost",
            "Jobs lost to another coordinator or to a lease not renewed in time.",
        ),
    )

    def __init__(self, store):
        self.store = store

    def collect(self):
        for name, attr, doc in self.SERIES:
            yield CounterMetricFamily(name, doc, value=int(getattr(self.store, attr, 0)))


class _BadRepliesCollector:
    """Scrape-time view of the `bad_replies` counters of the coordinator's other requesters: the null-label
    probes (coordinator.null_labels) and a latent fleet's decoder client (coordinator.decoder_client)."""

    def __init__(self, sources: dict):
        self.sources = sources  # label -> object with `bad_replies`

    def collect(self):
        family = CounterMetricFamily(
            "ddm_coordinator_bad_replies",
            "Replies to the coordinator's own requests that answer another request or not as they should "
            "(wrong rows, shape or value range, undecodable), by request: null_label_probe, decode.",
            labels=["request"],
        )
        for label, source in sorted(self.sources.items()):
            family.add_metric([label], int(getattr(source, "bad_replies", 0)))
        yield family


class CoordinatorMetrics:
    """The metrics of one coordinator (one scheduler). `registry` is what /metrics serves."""

    def __init__(self, scheduler: Scheduler):
        self.registry = CollectorRegistry()
        self.registry.register(_SchedulerCollector(scheduler))
        self._rejected = Counter(
            "ddm_coordinator_jobs_rejected", "Jobs refused at submit, by error code.", ["code"], registry=self.registry
        )
        self._rejected_by_limit = Counter(
            "ddm_coordinator_jobs_rejected_by_limit",
            "Jobs refused at submit by an admission limit, by the limit's name.",
            ["limit"],
            registry=self.registry,
        )
        self._rate_limited = Counter(
            "ddm_coordinator_requests_rate_limited",
            "Requests answered rate_limited, by kind (submit, status, republish).",
            ["kind"],
            registry=self.registry,
        )
        self._request_s = Histogram(
            "ddm_coordinator_expert_request_seconds",
            "One expert's velocity call per tick (its requests and retries).",
            ["expert"],
            buckets=REQUEST_BOUNDS,
            registry=self.registry,
        )
        self._expert_errors = Counter(
            "ddm_coordinator_expert_errors",
            "Expert calls that failed, by error code.",
            ["expert", "code"],
            registry=self.registry,
        )

    def rejected(self, code: ErrorCode | str, limit: str | None = None) -> None:
        """Count a job refused at submit with ErrorCode `code`; `limit` names the admission limit
        that refused it (`Rejected.limit`, e.g. "max_client_queued_jobs"), if any."""
        self._rejected.labels(code=ErrorCode(code).value).inc()
        if limit is not None:
            self._rejected_by_limit.labels(limit=str(limit)).inc()

    def rate_limited(self, kind: str) -> None:
        """Count a request answered `rate_limited` (kind: submit, status or republish)."""
        self._rate_limited.labels(kind=kind).inc()

    def expert_call(self, expert: int, seconds: float) -> None:
        """Observe the duration of one expert's velocity call (successful or not)."""
        self._request_s.labels(expert=str(int(expert))).observe(max(float(seconds), 0.0))

    def expert_error(self, expert: int, code: ErrorCode | str) -> None:
        """Count an expert call that failed with ErrorCode `code` (unavailable, bad_reply, ...)."""
        self._expert_errors.labels(expert=str(int(expert)), code=ErrorCode(code).value).inc()

    def watch_transport(self, transport) -> None:
        """Export `transport.requests_sent` / `hedge_counts` (read at scrape time) as
        ddm_coordinator_expert_requests_total and ddm_coordinator_expert_hedges_total. Once."""
        if getattr(self, "_transport_collector", None) is None:
            self._transport_collector = _TransportCollector(transport)
            self.registry.register(self._transport_collector)

    def watch_engine(self, engine) -> None:
        """Export `engine.cohorts_now()` and its batches out (read at scrape time) as
        ddm_coordinator_cohorts and ddm_coordinator_batches_out, and its guessed rows (--speculate) as
        ddm_coordinator_rows_guessed_total and ddm_coordinator_rows_guessed_unused_total. Once."""
        if getattr(self, "_engine_collector", None) is None:
            self._engine_collector = _EngineCollector(engine)
            self.registry.register(self._engine_collector)

    def watch_store(self, store) -> None:
        """Export a durable coordinator's JobStore counters (read at scrape time) as
        ddm_coordinator_checkpoints_written_total, _checkpoint_bytes_total, _job_takeovers_total and
        _job_leases_lost_total. Once."""
        if getattr(self, "_store_collector", None) is None:
            self._store_collector = _StoreCollector(store)
            self.registry.register(self._store_collector)

    def watch_bad_replies(self, **sources) -> None:
        """Export each source's `bad_replies` (read at scrape time) as ddm_coordinator_bad_replies_total
        {request=<name>}, e.g. watch_bad_replies(null_label_probe=probes, decode=decoder). Once."""
        if getattr(self, "_bad_replies_collector", None) is None:
            self._bad_replies_collector = _BadRepliesCollector({k: v for k, v in sources.items() if v is not None})
            self.registry.register(self._bad_replies_collector)

    def sample(self, name: str, **labels: str) -> float:
        """The current value of one sample (e.g. "ddm_coordinator_ticks_total"), 0.0 if absent."""
        value = self.registry.get_sample_value(name, labels)
        return 0.0 if value is None else float(value)
