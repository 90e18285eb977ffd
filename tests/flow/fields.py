"""Analytic velocity fields with known solutions, for solver tests (flow.solver, coordinator row groups)."""

from __future__ import annotations

import numpy as np


def linear_field(a: float):
    """dx/dt = a * x  ->  x(1) = x(0) * exp(a)."""

    def v(x, t, y):
        assert x.shape[0] == t.shape[0] == y.shape[0]
        return (a * x).astype(np.float32)

    return v


def time_field(x, t, y):
    """dx/dt = 2 t (per row t)  ->  x(1) = x(0) + 1; Euler is off by 1/steps, Heun exact."""
    return np.broadcast_to((2 * t).reshape(-1, 1, 1, 1), x.shape).astype(np.float32)
