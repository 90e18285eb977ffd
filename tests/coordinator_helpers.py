"""Shared helpers for coordinator integration tests: tiny real expert and router checkpoints."""

from __future__ import annotations

from pathlib import Path


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


def make_tiny_router(path: Path, num_experts: int = 2) -> Path:
    """A random-init small RouterNet saved in the shipped router format."""
    import torch

    from coordinator.router import RouterConfig, RouterNet, save_router

    torch.manual_seed(5)
    return save_router(path, RouterNet(cfg=RouterConfig(num_experts=num_experts, width=8, emb_dim=16)), {"test": True})
