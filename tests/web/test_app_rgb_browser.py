"""An RGB fleet in real headless Chromium: tiny 3-channel experts and router (4 named classes) served by real
workers and a real coordinator on the real nats-server. The page learns the fleet's spec (class names in the
form, RGB tiles), generates by class name, and every final canvas holds exactly the done event's images as
`dataset.images.to_uint8` makes them, per RGB channel."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from dataset.images import to_uint8
from schemas import DoneEvent, JobEvent, subjects, unpack
from schemas.spec import Conditioning, ModelSpec
from tests.web.test_app_browser import open_page, web_server  # noqa: F401 (fixtures)
from tests.web.test_app_trajectories import _download

NAMES = ["red", "green", "blue", "grey"]
SPEC = ModelSpec(sample_shape=(3, 32, 32), conditioning=Conditioning(num_classes=4, class_names=NAMES))


@pytest.fixture
async def rgb_fleet(nats_url, tmp_path):
    """Two tiny 3x32x32 experts (classes 0-1 | 2-3, jittered so they differ) and a tiny 3-channel router
    whose checkpoint carries the spec with the class names; the coordinator serves the router's spec."""
    import torch

    from coordinator.local_fleet import LocalFleet
    from coordinator.startup import router_spec
    from models.router import Router
    from models.tiny import make_tiny_expert, make_tiny_router

    shape = {"in_channels": 3, "num_classes": 4}
    experts = [
        make_tiny_expert(
            tmp_path / f"expert{k}", expert_id=k, jitter=0.02, classes=[2 * k, 2 * k + 1], null_label=True, **shape
        )
        for k in range(2)
    ]
    router_path = make_tiny_router(tmp_path / "router", 2, meta={"spec": SPEC.to_json()}, **shape)
    fleet = LocalFleet(
        experts,
        Router.load(router_path),
        num_experts=2,
        class_to_expert=[0, 0, 1, 1],
        nats_url=nats_url,
        buckets=(1, 2, 4),
        coordinator_options={"spec": router_spec(router_path)},
        dtype="float32",
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # spinning OpenMP threads make tiny forwards far slower on a shared 2-core box
    try:
        async with fleet:
            yield fleet
    finally:
        torch.set_num_threads(threads)


async def _canvas_rgb(canvas) -> np.ndarray:
    """A canvas' pixels as [H, W, 3] uint8 (alpha dropped)."""
    h, w, data = await canvas.evaluate(
        "c => [c.height, c.width, Array.from(c.getContext('2d').getImageData(0, 0, c.width, c.height).data)]"
    )
    return np.array(data, np.uint8).reshape(h, w, 4)[:, :, :3]


@pytest.mark.slow  # ~10 s: a real RGB fleet driven from Chromium
async def test_rgb_fleet_canvases_hold_the_done_events_pixels(browser, web_server, rgb_fleet, nc):
    done_events: list[DoneEvent] = []

    async def on_event(msg) -> None:
        ev = unpack(msg.data, JobEvent)
        if isinstance(ev, DoneEvent):
            done_events.append(ev)

    sub = await nc.subscribe(subjects.ALL_JOB_EVENTS, cb=on_event)
    try:
        page, errors = await open_page(browser, web_server)
        # the page learns the fleet's spec: the form asks for its classes
        await page.wait_for_function("() => document.body.dataset.channels === '3'", timeout=30_000)
        assert await page.locator("#labels-word").inner_text() == "classes"
        assert await page.input_value("#digits") == "red, green, blue, grey"
        await page.fill("#digits", "blue, red, ?, 3")
        await page.fill("#steps", "6")
        await page.select_option("#strategy", "top1")
        await page.click("#generate")
        done = page.locator(".job[data-state=done]")
        await done.wait_for(timeout=60_000)
        assert await done.get_attribute("data-channels") == "3"
        captions = await done.locator(".tile .label span").evaluate_all("ss => ss.map(s => s.textContent)")
        assert captions == ["blue", "red", "?", "grey"]
        job_id = await done.get_attribute("data-job-id")
        ev = next(e for e in done_events if e.job_id == job_id)
        assert ev.classes == [2, 0, -1, 3]
        expected = to_uint8(np.asarray(ev.images, np.float32)).transpose(0, 2, 3, 1)  # [N, H, W, 3]
        canvases = done.locator(".tile canvas")
        assert await canvases.count() == 4
        for i in range(4):
            got = await _canvas_rgb(canvases.nth(i))
            assert got.shape == (32, 32, 3)
            np.testing.assert_array_equal(got, expected[i], err_msg=f"tile {i}")
        assert len({tuple(expected[i].reshape(-1, 3).mean(0).round(1)) for i in range(4)}) > 1  # not all alike
        assert any(len(np.unique(expected[i].reshape(-1, 3), axis=0)) > 1 for i in range(4))  # not flat
        # the page's downloads keep the colours: .npz images [N, H, W, 3], a GIF in 256 colours
        npz = np.load(io.BytesIO(await _download(page, done.locator(".download-npz"))))
        assert npz["images"].shape == (4, 32, 32, 3) and (npz["images"] == expected).all()
        assert npz["labels"].tolist() == [2, 0, -1, 3] and npz["frames"].shape[1:] == (4, 32, 32, 3)
        gif = Image.open(io.BytesIO(await _download(page, done.locator(".download-gif"))))
        gif.seek(gif.n_frames - 1)
        r, g, b = np.asarray(gif.convert("RGB"))[2 + 10, 2 + 10]  # tile 0, pixel (5, 5), scaled 2x
        want = expected[0, 5, 5].astype(int)  # 3-3-2 bits: within a quantisation step
        assert abs(r - want[0]) <= 37 and abs(g - want[1]) <= 37 and abs(b - want[2]) <= 85, ((r, g, b), want)
        assert errors == [], errors
        await page.close()
    finally:
        await sub.unsubscribe()
