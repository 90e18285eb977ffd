"""The shipped colour MNIST fleets (checkpoints/colour/: a colour partition, with the monolith;
checkpoints/colour-shape/: a shape partition): one spec across experts, router and monolith, a partition
that records colour MNIST, and RGB images in the palette served through a real local fleet."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from coordinator.startup import router_spec
from dataset.builtin import palette_table
from evaluation.views import colour_check, palette_arrays

CKPT = Path(__file__).resolve().parents[2] / "checkpoints" / "colour"
SHAPE = CKPT.parent / "colour-shape"
FILES = ["expert0", "expert1", "expert2", "expert3", "router"]


@pytest.mark.parametrize("fleet", [CKPT, SHAPE], ids=["colour", "colour-shape"])
def test_every_colour_checkpoint_has_the_colour_spec(fleet):
    names = FILES + (["monolith"] if fleet == CKPT else [])  # one monolith of equal compute serves both
    specs = {name: router_spec(fleet / f"{name}.safetensors") for name in names}
    for name, spec in specs.items():
        assert tuple(spec.sample_shape) == (3, 32, 32), name
        assert spec.num_classes == 10 and spec.conditioning.null_label, name
    part = json.loads((fleet / "partition.json").read_text())
    judge = json.loads((CKPT.parent / "judges" / "colour-mnist-20b9f7088086-cnn-v1.json").read_text())
    assert part["num_experts"] == 4 and part["dataset"]["name"] == "colour-mnist"
    assert part["dataset"]["content_hash"] == judge["dataset_hash"]  # judged on the data it was trained on
    idx = np.concatenate([e["indices"] for e in part["experts"]])
    assert len(idx) == len(set(idx.tolist())) == 50_000


@pytest.mark.bus  # a LocalFleet: nats-server, workers and a coordinator
@pytest.mark.parametrize("fleet", [CKPT, SHAPE], ids=["colour", "colour-shape"])
async def test_the_colour_fleet_serves_rgb_digits_in_the_palette(fleet):
    from client.jobs import run_job
    from coordinator.local_fleet import LocalFleet
    from schemas import JobRequest

    async with LocalFleet.from_dir(fleet, dtype="float32", buckets=(1, 2, 4, 8)) as fleet:
        req = JobRequest(labels=[0, 3, 7, 9, -1, -1], steps=20, seed=5, strategy="top1", stream=False)
        done = await run_job(fleet.nc, req, timeout=300)
    images = np.asarray(done.images, np.float32)
    assert images.shape == (6, 3, 32, 32) and np.isfinite(images).all()
    reading = colour_check(images, *palette_arrays({"palette": palette_table()}))  # as the judges read a manifest
    assert reading.correct.sum() >= 5, (reading.foreground_error, reading.background_error)


def test_the_shape_partition_groups_digits_and_its_experts_trained_in_proportion():
    """checkpoints/colour-shape: k-means of the data judge's features puts (almost) every image of a digit with
    one expert, and each expert trained for its share of the monolith's 6,000 steps (equal compute)."""
    part = json.loads((SHAPE / "partition.json").read_text())
    counts = np.array([e["class_counts"] for e in part["experts"]])  # [K, 10]
    assert (counts.max(axis=0) / counts.sum(axis=0) > 0.99).all(), counts
    steps = [json.loads((SHAPE / f"expert{k}.json").read_text())["training"]["steps"] for k in range(4)]
    images = counts.sum(axis=1)
    assert sum(steps) == 6000 and np.allclose(np.array(steps) / 6000, images / images.sum(), atol=1e-3), steps


def test_the_colour_fleet_serves_the_guidance_scale_its_judges_chose():
    """Each colour fleet's router.json names the default scale its sweep chose (docs/RESULTS.md), which the
    experts, all trained with a null label, can serve."""
    from models.fleet_guidance import fleet_default_guidance

    for fleet, scale in ((CKPT, 3.0), (SHAPE, 2.0)):
        assert fleet_default_guidance(fleet / "router.safetensors") == scale
        assert "docs/RESULTS.md" in json.loads((fleet / "router.json").read_text())["guidance"]["chosen_by"]
        assert all(json.loads(p.read_text())["spec"]["conditioning"]["null_label"] for p in fleet.glob("expert*.json"))
