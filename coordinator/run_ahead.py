"""Running ahead: one expert request computes several solver steps of a few rows, so a lone job does
not pay a round trip through NATS for every step.

At one client each step waits for the last: the coordinator updates x, sends it, the worker
computes, the reply comes back (CAPACITY.md "Where a step's time goes": 1.6 ms of wire and worker
around a 3.6 ms forward). With running ahead, a request for a few rows also carries the times and
step sizes of the next A Euler steps (`StepRequest.ahead_t` / `ahead_dt`); the worker answers the
step asked for as always, then steps x itself, x' = x + dt * v, exactly as the coordinator would, and
publishes each further velocity as soon as it is computed. The coordinator keeps routing and
stepping as always, one step per tick; at each tick a row set whose velocity is already streaming in
takes it instead of asking again, but only when its expert is the one the routing chose and its state
is, bit for bit, the state the worker stepped to (`AheadRun.fits`). Anything else (the router moved
the rows, the job was cancelled, a row failed, another strategy mixed experts) ends the run and the
tick asks as usual. So running ahead changes when a velocity is computed, never which: the images
are the same as without it, and the worker computes its run-ahead steps in passes of their own
(`Batcher.submit(solo=True)`), never merged with another request's rows.

The pieces: `plan_ahead` (pure: how many steps, their times and step sizes), `AheadRun` (pure:
what the rows must look like for the next streamed velocity), `AheadStream` (the transport's side:
the stream of replies of one request, checked like any reply).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from bus.cancel import raise_if_cancelled
from flow.solver import euler_update

from .rows import RowGroup

#: Strategies whose rows take exactly one expert's velocity at every step (weight 1): only those
#: rows' states can be stepped by the worker as the coordinator steps them.
ONE_EXPERT_STRATEGIES = frozenset({"top1", "oracle", "sample"})

#: Evaluations a job does not run ahead after one of its runs ended unused (the routing moved it).
PAUSE_AFTER_MISS = 4

#: How long the next streamed velocity may take: this many times the request's first reply, at least
#: AHEAD_MIN_WAIT_S (a step run ahead is one more forward, no slower than the first reply's). A stream
#: that stalls (e.g. a server whose permissions let a worker answer only once) ends after that.
AHEAD_WAIT_FACTOR = 4.0
AHEAD_MIN_WAIT_S = 0.5


class AheadEnded(Exception):
    """The stream of a request that runs ahead stopped (an error reply, a time-out, a bad reply)."""


@dataclass(frozen=True)
class AheadPlan:
    """For the rows of one expert request: `steps` further steps, their times t [A, n] float32 (where
    each is evaluated) and step sizes dt [A, n] float32 (dt[a] moves x from step a to a + 1)."""

    steps: int
    t: np.ndarray
    dt: np.ndarray


def plan_ahead(groups: Sequence[RowGroup], most: int) -> AheadPlan | None:
    """The run-ahead plan for rows of `groups` (one entry per row, in request order), or None when they
    cannot run ahead: a solver other than Euler, a strategy that mixes experts, a job paused after a
    miss, or no step left after this one. At most `most` further steps, and no more than any row's
    job has left."""
    if most < 1 or not groups:
        return None
    distinct = {id(g): g for g in groups}.values()
    left = most
    for g in distinct:
        if g.solver != "euler" or g.strategy not in ONE_EXPERT_STRATEGIES or g.evals < g.ahead_paused_until:
            return None
        left = min(left, g.steps - g.step - 1)
    if left < 1:
        return None
    t = np.stack([g.grid_times(g.step + 1, left) for g in groups], axis=1)  # [A, n]
    dt = np.stack([g.step_sizes(g.step, left) for g in groups], axis=1)  # [A, n]
    return AheadPlan(left, t, dt)


@dataclass(eq=False)
class AheadRun:
    """A request's velocities still streaming in for `rows` (batch row ids in request order) of
    `expert`. `x_next` [n, C, H, W] and `at_evals` (per row, its job's evaluation count) say where the
    rows must be for the next streamed velocity to be theirs."""

    expert: int
    stream: AheadStream
    plan: AheadPlan
    groups: list[RowGroup]
    x_next: np.ndarray
    at_evals: list[int]
    used: int = 0  # streamed velocities taken so far (the first reply is not counted)
    last_tick: int = 0

    @classmethod
    def start(
        cls, expert: int, stream: AheadStream, plan: AheadPlan, groups: list[RowGroup], x: np.ndarray, v: np.ndarray
    ) -> AheadRun:
        """The run after the request's first reply v [n, C, H, W] for rows at x [n, C, H, W]."""
        run = cls(expert, stream, plan, list(groups), x, [g.evals for g in groups])
        run._expect(x, v, 0)
        return run

    def _expect(self, x: np.ndarray, v: np.ndarray, a: int) -> None:
        """After velocity a (v, at x) the rows step to x + dt[a] * v, one evaluation later."""
        self.x_next = euler_update(x, self.plan.dt[a], v)
        self.at_evals = [g.evals + 1 for g in self.groups]

    @property
    def left(self) -> int:
        """Streamed velocities not taken yet."""
        return self.plan.steps - self.used

    def fits(self, expert: int, groups: Sequence[RowGroup], x: np.ndarray, t: np.ndarray) -> bool:
        """Whether the next streamed velocity is the answer to asking `expert` for these rows now:
        the same expert, the same jobs, each one evaluation on, and x [n, C, H, W] / t [n] bit for bit
        where the worker stepped them."""
        if expert != self.expert or self.left < 1 or len(groups) != len(self.groups):
            return False
        if any(g is not h or g.evals != e for g, h, e in zip(groups, self.groups, self.at_evals)):
            return False
        if not np.array_equal(np.asarray(t, np.float32), self.plan.t[self.used]):
            return False
        x = np.ascontiguousarray(x, np.float32)
        return x.shape == self.x_next.shape and x.tobytes() == self.x_next.tobytes()

    def took(self, x: np.ndarray, v: np.ndarray) -> None:
        """The rows at x took streamed velocity v: expect the state after it."""
        self.used += 1
        if self.left:
            self._expect(x, v, self.used)


class AheadStream:
    """The replies after the first one of a request that runs ahead, in order. `check(data)` turns a
    message's bytes into (velocity float32 [n, C, H, W], worker id, ahead_index) or raises (a bad or
    error reply); `close` is called once when the stream is no longer wanted."""

    def __init__(
        self,
        steps: int,
        check: Callable[[bytes], tuple[np.ndarray, str, int]],
        close: Callable[[], None],
        on_stall: Callable[[], None] | None = None,
    ):
        self.steps = steps
        self.first_s = 0.0  # how long the request's first reply took (the transport sets it)
        self._on_stall = on_stall
        self.worker = ""  # the worker that answered the request's first reply
        self.tokens: list[str] = []  # the reply subjects' tokens of the request's legs (the transport's)
        self.token = ""  # ... of the leg whose first reply was taken: only its further replies count
        self._check = check
        self._close = close
        self._queue: asyncio.Queue[tuple[bytes, str]] = asyncio.Queue(maxsize=2 * steps + 2)
        self.received = 0
        self.closed = False
        self.dropped = 0  # messages not taken: another worker's (a hedge copy) or beyond the queue

    def put(self, data: bytes, token: str = "") -> None:
        """A message arrived on the reply subject of one of the request's legs (`token`)."""
        try:
            self._queue.put_nowait((data, token))
        except asyncio.QueueFull:
            self.dropped += 1

    def wait_s(self, most: float) -> float:
        """Seconds to wait for the next velocity: AHEAD_WAIT_FACTOR x the first reply's time, at least
        AHEAD_MIN_WAIT_S, at most `most`."""
        return min(most, max(AHEAD_MIN_WAIT_S, AHEAD_WAIT_FACTOR * self.first_s))

    async def next(self, timeout: float) -> np.ndarray:
        """The next velocity, float32 [n, C, H, W]; AheadEnded when the stream stopped or none came in
        `wait_s(timeout)` seconds (then `on_stall` is told)."""
        if self.closed or self.received >= self.steps:
            raise AheadEnded("the run is over")
        wait = self.wait_s(timeout)
        while True:
            try:
                data, token = await asyncio.wait_for(self._queue.get(), wait)
            except TimeoutError:
                raise_if_cancelled()  # 3.11's wait_for can turn a cancel into a time-out: not a stall then
                if self._on_stall is not None:
                    self._on_stall()
                raise AheadEnded(f"no velocity ran ahead within {wait:.3g} s") from None
            try:
                v, worker, index = self._check(data)
            except Exception as err:
                raise AheadEnded(f"{type(err).__name__}: {err}") from None
            if self.token and token != self.token:  # the other leg of a hedged request streams too: not ours
                self.dropped += 1
                continue
            if index != self.received + 1:
                raise AheadEnded(f"velocity {index} came where {self.received + 1} was due")
            self.received += 1
            return v

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._close()


@dataclass
class AheadCounters:
    """What running ahead did (engine status, /metrics, the bench)."""

    runs: int = 0  # requests sent to run ahead
    rows_taken: int = 0  # row evaluations answered from a run instead of a request
    steps_wasted: int = 0  # streamed steps never taken (the run ended early)
    ended: dict[str, int] = field(default_factory=dict)  # why runs ended early

    def end(self, run: AheadRun, why: str) -> None:
        self.steps_wasted += run.left
        self.ended[why] = self.ended.get(why, 0) + 1
