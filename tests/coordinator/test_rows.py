"""The coordinator's row groups step with flow.solver: one stage per tick gives `sample()`'s images bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

from coordinator.rows import RowGroup, initial_noise
from flow.solver import sample
from tests.flow.fields import linear_field, time_field


def test_a_row_group_refuses_an_unknown_solver():
    with pytest.raises(ValueError, match="unknown solver"):
        RowGroup(job_id="j", y=[0], x=np.zeros((1, 1, 2, 2), np.float32), steps=2, solver="rk45")


def wavy(x, t, y):
    """A nonlinear, time- and label-dependent field (float32 rounding shows up in every step)."""
    return (np.sin(3 * x) * 1.7 - x * t[:, None, None, None] + 0.3 * y[:, None, None, None]).astype(np.float32)


def step_rows(group: RowGroup, velocity) -> int:
    """Drive a row group one stage per call, as the engine does; returns the evaluations."""
    n = 0
    while not group.done:
        x, t = group.eval_point()
        group.advance(velocity(x, np.full(group.n, t, np.float32), group.y))
        n += 1
    return n


@pytest.mark.parametrize("method", ["euler", "heun"])
@pytest.mark.parametrize("steps", [1, 3, 7, 50])
def test_row_group_stepping_equals_sample_bit_for_bit(method, steps):
    """One stage per tick (the engine) and the whole loop at once (`sample`) are the same arithmetic."""
    digits = [2, 3, 4]
    group = RowGroup.from_seed("r", 11, digits, (1, 4, 4), steps=steps, solver=method)
    x0 = group.x.copy()
    evals = step_rows(group, wavy)
    assert evals == steps * (2 if method == "heun" else 1) and group.evals == evals
    ref = sample(wavy, x0, np.array(digits), steps, method)
    np.testing.assert_array_equal(group.x, ref)
    np.testing.assert_array_equal(x0[1], initial_noise(11, 1, (1, 4, 4)))


@pytest.mark.parametrize("method,order", [("euler", 1), ("heun", 2)])
def test_row_group_converges_on_an_analytic_flow(method, order):
    """dx/dt = -1.5 x: rows reach x0 exp(-1.5) with the solver's order of accuracy."""

    def err(steps):
        g = RowGroup.from_seed("a", 3, [0, 1], (1, 2, 2), steps=steps, solver=method)
        x0 = g.x.copy()
        step_rows(g, linear_field(-1.5))
        return np.abs(g.x - x0 * np.exp(-1.5)).max() / np.abs(x0).max()

    ratio = err(20) / err(40)
    assert 2**order * 0.9 < ratio < 2**order * 1.1


def test_heun_row_group_is_exact_for_a_linear_in_t_field():
    g = RowGroup(job_id="t", y=[0, 1], x=np.zeros((2, 1, 2, 2), np.float32), steps=8, solver="heun")
    step_rows(g, time_field)
    np.testing.assert_allclose(g.x, 1.0, atol=1e-6)  # x(1) = x(0) + 1
