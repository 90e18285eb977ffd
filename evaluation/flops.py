"""Forward-pass FLOPs of an expert and of the router, counted by torch's FlopCounterMode.

FLOPs here are what torch counts for matmuls and convolutions (2 per multiply-add) at batch 1, plus a
DiT's attention matmuls (`models.dit_common.attention_flops`, which the counter misses on CPU);
norms and activations are ignored (a few percent for these nets). Per-image inference cost is
then steps x (router + experts-used-per-step x expert).
"""

from __future__ import annotations

import os
from functools import cache


def _count(module, *inputs) -> int:
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    with torch.inference_mode(), FlopCounterMode(display=False) as counter:
        module(*inputs)
    return int(counter.get_total_flops())


@cache
def expert_flops(checkpoint: str | os.PathLike) -> int:
    """FLOPs of one expert forward at batch 1 (architecture from the checkpoint's JSON)."""
    import torch

    from models.arch import build_torch, config_from_meta
    from models.checkpoint import load_meta

    cfg = config_from_meta(load_meta(checkpoint))
    from models.config import DiTConfig
    from models.dit_common import attention_flops

    model = build_torch(cfg).eval()
    x = torch.zeros(1, cfg.in_channels, cfg.image_size, cfg.image_size)
    attention = attention_flops(cfg) if isinstance(cfg, DiTConfig) else 0
    return _count(model, x, torch.full((1,), 0.5), torch.zeros(1, dtype=torch.long)) + attention


@cache
def router_flops(router_path: str | os.PathLike) -> int:
    """FLOPs of one router forward at batch 1."""
    import torch

    from models.router import Router

    r = Router.load(router_path)
    return _count(r.net, torch.zeros(1, 1, 32, 32), torch.full((1,), 0.5), torch.zeros(1, dtype=torch.long))


def training_flops(checkpoint: str | os.PathLike) -> float:
    """Approximate training FLOPs: 3 x forward x images seen (forward + backward = 3 forwards)."""
    from models.checkpoint import load_meta

    tr = load_meta(checkpoint).get("training", {})
    images = int(tr.get("steps", 0)) * int(tr.get("batch_size", 0))
    return 3.0 * expert_flops(checkpoint) * images
