"""Which expert architecture a checkpoint holds, and one factory to build it (torch side, no flax).

A checkpoint's JSON names its architecture beside its config: "arch": "unet" | "dit" (absent = "unet",
so checkpoints made before DiT existed load unchanged). Everything that builds an expert goes through here
rather than constructing a UNet directly:

    arch_of(meta)            -> "unet" | "dit"
    config_from_meta(meta)   -> UNetConfig | DiTConfig (meta: a checkpoint JSON dict, {"arch", "config"})
    build_torch(spec)        -> unet_torch.UNet | dit_torch.DiT, fresh weights (spec: a meta dict or a config)

The flax counterpart is `models.arch_flax.build_flax` (a separate module so torch-only installs never
import flax). Both models take (x [B, C, H, W] float32, t [B] float32 in [0, 1], y [B] int64) -> v [B, C, H, W].
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from .config import DiTConfig, UNetConfig

ModelConfig = UNetConfig | DiTConfig

#: arch name -> its config class. "unet" is the default for a JSON without "arch".
CONFIGS: dict[str, type] = {"unet": UNetConfig, "dit": DiTConfig}
DEFAULT_ARCH = "unet"


def arch_name(cfg: ModelConfig) -> str:
    """The arch name of a config object ("unet" for UNetConfig, "dit" for DiTConfig)."""
    for name, cls in CONFIGS.items():
        if isinstance(cfg, cls):
            return name
    raise TypeError(
        f"not an expert model config: {type(cfg).__name__} (expected one of "
        f"{', '.join(c.__name__ for c in CONFIGS.values())})"
    )


def arch_of(meta: dict) -> str:
    """meta["arch"] checked against the known architectures; "unet" when absent."""
    arch = meta.get("arch", DEFAULT_ARCH)
    if arch not in CONFIGS:
        raise ValueError(f"unknown arch {arch!r}; known architectures are {', '.join(CONFIGS)}")
    return arch


def config_from_meta(meta: dict) -> ModelConfig:
    """The model config a checkpoint JSON describes: CONFIGS[arch_of(meta)].from_dict(meta["config"]).

    meta["config"] may already be a config object (then it must match meta's arch, if meta names one).
    Raises ValueError (unknown arch, bad or missing config) with the reason.
    """
    if "config" not in meta:
        raise ValueError(f"no 'config' in the checkpoint metadata (keys: {sorted(meta)})")
    cfg = meta["config"]
    if isinstance(cfg, tuple(CONFIGS.values())):
        if "arch" in meta and arch_of(meta) != arch_name(cfg):
            raise ValueError(f"meta says arch {meta['arch']!r} but its config is a {type(cfg).__name__}")
        return cfg
    if not isinstance(cfg, dict):
        raise ValueError(f"'config' must be a JSON object, got {type(cfg).__name__}")
    arch = arch_of(meta)
    try:
        return CONFIGS[arch].from_dict(cfg)
    except (TypeError, ValueError) as err:
        if "arch" not in meta:  # a config of another architecture whose "arch" was left out?
            for other, cls in CONFIGS.items():
                if other != arch and set(cfg) <= {f.name for f in fields(cls)}:
                    raise ValueError(
                        f'{err}; this config looks like a {other} config: add "arch": "{other}" beside it'
                    ) from None
        raise


def as_config(spec: Any) -> ModelConfig:
    """A config object from a config object or a meta dict ({"arch": ..., "config": ...})."""
    if isinstance(spec, tuple(CONFIGS.values())):
        return spec
    if isinstance(spec, dict):
        return config_from_meta(spec)
    raise TypeError(f"expected a UNetConfig, DiTConfig or checkpoint meta dict, got {type(spec).__name__}")


def build_torch(spec: Any):
    """A fresh torch expert for a config or meta dict: `unet_torch.UNet` or `dit_torch.DiT` (train mode,
    CPU, its own initialisation drawn from torch's global RNG)."""
    cfg = as_config(spec)
    if isinstance(cfg, DiTConfig):
        from .dit_torch import DiT

        return DiT(cfg)
    from .unet_torch import UNet

    return UNet(cfg)
