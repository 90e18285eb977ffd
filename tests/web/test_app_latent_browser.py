"""A latent fleet in real headless Chromium: a tiny real autoencoder (3x16x16 images <-> 4x8x8 latents) served
by a real decoder, tiny latent experts served by real workers, a real coordinator whose spec says
`space: latent`, on the real nats-server. The page asks for decoded previews, draws them and the decoded final
images (RGB, pixel for pixel what the decoder computed), never latent channels; the fleet panel names the
decoder; without a decoder the job's `decoder_unavailable` failure is shown."""

from __future__ import annotations

import io

import numpy as np
import pytest

from dataset.images import to_uint8
from schemas import DoneEvent, FrameEvent, JobEvent, subjects, unpack
from tests.web.test_app_browser import open_page, web_server  # noqa: F401 (fixtures)
from tests.web.test_app_trajectories import _download

C2E = [0] * 5 + [1] * 5


@pytest.fixture(scope="module")
def latent_files(tmp_path_factory):
    """(autoencoder path, its LatentCodec, the latent spec, [expert paths]): random-init, real formats."""
    from models.autoencoder_torch import LatentCodec
    from models.tiny import make_tiny_latent_fleet

    made = make_tiny_latent_fleet(tmp_path_factory.mktemp("latent-web"), autoencoder_seed=5)
    return made.autoencoder, LatentCodec.load(made.autoencoder), made.spec, made.experts


class _LatentFleet:
    """Expert workers + a coordinator serving the latent spec (+ a decoder unless `decoder=False`)."""

    def __init__(self, nats_url: str, files, *, decoder: bool):
        self.nats_url, self.files, self.with_decoder = nats_url, files, decoder
        self._stack = None

    async def __aenter__(self):
        from contextlib import AsyncExitStack

        import torch

        from coordinator.local_fleet import LabelRouter
        from coordinator.service import Coordinator
        from workers.decoder_service import DecoderWorker
        from workers.service import ExpertWorker

        ae, _codec, spec, experts = self.files
        self._threads = torch.get_num_threads()
        torch.set_num_threads(1)
        self._stack = AsyncExitStack()
        for k, path in enumerate(experts):
            await self._stack.enter_async_context(
                ExpertWorker(expert=k, checkpoint=path, nats_url=self.nats_url, buckets=(1, 4))
            )
        if self.with_decoder:
            await self._stack.enter_async_context(DecoderWorker(ae, nats_url=self.nats_url))
        await self._stack.enter_async_context(
            Coordinator(
                LabelRouter(C2E, 2),
                num_experts=2,
                class_to_expert=C2E,
                nats_url=self.nats_url,
                spec=spec,
                step_timeout=2,
                retries=1,
            )
        )
        return self

    async def __aexit__(self, *exc):
        import torch

        try:
            await self._stack.__aexit__(*exc)
        finally:
            torch.set_num_threads(self._threads)


async def _canvas_rgb(canvas) -> np.ndarray:
    h, w, data = await canvas.evaluate(
        "c => [c.height, c.width, Array.from(c.getContext('2d').getImageData(0, 0, c.width, c.height).data)]"
    )
    return np.array(data, np.uint8).reshape(h, w, 4)[:, :, :3]


def _rgb(x) -> np.ndarray:
    """Decoded images [N, 3, H, W] in [-1, 1] -> the page's pixels [N, H, W, 3] uint8."""
    return to_uint8(np.asarray(x, np.float32)).transpose(0, 2, 3, 1)


@pytest.mark.slow  # ~15 s: a real latent fleet and decoder driven from Chromium
async def test_latent_fleet_page_draws_decoded_previews_and_images(browser, web_server, nats_url, nc, latent_files):
    ae, codec, spec, _ = latent_files
    events: list = []

    async def on_event(msg) -> None:
        events.append(unpack(msg.data, JobEvent))

    sub = await nc.subscribe(subjects.ALL_JOB_EVENTS, cb=on_event)
    try:
        async with _LatentFleet(nats_url, latent_files, decoder=True):
            page, errors = await open_page(browser, web_server)
            await page.wait_for_function("() => document.body.dataset.space === 'latent'", timeout=30_000)
            # the fleet panel says the fleet is latent, names its decoder and sees the decoder process
            space = page.locator("#fleet-space")
            await page.wait_for_function(
                "() => document.querySelector('#fleet-space').dataset.decoders === '1'", timeout=30_000
            )
            text = await space.inner_text()
            assert "latent fleet" in text and "4×8×8 latents" in text and "1 decoder process" in text
            assert "3×16×16 images" in text
            assert await space.locator(".decoder-name").inner_text() == spec.decoder
            assert await page.is_disabled("#frame_x1")
            await page.fill("#digits", "1,7,3")
            await page.fill("#steps", "9")
            await page.select_option("#strategy", "top1")
            await page.click("#generate")
            done = page.locator(".job[data-state=done]")
            await done.wait_for(timeout=90_000)
            job_id = await done.get_attribute("data-job-id")
            assert int(await done.get_attribute("data-previews")) >= 1
            # final canvases: the decoder's images (3x16x16 RGB), pixel for pixel
            done_ev = next(e for e in events if isinstance(e, DoneEvent) and e.job_id == job_id)
            assert done_ev.images.shape == (3, 3, 16, 16)
            want = _rgb(done_ev.images)
            canvases = done.locator(".tile canvas")
            assert await canvases.count() == 3
            for i in range(3):
                got = await _canvas_rgb(canvases.nth(i))
                assert got.shape == (16, 16, 3)  # the images' size, not the latents' 8x8
                np.testing.assert_array_equal(got, want[i], err_msg=f"final tile {i}")
            assert len(np.unique(want.reshape(-1, 3), axis=0)) > 4  # real pictures, not one flat colour
            # the job asked for previews every 4 steps (the server's default): frames 4, 8 and the last carry one,
            # and each is the decoder's output for that frame's latents
            frames = {e.step: e for e in events if isinstance(e, FrameEvent) and e.job_id == job_id}
            assert sorted(s for s, f in frames.items() if f.preview is not None) == [4, 8, 9]
            for s in (4, 8, 9):
                np.testing.assert_allclose(
                    np.asarray(frames[s].preview, np.float32),
                    codec.decode(np.asarray(frames[s].x, np.float32)),
                    atol=2e-3,
                )
            # the page kept only decoded frames: each is that frame's preview as pixels (the last: the final images)
            npz = np.load(io.BytesIO(await _download(page, done.locator(".download-npz"))))
            steps = npz["frame_steps"].tolist()
            assert steps and set(steps) <= {4, 8, 9} and steps[-1] == 9, steps
            assert npz["frames"].shape == (len(steps), 3, 16, 16, 3)
            for j, s in enumerate(steps):
                expected = want if s == 9 else _rgb(frames[s].preview)
                np.testing.assert_array_equal(npz["frames"][j], expected, err_msg=f"kept frame of step {s}")
            # scrubbing back to a preview shows it
            if len(steps) > 1:
                await done.locator(".scrub-range").evaluate(
                    "r => { r.value = '0'; r.dispatchEvent(new Event('input')); }"
                )
                got = await _canvas_rgb(canvases.nth(0))
                np.testing.assert_array_equal(got, _rgb(frames[steps[0]].preview)[0])
            assert errors == [], errors
            await page.close()
    finally:
        await sub.unsubscribe()


