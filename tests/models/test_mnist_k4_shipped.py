"""The shipped MNIST study set (checkpoints/mnist-k4/): four experts on the K = 4 feature partition and a
monolith of equal training compute, the set docs/RESULTS.md compares unconditionally. One spec across
experts, router and monolith; the shipped feature partition; steps in proportion to each expert's images,
summing to the monolith's; and unlabelled `sample` jobs served through a real local fleet."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from coordinator.startup import router_spec

ROOT = Path(__file__).resolve().parents[2] / "checkpoints"
SET = ROOT / "mnist-k4"
NAMES = ["expert0", "expert1", "expert2", "expert3", "router", "monolith"]


def test_the_set_has_one_mnist_spec_and_the_shipped_feature_partition():
    for name in NAMES:
        spec = router_spec(SET / f"{name}.safetensors")
        assert tuple(spec.sample_shape) == (1, 32, 32), name
        assert spec.num_classes == 10 and spec.conditioning.null_label, name  # unlabelled rows have a null label
    assert (SET / "partition.json").read_bytes() == (ROOT / "features4" / "partition.json").read_bytes()


def test_the_experts_trained_in_proportion_to_their_images_for_the_monoliths_steps():
    part = json.loads((SET / "partition.json").read_text())
    images = np.array([len(e["indices"]) for e in part["experts"]])
    steps = np.array([json.loads((SET / f"expert{k}.json").read_text())["training"]["steps"] for k in range(4)])
    mono = json.loads((SET / "monolith.json").read_text())["training"]["steps"]
    assert steps.sum() == mono == 7200
    assert np.allclose(steps / mono, images / images.sum(), atol=1e-3), steps


@pytest.mark.bus  # a LocalFleet: nats-server, workers and a coordinator
async def test_unlabelled_sample_jobs_run_through_a_local_fleet():
    from client.jobs import run_job
    from coordinator.local_fleet import LocalFleet
    from schemas import JobRequest

    async with LocalFleet.from_dir(SET, dtype="float32", buckets=(1, 2, 4, 8)) as fleet:
        req = JobRequest(labels=[-1] * 6, steps=12, seed=3, strategy="sample", stream=False)
        done = await run_job(fleet.nc, req, timeout=300)
    images = np.asarray(done.images, np.float32)
    assert images.shape == (6, 1, 32, 32) and np.isfinite(images).all()
    usage = np.asarray(done.usage)
    # the share of the 12 steps each expert computed: one expert per row per step
    assert usage.shape == (6, 4) and np.allclose(usage.sum(axis=1), 1) and np.allclose(usage * 12, np.round(usage * 12))


def test_the_set_serves_the_guidance_scale_its_judges_chose():
    """router.json names the default scale docs/RESULTS.md's sweep chose; every expert has a null label."""
    import json

    from models.fleet_guidance import fleet_default_guidance

    assert fleet_default_guidance(SET / "router.safetensors") == 2.0
    assert "docs/RESULTS.md" in json.loads((SET / "router.json").read_text())["guidance"]["chosen_by"]
    assert all(json.loads(p.read_text())["spec"]["conditioning"]["null_label"] for p in SET.glob("expert*.json"))
