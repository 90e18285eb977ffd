"""Fixtures for the coordinator tests: the tiny fleet's checkpoint files (see helpers.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.coordinator.helpers import make_tiny_experts, make_tiny_router


@pytest.fixture(scope="session")
def tiny_experts(tmp_path_factory) -> list[Path]:
    """Two tiny jittered experts (classes 0-4 | 5-9); the ``.safetensors`` paths, shared read-only."""
    return make_tiny_experts(tmp_path_factory.mktemp("coord-experts"), 2)


@pytest.fixture(scope="session")
def tiny_router(tmp_path_factory) -> Path:
    """A tiny random-init router over two experts; its ``.safetensors`` path, shared read-only."""
    return make_tiny_router(tmp_path_factory.mktemp("coord-router") / "router", 2)


@pytest.fixture(scope="module")
def experts(tiny_experts):
    """`tiny_experts` for a module whose workers run in this process, with torch on one intra-op thread
    meanwhile (on a shared 2-core box spinning OpenMP threads make a tiny forward up to 100x slower)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield tiny_experts
    torch.set_num_threads(threads)