@pytest.mark.slow  # ~15 s: the coordinator waits (retries + 1) x step timeout for a decoder
async def test_latent_fleet_without_a_decoder_shows_decoder_unavailable(browser, web_server, nats_url, latent_files):
    async with _LatentFleet(nats_url, latent_files, decoder=False):
        page, errors = await open_page(browser, web_server)
        await page.wait_for_function("() => document.body.dataset.space === 'latent'", timeout=30_000)
        await page.wait_for_function(
            "() => document.querySelector('#fleet-space').textContent.includes('no decoder running')",
            timeout=30_000,
        )
        await page.fill("#digits", "2,8")
        await page.fill("#steps", "3")
        await page.click("#generate")
        failed = page.locator(".job[data-state=failed]")
        await failed.wait_for(timeout=60_000)
        status = await failed.locator(".job-status").inner_text()
        assert "decoder_unavailable" in status and "decoder" in status.split("decoder_unavailable", 1)[1], status
        assert "decoder_unavailable" in await page.locator("#errors li").first.inner_text()
        assert int(await failed.get_attribute("data-frames")) >= 1  # its frames came, without pixels
        assert [e for e in errors if "decoder_unavailable" not in e] == [], errors
        await page.close()


@pytest.fixture(scope="module")
def latent_files_256(tmp_path_factory):
    """The seeds' geometry: 3x256x256 images <-> 4x32x32 latents (a random autoencoder with an 8x8 patch fold)."""
    from models.autoencoder_torch import LatentCodec
    from models.tiny import make_tiny_latent_fleet

    made = make_tiny_latent_fleet(
        tmp_path_factory.mktemp("latent-web-256"), image_size=256, autoencoder_patch=8, autoencoder_widths=(8,)
    )
    return made.autoencoder, LatentCodec.load(made.autoencoder), made.spec, made.experts


@pytest.mark.slow  # ~20 s: 256px images decoded and drawn
async def test_latent_fleet_page_draws_256px_images_and_previews(browser, web_server, nats_url, nc, latent_files_256):
    _, codec, _, _ = latent_files_256
    events: list = []

    async def on_event(msg) -> None:
        events.append(unpack(msg.data, JobEvent))

    sub = await nc.subscribe(subjects.ALL_JOB_EVENTS, cb=on_event)
    try:
        async with _LatentFleet(nats_url, latent_files_256, decoder=True):
            page, errors = await open_page(browser, web_server)
            await page.wait_for_function(
                "() => document.querySelector('#fleet-space').dataset.decoders === '1'", timeout=30_000
            )
            text = await page.locator("#fleet-space").inner_text()
            assert "4×32×32 latents" in text and "3×256×256 images" in text
            await page.fill("#digits", "4,9")
            await page.fill("#steps", "5")
            await page.click("#generate")
            done = page.locator(".job[data-state=done]")
            await done.wait_for(timeout=90_000)
            job_id = await done.get_attribute("data-job-id")
            assert int(await done.get_attribute("data-previews")) >= 1
            done_ev = next(e for e in events if isinstance(e, DoneEvent) and e.job_id == job_id)
            assert done_ev.images.shape == (2, 3, 256, 256)
            want = _rgb(done_ev.images)
            canvases = done.locator(".tile canvas")
            for i in range(2):
                got = await _canvas_rgb(canvases.nth(i))
                assert got.shape == (256, 256, 3)
                np.testing.assert_array_equal(got, want[i], err_msg=f"final tile {i}")
            frames = [e for e in events if isinstance(e, FrameEvent) and e.job_id == job_id and e.preview is not None]
            assert frames and all(np.asarray(f.preview).shape == (2, 3, 256, 256) for f in frames)
            first = frames[0]
            np.testing.assert_allclose(
                np.asarray(first.preview, np.float32), codec.decode(np.asarray(first.x, np.float32)), atol=2e-3
            )
            assert errors == [], errors
            await page.close()
    finally:
        await sub.unsubscribe()
