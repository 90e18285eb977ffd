"""The engine loop: schedule -> execute -> update, forever, over any expert transport.

    engine = Engine(scheduler, router, transport, emit)
    task = asyncio.create_task(engine.run())
    engine.submit(JobRequest(...))      # -> JobAccepted, or raises scheduler.Rejected
    ...
    await engine.stop()

The engine runs `cohorts` lanes (no lock-step; see Scheduler.schedule): each lane ticks on its own.
`cohorts="auto"` (the coordinator's default) sizes the cohorts from the workers: `cohorts_for_workers`
of the most workers the transport knows for one expert (`transport.workers_per_expert()`, learned by
join-shortest-queue dispatch; None or 0: the floor of 2), re-read at every tick: lanes are added as
it grows, and an idle surplus lane leaves as it shrinks (at most that many batches out at once).
Each tick: the scheduler hands over the free active rows of one cohort (a job is in one batch at a
time); the router weighs all of them in one call (off the event loop, in the engine's own router
thread, one call at a time); each chosen expert gets ONE batched velocity call, all experts
concurrently. With `speculate` (the default) the calls do not wait for the router: each row's likely
experts (what its strategy chose from its job's last router weights, `Batch.guess_requests`) are
asked while the router runs; once it has spoken, each expert's guessed answer gives the rows the
routing needs from it, the rows its guess missed are asked for next (after that answer: one call at
a time per expert), and what the routing did not need is dropped (`rows_guessed_unused`); a job's
first evaluation waits for the router. An expert that is unavailable (no responders, timeouts after retries) is marked
failed for this tick and its rows are rerouted by their strategy (top1 -> next-best expert),
then the scheduler advances every row one solver stage and the events go to `emit`.

The engine only drives: `tick()` is literally `scheduler.schedule` -> `_execute` (router and
expert calls, the only I/O) -> `scheduler.update`. Job state lives in the scheduler and is read
through its methods (`job_progress`, `active_jobs`, `queued_jobs`, `stats`); the engine records
`metrics` (a `CoordinatorMetrics`: expert call times and errors, rejections) and names the
events subject of an accepted job (the scheduler knows no subjects).

`transport.velocity(expert, x [n, C, H, W], t [n], y [n], row_ids) -> v [n, C, H, W]` (with
`guidance=` [n] float32, each row's classifier-free guidance scale, only when some row is guided:
`flow.guidance.guided_rows`; a transport without it then fails the call, never guides silently) raises
`ExpertUnavailable` when no worker of that expert can answer (`BadExpertReply` when they answer
garbage; both live in `coordinator.errors`, re-exported here); the NATS transport lives in
`coordinator.transport`, an in-process one (direct backend calls) in `coordinator.local_fleet`.
Every velocity is checked here too (shape, float, finite): a bad one counts as a failed call, so
NaN never reaches a job's samples. A job whose rows no expert could serve fails with
`unavailable`, or with `bad_reply` when an expert it needed answered only garbage (the failed
expert's code travels with the batch: `Batch.mark_failed`).

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
import concurrent.futures
import contextvars
import inspect
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from bus.cancel import cancel_and_wait
from flow.guidance import guided_rows
from schemas import ErrorCode, FailedEvent, JobAccepted, JobRequest, subjects

from .batch import Batch
from .errors import BadExpertReply, ExpertUnavailable  # also re-exported: coordinator.engine.ExpertUnavailable
from .metrics import CoordinatorMetrics
from .run_ahead import PAUSE_AFTER_MISS, AheadCounters, AheadEnded, AheadPlan, AheadRun, plan_ahead
from .scheduler import DEFAULT_CLIENT, Rejected, Scheduler

log = logging.getLogger(__name__)

#: While set to a list (by the engine, around one expert call of a batch whose jobs asked for
#: `report_dtypes`), the transport appends the worker id of every reply it uses for that call: the
#: engine then knows which workers computed those rows, and the scheduler which dtypes (`worker_dtype`).
ANSWERED_BY: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar("answered_by", default=None)

#: Most ticks kept for rows_per_s (older ones drop out even within rate_window_s).
MAX_RATE_SAMPLES = 4096

#: Batches out at once (see Scheduler.schedule): 2 lets one cohort be routed and updated while
#: the experts work on the other. Also the floor of `cohorts="auto"`.
DEFAULT_COHORTS = 2

#: Running ahead (coordinator/run_ahead.py): most further steps one expert request computes, and
#: the most rows the coordinator may hold (all its running jobs) for its requests to run ahead (a lone
#: job or two: at load, batching already spreads the round trip over many rows, and a worker merges
#: the requests of several ticks into one forward, which steps run ahead never are).
DEFAULT_RUN_AHEAD = 8
DEFAULT_RUN_AHEAD_ROWS = 4
#: `cohorts="auto"`: size the cohorts from the workers each expert has (see cohorts_for_workers).
AUTO_COHORTS = "auto"


def parse_cohorts(text: str) -> int | str:
    """A `--cohorts` value: "auto" or an int >= 1 (an argparse `type`: a ValueError reads as
    "invalid parse_cohorts value", so the message says what is allowed)."""
    import argparse

    if str(text).strip().lower() == AUTO_COHORTS:
        return AUTO_COHORTS
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be 'auto' or an int >= 1, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be 'auto' or an int >= 1, got {n}")
    return n


def check_cohorts(cohorts: int | str) -> int | str:
    """`cohorts` if it is an int >= 1 or "auto", else ValueError (the Engine's and the Coordinator's check)."""
    if cohorts != AUTO_COHORTS and (not isinstance(cohorts, int) or isinstance(cohorts, bool) or cohorts < 1):
        raise ValueError(f"cohorts must be an int >= 1 (batches out at once) or {AUTO_COHORTS!r}, got {cohorts!r}")
    return cohorts


def cohorts_for_workers(workers: int | None) -> int:
    """The cohorts `cohorts="auto"` keeps out for an expert served by `workers` worker processes
    (the most any expert has): 2 up to 3 workers, 3 from 4, 4 from 8. With W workers per expert a
    cohort holds about 1.5 W requests of an expert, so with two cohorts half the workers have a
    single request queued while the other cohort is routed and stepped; a third (fourth) cohort
    keeps them fed. Measured with `ddm-fleet bench scale` (docs/CAPACITY.md "Scaling efficiency"):
    efficiency 0.97 / 0.91 / 0.85 / 0.77 with 2 cohorts and 0.98 / 0.95 / 0.92 / 0.84 with 3 at 1 / 2
    / 4 / 8 workers per expert, 0.88 with 4 at 8; where one worker serves each expert (CPU workers
    on a small host) a third cohort only costs CPU (~10% per image, `bench fleet`)."""
    w = int(workers or 0)
    return DEFAULT_COHORTS + (w >= 4) + (w >= 8)


class Transport(Protocol):
    async def velocity(
        self,
        expert: int,
        x: np.ndarray,
        t: np.ndarray,
        y: np.ndarray,
        row_ids: list[str],
        guidance: np.ndarray | None = None,
    ) -> np.ndarray: ...


def _guidance_of(batch: Batch, idx: np.ndarray) -> dict:
    """{"guidance": [n] float32} for a call on rows idx of which some are guided (scale != 1, label known:
    `flow.guidance.guided_rows`), else {} (the call goes as it always did, to any transport)."""
    scale = batch.guidance[idx]
    return {"guidance": scale} if len(guided_rows(batch.y[idx], scale)) else {}


class RouterLike(Protocol):
    def weights(self, x_t: np.ndarray, t: np.ndarray, y: np.ndarray) -> np.ndarray: ...


class Engine:
    """Owns the tick loop. `emit(event)` (sync or async) receives every job event in order.
    `metrics` defaults to a new `CoordinatorMetrics(scheduler)`."""

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
    ):
        check_cohorts(cohorts)
        self.scheduler = scheduler
        self.metrics = metrics if metrics is not None else CoordinatorMetrics(scheduler)
        self.router = router
        self.transport = transport
        # what a worker computes in, by its id ("" unknown): a transport that learns it says so
        scheduler.dtype_of = getattr(transport, "worker_dtype", None) or (lambda worker: "")
        self.emit = emit
        self.clock = clock
        self.router_in_thread = router_in_thread
        self.cohorts = cohorts  # the setting: an int, or "auto" (see cohorts_now)
        self._batches_out = 0  # batches between schedule and update (at most cohorts_now())
        self._lanes: list[asyncio.Task] = []  # run()'s lanes (one per cohort in use; see _lane)
        self._lanes_grew = asyncio.Event()
        self._lanes_started = 0
        self._warned_workers = False
        self.metrics.watch_engine(self)
        if not isinstance(route_every, int) or route_every < 1:
            raise ValueError(f"route_every must be an int >= 1 (evaluations per router call), got {route_every!r}")
        self.route_every = route_every
        if request_rows is not None and (not isinstance(request_rows, int) or request_rows < 1):
            raise ValueError(f"request_rows must be an int >= 1 or None, got {request_rows!r}")
        self.request_rows = request_rows  # the transport's rows per expert request: keep requests whole
        self.rows_routed = 0  # rows the router weighed (the rest reused their job's last weights)
        self.speculate = bool(speculate)  # send the likely expert requests while the router runs
        self.rows_guessed = 0  # rows sent to an expert before the router spoke (speculate)
        self.rows_guessed_unused = 0  # ... of which the routing did not need that expert's answer
        self._unwatched: set[asyncio.Future] = set()  # unneeded guessed calls still running
        for name, value in (("run_ahead", run_ahead), ("run_ahead_rows", run_ahead_rows)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0 (0: off), got {value!r}")
        self.run_ahead = run_ahead  # further steps per request of a small tick (0: never run ahead)
        self.run_ahead_rows = run_ahead_rows
        self.ahead = AheadCounters()
        self._runs: dict[tuple[str, ...], AheadRun] = {}  # row ids of a request -> its velocities running ahead
        self._executed = 0  # ticks executed (a run its rows' cohort skipped a tick of is dropped)
        self._wake = asyncio.Event()  # set (and replaced) by _poke: new work, or rows came back
        self._router_lock = asyncio.Lock()  # one router call at a time (it is CPU-bound)
        self._router_pool: concurrent.futures.ThreadPoolExecutor | None = None  # its thread (see _route)
        self._stopping = False
        self._running = False
        self._emit_lock = asyncio.Lock()
        self._rate: deque[tuple[float, int]] = deque(maxlen=MAX_RATE_SAMPLES)
        self._rate_window = rate_window_s
        self.started_at = clock()
        self.last_unavailable: dict[int, str] = {}
        self.tick_ms: deque[float] = deque(maxlen=100)
        self.tick_s_total = 0.0  # every tick's and router forward's time, summed (/metrics; bench step profile)
        self.router_s_total = 0.0
        self.dead: str | None = None  # why the loop died (then submits are refused), else None

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
            # let the lanes unwind (a call they abandon on the way joins _unwatched), bounded
            await cancel_and_wait(self._lanes, 1.0)
            for task in list(self._unwatched):
                task.cancel()
            self._drop_runs("engine stopped")
            self._running = False
            self._close_router_thread()

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
            worked = await self.tick()
            if not worked and not self._stopping:
                await wake.wait()

    @property
    def batches_out(self) -> int:
        """Batches between schedule and update now (at most `cohorts_now()` while run() drives the lanes)."""
        return self._batches_out

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
        self._drop_runs("engine stopped")
        self.scheduler.fail_all(ErrorCode.UNAVAILABLE, reason)
        await self.flush_events()
        self._close_router_thread()

    async def tick(self) -> bool:
        """One schedule -> execute -> update round. Returns False when there was nothing to do."""
        sched = self.scheduler
        batch = None
        started = time.perf_counter()
        out = False  # this tick holds one of the `cohorts_now()` batches (schedule until update / fail)
        try:
            batch = sched.schedule(self.clock(), cohorts=self.cohorts_now(), request_rows=self.request_rows)
            if batch is not None:
                self._batches_out += 1  # before any await: a lane woken meanwhile sees it
                out = True
            await self.flush_events()
            if batch is None:
                return False
            started = time.perf_counter()
            await self._execute(batch)
            sched.update(batch, self.clock())
        except Exception as err:  # never die: fail the jobs this tick concerns, keep serving the rest
            log.exception("tick failed")
            reason = f"coordinator error: {type(err).__name__}: {err}"
            if batch is not None:
                sched.fail_batch(batch, ErrorCode.INTERNAL, reason)
            else:  # schedule() itself broke: none of its jobs could be scheduled; sleep until the
                sched.fail_all(ErrorCode.INTERNAL, reason)  # next submit instead of spinning on it
                await self.flush_events()
                return False
        finally:
            if out:
                self._batches_out -= 1
        if batch is not None:
            took = time.perf_counter() - started
            self.tick_ms.append(took * 1000)
            self.tick_s_total += took
            self._count_rows(len(batch))
            self._poke()  # its jobs are free again: an idle lane may take them
        await self.flush_events()
        return True

    async def _execute(self, batch: Batch) -> None:
        """Route, then call every chosen expert (rerouting after failures); a failed expert is
        marked on the batch with its ErrorCode. With `speculate`, the likely requests
        (`Batch.guess_requests`) go out while the router runs, and the routing's other needs
        when it has spoken (see `_take_guesses`)."""
        self._executed += 1
        if self._runs:  # a run its rows skipped a tick of (cancelled, failed, finished) is not used again
            self._drop_runs("unused", older_than=self._executed - 1 - self.cohorts_now())
        fresh, w = batch.routing_plan(self.route_every)
        guesses: dict[int, tuple[np.ndarray, asyncio.Future]] = {}
        if fresh.any():
            if self.speculate:
                guesses = {
                    k: (idx, asyncio.ensure_future(self._call(batch, k, idx)))
                    for k, idx in batch.guess_requests().items()
                }
                self.rows_guessed += sum(len(idx) for idx, _ in guesses.values())
            try:
                await self._route(batch, fresh, w)
            except BaseException:
                for idx, task in guesses.values():
                    self._abandon(task, len(idx))
                raise
        batch.route(w, fresh)
        if guesses:
            await self._take_guesses(batch, guesses)
        while reqs := batch.requests():
            experts = list(reqs)
            results = await asyncio.gather(*(self._call(batch, k, reqs[k]) for k in experts), return_exceptions=True)
            for k, res in zip(experts, results):
                self._settle(batch, k, reqs[k], res)

    async def _route(self, batch: Batch, fresh: np.ndarray, w: np.ndarray) -> None:
        """Ask the router for the `fresh` rows' weights; written into w [R, K] in place."""
        idx = slice(None) if fresh.all() else np.nonzero(fresh)[0]
        x, t, y = batch.x[idx], batch.t[idx], batch.y[idx]
        async with self._router_lock:
            started = time.perf_counter()
            if self.router_in_thread:
                got = await asyncio.get_running_loop().run_in_executor(
                    self._router_thread(), self.router.weights, x, t, y
                )
            else:
                got = self.router.weights(x, t, y)
            self.router_s_total += time.perf_counter() - started
        got = np.asarray(got, dtype=np.float64)
        if got.shape != (len(y), w.shape[1]):
            raise ValueError(f"router weights must be [R, K] = [{len(y)}, {w.shape[1]}], got {list(got.shape)}")
        w[idx] = got
        self.rows_routed += len(y)

    def _router_thread(self) -> concurrent.futures.ThreadPoolExecutor:
        """The engine's one router thread (started at the first call, shut down when run() ends).
        Always the same thread: its malloc arena keeps the router's activations and its core's caches
        the weights (asyncio's default executor spread the calls over two threads; a dedicated one
        gave 2 - 4% more rows/s, docs/CAPACITY.md "The GIL, again"). See `_close_router_thread`."""
        if self._router_pool is None:
            self._router_pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="router")
        return self._router_pool

    def _close_router_thread(self) -> None:
        """Shut the router's thread down: a call still running finishes, then the thread exits (a
        later router call starts a new one)."""
        if self._router_pool is not None:
            self._router_pool.shutdown(wait=False)
            self._router_pool = None

    async def _take_guesses(self, batch: Batch, guesses: dict[int, tuple[np.ndarray, asyncio.Future]]) -> None:
        """The routing has spoken: per expert, keep the needed rows of its guessed call's answer,
        then ask it for the rows the guess missed; experts the guesses never named are asked at
        once. All experts concurrently, one call at a time per expert, and every guessed call is
        awaited (a job alone on the fleet sends the same requests in the same order every time,
        so a worker never merges them differently and its images repeat bit for bit)."""

        async def one(k: int) -> None:
            if k in guesses:
                idx, task = guesses[k]
                try:
                    v = await task
                except asyncio.CancelledError:
                    raise
                except Exception as err:
                    if (batch.weights[idx, k] > 0).any():
                        self._settle(batch, k, idx, err)
                    else:  # nobody needs it now; the failure is still counted in the metrics
                        self.rows_guessed_unused += len(idx)
                        if isinstance(err, ExpertUnavailable):
                            self.metrics.expert_error(k, err.code)
                        log.debug("an unneeded guessed call to expert %d failed: %r", k, err)
                    return
                self.last_unavailable.pop(k, None)
                self.rows_guessed_unused += len(idx) - batch.record_guess(k, idx, v)
            rest = batch.requests().get(k)
            if rest is not None:
                try:
                    v = await self._call(batch, k, rest)
                except asyncio.CancelledError:
                    raise
                except Exception as err:
                    v = err
                self._settle(batch, k, rest, v)

        await asyncio.gather(*(one(k) for k in sorted(set(guesses) | set(batch.requests()))))

    def _abandon(self, task: asyncio.Future, rows: int) -> None:
        """A guessed call whose tick broke before routing (the router failed): let it finish (a worker
        computes it anyway) and drop its answer; run() cancels any still out when the engine stops."""
        self.rows_guessed_unused += rows
        self._unwatched.add(task)
        task.add_done_callback(self._drop_answer)

    def _drop_answer(self, task: asyncio.Future) -> None:
        self._unwatched.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.debug("an unneeded guessed call failed: %r", task.exception())

    def _settle(self, batch: Batch, k: int, idx: np.ndarray, res: Any) -> None:
        """Record expert k's answer for rows idx, or mark it failed for this tick."""
        if isinstance(res, ExpertUnavailable):
            self.last_unavailable[k] = res.reason
            self.metrics.expert_error(k, res.code)
            batch.mark_failed(k, res.reason, res.code)
        elif isinstance(res, BaseException):
            if isinstance(res, asyncio.CancelledError):
                raise res
            log.warning("expert %d call failed: %r", k, res)
            self.last_unavailable[k] = f"failed: {type(res).__name__}: {res}"
            self.metrics.expert_error(k, ErrorCode.UNAVAILABLE)
            batch.mark_failed(k, f"failed ({type(res).__name__}: {res})", ErrorCode.UNAVAILABLE)
        else:
            self.last_unavailable.pop(k, None)
            batch.record(k, idx, res)

    async def _call(self, batch: Batch, k: int, idx: np.ndarray) -> np.ndarray:
        row_ids = [batch.row_ids[i] for i in idx]
        plan = None
        may_start = (
            self.run_ahead
            and self.scheduler.active_rows <= self.run_ahead_rows  # a job or two alone on the fleet
            and hasattr(self.transport, "velocity_ahead")
        )
        if self._runs or may_start:
            groups = [batch.groups[g] for g in np.searchsorted(batch.bounds, idx, side="right") - 1]
            v = await self._take_ahead(batch, k, idx, row_ids, groups) if self._runs else None
            if v is not None:
                return v
            if may_start:
                plan = plan_ahead(groups, self.run_ahead)
        started = time.perf_counter()
        answered = ANSWERED_BY.set([]) if batch.reports_dtypes else None  # this task's own context
        x, t, y = batch.x[idx], batch.t[idx], batch.y[idx]
        guided = _guidance_of(batch, idx)
        try:
            if plan is None:
                v, stream = await self.transport.velocity(k, x, t, y, row_ids, **guided), None
            else:
                v, stream = await self.transport.velocity_ahead(k, x, t, y, row_ids, plan.t, plan.dt, **guided)
            if answered is not None:
                batch.note_workers(k, ANSWERED_BY.get() or ())
        finally:
            if answered is not None:
                ANSWERED_BY.reset(answered)
            self.metrics.expert_call(k, time.perf_counter() - started)
        try:
            v = self._checked(batch, k, idx, v)
        except BaseException:
            if stream is not None:
                stream.close()
            raise
        if stream is not None:
            if stream.steps < plan.steps:  # the expert's workers take fewer steps ahead
                plan = AheadPlan(stream.steps, plan.t[: stream.steps], plan.dt[: stream.steps])
            self.ahead.runs += 1
            key = tuple(row_ids)
            if (old := self._runs.pop(key, None)) is not None:
                self._end_run(old, "replaced")
            run = AheadRun.start(k, stream, plan, groups, x, v)
            run.last_tick = self._executed
            self._runs[key] = run
        return v

    async def _take_ahead(
        self, batch: Batch, k: int, idx: np.ndarray, row_ids: list[str], groups: list
    ) -> np.ndarray | None:
        """Expert k's velocity for rows idx from a run already streaming it in (coordinator/run_ahead.py),
        or None: no run fits (one that no longer can is ended)."""
        key = tuple(row_ids)
        run = self._runs.pop(key, None)
        if run is None:
            return None
        x = batch.x[idx]
        if not run.fits(k, groups, x, batch.t[idx]):
            self._end_run(run, "diverged" if run.expert == k else "rerouted", pause=True)
            return None
        try:
            v = await run.stream.next(getattr(self.transport, "step_timeout", 10.0))
            v = self._checked(batch, k, idx, v)
        except (AheadEnded, BadExpertReply) as err:
            log.debug("expert %d: a run ahead ended: %s", k, err)
            self._end_run(run, "stream ended")
            return None
        except BaseException:  # cancelled (the engine stops): the run is out of `_runs`, close it here
            self._end_run(run, "cancelled")
            raise
        self.ahead.rows_taken += len(idx)
        if batch.reports_dtypes:
            batch.note_workers(k, (run.stream.worker,))
        run.took(x, v)
        run.last_tick = self._executed
        if not run.left:
            run.stream.close()
        elif key in self._runs:  # a call for these rows started a newer run meanwhile (speculation): it wins
            self._end_run(run, "replaced")
        else:
            self._runs[key] = run
        return v

    def _end_run(self, run: AheadRun, why: str, pause: bool = False) -> None:
        """Stop using a run: its stream is closed, its unused steps counted; `pause`: its jobs do not run
        ahead for a few evaluations (the routing moved them)."""
        run.stream.close()
        self.ahead.end(run, why)
        if pause:
            for g in run.groups:
                g.ahead_paused_until = g.evals + PAUSE_AFTER_MISS

    def _drop_runs(self, why: str, older_than: int | None = None) -> None:
        """End every run (or those last used before tick `older_than`)."""
        for key, run in list(self._runs.items()):
            if older_than is None or run.last_tick < older_than:
                del self._runs[key]
                self._end_run(run, why)

    def _checked(self, batch: Batch, k: int, idx: np.ndarray, v) -> np.ndarray:
        """Expert k's reply for rows idx as float32 [n, C, H, W]; BadExpertReply if it is not one."""
        v = np.asarray(v)
        want = (len(idx),) + batch.x.shape[1:]
        if v.shape != want:
            raise BadExpertReply(k, f"replied with shape {list(v.shape)}, expected {list(want)}")
        if v.dtype.kind != "f":
            raise BadExpertReply(k, f"replied with {v.dtype} velocities, expected float")
        with np.errstate(over="ignore", invalid="ignore"):
            v = v.astype(np.float32, copy=False)
        if not np.isfinite(v).all():
            raise BadExpertReply(k, "replied with NaN/Inf velocities")
        return v

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
