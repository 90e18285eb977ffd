"""Rows: one row = one image of one job, at its own position on its own time grid.

Rows of one engine tick may sit at different t, have different step counts, solvers and
strategies: everything a row needs to take its next solver stage lives with the row (the
diffusers-style global step counter does not fit continuous batching). The rows of one job
always share their position, so they are kept together in a `RowGroup` and stepped as arrays.

Time convention: t = 0 is noise, t = 1 is data; a row integrates dx/dt = v(x, t, y) on the
uniform grid `solver.time_grid(steps)` = [0, 1/steps, ..., 1].

The step arithmetic is `coordinator.solver`'s (the one implementation, shared with `sample()`);
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

import numpy as np

from .solver import check_method, euler_update, heun_correct, heun_predict, step_dt, time_grid


def initial_noise(seed: int, index: int, shape: tuple[int, ...]) -> np.ndarray:
    """Standard normal noise [*shape] float32 for row `index` of a job seeded with `seed`.

    Depends only on (seed, index): never on batch composition or arrival order."""
    rng = np.random.default_rng(np.random.SeedSequence([int(seed), 1, int(index)]))
    return rng.standard_normal(shape, dtype=np.float32)


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
    usage: np.ndarray = field(init=False)
    last_weights: np.ndarray = field(init=False)
    last_experts: np.ndarray = field(init=False)
    _grid: np.ndarray = field(init=False, repr=False)

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

    @classmethod
    def from_seed(cls, job_id: str, seed: int, digits: list[int], image_shape: tuple[int, ...], **kw) -> "RowGroup":
        """Rows whose noise is `initial_noise(seed, i, image_shape)` for row i."""
        x = np.stack([initial_noise(seed, i, image_shape) for i in range(len(digits))])
        return cls(job_id=job_id, y=np.asarray(digits, np.int64), x=x, **kw)

    @property
    def n(self) -> int:
        return len(self.y)

    @property
    def row_ids(self) -> list[str]:
        return [f"{self.job_id}:{i}" for i in range(self.n)]

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
        return step_dt(self._grid[self.step], self._grid[self.step + 1])

    def needs_routing(self, every: int) -> bool:
        """Whether this evaluation asks the router afresh: the first one, then every `every`-th
        (counted in evaluations, so Heun's two stages count twice). Depends only on the group's own
        progress, never on the batch it rides in."""
        return self.route_w is None or self.evals - self.routed_at >= every

    def remember_route(self, w: np.ndarray) -> None:
        """Keep router weights w [N, K] computed for this evaluation."""
        self.route_w = np.array(w, dtype=np.float64)
        self.routed_at = self.evals

    def eval_point(self) -> tuple[np.ndarray, float]:
        """(x [N, C, H, W], t) at which the next velocity must be evaluated."""
        if self.done:
            raise RuntimeError(f"job {self.job_id} is finished; nothing to evaluate")
        if self.solver == "heun" and self.stage == 1:
            assert self.v0 is not None
            return heun_predict(self.x, self.dt, self.v0), float(self._grid[self.step + 1])
        return self.x, self.t

    def advance(self, u: np.ndarray) -> bool:
        """Apply velocities u [N, C, H, W] at `eval_point()`. True if a full solver step completed.

        Divergence (Inf/NaN in x) is not an error here: the scheduler checks for it."""
        if self.done:
            raise RuntimeError(f"job {self.job_id} is finished; cannot advance")
        u = np.asarray(u, dtype=np.float32)
        if u.shape != self.x.shape:
            raise ValueError(f"velocity shape {list(u.shape)} does not match rows {list(self.x.shape)}")
        self.evals += 1
        self.last_u = u
        if self.solver == "euler":
            self.x = euler_update(self.x, self.dt, u)
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
