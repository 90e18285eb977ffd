"""DiT in flax.linen: the same network as `dit_torch.DiT`, for JAX backends and the JAX trainer.

Public call as the torch model: __call__(x [B, C, H, W], t [B] in [0, 1], y [B] int) -> v [B, C, H, W]; the
patch embedding runs NHWC internally (what flax convolutions expect), the rest works on tokens [B, T, D].

Parameter tree <-> torch state_dict names (rule in `models.checkpoint.torch_to_flax_params`):

    torch key                        flax path                        transform
    patch_embed.weight [D, C, p, p]  patch_embed/kernel [p, p, C, D]  transpose (2, 3, 1, 0)
    blocks.0.attn.qkv.weight [O, I]  blocks_0/attn/qkv/kernel [I, O]  transpose
    class_emb.weight [N, D]          class_emb/embedding [N, D]       none
    *.bias                           */bias                           none

LayerNorms have no parameters; the position embedding is a constant, not a parameter.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from .config import DiTConfig
from .dit_common import LN_EPS, sincos_pos_embed
from .unet_flax import timestep_embedding

_zeros = nn.initializers.zeros


def _layer_norm(x):
    """LayerNorm over the last axis without parameters, computed as torch's F.layer_norm (two-pass variance)."""
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + LN_EPS)


def _modulate(x, shift, scale):
    return x * (1 + scale[:, None, :]) + shift[:, None, :]


class Attention(nn.Module):
    """Multi-head self-attention [B, T, D] -> [B, T, D] (as `dit_torch.Attention`)."""

    num_heads: int

    @nn.compact
    def __call__(self, x):
        b, n, d = x.shape
        hd = d // self.num_heads
        qkv = nn.Dense(3 * d, name="qkv")(x).reshape(b, n, 3, self.num_heads, hd)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]  # [B, T, heads, hd]
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(jnp.asarray(hd, x.dtype))
        weights = jax.nn.softmax(logits.astype(jnp.float32), axis=-1).astype(x.dtype)
        out = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b, n, d)
        return nn.Dense(d, name="proj")(out)


class Mlp(nn.Module):
    hidden: int

    @nn.compact
    def __call__(self, x):
        h = nn.gelu(nn.Dense(self.hidden, name="fc1")(x), approximate=True)
        return nn.Dense(x.shape[-1], name="fc2")(h)


class DiTBlock(nn.Module):
    """adaLN-Zero block: h [B, T, D], c [B, D] -> [B, T, D] (as `dit_torch.DiTBlock`)."""

    num_heads: int
    mlp_hidden: int

    @nn.compact
    def __call__(self, h, c):
        d = h.shape[-1]
        mod = nn.Dense(6 * d, kernel_init=_zeros, bias_init=_zeros, name="ada")(nn.silu(c))
        shift_a, scale_a, gate_a, shift_m, scale_m, gate_m = jnp.split(mod, 6, axis=1)
        h = h + gate_a[:, None, :] * Attention(self.num_heads, name="attn")(_modulate(_layer_norm(h), shift_a, scale_a))
        return h + gate_m[:, None, :] * Mlp(self.mlp_hidden, name="mlp")(_modulate(_layer_norm(h), shift_m, scale_m))


class FinalLayer(nn.Module):
    out: int

    @nn.compact
    def __call__(self, h, c):
        d = h.shape[-1]
        shift, scale = jnp.split(
            nn.Dense(2 * d, kernel_init=_zeros, bias_init=_zeros, name="ada")(nn.silu(c)), 2, axis=1
        )
        return nn.Dense(self.out, kernel_init=_zeros, bias_init=_zeros, name="linear")(
            _modulate(_layer_norm(h), shift, scale)
        )


class DiT(nn.Module):
    """Class-conditional velocity model: __call__(x [B,C,H,W], t [B], y [B] int) -> v [B,C,H,W].

    y = -1 selects the null row when cfg.null_label; without it nothing checks -1 inside jit, so callers
    (the worker) must validate labels first (as `unet_flax.UNet`).
    """

    cfg: DiTConfig

    @nn.compact
    def __call__(self, x, t, y):
        cfg = self.cfg
        d, p, g = cfg.hidden_size, cfg.patch_size, cfg.grid
        te = timestep_embedding(t, cfg.time_freq_dim)
        te = nn.Dense(d, name="time_fc2")(nn.silu(nn.Dense(d, name="time_fc1")(te)))
        y = y.astype(jnp.int32)
        if cfg.null_label:
            y = jnp.where(y < 0, cfg.num_classes, y)
        c = te + nn.Embed(cfg.num_classes + int(cfg.null_label), d, name="class_emb")(y)

        h = jnp.transpose(x, (0, 2, 3, 1))  # NCHW -> NHWC
        h = nn.Conv(d, (p, p), strides=(p, p), padding="VALID", name="patch_embed")(h)  # [B, g, g, D]
        h = h.reshape(h.shape[0], g * g, d) + jnp.asarray(sincos_pos_embed(d, g), h.dtype)[None]
        for i in range(cfg.depth):
            h = DiTBlock(cfg.num_heads, cfg.mlp_hidden, name=f"blocks_{i}")(h, c)
        h = FinalLayer(p * p * cfg.in_channels, name="final")(h, c)  # [B, T, p*p*C]
        h = h.reshape(h.shape[0], g, g, p, p, cfg.in_channels)
        return jnp.einsum("bhwpqc->bchpwq", h).reshape(h.shape[0], cfg.in_channels, g * p, g * p)


def _init(cfg: DiTConfig, key):
    x = jnp.zeros((1, cfg.in_channels, cfg.image_size, cfg.image_size), jnp.float32)
    return DiT(cfg).init(key, x, jnp.zeros((1,)), jnp.zeros((1,), jnp.int32))["params"]


def init_params(cfg: DiTConfig, seed: int = 0) -> dict:
    """Fresh parameters for `DiT(cfg)` (flax default initialisers; adaLN and final layer zero), under jit."""
    return jax.jit(lambda key: _init(cfg, key))(jax.random.PRNGKey(seed))


def param_shapes(cfg: DiTConfig) -> dict:
    """The params tree of `DiT(cfg)` as jax.ShapeDtypeStruct leaves (traced, nothing computed)."""
    return jax.eval_shape(lambda key: _init(cfg, key), jax.random.PRNGKey(0))


def count_params(params) -> int:
    return sum(int(p.size) for p in jax.tree_util.tree_leaves(params))
