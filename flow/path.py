"""Flow-matching path and loss, shared by every trainer (numpy reference + torch version).

Convention (schemas.TIME_CONVENTION = "t0_noise_t1_data"):

    x_t = (1 - t) * noise + t * x        t in [0, 1], t = 0 pure noise, t = 1 data
    v   = x - noise                      the (constant-in-t) target velocity
    loss = mean((v_pred - v)**2)

Sampling integrates dx/dt = v(x, t, y) from t = 0 to t = 1 (flow/solver.py).
The JAX trainer can use the numpy helpers (they are plain array arithmetic, so they also work on jax arrays).
"""

from __future__ import annotations

import numpy as np


def _bcast(t, x):
    """Reshape t [B] to [B, 1, ..., 1] so it broadcasts against x [B, ...]."""
    return t.reshape((t.shape[0],) + (1,) * (x.ndim - 1))


def interpolate(x, noise, t):
    """x_t = (1 - t) noise + t x.  x, noise [B, C, H, W]; t [B] -> [B, C, H, W]."""
    tb = _bcast(t, x)
    return (1 - tb) * noise + tb * x


def target_velocity(x, noise):
    """v = x - noise, [B, C, H, W]."""
    return x - noise


def sample_time(rng: np.random.Generator, n: int) -> np.ndarray:
    """t ~ U[0, 1), float32 [n]."""
    return rng.random(n, dtype=np.float32)


def flow_pair(x: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Draw noise and t for a data batch x [B, C, H, W] -> (x_t [B,C,H,W], t [B], v_target [B,C,H,W])."""
    noise = rng.standard_normal(x.shape, dtype=np.float32)
    t = sample_time(rng, x.shape[0])
    return interpolate(x, noise, t).astype(np.float32), t, target_velocity(x, noise).astype(np.float32)


def mse(v_pred, v_target):
    """Mean squared error over all elements (scalar)."""
    return ((v_pred - v_target) ** 2).mean()


# ------------------------------------------------------------------------------------------------ torch
def torch_flow_batch(x, generator=None):
    """torch version of `flow_pair`: x [B,C,H,W] (any device) -> (x_t, t [B], v_target), same dtype/device."""
    import torch

    noise = torch.randn(x.shape, generator=generator, device=x.device, dtype=x.dtype)
    t = torch.rand(x.shape[0], generator=generator, device=x.device, dtype=x.dtype)
    return interpolate(x, noise, t), t, target_velocity(x, noise)


def torch_flow_loss(model, x, y, generator=None):
    """Flow-matching loss of `model(x_t, t, y)` on a data batch x [B,C,H,W], y [B]; scalar fp32 tensor."""
    x_t, t, v = torch_flow_batch(x, generator)
    v_pred = model(x_t, t, y)
    return mse(v_pred.float(), v.float())
