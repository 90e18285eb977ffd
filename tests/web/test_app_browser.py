"""The web viewer in real headless Chromium (Debian's /usr/bin/chromium driven by Playwright).

These tests fail, never skip, when Chromium is missing: CI installs it (.ci/run).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from aiohttp.test_utils import TestServer

from tests.waiting import wait_until
from tests.web.fakes import FakeCoordinator, FakeWorkerService
from web.app import WebConfig, create_app

DOCS_SCREENSHOT = Path(__file__).resolve().parents[2] / "docs" / "web.png"


@pytest.fixture
async def web_server(nats_url):
    server = TestServer(
        create_app(WebConfig(nats_url=nats_url, fleet_interval=0.5, discovery_window=0.15)), host="127.0.0.1"
    )
    await server.start_server()
    yield server
    await server.close()


async def open_page(browser, server):
    page = await browser.new_page(viewport={"width": 1280, "height": 900})
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    await page.goto(str(server.make_url("/")))
    await page.wait_for_selector("#conn[data-state=open]", timeout=30_000)
    return page, errors


async def test_page_bad_input_then_generate_with_fake_coordinator(browser, web_server, nc, tmp_path):
    async with FakeCoordinator(nc, frame_delay=0.05):
        page, errors = await open_page(browser, web_server)
        # bad input: a visible error, and the page keeps working
        await page.fill("#digits", "3,x,7")
        await page.click("#generate")
        err = page.locator("#errors li").first
        await err.wait_for(timeout=20_000)
        assert "'x' is not a digit" in await err.inner_text()
        await page.check("input[name=mode][value=count]")
        await page.fill("#count", "10000")
        await page.click("#generate")
        await page.wait_for_function(
            "() => document.querySelector('#errors li').textContent.includes('256')", timeout=20_000
        )
        await page.fill("#steps", "0")
        await page.check("input[name=mode][value=digits]")
        await page.fill("#digits", "1")
        await page.click("#generate")
        await page.wait_for_function(
            "() => document.querySelector('#errors li').textContent.includes('steps')", timeout=20_000
        )
        # a good job: tiles fill in, frames stream, final images come with PNG links
        await page.fill("#digits", "1,6,9")
        await page.fill("#steps", "20")
        await page.click("#generate")
        job = page.locator(".job[data-state=done]")
        await job.wait_for(timeout=60_000)
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


async def test_a_worker_that_stops_is_greyed_for_one_snapshot_then_leaves_the_panel(browser, nats_url, nc):
    # a snapshot a second: the page has the time to draw each one, the greyed one too
    server = TestServer(
        create_app(WebConfig(nats_url=nats_url, fleet_interval=1.0, discovery_window=0.3)), host="127.0.0.1"
    )
    await server.start_server()
    try:
        page, errors = await open_page(browser, server)
        coord = page.locator("#fleet-coordinator")
        async with FakeCoordinator(nc, status={"active_jobs": 1}), FakeWorkerService(nc, 5, "torch", "cpu") as w:
            row = page.locator(f"#fleet-experts tr.worker[data-worker-id='{w.id}']")
            await row.wait_for(timeout=30_000)
            await page.wait_for_selector("#fleet-coordinator:not(.stale) table", timeout=30_000)
            assert "stale" not in await row.get_attribute("class")
        # stopped: the next snapshot keeps both greyed (the worker with its backend and without rates, the
        # coordinator's last status); the one after drops the worker and says the coordinator is not answering
        await page.locator(f"#fleet-experts tr.worker.stale[data-worker-id='{w.id}']").wait_for(timeout=30_000)
        assert "torch" in await row.inner_text() and "missed" in await row.get_attribute("title")
        await page.wait_for_function(  # its last status, greyed
            "() => (c => c.classList.contains('stale') && c.querySelector('table')"
            " && c.innerText.includes('last status'))(document.querySelector('#fleet-coordinator'))",
            timeout=30_000,
        )
        await row.wait_for(state="detached", timeout=30_000)
        await page.wait_for_function(
            "() => document.querySelector('#fleet-coordinator').innerText.includes('not answering')", timeout=30_000
        )
        assert "stale" not in (await coord.get_attribute("class") or "")
        assert errors == [], errors
        await page.close()
    finally:
        await server.close()


async def test_closing_the_tab_cancels_its_job(browser, web_server, nc):
    async with FakeCoordinator(nc, frame_delay=0.05) as coordinator:
        page, _ = await open_page(browser, web_server)
        await page.fill("#digits", "2,2")
        await page.fill("#steps", "500")
        await page.click("#generate")
        running = page.locator(".job[data-state=running]")
        await running.wait_for(timeout=30_000)
        job_id = await running.get_attribute("data-job-id")
        await page.close()
        await wait_until(lambda: job_id in coordinator.cancelled, timeout=20, what="the cancel from the closed page")


EVIL_PAGE = """<!doctype html><title>another site</title><script>
window.result = {events: [], messages: []};
const ws = new WebSocket("ws://VIEWER/ws");
ws.onopen = () => window.result.events.push("open");
ws.onmessage = (ev) => window.result.messages.push(ev.data);
ws.onerror = () => window.result.events.push("error");
ws.onclose = (ev) => { window.result.events.push("close"); window.result.code = ev.code; };
fetch("http://VIEWER/api/fleet").then(r => r.text()).then(t => window.result.fleet = t,
                                                          e => window.result.fleet_error = String(e));
