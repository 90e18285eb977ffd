"""SmallConditionalUNet in flax.linen: the same network as `unet_torch.UNet`, for JAX backends.

The public call takes NCHW arrays like the torch model (x [B, C, H, W], t [B], y [B] -> v [B, C, H, W]);
internally it runs NHWC, which is what flax convolutions expect.

Parameter tree <-> torch state_dict names (rule implemented in `models.checkpoint.torch_to_flax_params`):

    torch key                       flax path                       transform
    enc.0.conv1.weight [O,I,kh,kw]  enc_0/conv1/kernel [kh,kw,I,O]  transpose (2, 3, 1, 0)
    time_fc1.weight [O, I]          time_fc1/kernel [I, O]          transpose
    enc.0.norm1.weight [C]          enc_0/norm1/scale [C]           none
    class_emb.weight [N, D]         class_emb/embedding [N, D]      none
    *.bias                          */bias                          none

i.e. a ModuleList index `name.i` becomes the flax module name `name_i`, and the leaf name follows the
layer type (Conv/Dense `kernel`, GroupNorm `scale`, Embed `embedding`).
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax.numpy as jnp

from .config import UNetConfig

GN_EPS = 1e-5  # torch.nn.GroupNorm default; flax's default is 1e-6


def timestep_embedding(t, dim: int):
    """Sinusoidal embedding of t in [0, 1]: t [B] -> [B, dim], identical to the torch version."""
    half = dim // 2
    freqs = jnp.exp(-math.log(10000.0) * jnp.arange(half, dtype=jnp.float32) / half)
    args = t.astype(jnp.float32)[:, None] * 1000.0 * freqs[None, :]
    return jnp.concatenate([jnp.sin(args), jnp.cos(args)], axis=1)


def _conv(features: int, k: int, name: str) -> nn.Conv:
    pad = (k - 1) // 2
    return nn.Conv(features, (k, k), padding=((pad, pad), (pad, pad)), name=name)


class ResBlock(nn.Module):
    """x [B, H, W, cin] (NHWC), emb [B, emb_dim] -> [B, H, W, cout]."""

    cout: int
    groups: int

    @nn.compact
    def __call__(self, x, emb):
        cin = x.shape[-1]
        h = _conv(self.cout, 3, "conv1")(nn.silu(nn.GroupNorm(self.groups, epsilon=GN_EPS, name="norm1")(x)))
        h = h + nn.Dense(self.cout, name="emb_proj")(nn.silu(emb))[:, None, None, :]
        h = _conv(self.cout, 3, "conv2")(nn.silu(nn.GroupNorm(self.groups, epsilon=GN_EPS, name="norm2")(h)))
        skip = _conv(self.cout, 1, "skip")(x) if cin != self.cout else x
        return h + skip


class UNet(nn.Module):
    """Class-conditional velocity model: __call__(x [B,C,H,W], t [B], y [B] int) -> v [B,C,H,W].

    y = -1 (unknown) selects the null row when cfg.null_label (as `unet_torch.UNet`); without it
    nothing checks -1 inside jit, so callers (the worker) must validate labels first.
    """

    cfg: UNetConfig

    @nn.compact
    def __call__(self, x, t, y):
        cfg = self.cfg
        w, g = cfg.widths, cfg.groups
        te = timestep_embedding(t, cfg.time_dim)
        te = nn.Dense(cfg.time_dim, name="time_fc2")(nn.silu(nn.Dense(cfg.time_dim, name="time_fc1")(te)))
        y = y.astype(jnp.int32)
        if cfg.null_label:  # y = -1 (unknown) -> the extra last row, as the torch model
            y = jnp.where(y < 0, cfg.num_classes, y)
        ce = nn.Embed(cfg.num_classes + int(cfg.null_label), cfg.class_dim, name="class_emb")(y)
        emb = jnp.concatenate([te, ce], axis=1)

        h = jnp.transpose(x, (0, 2, 3, 1))  # NCHW -> NHWC
        h = _conv(w[0], 3, "conv_in")(h)
        skips = []
        for i, wi in enumerate(w):
            h = ResBlock(wi, g, name=f"enc_{i}")(h, emb)
            skips.append(h)
            h = nn.avg_pool(h, (2, 2), strides=(2, 2))
        for i in range(2):
            h = ResBlock(w[-1], g, name=f"mid_{i}")(h, emb)
        for i in reversed(range(len(w))):
            h = jnp.repeat(jnp.repeat(h, 2, axis=1), 2, axis=2)
            h = ResBlock(w[i], g, name=f"dec_{i}")(jnp.concatenate([h, skips[i]], axis=-1), emb)
        h = nn.GroupNorm(g, epsilon=GN_EPS, name="norm_out")(h)
        h = _conv(cfg.in_channels, 3, "conv_out")(nn.silu(h))
        return jnp.transpose(h, (0, 3, 1, 2))  # NHWC -> NCHW


def _init(cfg: UNetConfig, key):
    x = jnp.zeros((1, cfg.in_channels, cfg.image_size, cfg.image_size), jnp.float32)
    return UNet(cfg).init(key, x, jnp.zeros((1,)), jnp.zeros((1,), jnp.int32))["params"]


def init_params(cfg: UNetConfig, seed: int = 0) -> dict:
    """Fresh random parameters for `UNet(cfg)` (the `params` collection), initialised under jit."""
    import jax

    return jax.jit(lambda key: _init(cfg, key))(jax.random.PRNGKey(seed))


def param_shapes(cfg: UNetConfig) -> dict:
    """The params tree of `UNet(cfg)` as jax.ShapeDtypeStruct leaves (traced, nothing computed)."""
    import jax

    return jax.eval_shape(lambda key: _init(cfg, key), jax.random.PRNGKey(0))


def count_params(params) -> int:
    import jax

    return sum(int(p.size) for p in jax.tree_util.tree_leaves(params))
