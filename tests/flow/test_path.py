"""The flow-matching path (flow.path): t = 0 is noise, t = 1 is data, the target is x - noise, and the torch
helpers compute the same thing as the numpy ones."""

from __future__ import annotations

import numpy as np
import pytest

from flow.path import flow_pair, interpolate, mse, sample_time, target_velocity, torch_flow_batch, torch_flow_loss


def test_the_path_runs_from_noise_at_t0_to_data_at_t1():
    rng = np.random.default_rng(0)
    x = rng.uniform(-1, 1, (3, 1, 4, 4)).astype(np.float32)
    noise = rng.standard_normal(x.shape).astype(np.float32)
    np.testing.assert_array_equal(interpolate(x, noise, np.zeros(3, np.float32)), noise)
    np.testing.assert_array_equal(interpolate(x, noise, np.ones(3, np.float32)), x)
    t = np.array([0.25, 0.5, 0.75], np.float32)  # per row
    np.testing.assert_allclose(interpolate(x, noise, t)[1], 0.5 * noise[1] + 0.5 * x[1], rtol=1e-6)
    # the target is the path's (constant) velocity: d x_t / dt = x - noise
    v = target_velocity(x, noise)
    h = np.float32(1e-2)
    fd = (interpolate(x, noise, t + h) - interpolate(x, noise, t)) / h
    np.testing.assert_allclose(fd, v, atol=2e-3)


def test_flow_pair_draws_float32_t_in_the_unit_interval():
    x = np.zeros((64, 1, 2, 2), np.float32)
    x_t, t, v = flow_pair(x, np.random.default_rng(1))
    assert x_t.dtype == t.dtype == v.dtype == np.float32 and t.shape == (64,)
    assert 0.0 <= t.min() and t.max() < 1.0
    np.testing.assert_allclose(x_t, -(1 - t)[:, None, None, None] * v, rtol=1e-6)  # x = 0: x_t = (1-t) noise
    assert sample_time(np.random.default_rng(2), 5).dtype == np.float32
    assert mse(np.ones(4), np.zeros(4)) == 1.0


def test_the_torch_helpers_match_the_numpy_path():
    torch = pytest.importorskip("torch")
    x = torch.rand(8, 1, 4, 4) * 2 - 1
    x_t, t, v = torch_flow_batch(x, torch.Generator().manual_seed(0))
    noise = x - v
    np.testing.assert_allclose(x_t.numpy(), interpolate(x.numpy(), noise.numpy(), t.numpy()), atol=1e-6)

    def perfect(x_t, t, y):  # the exact velocity of this batch, given the same generator
        return v

    loss = torch_flow_loss(perfect, x, torch.zeros(8, dtype=torch.long), torch.Generator().manual_seed(0))
    assert loss.dtype == torch.float32 and float(loss) == 0.0