</script>"""


async def test_another_origin_cannot_use_the_viewer_socket_but_its_own_page_can(browser, web_server, caplog):
    """Cross-site websocket hijacking: a page served from another origin (another port of the same host)
    opens ws://<viewer>/ws in real Chromium; the upgrade is refused (403, logged), no message reaches it."""
    import logging

    from aiohttp import web

    caplog.set_level(logging.WARNING, logger="web.guard")
    viewer = f"127.0.0.1:{web_server.port}"

    async def evil_page(_request):
        return web.Response(text=EVIL_PAGE.replace("VIEWER", viewer), content_type="text/html")

    evil_app = web.Application()
    evil_app.router.add_get("/", evil_page)
    evil = TestServer(evil_app, host="127.0.0.1")
    await evil.start_server()
    try:
        page = await browser.new_page()
        await page.goto(str(evil.make_url("/")))
        await page.wait_for_function("() => window.result && window.result.events.includes('close')", timeout=30_000)
        result = await page.evaluate("window.result")
        assert "open" not in result["events"] and result["messages"] == [], result
        assert result["code"] == 1006, result  # the handshake failed
        await page.wait_for_function(
            "() => window.result.fleet !== undefined || window.result.fleet_error !== undefined", timeout=30_000
        )
        assert "fleet" not in await page.evaluate("window.result"), "the other origin read /api/fleet"
        evil_origin = f"http://127.0.0.1:{evil.port}"
        refused = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
        assert any(evil_origin in line and "/ws" in line for line in refused), refused
        await page.close()
    finally:
        await evil.close()
    # ... while the viewer's own page connects and works, with no CSP violation in its console
    own, errors = await open_page(browser, web_server)
    assert await own.locator("#conn").get_attribute("data-state") == "open"
    assert errors == [], errors
    await own.close()


async def test_token_from_the_url_fragment_opens_the_socket(browser, nats_url):
    token = "browser-test-token-0123456789"
    server = TestServer(create_app(WebConfig(nats_url=nats_url, token=token)), host="127.0.0.1")
    await server.start_server()
    try:
        page = await browser.new_page()
        errors: list[str] = []
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        await page.goto(str(server.make_url("/")))  # no token: the server says why, the page shows it
        await page.wait_for_function("() => document.querySelector('#errors li') !== null", timeout=30_000)
        assert "token required" in await page.locator("#errors li").first.inner_text()
        await page.goto(str(server.make_url("/")) + f"#token={token}")
        await page.reload()  # a fresh page load with the fragment
        await page.wait_for_selector("#conn[data-state=open]", timeout=30_000)
        assert token not in page.url  # removed from the address bar (kept for the tab only)
        await page.reload()  # the tab remembers it
        await page.wait_for_selector("#conn[data-state=open]", timeout=30_000)
        await page.close()
    finally:
        await server.close()


# ---------------------------------------------------------------- end to end, real local fleet


