"""The execute stage of the engine's tick (schedule -> execute -> update): route one batch, call
every chosen expert, settle their answers onto the batch. The only I/O of a tick (router thread,
transport); what to compute and what the answers do is the pure scheduler's and `Batch`'s.

    executor = Executor(scheduler, router, transport, metrics, cohorts_now=engine.cohorts_now)
    await executor.execute(batch)      # between scheduler.schedule and scheduler.update

The router weighs the rows that need fresh weights (`Batch.routing_plan`, `route_every`) in one
call, off the event loop in the executor's own router thread, one call at a time; each chosen expert
gets ONE batched velocity call, all experts concurrently. With `speculate` (the default) the calls do
not wait for the router: each row's likely experts (what its strategy chose from its job's last
router weights, `Batch.guess_requests`) are asked while the router runs; once it has spoken, each
expert's guessed answer gives the rows the routing needs from it, the rows its guess missed are
asked for next (after that answer: one call at a time per expert), and what the routing did not
need is dropped (`rows_guessed_unused`); a job's first evaluation waits for the router, and where runs
ahead (below) already stream the likely requests they are guessed only if the routing moved rows. An expert
that is unavailable (no responders, timeouts after retries) is marked failed for this tick and its
rows are rerouted by their strategy (top1 -> next-best expert).

Running ahead (`run_ahead` further steps, only while the scheduler holds at most `run_ahead_rows`
rows, over a transport with `velocity_ahead`): a small tick's expert request computes the next
Euler steps on its worker, streamed back; the next ticks take their velocities from that stream
while their rows are where the plan said (`coordinator/run_ahead.py`: the plan, the check, the
stream; here: the runs in use, keyed by the row ids of their request).

`transport.velocity(expert, x [n, C, H, W], t [n], y [n], row_ids) -> v [n, C, H, W]` (with
`guidance=` [n] float32, each row's classifier-free guidance scale, only when some row is guided:
`flow.guidance.guided_rows`; a transport without it then fails the call, never guides silently) raises
`ExpertUnavailable` when no worker of that expert can answer (`BadExpertReply` when they answer
garbage; both live in `coordinator.errors`); the NATS transport lives in `coordinator.transport`, an
in-process one (direct backend calls) in `coordinator.local_fleet`. Every velocity is checked here
too (shape, float, finite): a bad one counts as a failed call, so NaN never reaches a job's samples.
The failed expert's code travels with the batch (`Batch.mark_failed`), so a job whose rows no expert
could serve fails with `unavailable`, or `bad_reply` when an expert it needed answered only garbage.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from flow.guidance import guided_rows
from schemas import ErrorCode

from .batch import Batch
from .errors import BadExpertReply, ExpertUnavailable
from .metrics import CoordinatorMetrics
from .run_ahead import PAUSE_AFTER_MISS, AheadCounters, AheadEnded, AheadPlan, AheadRun, plan_ahead
from .scheduler import Scheduler

log = logging.getLogger(__name__)

#: While set to a list (by the executor, around one expert call of a batch whose jobs asked for
#: `report_dtypes`), the transport appends the worker id of every reply it uses for that call: the
#: executor then knows which workers computed those rows, and the scheduler which dtypes (`worker_dtype`).
ANSWERED_BY: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar("answered_by", default=None)


#: A router call of at most this many rows runs on the event loop, not in the router thread (`Executor._route`).
INLINE_ROUTER_ROWS = 4


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


class RouterLike(Protocol):
    def weights(self, x_t: np.ndarray, t: np.ndarray, y: np.ndarray) -> np.ndarray: ...


def _guidance_of(batch: Batch, idx: np.ndarray) -> dict:
    """{"guidance": [n] float32} for a call on rows idx of which some are guided (scale != 1, label known:
    `flow.guidance.guided_rows`), else {} (the call goes as it always did, to any transport)."""
    scale = batch.guidance[idx]
    return {"guidance": scale} if len(guided_rows(batch.y[idx], scale)) else {}


class Executor:
    """Executes the batches of one engine (see the module docstring); the settings are the Engine's
    (defaults there). `cohorts_now()`: the engine's cohorts in use (a run ahead that its rows' cohort
    skipped a tick of is not used again)."""

    def __init__(
        self,
        scheduler: Scheduler,
        router: RouterLike,
        transport: Transport,
        metrics: CoordinatorMetrics,
        *,
        cohorts_now: Callable[[], int],
        router_in_thread: bool,
        route_every: int,
        speculate: bool,
        run_ahead: int,
        run_ahead_rows: int,
    ):
        if not isinstance(route_every, int) or route_every < 1:
            raise ValueError(f"route_every must be an int >= 1 (evaluations per router call), got {route_every!r}")
        for name, value in (("run_ahead", run_ahead), ("run_ahead_rows", run_ahead_rows)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0 (0: off), got {value!r}")
        self.scheduler = scheduler
        self.router = router
        self.transport = transport
        self.metrics = metrics
        self.cohorts_now = cohorts_now
        self.router_in_thread = router_in_thread
        self.route_every = route_every
        self.rows_routed = 0  # rows the router weighed (the rest reused their job's last weights)
        self.router_s_total = 0.0  # every router forward's time, summed (/metrics; bench step profile)
        self.speculate = bool(speculate)  # send the likely expert requests while the router runs
        self.rows_guessed = 0  # rows sent to an expert before the router spoke (speculate)
        self.rows_guessed_unused = 0  # ... of which the routing did not need that expert's answer
        self._unwatched: set[asyncio.Future] = set()  # unneeded guessed calls still running
        self.run_ahead = run_ahead  # further steps per request of a small tick (0: never run ahead)
        self.run_ahead_rows = run_ahead_rows
        self.ahead = AheadCounters()
        self._runs: dict[tuple[str, ...], AheadRun] = {}  # row ids of a request -> its velocities running ahead
        self._executed = 0  # ticks executed (a run its rows' cohort skipped a tick of is dropped)
        self._router_lock = asyncio.Lock()  # one router call at a time (it is CPU-bound)
        self._router_pool: concurrent.futures.ThreadPoolExecutor | None = None  # its thread (see _route)
        self.last_unavailable: dict[int, str] = {}  # expert -> why its last call failed (cleared by an answer)
        #: called (batch) after each expert answer recorded onto a batch: the engine's early update
        self.on_answer: Callable[[Batch], None] | None = None

    def running_ahead(self) -> bool:
        """Runs are streaming, or a call now may start one (a job or two alone on the fleet)."""
        return bool(self._runs) or self._may_start_run()

    def _may_start_run(self) -> bool:
        """An expert call now may run ahead: the scheduler holds a job or two alone (at most `run_ahead_rows`
        rows) and the transport can stream."""
        return bool(
            self.run_ahead
            and self.scheduler.active_rows <= self.run_ahead_rows
            and hasattr(self.transport, "velocity_ahead")
        )

    def cancel_unneeded_calls(self) -> None:
        """Cancel the guessed calls still running that no tick waits for (the engine stops)."""
        for task in list(self._unwatched):
            task.cancel()

    async def execute(self, batch: Batch) -> None:
        """Route, then call every chosen expert (rerouting after failures); a failed expert is
        marked on the batch with its ErrorCode. With `speculate`, the likely requests
        (`Batch.guess_requests`) go out while the router runs, and the routing's other needs
        when it has spoken (see `_take_guesses`). Where runs ahead already stream every likely request
        (a lone job), nothing is guessed: the routing's requests, when they are the likely ones, take the
        runs' velocities (guessing would only add tasks and event-loop passes around them); when the routing
        moved rows, the guessed calls go out then, so every row gets the velocity it would have got."""
        self._executed += 1
        if self._runs:  # a run its rows skipped a tick of (cancelled, failed, finished) is not used again
            self.drop_runs("unused", older_than=self._executed - 1 - self.cohorts_now())
        fresh, w = batch.routing_plan(self.route_every)
        guesses: dict[int, tuple[np.ndarray, asyncio.Future]] = {}
        streamed: dict[int, np.ndarray] = {}  # likely requests that runs ahead stream: guessed only if need be
        if fresh.any():
            likely = batch.guess_requests() if self.speculate else {}
            if likely and self._served_by_runs(batch, likely):
                streamed = likely
            elif likely:
                guesses = self._guess(batch, likely)
            try:
                await self._route(batch, fresh, w, speculating=bool(guesses))
            except BaseException:
                for idx, task in guesses.values():
                    self._abandon(task, len(idx))
                raise
        batch.route(w, fresh)
        if streamed and not _same_requests(batch.requests(), streamed):
            guesses = self._guess(batch, streamed)  # the routing moved rows: the guessed calls, as ever
        if guesses:
            await self._take_guesses(batch, guesses)
        while reqs := batch.requests():  # each expert's answer is settled as it comes (see on_answer),
            failed: dict[int, Exception] = {}  # its failure after the round, in expert order (a reroute's
            settled = (self._call_and_settle(batch, k, idx, failed) for k, idx in reqs.items())  # draws see
            for res in await asyncio.gather(*settled, return_exceptions=True):  # every call ends first
                if isinstance(res, BaseException):  # the experts failed so far in one fixed order)
                    raise res
            for k in sorted(failed):
                self._settle(batch, k, reqs[k], failed[k])

    def _guess(self, batch: Batch, likely: dict[int, np.ndarray]) -> dict[int, tuple[np.ndarray, asyncio.Future]]:
        """Start the guessed calls of `likely` (expert -> rows): expert -> (rows, the call)."""
        self.rows_guessed += sum(len(idx) for idx in likely.values())
        return {k: (idx, asyncio.ensure_future(self._call(batch, k, idx))) for k, idx in likely.items()}

    def _served_by_runs(self, batch: Batch, reqs: dict[int, np.ndarray]) -> bool:
        """Every request of `reqs` (expert -> rows) would be answered by a run already streaming its velocity
        (coordinator/run_ahead.py), if the routing keeps it there."""
        if not self._runs:
            return False
        for k, idx in reqs.items():
            run = self._runs.get(tuple(batch.row_ids[i] for i in idx))
            if run is None or run.expert != k:
                return False
        return True

    async def _call_and_settle(
        self, batch: Batch, k: int, idx: np.ndarray, failed: dict[int, Exception] | None = None
    ) -> None:
        """Call expert k for rows idx and settle its answer onto the batch at once; its failure too, or
        into `failed` (expert -> error) when given."""
        try:
            res = await self._call(batch, k, idx)
        except asyncio.CancelledError:
            raise
        except Exception as err:
            if failed is not None:
                failed[k] = err
                return
            res = err
        self._settle(batch, k, idx, res)

    async def _route(self, batch: Batch, fresh: np.ndarray, w: np.ndarray, speculating: bool = False) -> None:
        """Ask the router for the `fresh` rows' weights; written into w [R, K] in place. Up to
        INLINE_ROUTER_ROWS rows are weighed on the event loop (a router forward of a few rows takes less
        than handing it to the thread and back, which at one client was a seventh of the coordinator's CPU);
        more rows go to the router thread, so the loop keeps sending and receiving meanwhile.
        `speculating`: guessed calls were just started; they are let out first, before the router starts
        on either side: inline it would hold the loop, and in its thread the Python around its forward
        takes the GIL from the calls' encoding (at 64 clients the first request left the coordinator
        4.4 ms after its tick began when the thread started first, 1.8 ms when the calls go first)."""
        idx = slice(None) if fresh.all() else np.nonzero(fresh)[0]
        x, t, y = batch.x[idx], batch.t[idx], batch.y[idx]
        async with self._router_lock:
            inline = len(y) <= INLINE_ROUTER_ROWS
            if speculating:  # let the guessed calls reach the socket before the router runs
                for _ in range(2):  # the calls publish, then nats-py's flusher writes
                    await asyncio.sleep(0)
            started = time.perf_counter()
            if self.router_in_thread and not inline:
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
        """The executor's one router thread (started at the first call, shut down when the engine's run() ends).
        Always the same thread: its malloc arena keeps the router's activations and its core's caches
        the weights (asyncio's default executor spread the calls over two threads; a dedicated one
        gave 2 - 4% more rows/s, docs/CAPACITY.md "The GIL, again"). See `close_router_thread`."""
        if self._router_pool is None:
            self._router_pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="router")
        return self._router_pool

    def close_router_thread(self) -> None:
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
            answered = False  # a guessed answer was recorded: the engine hears of it (on_answer)
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
                answered = self.on_answer is not None
            rest = batch.requests().get(k)
            call = None if rest is None else self._call_and_settle(batch, k, rest)
            if answered:  # the rows the guess missed go out first, then the engine hears of the answer
                if call is not None:
                    call = asyncio.ensure_future(call)
                    for _ in range(2):  # the call publishes, then nats-py's flusher writes
                        await asyncio.sleep(0)
                self.on_answer(batch)
            if call is not None:
                await call

        await asyncio.gather(*(one(k) for k in sorted(set(guesses) | set(batch.requests()))))

    def _abandon(self, task: asyncio.Future, rows: int) -> None:
        """A guessed call whose tick broke before routing (the router failed): let it finish (a worker
        computes it anyway) and drop its answer; `cancel_unneeded_calls` cancels any still out when the engine stops."""
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
            if self.on_answer is not None:
                self.on_answer(batch)

    async def _call(self, batch: Batch, k: int, idx: np.ndarray) -> np.ndarray:
        row_ids = [batch.row_ids[i] for i in idx]
        plan = None
        may_start = self._may_start_run()
        if self._runs or may_start:
            groups = [batch.groups[g] for g in np.searchsorted(batch.bounds, idx, side="right") - 1]
            v = await self._take_ahead(batch, k, idx, row_ids, groups) if self._runs else None
            if v is not None:
                return v
            if may_start:
                plan = plan_ahead(groups, self.run_ahead)
        started = time.perf_counter()
        answered = ANSWERED_BY.set([]) if batch.reports_dtypes else None  # (reset below: the caller's value back)
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

    def drop_runs(self, why: str, older_than: int | None = None) -> None:
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


def _same_requests(a: dict[int, np.ndarray], b: dict[int, np.ndarray]) -> bool:
    """The same experts asked for the same rows (expert -> row indices)."""
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
