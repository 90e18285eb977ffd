"""The shipped latent colour MNIST fleet (checkpoints/colour-latent/): one latent spec across experts, router
and monolith naming the autoencoder shipped beside them, and a job through a real local fleet (with its
decoder) that comes back as RGB digits in the palette."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from coordinator.startup import router_spec
from dataset.builtin import palette_table
from evaluation.views import colour_check, palette_arrays
from models.autoencoder import decoder_name
from models.codec import codec_info, fleet_codec

CKPT = Path(__file__).resolve().parents[2] / "checkpoints" / "colour-latent"
FILES = ["expert0", "expert1", "expert2", "expert3", "router", "monolith"]


def check_names_its_autoencoder(ckpt: Path, names: list[str], latent_shape: tuple[int, ...]) -> None:
    """Each of `names` (checkpoints in `ckpt`) has one latent spec of `latent_shape`, 10 classes and a null
    label, naming the autoencoder shipped beside it, which is the codec a fleet of that directory finds."""
    info = codec_info(ckpt / "autoencoder.safetensors")
    for name in names:
        spec = router_spec(ckpt / f"{name}.safetensors")
        assert spec.space == "latent" and tuple(spec.sample_shape) == latent_shape, name
        assert spec.decoder == decoder_name(info.content_hash), name
        assert spec.num_classes == 10 and spec.conditioning.null_label, name
        assert fleet_codec(spec, [ckpt]) == ckpt / "autoencoder.safetensors"


def test_every_latent_checkpoint_names_the_shipped_autoencoder():
    info = codec_info(CKPT / "autoencoder.safetensors")
    assert info.image_shape == (3, 32, 32) and info.latent_channels == 4 and info.downsample == 2
    meta = json.loads((CKPT / "autoencoder.json").read_text())
    assert meta["training"]["val_psnr_db"] >= 30.0
    check_names_its_autoencoder(CKPT, FILES, (4, 16, 16))
    # the pixel fleet's partition: the same images per expert, so the two fleets compare like for like
    assert (CKPT / "partition.json").read_bytes() == (CKPT.parent / "colour" / "partition.json").read_bytes()


@pytest.mark.bus  # a LocalFleet: nats-server, workers and a coordinator
async def test_the_latent_fleet_serves_decoded_rgb_digits_in_the_palette():
    from client.jobs import run_job
    from coordinator.local_fleet import LocalFleet
    from schemas import JobRequest

    async with LocalFleet.from_dir(CKPT, dtype="float32", buckets=(1, 2, 4, 8)) as fleet:
        assert fleet.decoder is not None
        req = JobRequest(labels=[0, 3, 7, 9, -1, -1], steps=20, seed=5, strategy="top1", stream=False)
        done = await run_job(fleet.nc, req, timeout=300)
    images = np.asarray(done.images, np.float32)
    assert images.shape == (6, 3, 32, 32) and np.isfinite(images).all()
    reading = colour_check(images, *palette_arrays({"palette": palette_table()}))  # as the judges read a manifest
    assert reading.correct.sum() >= 5, (reading.foreground_error, reading.background_error)
    # the in-process sampler (`ddm-fleet eval`'s offline twin) makes the same images of the same job, to float32
    # rounding: the workers may batch the job's rows otherwise (its labelled and null rows, 2 experts), and a
    # convolution's last bits follow the batch; a sampler that clipped the latents before decoding was far more off
    np.testing.assert_allclose(images, in_process_images(req), atol=1e-4)


def in_process_images(req, ckpt: Path = CKPT) -> np.ndarray:
    """The images the in-process sampler makes of a top1 job `req` that sets no guidance (the fleet's default
    applies) on the latent fleet in `ckpt`, decoded by its autoencoder: what the fleet's job should return."""
    from evaluation.sample_inprocess import SampleConfig, generate, initial_batch
    from models.autoencoder_torch import LatentCodec
    from models.fleet_guidance import fleet_default_guidance

    labels = np.asarray(req.labels, np.int64)
    scale = fleet_default_guidance(ckpt / "router.safetensors")  # the job set none: the fleet's default
    assert scale > 1  # the shipped latent fleets are served guided
    latents, _ = generate(
        SampleConfig("ddm-top1", "ddm", "top1", guidance=scale),
        digits=labels,
        noise=initial_batch(
            len(labels), len(labels), req.seed, tuple(router_spec(ckpt / "router.safetensors").sample_shape)
        ),
        steps=req.steps,
        solver="euler",
        device="cpu",
        checkpoints=str(ckpt),
        seed=req.seed,
        job_size=len(labels),
        dtype="float32",
        latent=True,
    )
    return LatentCodec.load(ckpt / "autoencoder").decode(latents)