def _shipped(directory: Path) -> bool:
    return all(
        (directory / f).exists()
        for f in ("expert0.safetensors", "expert1.safetensors", "router.safetensors", "partition.json")
    )


@pytest.fixture
async def real_fleet(nats_url, request):
    """nats-server (the session's) + real expert workers + real coordinator with a real router.

    Uses the shipped checkpoints when they are there (real digits), else tiny random-init experts
    and router built from the project's own model code (noise-like images, same machinery)."""
    from coordinator.local_fleet import LocalFleet

    shipped = Path(__file__).resolve().parents[2] / "checkpoints"
    if _shipped(shipped):
        fleet = LocalFleet.from_dir(shipped, nats_url=nats_url, buckets=(1, 2, 4, 8, 16))
    else:
        from models.router import Router

        files = request.getfixturevalue("tiny_fleet_files")  # tests/web/conftest.py
        experts, router = files["experts"], Router.load(files["router"])
        fleet = LocalFleet(
            experts,
            router,
            num_experts=2,
            class_to_expert=[0] * 5 + [1] * 5,
            nats_url=nats_url,
            buckets=(1, 2, 4, 8, 16),
        )
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # spinning OpenMP threads make tiny forwards far slower on a shared 2-core box
    try:
        async with fleet:
            yield fleet
    finally:
        torch.set_num_threads(threads)


@pytest.mark.slow  # ~6 s: a real fleet driven from Chromium
async def test_real_fleet_generate_in_the_browser(browser, web_server, real_fleet, tmp_path):
    page, errors = await open_page(browser, web_server)
    # the fleet panel discovers both experts' real workers (backend and device from their metadata)
    # the panel is redrawn every snapshot: read it in one evaluation, from a snapshot that lists both experts
    panel = await page.wait_for_function(
        """() => {
          const box = document.querySelector('#fleet-experts');
          if (box.querySelectorAll('.expert').length < 2) return null;
          return {
            workers0: box.querySelectorAll(".expert[data-expert='0'] tr.worker").length,
            text: box.innerText,
            dtypes: [...box.querySelectorAll('.dtype')].map(d => d.innerText),
            overflow: [...box.querySelectorAll('table')].map(t => t.scrollWidth - t.parentElement.clientWidth),
          };
        }""",
        timeout=60_000,
    )
    panel = await panel.json_value()
    assert panel["workers0"] >= 1
    assert "torch" in panel["text"]
    # each worker's dtype; in-process workers run the eager forward, so no ", compiled"
    assert set(panel["dtypes"]) <= {"float32", "bfloat16"}
    # every worker table fits the panel: no column (rows/s, ms, reqs) is cut off at its right edge
    assert len(panel["overflow"]) >= 2 and max(panel["overflow"]) <= 0, panel["overflow"]
    await page.wait_for_selector("#fleet-coordinator table", timeout=30_000)  # FleetStatus answered
    await page.fill("#digits", "0,1,2,3,4,5,6,7,8,9")
    await page.fill("#steps", "24")
    await page.select_option("#strategy", "top1")
    await page.click("#generate")
    # intermediate frames reach the screen before the final images
    await page.wait_for_function(
        "() => (j => j && +j.dataset.frames >= 1)(document.querySelector('.job'))", timeout=60_000
    )
    await page.screenshot(path=str(tmp_path / "web-running.png"), full_page=True)
    # ... and the final images arrive
    done = page.locator(".job[data-state=done]")
    await done.wait_for(timeout=120_000)
    assert int(await done.get_attribute("data-frames")) >= 1
    assert 1 <= int(await done.get_attribute("data-first-step")) < 24  # a partly denoised frame was drawn
    canvases = done.locator(".tile canvas")
    assert await canvases.count() == 10
    assert await canvases.evaluate_all("cs => cs.every(c => c.dataset.final === '1')")
    experts = await canvases.evaluate_all("cs => cs.map(c => c.dataset.expert)")
    assert set(experts) <= {"0", "1"}, experts  # top-1: one expert per tile, outlined in its colour
    # the canvas holds a real image (not all one grey level)
    spread = await canvases.first.evaluate(
        "c => { const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;"
        " let lo = 255, hi = 0;"
        " for (let i = 0; i < d.length; i += 4) { lo = Math.min(lo, d[i]); hi = Math.max(hi, d[i]); }"
        " return hi - lo; }"
    )
    assert spread > 0
    await page.screenshot(path=str(tmp_path / "web-done.png"), full_page=True)
    # the full ensemble: every step mixes both experts -> tiles outlined as "several" (-1)
    await page.fill("#digits", "2,7")
    await page.fill("#steps", "6")
    await page.select_option("#strategy", "full")
    await page.click("#generate")
    await page.wait_for_function(
        "() => document.querySelectorAll('.job[data-state=done]').length >= 2", timeout=120_000
    )
    newest = page.locator(".job").first  # new jobs go on top
    assert await newest.locator(".tile canvas").evaluate_all("cs => cs.map(c => c.dataset.expert)") == ["-1", "-1"]
    assert await newest.locator(".bars").first.locator("span").count() == 2  # one weight bar per expert
    if os.environ.get("DDM_WEB_SHOT_DIR"):
        await page.screenshot(path=os.path.join(os.environ["DDM_WEB_SHOT_DIR"], "web-real.png"), full_page=True)
    assert errors == [], errors
    await page.close()


