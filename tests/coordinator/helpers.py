"""The tiny fleet the coordinator-level tests share, built with the one factory `models.tiny`.

Coordinator, system and CLI tests want experts that differ visibly (strategies pick between
them), so these use three levels (8, 16, 32) and ``jitter=0.05`` on top of the factory's seeded
random init; the fixtures in tests/coordinator/conftest.py wrap them.
"""

from __future__ import annotations

from pathlib import Path

from models.tiny import make_tiny_expert
from models.tiny import make_tiny_experts as _factory_experts
from models.tiny import make_tiny_router as _factory_router

TINY_WIDTHS = (8, 16, 32)
JITTER = 0.05

__all__ = ["TINY_WIDTHS", "JITTER", "make_tiny_expert", "make_tiny_experts", "make_tiny_router"]


def make_tiny_experts(directory: Path, num_experts: int = 2) -> list[Path]:
    """``num_experts`` tiny experts ``<directory>/expert<k>`` (widths 8,16,32, GroupNorm 8,
    jitter 0.05, classes dealt out 0-4 | 5-9); returns their ``.safetensors`` paths."""
    return _factory_experts(directory, num_experts, widths=TINY_WIDTHS, jitter=JITTER, groups=8)


def make_tiny_router(path: Path, num_experts: int = 2) -> Path:
    """A random-init RouterNet (width 8, emb 16, seed 5) in the shipped router format."""
    return _factory_router(path, num_experts, meta={"test": True})
