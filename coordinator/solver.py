"""ODE solvers for flow-matching sampling (pure numpy, no framework).

Integrates dx/dt = v(x, t, y) from t = 0 (noise) to t = 1 (data) on a uniform grid.
`velocity(x [B,C,H,W], t [B], y [B]) -> v [B,C,H,W]` is any callable (a local model, a NATS expert,
the router-weighted ensemble). Each row carries its own t, so rows of one batch may sit at different
times; the step functions take per-row t and dt.

* Euler: x' = x + dt * v(x, t)                                    (1 NFE, global error O(dt))
* Heun:  x~ = x + dt * v(x, t);  x' = x + dt/2 * (v(x, t) + v(x~, t + dt))   (2 NFE, O(dt^2))
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

Velocity = Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]
METHODS = ("euler", "heun")


def time_grid(steps: int) -> np.ndarray:
    """Uniform float32 grid of steps + 1 points from 0 to 1 (first 0.0, last exactly 1.0)."""
    if int(steps) != steps or steps < 1:
        raise ValueError(f"steps must be a positive integer, got {steps!r}")
    return np.linspace(0.0, 1.0, int(steps) + 1, dtype=np.float64).astype(np.float32)


def _col(a: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Per-row scalar a [B] (or scalar) -> broadcastable against x [B, ...]."""
    a = np.asarray(a, dtype=np.float32)
    if a.ndim == 0:
        return a
    return a.reshape((a.shape[0],) + (1,) * (x.ndim - 1))


def _rows(a, n: int) -> np.ndarray:
    a = np.asarray(a, dtype=np.float32)
    return np.full(n, a, dtype=np.float32) if a.ndim == 0 else a


def euler_step(velocity: Velocity, x: np.ndarray, t, dt, y: np.ndarray, v: np.ndarray | None = None) -> np.ndarray:
    """One Euler step: x [B,C,H,W] at t [B] (or scalar) -> x at t + dt. `v` reuses a known v(x, t)."""
    t = _rows(t, x.shape[0])
    if v is None:
        v = velocity(x, t, y)
    return (x + _col(dt, x) * v).astype(np.float32)


def heun_step(velocity: Velocity, x: np.ndarray, t, dt, y: np.ndarray, v: np.ndarray | None = None) -> np.ndarray:
    """One Heun (explicit trapezoid, predictor-corrector) step: 2 velocity calls, x [B,C,H,W] -> [B,C,H,W]."""
    t = _rows(t, x.shape[0])
    dt_b = _rows(dt, x.shape[0])
    if v is None:
        v = velocity(x, t, y)
    x_pred = x + _col(dt_b, x) * v
    v_next = velocity(x_pred.astype(np.float32), (t + dt_b).astype(np.float32), y)
    return (x + _col(dt_b, x) * 0.5 * (v + v_next)).astype(np.float32)


STEP_FUNCTIONS = {"euler": euler_step, "heun": heun_step}


def sample(velocity: Velocity, x0: np.ndarray, y: np.ndarray, steps: int, method: str = "euler",
           callback: Callable[[int, np.ndarray, float], None] | None = None) -> np.ndarray:
    """Integrate from t = 0 to 1: x0 [B,C,H,W] noise, y [B] labels -> x1 [B,C,H,W] float32.

    callback(i, x, t) is called after each step i (1-based) with the state at time t.
    NFE = steps (euler) or 2 * steps (heun).
    """
    if method not in STEP_FUNCTIONS:
        raise ValueError(f"unknown solver method {method!r}; choose one of {', '.join(METHODS)}")
    x = np.asarray(x0, dtype=np.float32)
    if x.ndim < 1 or len(np.asarray(y)) != x.shape[0]:
        raise ValueError(f"x0 {x.shape} and y {np.shape(y)} must have the same number of rows")
    step_fn = STEP_FUNCTIONS[method]
    grid = time_grid(steps)
    for i in range(int(steps)):
        t, dt = grid[i], grid[i + 1] - grid[i]
        x = step_fn(velocity, x, np.full(x.shape[0], t, np.float32), dt, y)
        if callback is not None:
            callback(i + 1, x, float(grid[i + 1]))
    return x
