"""Shared helpers for coordinator integration tests: tiny real expert checkpoints, a small router."""

from __future__ import annotations

from pathlib import Path

import numpy as np

TINY_WIDTHS = (8, 16, 32)


def make_tiny_experts(directory: Path, num_experts: int = 2) -> list[Path]:
    """Random-init tiny UNet expert checkpoints (real files in the shipped format)."""
    import torch

    from workers.checkpoint import save_checkpoint, torch_state_to_numpy
    from workers.models.config import UNetConfig
    from workers.models.unet_torch import UNet

    cfg = UNetConfig(widths=TINY_WIDTHS, time_dim=16, class_dim=16)
    paths = []
    for k in range(num_experts):
        torch.manual_seed(100 + k)
        model = UNet(cfg)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * torch.randn_like(p))
        meta = {"config": cfg.to_dict(), "expert_id": k, "partition": {"classes": list(range(5 * k, 5 * k + 5))}}
        paths.append(save_checkpoint(directory / f"expert{k}", torch_state_to_numpy(model.state_dict()), meta))
    return paths


class ClassRouter:
    """weights(x_t [B,C,H,W], t [B], y [B]) -> [B, K]: 0.8 on the owner of y (classes split evenly)."""

    def __init__(self, num_experts: int = 2, prefer: dict[int, int] | None = None):
        self.k = num_experts
        self.prefer = prefer or {}

    def weights(self, x_t, t, y):
        y = np.asarray(y)
        owner = np.array([self.prefer.get(int(c), int(c) * self.k // 10) for c in y])
        w = np.full((len(y), self.k), 0.2 / max(self.k - 1, 1))
        w[np.arange(len(y)), owner] = 0.8
        return w
