"""Pieces both DiT implementations share, numpy only (no torch, no jax): the fixed 2-D sin-cos position
embedding and the LayerNorm epsilon, so `dit_torch` and `dit_flax` compute the same numbers."""

from __future__ import annotations

import numpy as np

LN_EPS = 1e-6  # DiT's LayerNorm epsilon (torch's default would be 1e-5)


def sincos_pos_embed(dim: int, grid: int) -> np.ndarray:
    """Fixed 2-D sin-cos position embedding [grid * grid, dim] float32 (MAE / DiT layout: the first half of the
    channels encodes the column (w), the second half the row (h); each half is [sin | cos] over dim / 4
    frequencies 1 / 10000**(k / (dim / 4))). Token order is row-major, as the patch flattening."""
    quarter = dim // 4
    omega = 1.0 / 10000 ** (np.arange(quarter, dtype=np.float64) / quarter)
    hh, ww = np.meshgrid(np.arange(grid, dtype=np.float64), np.arange(grid, dtype=np.float64), indexing="ij")

    def one(pos):
        out = pos.reshape(-1)[:, None] * omega[None, :]
        return np.concatenate([np.sin(out), np.cos(out)], axis=1)

    return np.concatenate([one(ww), one(hh)], axis=1).astype(np.float32)


def attention_flops(cfg) -> int:
    """FLOPs per image of a DiT's attention matmuls (q k^T and weights v: 2 x 2 T^2 D per block, T tokens,
    D = hidden_size), which torch's FlopCounterMode does not see inside CPU scaled_dot_product_attention."""
    tokens = cfg.grid**2
    return 4 * tokens * tokens * cfg.hidden_size * cfg.depth
