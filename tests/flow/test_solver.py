"""The one solver implementation (flow.solver) against analytic flows (tests/coordinator/test_rows.py steps the
coordinator's row groups with it, bit for bit)."""

from __future__ import annotations

import numpy as np
import pytest

from flow.solver import euler_step, euler_update, heun_correct, heun_predict, heun_step, sample, step_dt, time_grid
from tests.flow.fields import linear_field, time_field


def test_time_grid():
    g = time_grid(4)
    assert g.dtype == np.float64 and g.shape == (5,) and not g.flags.writeable
    np.testing.assert_array_equal(g, [0, 0.25, 0.5, 0.75, 1.0])
    assert time_grid(4) is g  # cached
    for steps in (3, 7, 40, 999):  # exact ends; t + dt lands exactly on the next point
        g = time_grid(steps)
        assert g[0] == 0.0 and g[-1] == 1.0
        assert all(g[n] + (g[n + 1] - g[n]) == g[n + 1] for n in range(steps))
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="positive integer"):
            time_grid(bad)


def test_update_functions_by_hand():
    x = np.array([[[[1.0]]], [[[2.0]]]], np.float32)  # [2, 1, 1, 1]
    v0, v1 = np.full_like(x, 4.0), np.full_like(x, 8.0)
    np.testing.assert_array_equal(euler_update(x, np.float32(0.25), v0)[:, 0, 0, 0], [2.0, 3.0])
    np.testing.assert_array_equal(heun_predict(x, np.float32(0.5), v0)[:, 0, 0, 0], [3.0, 4.0])
    np.testing.assert_array_equal(heun_correct(x, np.float32(0.5), v0, v1)[:, 0, 0, 0], [4.0, 5.0])
    # per-row dt [B]
    np.testing.assert_array_equal(euler_update(x, np.array([0.25, 0.5]), v0)[:, 0, 0, 0], [2.0, 4.0])
    assert euler_update(x, 0.5, v0).dtype == np.float32
    with pytest.raises(ValueError, match="one value per row"):
        euler_update(x, np.array([0.1, 0.2, 0.3]), v0)
    assert step_dt(0.25, 0.5) == np.float32(0.25) and step_dt(0.25, 0.5).dtype == np.float32
    # overflow is reported as Inf (callers check), never raised or warned
    big = np.full_like(x, 3.4e38)
    with np.errstate(all="raise"):
        assert np.isinf(heun_correct(x, np.float32(1.0), big, big)).all()


def _err(method, steps, a=-1.5):
    x0 = np.random.default_rng(0).standard_normal((3, 1, 4, 4)).astype(np.float32)
    y = np.zeros(3, np.int64)
    x1 = sample(linear_field(a), x0, y, steps, method)
    return np.abs(x1 - x0 * np.exp(a)).max() / np.abs(x0).max()


def test_linear_field_heun_beats_euler():
    assert _err("heun", 10) < _err("euler", 10) / 10


def test_convergence_orders():
    """Halving the step size halves Euler's error (order 1) and quarters Heun's (order 2)."""
    e1, e2 = _err("euler", 20), _err("euler", 40)
    h1, h2 = _err("heun", 20), _err("heun", 40)
    assert 1.8 < e1 / e2 < 2.2
    assert 3.6 < h1 / h2 < 4.4


def test_time_dependent_field_and_per_row_time():
    x0 = np.zeros((2, 1, 2, 2), np.float32)
    y = np.zeros(2, np.int64)
    np.testing.assert_allclose(sample(time_field, x0, y, 8, "heun"), 1.0, atol=1e-6)
    np.testing.assert_allclose(sample(time_field, x0, y, 8, "euler"), 1.0 - 1 / 8, atol=1e-6)
    # rows at different t in one call: row 0 at t=0, row 1 at t=0.5, dt=0.5
    out = heun_step(time_field, x0, np.array([0.0, 0.5], np.float32), 0.5, y)
    np.testing.assert_allclose(out[:, 0, 0, 0], [0.25, 0.75], atol=1e-6)
    out = euler_step(time_field, x0, np.array([0.0, 0.5], np.float32), 0.5, y)
    np.testing.assert_allclose(out[:, 0, 0, 0], [0.0, 0.5], atol=1e-6)


def test_nfe_and_callback():
    calls = []

    def v(x, t, y):
        calls.append(float(t[0]))
        return np.zeros_like(x)

    seen = []
    sample(
        v,
        np.zeros((1, 1, 2, 2), np.float32),
        np.zeros(1, np.int64),
        5,
        "heun",
        callback=lambda i, x, t: seen.append((i, round(t, 4))),
    )
    assert len(calls) == 10
    assert seen == [(1, 0.2), (2, 0.4), (3, 0.6), (4, 0.8), (5, 1.0)]
    calls.clear()
    sample(v, np.zeros((1, 1, 2, 2), np.float32), np.zeros(1, np.int64), 5, "euler")
    assert len(calls) == 5


def test_bad_inputs():
    with pytest.raises(ValueError, match="unknown solver"):
        sample(time_field, np.zeros((1, 1, 2, 2), np.float32), np.zeros(1), 4, "rk45")
    with pytest.raises(ValueError, match="same number of rows"):
        sample(time_field, np.zeros((2, 1, 2, 2), np.float32), np.zeros(3), 4)