async def test_guidance_input_follows_the_null_label_and_reaches_the_job_request(browser, web_server, nc):
    """The Sampling fieldset's guidance input: disabled (saying why) on a fleet without a null label; on one
    with it a scale other than 1 goes into the job request, the job's notes and the compare view's rerun."""
    from schemas.spec import legacy_spec

    status = {"kind": "fleet_status", "coordinator": "fake"}  # no spec: the MNIST fleet, no null label
    async with FakeCoordinator(nc, frame_delay=0.02, status=status) as coordinator:
        page, errors = await open_page(browser, web_server)
        await page.wait_for_selector("#guidance:disabled", timeout=30_000)
        assert "no null label" in await page.locator("#guidance-label").get_attribute("title")
        coordinator.status = {**status, "spec": legacy_spec(null_label=True).to_json(), "default_guidance_scale": 2.0}
        await page.wait_for_selector("#guidance:enabled", timeout=30_000)
        assert await page.locator("#guidance").get_attribute("placeholder") == "fleet 2"  # what empty gives
        # left empty (the default) the request carries no scale: the fleet's default applies, and the card says so
        await page.fill("#digits", "1,6")
        await page.fill("#steps", "4")
        await page.click("#generate")
        await page.locator(".job[data-state=done]").first.wait_for(timeout=30_000)
        await page.fill("#guidance", "25")  # out of range: the server's message, no job
        await page.click("#generate")
        await page.wait_for_function(
            "() => (li => li && li.textContent.includes('guidance_scale must be 0-20'))"
            "(document.querySelector('#errors li'))",
            timeout=20_000,
        )
        await page.fill("#guidance", "3")
        await page.fill("#seed", "5")
        await page.click("#generate")
        await page.wait_for_function(
            "() => document.querySelectorAll('.job[data-state=done]').length === 2", timeout=30_000
        )
        plain, guided = list(coordinator.jobs.values())
        assert plain.guidance_scale is None and guided.guidance_scale == 3.0 and guided.n_guided == 2
        newest = page.locator(".job").first  # new jobs go on top
        assert "guidance 3" in await newest.locator(".job-notes").inner_text()
        assert "guidance 2 (fleet default)" in await page.locator(".job").nth(1).locator(".job-notes").inner_text()
        # the comparison reruns the same digits and seed with the same scale
        await newest.locator(".cmp-strategy").select_option("full")
        await newest.locator(".cmp-run").click()
        await wait_until(lambda: len(coordinator.jobs) == 3, timeout=20, what="the comparison's job request")
        again = list(coordinator.jobs.values())[2]
        assert (again.guidance_scale, again.strategy, again.seed) == (3.0, "full", 5)
        await page.wait_for_selector(".job.comparison[data-state=done]", timeout=30_000)
        assert "full · euler · guidance 3" in await page.locator(".job.comparison .tiles").get_attribute("data-label")
        assert errors == [], errors
        await page.close()
