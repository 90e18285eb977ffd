"""The engine loop: schedule -> execute -> update, forever, over any expert transport.

    engine = Engine(scheduler, router, transport, emit)
    task = asyncio.create_task(engine.run())
    engine.submit(JobRequest(...))      # -> JobAccepted, or raises scheduler.Rejected
    ...
    await engine.stop()

The engine runs `cohorts` lanes (no lock-step; see `coordinator.cohorts`): each lane ticks on its own.
`cohorts="auto"` (the coordinator's default) sizes the cohorts from the workers: `cohorts_for_workers`
of the most workers the transport knows for one expert (`transport.workers_per_expert()`, learned by
join-shortest-queue dispatch; None or 0: the floor of 2), re-read at every tick: lanes are added as
it grows, and an idle surplus lane leaves as it shrinks (at most that many batches out at once).
Each tick: the scheduler hands over the free active rows of one cohort (a job is in one batch at a
time); the executor routes them and calls the experts (one batched velocity call per chosen expert,
all concurrently, speculating on the routing and running ahead: `coordinator.executor`); then the
scheduler advances every row one solver stage and the events go to `emit`. With `early_update` (the
default) a job whose experts have all answered takes its stage at once, while the batch's slower experts
still compute (`_update_answered`); the next requests still leave together at the tick's end.

The engine only drives: `tick()` is literally `scheduler.schedule` -> `executor.execute` (router and
expert calls, the only I/O) -> `scheduler.update`. Job state lives in the scheduler and is read
through its methods (`job_progress`, `active_jobs`, `queued_jobs`, `stats`); the engine records
`metrics` (a `CoordinatorMetrics`: expert call times and errors, rejections) and names the
events subject of an accepted job (the scheduler knows no subjects). The transport's contract
(`Transport`, `ExpertUnavailable`, `BadExpertReply`, `ANSWERED_BY`) is the executor's, re-exported here.

Supervision: an error inside a tick fails the jobs it concerns (after `schedule`: that batch's
jobs; in `schedule` itself: every job the scheduler holds, none of which could be scheduled) and
the loop goes on. If the loop itself dies (an error while failing or flushing), `run()` fails every
job with `internal` ("coordinator engine stopped: ..."), publishes those events, marks the engine
`dead` (later submits raise `Rejected(unavailable)`) and re-raises, so that whoever awaits the
task (the service, `ddm-fleet coordinator`) exits and a supervisor restarts the process.
Bounds: `tick_ms` keeps the last 100 tick times, the rows/s window at most `MAX_RATE_SAMPLES` ticks.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from bus.cancel import cancel_and_wait
from schemas import ErrorCode, FailedEvent, JobAccepted, JobRequest, subjects

from .cohorts import AUTO_COHORTS, DEFAULT_COHORTS, check_cohorts, cohorts_for_workers
from .cohorts import parse_cohorts as parse_cohorts  # re-exported: coordinator.config's --cohorts type
from .errors import BadExpertReply as BadExpertReply  # re-exported (see coordinator.errors)
from .errors import ExpertUnavailable as ExpertUnavailable
from .executor import ANSWERED_BY as ANSWERED_BY  # re-exported: the transport notes its workers there
from .executor import Executor, RouterLike, Transport
from .metrics import CoordinatorMetrics
from .run_ahead import AheadCounters
from .scheduler import DEFAULT_CLIENT, Rejected, Scheduler

log = logging.getLogger(__name__)

#: Most ticks kept for rows_per_s (older ones drop out even within rate_window_s).
MAX_RATE_SAMPLES = 4096

#: Running ahead (coordinator/run_ahead.py): most further steps one expert request computes, and
#: the most rows the coordinator may hold (all its running jobs) for its requests to run ahead (a lone
#: job or two: at load, batching already spreads the round trip over many rows, and a worker merges
#: the requests of several ticks into one forward, which steps run ahead never are).
DEFAULT_RUN_AHEAD = 8
DEFAULT_RUN_AHEAD_ROWS = 4


class Engine:
    """Owns the tick loop. `emit(event)` (sync or async) receives every job event in order.
    `metrics` defaults to a new `CoordinatorMetrics(scheduler)`."""

    @classmethod
    def from_settings(
        cls, scheduler: Scheduler, router: RouterLike, transport: Transport, emit, settings, **kw
    ) -> Engine:
        """The engine of a coordinator's `EngineSettings` (coordinator.config), handed whole; `kw`: the
        keywords below that are not settings (request_rows, metrics, ...)."""
        return cls(
            scheduler,
            router,
            transport,
            emit,
            cohorts=settings.cohorts,
            route_every=settings.route_every,
            speculate=settings.speculate,
            run_ahead=settings.run_ahead,
            run_ahead_rows=settings.run_ahead_rows,
            early_update=settings.early_update,
            **kw,
        )

    def __init__(
        self,
        scheduler: Scheduler,
        router: RouterLike,
        transport: Transport,
        emit: Callable[[Any], Any] | None = None,
        *,
        clock: Callable[[], float] = time.time,
        router_in_thread: bool = True,
        rate_window_s: float = 10.0,
        metrics: CoordinatorMetrics | None = None,
        cohorts: int | str = DEFAULT_COHORTS,
        route_every: int = 1,
        request_rows: int | None = None,
        speculate: bool = True,
        run_ahead: int = DEFAULT_RUN_AHEAD,
        run_ahead_rows: int = DEFAULT_RUN_AHEAD_ROWS,
        early_update: bool = True,
    ):
        check_cohorts(cohorts)
        self.scheduler = scheduler
        self.metrics = metrics if metrics is not None else CoordinatorMetrics(scheduler)
        self.transport = transport
        # what a worker computes in, by its id ("" unknown): a transport that learns it says so
        scheduler.dtype_of = getattr(transport, "worker_dtype", None) or (lambda worker: "")
        self.emit = emit
        self.clock = clock
        self.cohorts = cohorts  # the setting: an int, or "auto" (see cohorts_now)
        self._batches_out = 0  # batches between schedule and update (at most cohorts_now())
        self._lanes: list[asyncio.Task] = []  # run()'s lanes (one per cohort in use; see _lane)
        self._lanes_grew = asyncio.Event()
        self._lanes_started = 0
        self._warned_workers = False
        self.metrics.watch_engine(self)
        if request_rows is not None and (not isinstance(request_rows, int) or request_rows < 1):
            raise ValueError(f"request_rows must be an int >= 1 or None, got {request_rows!r}")
        self.request_rows = request_rows  # the transport's rows per expert request: keep requests whole
        self.executor = Executor(
            scheduler,
            router,
            transport,
            self.metrics,
            cohorts_now=self.cohorts_now,
            router_in_thread=router_in_thread,
            route_every=route_every,
            speculate=speculate,
            run_ahead=run_ahead,
            run_ahead_rows=run_ahead_rows,
        )
        #: each job's solver step as soon as its experts answered (see `_update_answered`)
        self.early_update = bool(early_update)
        if self.early_update:
            self.executor.on_answer = self._update_answered
        self._flushes: set[asyncio.Future] = set()  # the events flushes started (`_update_early`, `_flush`)
        self._flush_pending = False  # a `_flush` task has not started emitting yet
        self._wake = asyncio.Event()  # set (and replaced) by _poke: new work, or rows came back
        self._stopping = False
        self._running = False
        self._emit_lock = asyncio.Lock()
        self._rate: deque[tuple[float, int]] = deque(maxlen=MAX_RATE_SAMPLES)
        self._rate_window = rate_window_s
        self.started_at = clock()
        self.tick_ms: deque[float] = deque(maxlen=100)
        self.tick_s_total = 0.0  # every tick's time, summed (/metrics; bench step profile)
        self.dead: str | None = None  # why the loop died (then submits are refused), else None

    # the executor's counters, read by /metrics, `bench engine` and the tests
    @property
    def rows_routed(self) -> int:
        return self.executor.rows_routed

    @property
    def rows_guessed(self) -> int:
        return self.executor.rows_guessed

    @property
    def rows_guessed_unused(self) -> int:
        return self.executor.rows_guessed_unused

    @property
    def router_s_total(self) -> float:
        return self.executor.router_s_total

    @property
    def ahead(self) -> AheadCounters:
        return self.executor.ahead

    @property
    def last_unavailable(self) -> dict[int, str]:
        return self.executor.last_unavailable

    # ------------------------------------------------------------ intake
    def submit(self, request: JobRequest, client: str = DEFAULT_CLIENT, job_id: str | None = None) -> JobAccepted:
        """Queue a job of `client` (the scheduler's fairness key; joins at the next tick) under `job_id`
        (default: the request's, else a random one). Raises scheduler.Rejected (`unavailable` once the
        loop has died)."""
        try:
            if self.dead is not None:
                raise Rejected(
                    ErrorCode.UNAVAILABLE, f"{self.dead}; submit to another coordinator or retry after it restarts"
                )
            owner = client.split("/", 1)[0] if isinstance(client, str) else None  # the client token;
            if not subjects.is_token(owner):  # "/<session>" is only for fairness
                raise Rejected(
                    ErrorCode.BAD_REQUEST,
                    f"client key {client!r:.80} must start with a client name "
                    "(1-64 of [A-Za-z0-9_-]), optionally followed by /<session>",
                )
            admitted = self.scheduler.submit(request, self.clock(), client=client, job_id=job_id)
        except Rejected as err:
            self.metrics.rejected(err.code, err.limit)
            raise
        self._poke()
        return JobAccepted(
            job_id=admitted.job_id,
            events_subject=subjects.job_events(owner, admitted.job_id),
            **{request.label_field: admitted.digits},
            seed=admitted.seed,
            queue_position=admitted.queue_position,
        )

    async def cancel(self, job_id: str, reason: str = "cancelled by client") -> bool:
        ok = self.scheduler.cancel(job_id, self.clock(), reason)
        await self.flush_events()
        return ok

    async def flush_events(self) -> None:
        """Send pending scheduler events to `emit`, in order."""
        async with self._emit_lock:
            for ev in self.scheduler.pop_events():
                await self._emit_one(ev)

    async def _emit_one(self, ev) -> None:
        if self.emit is None:
            return
        try:
            out = self.emit(ev)
            if inspect.isawaitable(out):
                await out
        except Exception:  # a broken listener must not stop the fleet
            log.exception("emitting %s for job %s failed", ev.kind, getattr(ev, "job_id", "?"))

    def wake(self) -> None:
        """Tell the engine that jobs were added behind its back (e.g. `Scheduler.restore`): idle lanes
        look for work at once."""
        self._poke()

    # ------------------------------------------------------------ loop
    def _poke(self) -> None:
        """Wake every idle lane (a job arrived, a batch came back, or we stop)."""
        self._wake.set()
        self._wake = asyncio.Event()

    async def run(self) -> None:
        """Run one lane per cohort; each ticks while it finds free rows and sleeps otherwise. With
        cohorts="auto" lanes are added when `cohorts_now()` grows and an idle surplus lane leaves
        when it shrinks, so an engine with few workers per expert runs exactly as with a fixed 2.
        If a lane dies, the others are stopped and every job fails (see `_die`)."""
        self._running = True
        self._add_lanes(self.cohorts_now())
        try:
            while pending := [t for t in self._lanes if not t.done()]:
                grew = asyncio.ensure_future(self._lanes_grew.wait())
                try:
                    done, _ = await asyncio.wait([*pending, grew], return_when=asyncio.FIRST_COMPLETED)
                finally:
                    grew.cancel()
                self._lanes_grew.clear()
                for task in done:
                    if task is not grew and not task.cancelled() and task.exception() is not None:
                        raise task.exception()
        except asyncio.CancelledError:
            raise
        except Exception as err:
            for task in self._lanes:
                task.cancel()
            await asyncio.gather(*self._lanes, return_exceptions=True)
            await self._die(err)
            raise
        finally:
            # let the lanes unwind (a guessed call they abandon on the way is cancelled next), bounded
            await cancel_and_wait(self._lanes, 1.0)
            await self._flushes_done()
            self.executor.cancel_unneeded_calls()
            self.executor.drop_runs("engine stopped")
            self._running = False
            self.executor.close_router_thread()

    def _add_lanes(self, n: int) -> None:
        """Start lanes until `n` run."""
        while len(self._lanes) < n:
            self._lanes_started += 1
            self._lanes.append(asyncio.create_task(self._lane(), name=f"engine-lane-{self._lanes_started}"))
            self._lanes_grew.set()

    async def _lane(self) -> None:
        me = asyncio.current_task()
        while not self._stopping:
            wake = self._wake  # taken before the tick: a poke during it is not missed
            n = self.cohorts_now()
            if len(self._lanes) < n:  # "auto": more workers appeared
                self._add_lanes(n)
            if self._batches_out >= n:  # "auto" went down: this lane may not tick now
                if len(self._lanes) > n and me in self._lanes:  # a surplus lane leaves
                    self._lanes.remove(me)
                    return
                await wake.wait()
                continue
            worked = await self.tick(flush_later=True)
            if not worked and not self._stopping:
                await wake.wait()

    @property
    def batches_out(self) -> int:
        """Batches between schedule and update now (at most `cohorts_now()` while run() drives the lanes)."""
        return self._batches_out

    def _update_answered(self, batch) -> None:
        """An expert answered rows of `batch` (early_update): the jobs whose rows now have every velocity
        they need take their solver step at once and their events start out, while the batch's slower
        experts still compute; the tick's end updates the rest. The coordinator's per-job work (the
        update, the frames) then overlaps the experts instead of following the slowest one, and the
        next requests still leave together (a job updated early is not sent on before the tick ends,
        whatever the cohorts: they stay in flight until then). Only for batches the tick allowed it
        (`Batch.update_early`: not while requests run ahead, whose runs follow whole ticks).

        The update runs one pass of the event loop later (`_update_early`), so that answers that came in
        together (experts that answer at once, a worker's replies read in one go) are applied in one pass
        by the tick's own update, not in two."""
        if batch.update_early and not batch.early_pending:
            batch.early_pending = True
            asyncio.get_running_loop().call_soon(self._update_early, batch)

    def _update_early(self, batch) -> None:
        """Update the complete jobs of `batch` ahead of its tick (see `_update_answered`); nothing once the
        tick has ended or when they are all its jobs left. An error in the update fails those jobs (never
        the batch's others) and the tick goes on."""
        batch.early_pending = False
        if not batch.update_early:
            return  # the tick ended meanwhile
        gis = batch.complete_groups()
        if not gis or len(gis) + len(batch.released) == len(batch.groups):
            return  # nothing new, or the last of the batch: the tick's own update is as early
        batch.released.update(gis)
        part = batch.subset(gis)
        try:
            self.scheduler.update(part, self.clock(), part=True)
        except Exception as err:
            log.exception("updating %d job(s) ahead of their tick failed", len(gis))
            self.scheduler.fail_batch(part, ErrorCode.INTERNAL, f"coordinator error: {type(err).__name__}: {err}")
        flush = asyncio.ensure_future(self.flush_events())  # (flushes queue on the emit lock, in order)
        self._flushes.add(flush)
        flush.add_done_callback(self._flushes.discard)

    async def _flushes_done(self, timeout: float = 1.0) -> None:
        """Let the event flushes started in tasks (`_update_early`, `_flush`) finish (bounded)."""
        if self._flushes:
            await asyncio.wait(list(self._flushes), timeout=timeout)

    def cohorts_now(self) -> int:
        """The cohorts in use: the fixed setting, or for "auto" `cohorts_for_workers` of the most
        workers the transport knows for one expert (re-read at every tick)."""
        if self.cohorts != AUTO_COHORTS:
            return self.cohorts
        known = getattr(self.transport, "workers_per_expert", None)
        try:
            workers = known() if callable(known) else None
        except Exception:  # a transport's bookkeeping must not stop the engine: use the floor
            if not self._warned_workers:
                self._warned_workers = True
                log.exception("transport.workers_per_expert() failed; using %d cohorts", DEFAULT_COHORTS)
            workers = None
        return cohorts_for_workers(workers)

    async def _die(self, err: BaseException) -> None:
        """The loop broke: refuse new jobs, fail every held job with `internal`, publish the events
        (each one guarded: the scheduler or emit may be what broke)."""
        self.dead = f"coordinator engine stopped: {type(err).__name__}: {err}"
        log.critical("engine loop died; failing every job", exc_info=err)
        sched = self.scheduler
        try:
            sched.fail_all(ErrorCode.INTERNAL, self.dead)
        except Exception:
            log.exception("failing the jobs of a dead engine failed")
            try:  # at least tell the clients of the jobs we can name, straight to emit
                ids = list(dict.fromkeys([*sched.active_job_ids(), *sched.queued_job_ids()]))
            except Exception:
                log.exception("cannot name the jobs of a dead engine")
                ids = []
            try:  # their pending frames first: a job's `failed` is its last event
                await self.flush_events()
            except Exception:
                log.exception("publishing the pending events of a dead engine failed")
            for job_id in ids:
                await self._emit_one(FailedEvent(job_id=job_id, code=ErrorCode.INTERNAL, reason=self.dead))
        try:
            await self.flush_events()
        except Exception:
            log.exception("publishing the failures of a dead engine failed")

    async def stop(self, reason: str = "coordinator shutting down") -> None:
        """Stop after the current tick; jobs still queued or running fail with `unavailable`. The
        router's thread ends too (an engine driven by `tick()` alone has it until stop or collection)."""
        self._stopping = True
        self._poke()
        self.executor.drop_runs("engine stopped")
        self.scheduler.fail_all(ErrorCode.UNAVAILABLE, reason)
        await self._flushes_done()
        await self.flush_events()
        self.executor.close_router_thread()

    async def tick(self, *, flush_later: bool = False) -> bool:
        """One schedule -> execute -> update round. Returns False when there was nothing to do.
        Its events (frames, done, failed) are emitted before it returns; with `flush_later` (the lanes'
        ticks) those of a tick that found work go out in a task of their own (`_flush`)."""
        sched = self.scheduler
        batch = None
        started = time.perf_counter()
        out = False  # this tick holds one of the `cohorts_now()` batches (schedule until update / fail)
        try:
            batch = sched.schedule(self.clock(), cohorts=self.cohorts_now(), request_rows=self.request_rows)
            if batch is not None:
                self._batches_out += 1  # before any await: a lane woken meanwhile sees it
                out = True
            await self._flush(later=flush_later and batch is not None)
            if batch is None:
                return False
            started = time.perf_counter()
            batch.update_early = self.early_update and not self.executor.running_ahead()  # (decided once a tick)
            await self.executor.execute(batch)
            sched.update(batch, self.clock())  # (the jobs it did not update early)
        except Exception as err:  # never die: fail the jobs this tick concerns, keep serving the rest
            log.exception("tick failed")
            reason = f"coordinator error: {type(err).__name__}: {err}"
            if batch is not None:  # (not the jobs it updated early: they took their step)
                sched.fail_batch(batch, ErrorCode.INTERNAL, reason)
            else:  # schedule() itself broke: none of its jobs could be scheduled; sleep until the
                sched.fail_all(ErrorCode.INTERNAL, reason)  # next submit instead of spinning on it
                await self.flush_events()
                return False
        finally:
            if batch is not None:
                batch.update_early = False  # (an early update still pending does nothing now)
                if batch.released:  # updated early: free for the next tick now
                    sched.returned([batch.groups[gi] for gi in batch.released])
            if out:
                self._batches_out -= 1
        if batch is not None:
            took = time.perf_counter() - started
            self.tick_ms.append(took * 1000)
            self.tick_s_total += took
            self._count_rows(len(batch))
            self._poke()  # its jobs are free again: an idle lane may take them
        await self._flush(later=flush_later)
        return True

    async def _flush(self, later: bool = False) -> None:
        """`flush_events`; with `later`, in a task that first lets two event-loop passes go by, so that the
        next tick's requests (a lane goes on to it at once) reach the socket before the frames are packed
        and sent, where they leave within those passes (guessed calls, no routing): the workers wait less
        between ticks (docs/COORDINATOR.md, "The loop"). At most one such task waits to start."""
        if not later:
            return await self.flush_events()
        if self._flush_pending or not self.scheduler.has_events:
            return
        self._flush_pending = True
        flush = asyncio.ensure_future(self._flush_soon())
        self._flushes.add(flush)
        flush.add_done_callback(self._flush_ended)

    def _flush_ended(self, flush: asyncio.Future) -> None:
        self._flushes.discard(flush)
        self._flush_pending = False  # (also when it was cancelled before it started)

    async def _flush_soon(self) -> None:
        for _ in range(2):  # the requests publish, then nats-py's flusher writes
            await asyncio.sleep(0)
        self._flush_pending = False  # events from here on may need a task of their own
        await self.flush_events()

    # ------------------------------------------------------------ job state
    def job_state(self, job_id: str) -> dict[str, Any] | None:
        """{state: queued|running, step, steps, queue_position} of a job the scheduler holds, else None."""
        return self.scheduler.job_progress(job_id)

    # ------------------------------------------------------------ status
    def _count_rows(self, n: int) -> None:
        now = time.monotonic()
        self._rate.append((now, n))
        while self._rate and now - self._rate[0][0] > self._rate_window:
            self._rate.popleft()

    def rows_per_s(self) -> float:
        """Row evaluations per second over the last `rate_window_s` seconds."""
        now = time.monotonic()
        while self._rate and now - self._rate[0][0] > self._rate_window:
            self._rate.popleft()
        if not self._rate:
            return 0.0
        span = max(now - self._rate[0][0], 1e-3)
        return sum(n for _, n in self._rate) / span if len(self._rate) > 1 else 0.0

    def status(self) -> dict[str, Any]:
        s = self.scheduler
        st = s.stats
        ticks = list(self.tick_ms)
        return dict(
            active_jobs=s.active_jobs,
            active_rows=s.active_rows,
            queued_jobs=s.queued_jobs,
            max_rows=s.config.max_rows,
            max_queued_jobs=s.config.max_queued_jobs,
            num_experts=s.config.num_experts,
            jobs_submitted=st.jobs_submitted,
            jobs_done=st.jobs_done,
            jobs_failed=st.jobs_failed,
            jobs_cancelled=st.jobs_cancelled,
            jobs_rejected=st.jobs_rejected,
            images_done=st.images_done,
            ticks=st.ticks,
            rows_per_s=round(self.rows_per_s(), 2),
            tick_ms_p50=round(float(np.median(ticks)), 2) if ticks else 0.0,
            uptime_s=round(self.clock() - self.started_at, 1),
            unavailable_experts=sorted(self.last_unavailable),
        )
