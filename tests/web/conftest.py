"""Fixtures for the web tests: the tiny checkpoints a real fleet serves when ./checkpoints is absent."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_fleet_files(tmp_path_factory) -> dict[str, list[Path] | Path]:
    """``{"experts": [expert0, expert1], "router": router}``: tiny random-init checkpoints from
    `models.tiny` (UNet widths 8,16,32; classes 0-4 | 5-9), real files in the shipped formats."""
    from models.tiny import make_tiny_experts, make_tiny_router

    d = tmp_path_factory.mktemp("web-fleet")
    return {"experts": make_tiny_experts(d, 2, widths=(8, 16, 32)), "router": make_tiny_router(d / "router", 2)}
