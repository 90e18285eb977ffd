"""The one solver implementation against analytic flows, the row groups that step with it, and the PNG grid writer."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from coordinator.rows import RowGroup, initial_noise
from coordinator.solver import (euler_step, euler_update, heun_correct, heun_predict, heun_step, sample, step_dt,
                                time_grid)
from infra.grid import make_grid, to_uint8, write_grid


def linear_field(a: float):
    """dx/dt = a * x  ->  x(1) = x(0) * exp(a)."""
    def v(x, t, y):
        assert x.shape[0] == t.shape[0] == y.shape[0]
        return (a * x).astype(np.float32)
    return v


def time_field(x, t, y):
    """dx/dt = 2 t (per row t)  ->  x(1) = x(0) + 1; Euler is off by 1/steps, Heun exact."""
    return np.broadcast_to((2 * t).reshape(-1, 1, 1, 1), x.shape).astype(np.float32)


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
    sample(v, np.zeros((1, 1, 2, 2), np.float32), np.zeros(1, np.int64), 5, "heun",
           callback=lambda i, x, t: seen.append((i, round(t, 4))))
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
    assert 2 ** order * 0.9 < ratio < 2 ** order * 1.1


def test_heun_row_group_is_exact_for_a_linear_in_t_field():
    g = RowGroup(job_id="t", y=[0, 1], x=np.zeros((2, 1, 2, 2), np.float32), steps=8, solver="heun")
    step_rows(g, time_field)
    np.testing.assert_allclose(g.x, 1.0, atol=1e-6)  # x(1) = x(0) + 1


def test_grid_png(tmp_path):
    imgs = np.linspace(-1, 1, 6 * 32 * 32, dtype=np.float32).reshape(6, 1, 32, 32)
    assert to_uint8(imgs)[0, 0, 0] == 0 and to_uint8(imgs)[-1, -1, -1] == 255
    assert to_uint8(np.full((1, 1, 2, 2), 5.0))[0, 0, 0] == 255  # clipped
    g = make_grid(imgs, nrow=3, pad=2)
    assert g.shape == (2 * 34 + 2, 3 * 34 + 2)
    path = write_grid(tmp_path / "g.png", imgs, nrow=3, row_labels=["a", "b"], scale=2)
    im = Image.open(path)
    assert im.mode == "L" and im.size[1] == 2 * 66 + 2 and im.size[0] > 3 * 66
    # plain grid (no labels) reproduces the pixels
    path = write_grid(tmp_path / "h.png", imgs, nrow=3, scale=1)
    np.testing.assert_array_equal(np.asarray(Image.open(path)), g)
    with pytest.raises(ValueError, match="row labels"):
        write_grid(tmp_path / "x.png", imgs, nrow=3, row_labels=["only one"])
    with pytest.raises(ValueError):
        to_uint8(np.zeros((2, 3, 8, 8)))
