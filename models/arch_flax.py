"""The flax half of `models.arch`: build the flax expert (`unet_flax.UNet` or `dit_flax.DiT`) for a config or
checkpoint meta dict. Separate from `models.arch` so torch-only workers never import flax.

    model = build_flax(meta)                                  # a flax.linen Module, no parameters
    params = torch_to_flax_params(state, config_from_meta(meta))
    v = model.apply({"params": params}, x, t, y)              # x [B, C, H, W], t [B], y [B] -> [B, C, H, W]
"""

from __future__ import annotations

from typing import Any

from .arch import as_config
from .config import DiTConfig


def build_flax(spec: Any):
    """flax module for a UNetConfig / DiTConfig / checkpoint meta dict (parameters come from `init` or a
    checkpoint via `models.checkpoint.torch_to_flax_params`)."""
    cfg = as_config(spec)
    if isinstance(cfg, DiTConfig):
        from .dit_flax import DiT

        return DiT(cfg)
    from .unet_flax import UNet

    return UNet(cfg)


def count_params(params) -> int:
    """Number of scalars in a flax params tree (either architecture)."""
    import jax

    return sum(int(p.size) for p in jax.tree_util.tree_leaves(params))
