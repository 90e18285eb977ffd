"""Rows: one row = one image of one job, at its own position on its own time grid.

Rows of one engine tick may sit at different t, have different step counts, solvers and
strategies: everything a row needs to take its next solver stage lives with the row (the
diffusers-style global step counter does not fit continuous batching). The rows of one job
always share their position, so they are kept together in a `RowGroup` and stepped as arrays.

Time convention: t = 0 is noise, t = 1 is data; a row integrates dx/dt = v(x, t, y) on the
uniform grid `solver.time_grid(steps)` = [0, 1/steps, ..., 1].

The step arithmetic is `flow.solver`'s (the one implementation, shared with `sample()`);
a row only keeps where it is. Per step n:

* euler: one evaluation, one tick:  x[n+1] = euler_update(x[n], dt, v(x[n], t[n]))
* heun:  two evaluations, one per engine tick (the stage is kept on the row):
      stage 0: v0 = v(x[n], t[n])
      stage 1: v1 = v(heun_predict(x[n], dt, v0), t[n+1]);   x[n+1] = heun_correct(x[n], dt, v0, v1)

Initial noise depends only on (seed, row index), so a seeded job gives the same image
whether it runs alone or batched with a hundred others.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

from flow.solver import check_method, euler_update, heun_correct, heun_predict, step_dt, time_grid


def initial_noise(seed: int, index: int, shape: tuple[int, ...]) -> np.ndarray:
    """Standard normal noise [*shape] float32 for row `index` of a job seeded with `seed`.

    Depends only on (seed, index): never on batch composition or arrival order."""
    rng = np.random.default_rng(np.random.SeedSequence([int(seed), 1, int(index)]))
    return rng.standard_normal(shape, dtype=np.float32)


@lru_cache(maxsize=64)
def step_dts(steps: int) -> np.ndarray:
    """[steps] float32: `step_dt(grid[n], grid[n + 1])` of every step n of `time_grid(steps)` (read-only,
    cached; the same values as computing each step's dt on its own)."""
    grid = time_grid(steps)
    dts = step_dt(grid[:-1], grid[1:])
    dts.setflags(write=False)
    return dts


def draw_digits(seed: int, count: int, num_classes: int = 10) -> list[int]:
    """Class labels for a `count` job: `count` ints in [0, num_classes), fixed by `seed`."""
    rng = np.random.default_rng(np.random.SeedSequence([int(seed), 0]))
    return [int(v) for v in rng.integers(0, num_classes, size=count)]


@dataclass(eq=False)
class RowGroup:
    """The N rows (images) of one job. They share steps, solver, strategy and position on the
    time grid, so they advance together; each row keeps its own label, noise and state.

    x: committed state [N, C, H, W] float32 at t = grid[step].  y: [N] int64 labels.
    oracle_expert: [N] int64 partition owning each label (-1 unknown).
    usage: [N, K] evaluations each expert contributed to; last_weights [N, K]; last_experts [N].
    """

    job_id: str
    y: np.ndarray
    x: np.ndarray
    steps: int
    solver: str = "euler"
    strategy: str = "top1"
    top_k: int = 2
    oracle_expert: np.ndarray | None = None
    num_experts: int = 1
    step: int = 0  # completed solver steps
    stage: int = 0  # heun: 0 = predictor evaluation next, 1 = corrector evaluation next
    v0: np.ndarray | None = None  # heun: stage-0 velocity [N, C, H, W]
    last_u: np.ndarray | None = None  # the last combined velocity applied [N, C, H, W] (for x1 = x + (1 - t) u)
    evals: int = 0  # velocity evaluations applied
    route_w: np.ndarray | None = None  # [N, K] float64 router weights last computed for these rows
    routed_at: int = -1  # `evals` when route_w was computed
    seed: int = 0  # the job's seed: drawn strategies (`strategies.DRAWN`) draw from (seed, row, evals)
    #: the job's classifier-free guidance scale (`JobRequest.guidance_scale`; 1 = off): each expert guides its
    #: velocity of these rows with the null label's (`flow.guidance`)
    guidance: float = 1.0
    #: per expert, the ids of the workers that computed its rows (only for a job that asked for
    #: `report_dtypes`; None otherwise, and not kept across a durable take-over)
    answered: list[set[str]] | None = None
    #: running ahead (coordinator/run_ahead.py) waits until `evals` reaches this after a run went unused
    ahead_paused_until: int = 0
    usage: np.ndarray = field(init=False)
    last_weights: np.ndarray = field(init=False)
    last_experts: np.ndarray = field(init=False)
    _grid: np.ndarray = field(init=False, repr=False)
    _dts: np.ndarray = field(init=False, repr=False)
    _row_ids: list[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        check_method(self.solver)
        self.y = np.asarray(self.y, dtype=np.int64)
        self.x = np.asarray(self.x, dtype=np.float32)
        n = len(self.y)
        if self.x.shape[0] != n or self.x.ndim != 4:
            raise ValueError(f"x must be [N={n}, C, H, W], got {list(self.x.shape)}")
        if self.oracle_expert is None:
            self.oracle_expert = np.full(n, -1, np.int64)
        self.oracle_expert = np.asarray(self.oracle_expert, dtype=np.int64)
        self.usage = np.zeros((n, self.num_experts), np.int64)
        self.last_weights = np.zeros((n, self.num_experts), np.float32)
        self.last_experts = np.full(n, -1, np.int64)
        self._grid = time_grid(self.steps)
        self._dts = step_dts(int(self.steps))
        self._row_ids = [f"{self.job_id}:{i}" for i in range(n)]

    @classmethod
    def from_seed(cls, job_id: str, seed: int, digits: list[int], image_shape: tuple[int, ...], **kw) -> RowGroup:
        """Rows whose noise is `initial_noise(seed, i, image_shape)` for row i (and whose routing draws,
        for a drawn strategy, come from the same seed)."""
        x = np.stack([initial_noise(seed, i, image_shape) for i in range(len(digits))])
        return cls(job_id=job_id, y=np.asarray(digits, np.int64), x=x, seed=int(seed), **kw)

    @property
    def n(self) -> int:
        return len(self.y)

    @property
    def row_ids(self) -> list[str]:
        """["<job_id>:0", ..., "<job_id>:<N-1>"] (built once; do not modify the list)."""
        return self._row_ids

    @property
    def done(self) -> bool:
        return self.step >= self.steps

    @property
    def t(self) -> float:
        """Time of the committed state x."""
        return float(self._grid[self.step])

    @property
    def dt(self) -> np.float32:
        """Step size of the current step, float32 (as the update uses it)."""
        return self._dts[self.step]

    def grid_times(self, start: int, count: int) -> np.ndarray:
        """[count] float32: the grid times of steps start .. start + count - 1 (as a batch's t carries them)."""
        return self._grid[start : start + count].astype(np.float32)

    def step_sizes(self, start: int, count: int) -> np.ndarray:
        """[count] float32: the step sizes dt of steps start .. start + count - 1 (as the update uses them)."""
        return np.array(self._dts[start : start + count], dtype=np.float32)

    def needs_routing(self, every: int) -> bool:
        """Whether this evaluation asks the router afresh: the first one, then every `every`-th
        (counted in evaluations, so Heun's two stages count twice). Depends only on the group's own
        progress, never on the batch it rides in."""
        return self.route_w is None or self.evals - self.routed_at >= every

    def remember_route(self, w: np.ndarray) -> None:
        """Keep router weights w [N, K] computed for this evaluation: kept as given when it is a
        read-only float64 array (a slice of a batch's weights, which nothing changes), else copied."""
        w = np.asarray(w)
        self.route_w = w if w.dtype == np.float64 and not w.flags.writeable else np.array(w, dtype=np.float64)
        self.routed_at = self.evals

    def eval_point(self) -> tuple[np.ndarray, float]:
        """(x [N, C, H, W], t) at which the next velocity must be evaluated."""
        if self.done:
            raise RuntimeError(f"job {self.job_id} is finished; nothing to evaluate")
        if self.solver == "heun" and self.stage == 1:
            assert self.v0 is not None
            return heun_predict(self.x, self.dt, self.v0), float(self._grid[self.step + 1])
        return self.x, self.t

    @property
    def euler_next(self) -> bool:
        """Whether the next `advance` is an Euler update x + dt * u (solver euler), which a caller
        may compute for many groups at once and hand over as `advance(u, x_next=...)`."""
        return self.solver == "euler"

    def advance(self, u: np.ndarray, x_next: np.ndarray | None = None) -> bool:
        """Apply velocities u [N, C, H, W] at `eval_point()`. True if a full solver step completed.

        `x_next` [N, C, H, W] float32, only when `euler_next`: `euler_update(x, dt, u)` already
        computed by the caller (the scheduler does it for a whole batch in one pass; elementwise,
        so the same bits as this group's own update). Divergence (Inf/NaN in x) is not an error
        here: the scheduler checks for it."""
        if self.done:
            raise RuntimeError(f"job {self.job_id} is finished; cannot advance")
        u = np.asarray(u, dtype=np.float32)
        if u.shape != self.x.shape:
            raise ValueError(f"velocity shape {list(u.shape)} does not match rows {list(self.x.shape)}")
        if x_next is not None and (self.solver != "euler" or x_next.shape != self.x.shape):
            raise ValueError(f"x_next is only for an Euler step of rows {list(self.x.shape)}")
        self.evals += 1
        self.last_u = u
        if self.solver == "euler":
            self.x = euler_update(self.x, self.dt, u) if x_next is None else x_next
        elif self.stage == 0:
            self.v0 = u.copy()
            self.stage = 1
            return False
        else:
            assert self.v0 is not None
            self.x = heun_correct(self.x, self.dt, self.v0, u)
            self.v0 = None
            self.stage = 0
        self.step += 1
        return True
