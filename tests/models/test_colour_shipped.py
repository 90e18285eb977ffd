"""The shipped colour MNIST fleet (checkpoints/colour/): one spec across experts, router and monolith, a
partition that records colour MNIST, and RGB images in the palette served through a real local fleet."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from coordinator.startup import router_spec
from dataset.builtin import palette_table
from evaluation.views import colour_check, palette_arrays

CKPT = Path(__file__).resolve().parents[2] / "checkpoints" / "colour"
FILES = ["expert0", "expert1", "expert2", "expert3", "router", "monolith"]


def test_every_colour_checkpoint_has_the_colour_spec():
    specs = {name: router_spec(CKPT / f"{name}.safetensors") for name in FILES}
    for name, spec in specs.items():
        assert tuple(spec.sample_shape) == (3, 32, 32), name
        assert spec.num_classes == 10 and spec.conditioning.null_label, name
    part = json.loads((CKPT / "partition.json").read_text())
    judge = json.loads((CKPT.parent / "judges" / "colour-mnist-20b9f7088086-cnn-v1.json").read_text())
    assert part["num_experts"] == 4 and part["dataset"]["name"] == "colour-mnist"
    assert part["dataset"]["content_hash"] == judge["dataset_hash"]  # judged on the data it was trained on
    idx = np.concatenate([e["indices"] for e in part["experts"]])
    assert len(idx) == len(set(idx.tolist())) == 50_000


async def test_the_colour_fleet_serves_rgb_digits_in_the_palette():
    from client.jobs import run_job
    from coordinator.local_fleet import LocalFleet
    from schemas import JobRequest

    async with LocalFleet.from_dir(CKPT, dtype="float32", buckets=(1, 2, 4, 8)) as fleet:
        req = JobRequest(labels=[0, 3, 7, 9, -1, -1], steps=20, seed=5, strategy="top1", stream=False)
        done = await run_job(fleet.nc, req, timeout=300)
    images = np.asarray(done.images, np.float32)
    assert images.shape == (6, 3, 32, 32) and np.isfinite(images).all()
    reading = colour_check(images, *palette_arrays({"palette": palette_table()}))  # as the judges read a manifest
    assert reading.correct.sum() >= 5, (reading.foreground_error, reading.background_error)
