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
