"""Studying finished jobs in real headless Chromium against a real local fleet: scrubbing and replay, the
predicted clean image x1, the router timeline, same-seed comparisons, the fleet sparklines and the
downloads (PNG grid, animated GIF, .npz, all made by the page). Screenshots go to out/screenshots/;
DDM_WEB_DOCS_SHOT=1 also refreshes docs/web.png (a finished job scrubbed, timeline visible).
"""

from __future__ import annotations

import io
import os
import socket
import zipfile
from pathlib import Path

import numpy as np
import pytest

from tests.web.test_app_browser import DOCS_SCREENSHOT, open_page, real_fleet, web_server  # noqa: F401 (fixtures)

SHOTS = Path(__file__).resolve().parents[2] / "out" / "screenshots"


async def _shot(page, name: str, **kw) -> None:
    SHOTS.mkdir(parents=True, exist_ok=True)
    await page.screenshot(path=str(SHOTS / name), **kw)


async def _pixels(locator) -> list[int]:
    """The grey levels of a canvas (its red channel), row-major."""
    return await locator.evaluate(
        "c => Array.from(c.getContext('2d').getImageData(0, 0, c.width, c.height).data.filter((_, i) => i % 4 === 0))"
    )


async def _download(page, button) -> bytes:
    async with page.expect_download() as info:
        await button.click()
    download = await info.value
    return Path(await download.path()).read_bytes()


