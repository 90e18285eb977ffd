"""ODE solvers for flow-matching sampling (pure numpy, no framework): the one stepping implementation.

Integrates dx/dt = v(x, t, y) from t = 0 (noise) to t = 1 (data) on the uniform grid
`time_grid(steps)`. Both users build on the same small pure functions below:

* `sample()` (and `euler_step` / `heun_step`): a whole batch at one t, velocity called inline
  (`ddm-fleet sample`, tests against analytic flows);
* `coordinator.rows.RowGroup`: one solver stage per engine tick, the stage kept on the row.

Per step n (t = grid[n], t' = grid[n + 1], dt = float32(t' - t)):

* Euler: x' = x + dt * v(x, t)                                           (1 NFE, global error O(dt))
      `euler_update(x, dt, v)`
* Heun:  x~ = x + dt * v0,  v0 = v(x, t)                                 (2 NFE, O(dt^2))
      `heun_predict(x, dt, v0)`
         x' = x + dt/2 * (v0 + v1),  v1 = v(x~, t')
      `heun_correct(x, dt, v0, v1)`

Arrays: x, v, v0, v1 [B, C, H, W] float32; dt a scalar or per-row [B]; results float32.
The grid is float64 (so dt = t' - t is exact, and t + dt == t'); velocities see t as float32.
Overflow is not an error here: it gives Inf/NaN, which the callers check for.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache

import numpy as np

Velocity = Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]
METHODS = ("euler", "heun")
#: Velocity evaluations per solver step.
EVALS_PER_STEP = {"euler": 1, "heun": 2}


def check_method(method: str) -> str:
    """`method` if it is a known solver, else ValueError naming the choices."""
    if method not in EVALS_PER_STEP:
        raise ValueError(f"unknown solver method {method!r}; choose one of {', '.join(METHODS)}")
    return method


@lru_cache(maxsize=256)
def _grid(steps: int) -> np.ndarray:
    g = np.linspace(0.0, 1.0, steps + 1, dtype=np.float64)
    g.setflags(write=False)
    return g


def time_grid(steps: int) -> np.ndarray:
    """Uniform grid [steps + 1] from 0.0 (noise) to exactly 1.0 (data), float64, read-only (cached)."""
    if isinstance(steps, bool) or int(steps) != steps or steps < 1:
        raise ValueError(f"steps must be a positive integer, got {steps!r}")
    return _grid(int(steps))


def step_dt(t, t_next) -> np.float32 | np.ndarray:
    """dt = t_next - t, taken in float64 and rounded once to float32 (scalar, or [B] for per-row t)."""
    dt = np.asarray(t_next, np.float64) - np.asarray(t, np.float64)
    return np.float32(dt) if dt.ndim == 0 else dt.astype(np.float32)


def _col(dt, x: np.ndarray):
    """dt (scalar or [B]) as float32, broadcastable against x [B, ...]."""
    dt = np.asarray(dt, dtype=np.float32)
    if dt.ndim == 0:
        return np.float32(dt)
    if dt.shape != (x.shape[0],):
        raise ValueError(f"dt must be a scalar or one value per row [{x.shape[0]}], got {list(dt.shape)}")
    return dt.reshape((x.shape[0],) + (1,) * (x.ndim - 1))


def euler_update(x: np.ndarray, dt, v: np.ndarray) -> np.ndarray:
    """Euler: x + dt * v. x, v [B, C, H, W] float32 -> [B, C, H, W] float32."""
    with np.errstate(over="ignore", invalid="ignore"):
        return (x + _col(dt, x) * v).astype(np.float32, copy=False)


def heun_predict(x: np.ndarray, dt, v0: np.ndarray) -> np.ndarray:
    """Heun predictor: the point x~ = x + dt * v0 [B, C, H, W] where v1 is evaluated (at t + dt)."""
    return euler_update(x, dt, v0)


def heun_correct(x: np.ndarray, dt, v0: np.ndarray, v1: np.ndarray) -> np.ndarray:
    """Heun corrector: x + dt/2 * (v0 + v1). All [B, C, H, W] float32 -> [B, C, H, W] float32."""
    with np.errstate(over="ignore", invalid="ignore"):
        return (x + (_col(dt, x) / np.float32(2.0)) * (v0 + v1)).astype(np.float32, copy=False)


def _rows_t(t, n: int) -> np.ndarray:
    """t (scalar or [n]) -> [n] float32, as the velocity receives it."""
    t = np.asarray(t, dtype=np.float32)
    return np.full(n, t, dtype=np.float32) if t.ndim == 0 else t


def _velocity(velocity: Velocity, x: np.ndarray, t, y) -> np.ndarray:
    return np.asarray(velocity(x, _rows_t(t, x.shape[0]), y), dtype=np.float32)


def euler_step(velocity: Velocity, x: np.ndarray, t, dt, y: np.ndarray, v: np.ndarray | None = None) -> np.ndarray:
    """One Euler step: x [B,C,H,W] at t ([B] or scalar) -> x at t + dt. `v` reuses a known v(x, t)."""
    x = np.asarray(x, dtype=np.float32)
    v0 = _velocity(velocity, x, t, y) if v is None else v
    return euler_update(x, step_dt(0.0, dt), v0)


def heun_step(velocity: Velocity, x: np.ndarray, t, dt, y: np.ndarray, v: np.ndarray | None = None) -> np.ndarray:
    """One Heun (explicit trapezoid) step: 2 velocity calls, x [B,C,H,W] at t -> x at t + dt.

    t + dt is taken in float64 (on the grid it is exactly the next grid point)."""
    x = np.asarray(x, dtype=np.float32)
    t_next = np.asarray(t, np.float64) + np.asarray(dt, np.float64)
    dt32 = step_dt(0.0, dt)
    v0 = _velocity(velocity, x, t, y) if v is None else v
    v1 = _velocity(velocity, heun_predict(x, dt32, v0), t_next, y)
    return heun_correct(x, dt32, v0, v1)


STEP_FUNCTIONS = {"euler": euler_step, "heun": heun_step}


def sample(
    velocity: Velocity,
    x0: np.ndarray,
    y: np.ndarray,
    steps: int,
    method: str = "euler",
    callback: Callable[[int, np.ndarray, float], None] | None = None,
) -> np.ndarray:
    """Integrate from t = 0 to 1: x0 [B,C,H,W] noise, y [B] labels -> x1 [B,C,H,W] float32.

    callback(i, x, t) is called after each step i (1-based) with the state at time t.
    NFE = steps (euler) or 2 * steps (heun). Same arithmetic, bit for bit, as a `RowGroup`
    stepped one stage per tick with the same velocity.
    """
    step_fn = STEP_FUNCTIONS[check_method(method)]
    x = np.asarray(x0, dtype=np.float32)
    if x.ndim < 1 or len(np.asarray(y)) != x.shape[0]:
        raise ValueError(f"x0 {x.shape} and y {np.shape(y)} must have the same number of rows")
    grid = time_grid(steps)
    for i in range(int(steps)):
        x = step_fn(velocity, x, grid[i], grid[i + 1] - grid[i], y)
        if callback is not None:
            callback(i + 1, x, float(grid[i + 1]))
    return x
