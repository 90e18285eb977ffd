"""The shipped 256px latent fleet (checkpoints/colour-latent-256/): the seeds' geometry (3x256x256 images,
an autoencoder with 8x downsampling to 4x32x32 latents, UNet experts on the latents), one latent spec across
experts and router naming the autoencoder beside them, and the seeds' call through a real local fleet (workers,
coordinator, decoder on a real nats-server): four 3x256x256 images, the in-process sampler's to float32 rounding
(bit for bit with batch-invariant workers: docs/LATENT.md; the mode's self-checks would double this test's time,
and tests/coordinator/test_service_guidance.py checks the mode itself), RGB digits in the palette."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from dataset.builtin import palette_table
from evaluation.views import area_downsample, colour_check, palette_arrays
from models.checkpoint import load_checkpoint
from models.codec import codec_info
from tests.models.test_colour_latent_shipped import check_names_its_autoencoder, in_process_images

CKPT = Path(__file__).resolve().parents[2] / "checkpoints" / "colour-latent-256"


def test_the_256px_fleet_has_the_seeds_geometry_and_names_its_autoencoder():
    info = codec_info(CKPT / "autoencoder.safetensors")
    assert info.image_shape == (3, 256, 256) and info.latent_channels == 4 and info.downsample == 8
    meta = json.loads((CKPT / "autoencoder.json").read_text())
    assert meta["training"]["val_psnr_db"] >= 35.0
    partition = json.loads((CKPT / "partition.json").read_text())
    names = [f"expert{k}" for k in range(partition["num_experts"])] + ["router"]
    check_names_its_autoencoder(CKPT, names, (4, 32, 32))
    for name in names[:-1]:
        meta, _ = load_checkpoint(CKPT / f"{name}.safetensors")
        assert meta["arch"] == "unet" and meta["config"]["in_channels"] == 4 and meta["config"]["image_size"] == 32


@pytest.mark.bus  # a LocalFleet: nats-server, DiT workers, a coordinator and a decoder
async def test_the_seeds_call_gives_four_256px_images_of_the_in_process_sampler():
    from client.jobs import run_job
    from coordinator.local_fleet import LocalFleet
    from schemas import JobRequest

    async with LocalFleet.from_dir(CKPT, dtype="float32", buckets=(8,)) as fleet:
        req = JobRequest(labels=[1, 4, 7, 9], steps=6, seed=11, strategy="top1", stream=False)
        done = await run_job(fleet.nc, req, timeout=300)
    images = np.asarray(done.images, np.float32)
    assert images.shape == (4, 3, 256, 256) and np.isfinite(images).all()
    small = area_downsample(images, (3, 32, 32))  # as the 32px judges read them
    reading = colour_check(small, *palette_arrays({"palette": palette_table()}))
    assert reading.correct.sum() >= 3, (reading.foreground_error, reading.background_error)
    # a convolution's last bits follow its batch, and the workers may batch the job's rows otherwise
    np.testing.assert_allclose(images, in_process_images(req, CKPT), atol=1e-4)
