"""`ddm-fleet generate --local` on a fleet that is not MNIST: tiny 3x32x32 experts of 4 named classes (UNets
or DiTs) and a 3-channel router whose checkpoint names the classes. The CLI reads the fleet's spec, takes
--labels by name, index or "?", submits them as `labels` (not a ten-class fleet), and writes an RGB PNG grid
and an npz with labels and class names."""

from __future__ import annotations

import json

import numpy as np
import pytest

from schemas.spec import Conditioning, ModelSpec
from tests.infra.test_cmd_generate import _cli

NAMES = ["red", "green", "blue", "Sea Blue"]
SPEC = ModelSpec(sample_shape=(3, 32, 32), conditioning=Conditioning(num_classes=4, class_names=NAMES, null_label=True))


def _rgb_fleet_dir(d, arch: str):
    """<d>/expert0,1 (classes 0-1 | 2-3, null label), router.safetensors with SPEC, partition.json of 4 classes."""
    from dataset.partition import DatasetRef, partition_by_classes, save_manifest
    from models.tiny import make_tiny_dit, make_tiny_expert, make_tiny_router

    shape = {"in_channels": 3, "num_classes": 4, "null_label": True}
    for k in range(2):
        make = make_tiny_dit if arch == "dit" else make_tiny_expert
        make(d / f"expert{k}", expert_id=k, jitter=0.05, classes=[2 * k, 2 * k + 1], **shape)
    make_tiny_router(d / "router", 2, meta={"spec": SPEC.to_json()}, in_channels=3, num_classes=4)
    ref = DatasetRef(name="rgb4", path=str(d), content_hash="0" * 64, sample_shape=[3, 32, 32], num_classes=4)
    save_manifest(partition_by_classes(np.arange(8) % 4, [[0, 1], [2, 3]], dataset=ref), d / "partition.json")
    return d


@pytest.mark.procs
@pytest.mark.parametrize("arch", ["unet", "dit"])
def test_generate_local_rgb_fleet_by_class_name_writes_npz_with_class_names(tmp_path, arch):
    d = _rgb_fleet_dir(tmp_path / "ck", arch)
    out = tmp_path / "rgb.npz"
    r = _cli(
        "--local", "--checkpoints", str(d), "--labels", "red, sea blue,?,2", "--steps", "2", "--seed", "3",
        "--strategy", "top1", "--out", str(out), "--json", "--no-progress", timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    s = json.loads(r.stdout)
    assert [i["label"] for i in s["images"]] == [0, 3, -1, 2]
    assert [i["class"] for i in s["images"]] == ["red", "Sea Blue", "?", "blue"]
    assert "digit" not in s["images"][0] and s["class_names"] == NAMES and s["sample_shape"] == [3, 32, 32]
    data = np.load(out)
    assert data["images"].shape == (4, 3, 32, 32) and data["images"].dtype == np.float32
    assert np.isfinite(data["images"]).all() and np.abs(data["images"]).max() <= 1.0
    assert data["labels"].tolist() == [0, 3, -1, 2] and data["class_names"].tolist() == NAMES
    # the jittered experts differ: the red image (expert 0) is not the blue one (expert 1)
    assert np.abs(data["images"][0] - data["images"][3]).max() > 1e-3


@pytest.mark.procs
def test_generate_local_rgb_fleet_writes_an_rgb_grid_and_refuses_unknown_classes(tmp_path):
    from PIL import Image

    d = _rgb_fleet_dir(tmp_path / "ck", "unet")
    png = tmp_path / "rgb.png"
    r = _cli("--local", "--checkpoints", str(d), "--count", "5", "--steps", "2", "--seed", "1", "--per-row", "3",
             "--out", str(png), "--no-progress", timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert "wrote 5 images (" in r.stdout and all(n in NAMES for n in r.stdout.split("(")[1].split(")")[0].split(","))
    im = Image.open(png)
    assert im.mode == "RGB" and im.size == (3 * 66 + 2, 2 * 66 + 2)  # rows of 3 tiles of 64 px (32 px scaled 2x)
    bad = _cli("--local", "--checkpoints", str(d), "--labels", "red,purple", "--out", str(png), "--no-progress")
    assert bad.returncode == 2 and "'purple' is not a class of this fleet" in bad.stderr and "Sea Blue" in bad.stderr


def test_plan_sends_labels_on_a_four_class_fleet_and_digits_on_mnist():
    from infra.cli import parse_args
    from infra.cmd_generate import plan_requests

    args = parse_args(["generate", "--labels", "blue;Red;?", "--seed", "4", "--out", "x.npz"])
    (req,), seed = plan_requests(args, SPEC)
    assert req.labels == [2, 0, -1] and req.digits is None and seed == 4
    args = parse_args(["generate", "--count", "7", "--seed", "4", "--images-per-job", "3", "--out", "x.npz"])
    reqs, _ = plan_requests(args, SPEC)
    drawn = [c for r in reqs for c in r.labels]
    assert len(drawn) == 7 and set(drawn) <= {0, 1, 2, 3} and all(r.digits is None for r in reqs)
    (mnist,), _ = plan_requests(parse_args(["generate", "--labels", "3,7", "--out", "x.npz"]))
    assert mnist.digits == [3, 7] and mnist.labels is None  # v1 field on the ten-class fleet
    with pytest.raises(ValueError, match="4 classes"):
        plan_requests(parse_args(["generate", "--digits", "7", "--out", "x.npz"]), SPEC)
