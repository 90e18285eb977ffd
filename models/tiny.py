"""Tiny random-init checkpoints in the shipped formats, for exercising the serving path cheaply.

One factory for tests, the fuzzer and the benchmarks: real model code and real files (the same
safetensors + JSON a trained expert ships as), small enough that a forward pass costs microseconds
to milliseconds. They are NOT for quality: the weights are random.

    make_tiny_expert(path, expert_id=0)              -> Path of <path>.safetensors
    make_tiny_experts(directory, num_experts=2)      -> [Path, ...] named expert0, expert1, ...
    make_tiny_router(path, num_experts=2)            -> Path of <path>.safetensors (in_channels=3, ...)
    make_tiny_dit(path, expert_id=0)                 -> Path of <path>.safetensors (a DiT expert, "arch": "dit")

Every call with the same arguments writes the same weights (seeded), so two processes that build
"the same" tiny fleet serve identical velocities.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

TINY_WIDTHS = (8, 16)


def tiny_config(
    widths: Sequence[int] = TINY_WIDTHS,
    *,
    time_dim: int = 16,
    class_dim: int = 16,
    groups: int = 4,
    null_label: bool = False,
    **shape: int,
):
    """The UNetConfig the factory uses: channel `widths` per level, small embeddings; `null_label`
    adds the unknown-label row (y = -1), as `train-expert --label-dropout` does; `shape` overrides
    in_channels / image_size / num_classes (default 1 x 32 x 32, 10 classes)."""
    from .config import UNetConfig

    return UNetConfig(
        widths=tuple(int(w) for w in widths),
        time_dim=time_dim,
        class_dim=class_dim,
        groups=groups,
        null_label=null_label,
        **shape,
    )


def make_tiny_expert(
    path: str | os.PathLike,
    *,
    expert_id: int = 0,
    widths: Sequence[int] = TINY_WIDTHS,
    seed: int | None = None,
    jitter: float = 0.0,
    classes: Sequence[int] | None = None,
    dtype: str = "float32",
    **config: Any,
) -> Path:
    """Write one random-init expert checkpoint and return its ``.safetensors`` path.

    ``seed`` defaults to ``100 + expert_id``; ``jitter`` adds ``jitter * N(0, 1)`` to every
    parameter (random-init UNets output near-constant velocities; jitter makes experts differ
    visibly); ``classes`` goes into the meta's partition summary (what the oracle strategy and
    evaluation read); ``config`` overrides `tiny_config` keywords (time_dim, class_dim, groups).
    """
    import torch

    from .checkpoint import save_checkpoint, torch_state_to_numpy
    from .unet_torch import UNet

    cfg = tiny_config(widths, **config)
    torch.manual_seed(100 + expert_id if seed is None else seed)
    model = UNet(cfg)
    if jitter:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(jitter * torch.randn_like(p))
    meta: dict[str, Any] = {"config": cfg.to_dict(), "expert_id": int(expert_id)}
    if classes is not None:
        meta["partition"] = {"classes": [int(c) for c in classes]}
    return save_checkpoint(path, torch_state_to_numpy(model.state_dict()), meta, dtype=dtype)


def tiny_dit_config(
    *,
    image_size: int = 32,
    patch_size: int = 4,
    hidden_size: int = 32,
    depth: int = 2,
    num_heads: int = 2,
    null_label: bool = False,
    **config: Any,
):
    """The DiTConfig `make_tiny_dit` uses: 8x8 tokens of width 32, two blocks (keywords override, e.g.
    in_channels=3, mlp_ratio=2.0)."""
    from .config import DiTConfig

    return DiTConfig(
        image_size=image_size,
        patch_size=patch_size,
        hidden_size=hidden_size,
        depth=depth,
        num_heads=num_heads,
        null_label=null_label,
        **config,
    )


def make_tiny_dit(
    path: str | os.PathLike,
    *,
    expert_id: int = 0,
    seed: int | None = None,
    jitter: float = 0.05,
    classes: Sequence[int] | None = None,
    dtype: str = "float32",
    **config: Any,
) -> Path:
    """Write one random-init DiT expert checkpoint ("arch": "dit") and return its ``.safetensors`` path.

    As `make_tiny_expert`, except ``jitter`` defaults to 0.05: a freshly initialised DiT outputs exactly zero
    (adaLN-Zero), so the jitter is what makes its velocity non-trivial; ``config`` overrides `tiny_dit_config`.
    """
    import torch

    from .checkpoint import save_checkpoint, torch_state_to_numpy
    from .dit_torch import DiT

    cfg = tiny_dit_config(**config)
    torch.manual_seed(100 + expert_id if seed is None else seed)
    model = DiT(cfg)
    if jitter:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(jitter * torch.randn_like(p))
    meta: dict[str, Any] = {"arch": "dit", "config": cfg.to_dict(), "expert_id": int(expert_id)}
    if classes is not None:
        meta["partition"] = {"classes": [int(c) for c in classes]}
    return save_checkpoint(path, torch_state_to_numpy(model.state_dict()), meta, dtype=dtype)


def make_tiny_experts(
    directory: str | os.PathLike,
    num_experts: int = 2,
    *,
    prefix: str = "expert",
    split_classes: bool = True,
    **kwargs: Any,
) -> list[Path]:
    """``num_experts`` tiny experts ``<directory>/<prefix><k>``; with ``split_classes`` the ten
    digits are dealt out in contiguous blocks (2 experts: 0-4 | 5-9), as the shipped partition."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    out = []
    for k in range(num_experts):
        classes = None
        if split_classes:
            lo, hi = (10 * k) // num_experts, (10 * (k + 1)) // num_experts
            classes = list(range(lo, hi))
        out.append(make_tiny_expert(directory / f"{prefix}{k}", expert_id=k, classes=classes, **kwargs))
    return out


def make_tiny_router(
    path: str | os.PathLike,
    num_experts: int = 2,
    *,
    seed: int = 5,
    width: int = 8,
    emb_dim: int = 16,
    meta: dict[str, Any] | None = None,
    **shape: int,
) -> Path:
    """Write a random-init RouterNet in the shipped router format; returns the ``.safetensors`` path.
    ``shape`` overrides the RouterConfig's in_channels / image_size / num_classes (default 1 x 32 x 32,
    10 classes); ``meta`` adds to its JSON (e.g. ``{"spec": spec.to_json()}`` to name the classes)."""
    import torch

    from .router import RouterConfig, RouterNet, save_router

    torch.manual_seed(seed)
    net = RouterNet(cfg=RouterConfig(num_experts=num_experts, width=width, emb_dim=emb_dim, **shape))
    return save_router(path, net, {"tiny": True, **(meta or {})})
