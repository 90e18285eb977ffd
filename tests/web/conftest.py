"""Fixtures for the web tests: the tiny checkpoints a real fleet serves when ./checkpoints is absent, and the
headless Chromium the browser tests drive."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_fleet_files(tmp_path_factory) -> dict[str, list[Path] | Path]:
    """``{"experts": [expert0, expert1], "router": router}``: tiny random-init checkpoints from
    `models.tiny` (UNet widths 8,16,32; classes 0-4 | 5-9), real files in the shipped formats."""
    from models.tiny import make_tiny_experts, make_tiny_router

    d = tmp_path_factory.mktemp("web-fleet")
    return {"experts": make_tiny_experts(d, 2, widths=(8, 16, 32)), "router": make_tiny_router(d / "router", 2)}


CHROMIUM = os.environ.get("DDM_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


@pytest.fixture(scope="session")
async def chromium():
    """One headless Chromium per test process (each pytest-xdist worker has its own), driven by Playwright.
    Tests take it through `browser`, which closes what they opened."""
    if not os.path.exists(CHROMIUM):
        pytest.fail(
            f"Chromium not found at {CHROMIUM}: install it with `apt-get install -y chromium` "
            "(or point DDM_CHROMIUM at a Chromium binary); browser tests do not skip"
        )
    from playwright.async_api import async_playwright

    async with async_playwright() as pw:
        b = await pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            yield b
        finally:
            await b.close()


@pytest.fixture
async def browser(chromium):
    """The session's Chromium for one test. Each page a test opens with `browser.new_page()` lives in a
    browser context of its own (cookies, storage and cache apart from every other test's); the contexts the
    test opened are closed at its end, so no page, socket or download outlives it."""
    before = set(chromium.contexts)
    yield chromium
    for ctx in chromium.contexts:
        if ctx not in before:
            await ctx.close()