@pytest.mark.slow  # ~30 s: three jobs on a real fleet driven from Chromium
async def test_scrub_predict_timeline_compare_and_download_a_finished_job(browser, web_server, real_fleet):
    page, errors = await open_page(browser, web_server)
    await page.wait_for_function(
        "() => document.querySelectorAll('#fleet-experts .expert').length >= 2", timeout=60_000
    )
    digits, steps = [0, 3, 5, 7, 8, 9], 16
    await page.fill("#digits", ",".join(map(str, digits)))
    await page.fill("#steps", str(steps))
    await page.fill("#seed", "4242")
    await page.select_option("#strategy", "top1")
    assert await page.is_checked("#frame_x1")  # the page asks for the predicted image by default
    await page.click("#generate")
    job = page.locator(".job[data-state=done]").first
    await job.wait_for(timeout=120_000)
    kept = int(await job.get_attribute("data-kept"))
    assert 2 <= kept <= steps
    tiles = job.locator(".tiles .tile canvas")
    assert await tiles.count() == len(digits)
    final = await _pixels(tiles.first)

    # 1. scrub: the slider covers the kept frames; Home jumps to the first, the tiles show that step
    scrub = job.locator(".scrub-range")
    assert await job.locator(".scrub").is_visible()
    assert await scrub.get_attribute("max") == str(kept - 1)
    assert await job.get_attribute("data-cursor") == str(steps)
    await scrub.focus()
    await page.keyboard.press("Home")
    first_step = int(await job.get_attribute("data-cursor"))
    assert first_step < steps
    early = await _pixels(tiles.first)
    assert early != final
    await job.locator(".tiles").click()  # focus the card (not the slider): arrows step through frames
    await page.keyboard.press("ArrowRight")
    assert int(await job.get_attribute("data-cursor")) > first_step
    assert "step" in await job.locator(".scrub-label").inner_text()

    # 2. predicted clean image: at an early step x1 differs from x_t; at the end both are the sample
    await page.keyboard.press("Home")
    assert await job.locator(".views").is_visible()
    await job.locator("button.view[data-view=x1]").click()
    assert await job.get_attribute("data-view") == "x1"
    predicted = await _pixels(tiles.first)
    assert predicted != early
    # x1 estimates the sample: nearer the final image than the noisy state is
    err = lambda a: float(np.abs(np.array(a, float) - np.array(final, float)).mean())  # noqa: E731
    assert err(predicted) < err(early), (err(predicted), err(early))
    await job.locator(".tiles").click()
    await page.keyboard.press("End")
    assert await _pixels(tiles.first) == final
    await job.locator("button.view[data-view=x]").click()

    # play from the start at 4x: it runs to the last frame and stops
    await page.keyboard.press("Home")
    await job.locator(".speed").select_option("4")
    await job.locator(".play").click()
    await page.wait_for_function("() => document.querySelector('.job').dataset.playing === '1'", timeout=10_000)
    await page.wait_for_function(
        f"() => (j => j.dataset.cursor === '{steps}' && !j.dataset.playing)(document.querySelector('.job'))",
        timeout=30_000,
    )

    # 3. router timeline: one line per expert per image, the served grid, numbers on hover
    plot = job.locator(".tile svg.plot").first
    assert await plot.locator("polyline").count() == 2
    await plot.hover()
    tip = page.locator("#tip")
    await tip.wait_for(state="visible", timeout=10_000)
    text = await tip.inner_text()
    assert "expert 0" in text and "expert 1" in text and "step" in text and "served by" in text
    served = job.locator("canvas.served")
    assert (
        await served.get_attribute("width") == str(kept - (1 if kept > steps else 0))
        or int(await served.get_attribute("width")) >= 2
    )
    assert await served.get_attribute("height") == str(len(digits))
    await served.hover(position={"x": 5, "y": 3})
    assert "image 0 (digit 0)" in await tip.inner_text()
    await job.locator(".tiles").click()
    await page.keyboard.press("Home")
    for _ in range(kept // 3):
        await page.keyboard.press("ArrowRight")
    await job.locator(".tile svg.plot").nth(2).hover()
    await _shot(page, "trajectory-scrubbed.png", full_page=True)
    await job.locator("button.view[data-view=x1]").click()  # the same step, predicted final images
    await job.locator(".tile svg.plot").nth(2).hover()
    await _shot(page, "trajectory-predicted.png", full_page=True)
    if os.environ.get("DDM_WEB_DOCS_SHOT"):  # refresh docs/web.png: DDM_WEB_DOCS_SHOT=1 pytest ...
        await page.screenshot(path=str(DOCS_SCREENSHOT), full_page=False)
    await job.locator("button.view[data-view=x]").click()

    # 6. downloads, parsed here: PNG grid, animated GIF of the kept frames, .npz of everything kept
    from PIL import Image

    png = Image.open(io.BytesIO(await _download(page, job.locator(".download-all"))))
    assert png.format == "PNG" and png.size == (6 * (32 * 2 + 2) + 2, 32 * 2 + 4)
    gif = Image.open(io.BytesIO(await _download(page, job.locator(".download-gif"))))
    assert gif.format == "GIF" and gif.n_frames == kept and gif.size == png.size
    gif.seek(kept - 1)
    last = np.asarray(gif.convert("L"))
    assert last[2 + 10, 2 + 10] == final[5 * 32 + 5]  # tile 0, pixel (5, 5), scaled 2x, 2 px margin
    npz = np.load(io.BytesIO(await _download(page, job.locator(".download-npz"))))
    assert npz["images"].shape == (6, 32, 32) and npz["images"].dtype == np.uint8
    assert npz["images"][0].ravel().tolist() == final
    assert npz["labels"].tolist() == digits
    assert npz["usage"].shape == (6, 2) and np.allclose(npz["usage"].sum(axis=1), 1, atol=1e-3)
    frames, frames_x1 = npz["frames"], npz["frames_x1"]
    assert frames.shape == frames_x1.shape == (kept, 6, 32, 32)
    assert (frames[-1] == npz["images"]).all() and not (frames[0] == frames_x1[0]).all()
    assert npz["frame_steps"].tolist() == sorted(npz["frame_steps"].tolist()) and npz["frame_steps"][-1] == steps
    assert npz["frame_weights"].shape == (kept, 6, 2) and npz["frame_experts"].shape == (kept, 6)
    assert set(npz["frame_experts"].ravel().tolist()) <= {0, 1}  # top-1
    with zipfile.ZipFile(io.BytesIO(await _download(page, job.locator(".download-npz")))) as z:
        assert z.testzip() is None  # CRCs right

    # 4. same seed, side by side: the same routing reproduces the images exactly (|A - B| = 0) ...
    original_id = await job.get_attribute("data-job-id")
    await job.locator(".cmp-strategy").select_option("top1")
    await job.locator(".cmp-run").click()
    same = page.locator(f".job.comparison[data-compare-of='{original_id}'][data-state=done]")
    await same.wait_for(timeout=120_000)
    assert float(await same.get_attribute("data-mean-abs-diff")) == 0.0
    # ... another solver does not (the shipped router is one-hot per label, so there "full" = "top1");
    # the comparison's card sits right under the original with rows A, B and |A - B|
    await job.locator(".cmp-solver").select_option("heun")
    await job.locator(".cmp-run").click()
    await page.wait_for_function(
        f"() => [...document.querySelectorAll('.job.comparison[data-state=done]')]"
        f".filter(j => j.dataset.compareOf === '{original_id}').length === 2",
        timeout=120_000,
    )
    full = page.locator(f".job.comparison[data-compare-of='{original_id}']").first  # the newest is right below
    assert await page.evaluate(
        f"() => document.querySelector(\"[data-job-id='{original_id}']\").nextElementSibling.dataset.jobId"
    ) == await full.get_attribute("data-job-id")
    assert float(await full.get_attribute("data-mean-abs-diff")) > 0, (
        await full.locator(".job-notes").inner_text(),
        await full.inner_text(),
    )
    assert await full.locator(".cmp-a canvas").count() == 6 and await full.locator(".cmp-diff canvas").count() == 6
    assert "mean |A − B|" in await full.locator(".job-notes").inner_text()
    assert "heun" in await full.locator(".tiles").get_attribute("data-label")
    await full.scroll_into_view_if_needed()
    await _shot(page, "compare-same-seed.png", full_page=True)

    # 5. fleet over time: sparklines fill, each worker says its host, latency once requests were served
    await page.wait_for_function("() => +document.querySelector('#sparks').dataset.points >= 3", timeout=30_000)
    hosts = await page.wait_for_function(  # read from one drawing of the panel that lists workers
        "() => (rs => rs.length ? rs.map(r => r.dataset.host) : null)"
        "([...document.querySelectorAll('#fleet-experts tr.worker')])",
        timeout=30_000,
    )
    hosts = await hosts.json_value()
    assert hosts and set(hosts) == {socket.gethostname()}
    assert await page.locator(".spark-row[data-key=latency] canvas").is_visible()
    assert float(await page.locator(".spark-row[data-key=rows] canvas").get_attribute("data-max")) > 0
    await page.locator(".spark-row[data-key=rows] canvas").hover()
    assert "rows/s" in await tip.inner_text()
    await _shot(page, "fleet-sparklines.png", clip={"x": 1280 - 320, "y": 0, "width": 320, "height": 600})
    assert errors == [], errors
    await page.close()


FRAME_JS = """async ({n, frames, jobs}) => {
  const tile = btoa(String.fromCharCode(...Array.from({length: 1024}, (_, i) => i % 251)));
  const tiles = Array(n).fill(tile), weights = Array(n).fill([0.5, 0.5]), experts = Array(n).fill(-1);
  for (let j = 0; j < jobs; j++) {
    const id = `synthetic${j}`;
    HANDLERS.accepted({type: "accepted", job_id: id, digits: Array(n).fill(1), seed: String(j), queue_position: 0});
    for (let s = 1; s <= frames; s++) {
      HANDLERS.frame({type: "frame", job_id: id, step: s, steps: frames, t: s / frames, size: [32, 32], tiles,
                      x1: tiles, experts, weights, notes: []});
    }
    HANDLERS.done({type: "done", job_id: id, size: [32, 32], tiles, digits: Array(n).fill(1),
                   usage: weights, steps: frames, strategy: "full", elapsed_s: 1, notes: []});
  }
  return {kept: [...state.jobs.values()].map(j => [j.id, j.traj.length, j.keptBytes, j.dropped, j.thinned]),
          total: keptBytes(), budget: KEEP_BYTES};
}"""


async def test_kept_frames_stay_within_the_page_bound_oldest_finished_first(browser, web_server):
    """256-image jobs of 90 frames (x and x1: 512 KiB a frame) through the page's own message handlers:
    over the budget the oldest finished job loses its frames first, the newest stays scrubbable."""
    page, errors = await open_page(browser, web_server)
    out = await page.evaluate(FRAME_JS, {"n": 256, "frames": 90, "jobs": 3})
    assert out["total"] <= out["budget"], out
    kept = {row[0]: row for row in out["kept"]}
    assert kept["synthetic0"][3] is True and kept["synthetic0"][1] == 0  # the oldest: dropped
    assert kept["synthetic2"][3] is False and kept["synthetic2"][1] == 90  # the newest: whole
    oldest = page.locator(".job[data-job-id=synthetic0]")
    assert "trajectory dropped" in await oldest.locator(".scrub-label").inner_text()
    assert await oldest.locator(".scrub-range").is_disabled()
    newest = page.locator(".job[data-job-id=synthetic2]")
    assert await newest.locator(".scrub-range").get_attribute("max") == "89"
    assert await newest.locator(".tile svg.plot").count() == 256  # the timeline is kept for every job
    assert await oldest.locator(".tile svg.plot").count() == 256
    # one running job alone over the budget is thinned, never dropped
    out = await page.evaluate("""() => { const job = jobCard('big', Array(256).fill(2));
      const tile = btoa('\\0'.repeat(1024)); const tiles = Array(256).fill(tile);
      for (const j of [...state.jobs.values()]) if (j !== job) dropTrajectory(j);
      for (let s = 1; s <= 200; s++) HANDLERS.frame({type: 'frame', job_id: 'big', step: s, steps: 200, t: s / 200,
        size: [32, 32], tiles, x1: tiles, experts: Array(256).fill(0), weights: Array(256).fill([1, 0]), notes: []});
      return {frames: job.traj.length, thinned: job.thinned, total: keptBytes(), budget: KEEP_BYTES,
              last: job.traj[job.traj.length - 1].step}; }""")
    assert out["thinned"] and out["total"] <= out["budget"] and out["last"] == 200 and out["frames"] < 200, out
    assert errors == [], errors
    await page.close()
