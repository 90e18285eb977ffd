"""The web viewer in real headless Chromium (Debian's /usr/bin/chromium driven by Playwright).

These tests fail, never skip, when Chromium is missing: CI installs it (.ci/run).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from aiohttp.test_utils import TestServer

from web.app import WebConfig, create_app
from web_fakes import FakeCoordinator

CHROMIUM = os.environ.get("DDM_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
DOCS_SCREENSHOT = Path(__file__).resolve().parent.parent / "docs" / "web.png"


@pytest.fixture
async def browser():
    if not os.path.exists(CHROMIUM):
        pytest.fail(f"Chromium not found at {CHROMIUM}: install it with `apt-get install -y chromium` "
                    "(or point DDM_CHROMIUM at a Chromium binary); browser tests do not skip")
    from playwright.async_api import async_playwright

    async with async_playwright() as pw:
        b = await pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            yield b
        finally:
            await b.close()


@pytest.fixture
async def web_server(nats_url):
    server = TestServer(create_app(WebConfig(nats_url=nats_url, fleet_interval=0.5, discovery_window=0.15)),
                        host="127.0.0.1")
    await server.start_server()
    yield server
    await server.close()


async def open_page(browser, server):
    page = await browser.new_page(viewport={"width": 1280, "height": 900})
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    await page.goto(str(server.make_url("/")))
    await page.wait_for_selector("#conn[data-state=open]", timeout=10_000)
    return page, errors


async def test_page_bad_input_then_generate_with_fake_coordinator(browser, web_server, nc, tmp_path):
    async with FakeCoordinator(nc, frame_delay=0.05):
        page, errors = await open_page(browser, web_server)
        # bad input: a visible error, and the page keeps working
        await page.fill("#digits", "3,x,7")
        await page.click("#generate")
        err = page.locator("#errors li").first
        await err.wait_for(timeout=5_000)
        assert "'x' is not a digit" in await err.inner_text()
        await page.check("input[name=mode][value=count]")
        await page.fill("#count", "10000")
        await page.click("#generate")
        await page.wait_for_function("document.querySelector('#errors li').textContent.includes('256')", timeout=5_000)
        await page.fill("#steps", "0")
        await page.check("input[name=mode][value=digits]")
        await page.fill("#digits", "1")
        await page.click("#generate")
        await page.wait_for_function("document.querySelector('#errors li').textContent.includes('steps')", timeout=5_000)
        # a good job: tiles fill in, frames stream, final images come with PNG links
        await page.fill("#digits", "1,6,9")
        await page.fill("#steps", "20")
        await page.click("#generate")
        job = page.locator(".job[data-state=done]")
        await job.wait_for(timeout=15_000)
        assert int(await job.get_attribute("data-frames")) >= 1
        assert await job.locator(".tile canvas").count() == 3
        colours = await job.locator(".tile canvas").evaluate_all("cs => cs.map(c => c.dataset.expert)")
        assert colours == ["0", "1", "1"]
        assert await job.locator(".tile a.download").count() == 3
        png = await job.locator(".tile canvas").first.evaluate("c => c.toDataURL('image/png')")
        assert png.startswith("data:image/png;base64,")
        await page.screenshot(path=str(tmp_path / "web-fake.png"), full_page=True)
        if os.environ.get("DDM_WEB_SHOT_DIR"):
            await page.screenshot(path=os.path.join(os.environ["DDM_WEB_SHOT_DIR"], "web-fake.png"), full_page=True)
        assert errors == [], errors
        await page.close()


async def test_closing_the_tab_cancels_its_job(browser, web_server, nc):
    async with FakeCoordinator(nc, frame_delay=0.05) as coordinator:
        page, _ = await open_page(browser, web_server)
        await page.fill("#digits", "2,2")
        await page.fill("#steps", "500")
        await page.click("#generate")
        running = page.locator(".job[data-state=running]")
        await running.wait_for(timeout=10_000)
        job_id = await running.get_attribute("data-job-id")
        await page.close()
        import asyncio

        for _ in range(100):
            if job_id in coordinator.cancelled:
                break
            await asyncio.sleep(0.05)
        assert job_id in coordinator.cancelled
