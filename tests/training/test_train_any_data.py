"""Training on any prepared dataset, with either architecture: partition, train-expert (--arch dit, torch
and jax), train-router and distill on a tiny RGB dataset; every checkpoint carries its model spec, the
torch worker backend serves the DiT expert, and a partition made from other data is refused."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dataset.partition import PartitionError, load_manifest
from dataset.prepared import inputs_key, write_prepared
from infra.cli import main
from models.checkpoint import load_checkpoint
from models.router import load_router_meta
from models.spec import spec_of
from training.train_torch import TrainConfig, load_expert_data

NAMES = ["red", "green", "blue"]
SIZE = 16
DIT = ["--arch", "dit", "--patch-size", "4", "--hidden-size", "32", "--depth", "2", "--heads", "2"]
QUICK = ["--steps", "3", "--batch-size", "8", "--threads", "1", "--no-progress"]


def _prepare(out, seed: int, labelled: bool = True, n_train: int = 48, n_val: int = 16):
    """A tiny RGB prepared dataset (3x16x16 uint8, 3 named classes or unlabelled), made by the builders'
    writer; different seeds give different content."""
    rng = np.random.default_rng(seed)

    def split(n):
        labels = rng.integers(0, 3, n).astype(np.int64) if labelled else np.full(n, -1, np.int64)
        return {"images": rng.integers(0, 256, (n, 3, SIZE, SIZE)).astype(np.uint8), "labels": labels}

    write_prepared(
        out,
        {"train": split(n_train), "val": split(n_val)},
        name="tiny-rgb" if labelled else "tiny-rgb-unlabelled",
        source={"test": seed},
        class_names=NAMES if labelled else None,
        made={"seed": seed},
        key=inputs_key({"seed": seed, "labelled": labelled}),
    )
    return out


@pytest.fixture(scope="module")
def rgb(tmp_path_factory):
    """(dataset dir, partition file) of a labelled 3x16x16 dataset split into 2 kmeans experts."""
    d = tmp_path_factory.mktemp("rgb")
    data = _prepare(d / "ds", seed=0)
    part = d / "partition.json"
    assert main(["partition", "--data", str(data), "--method", "kmeans", "--experts", "2", "--out", str(part)]) == 0
    return data, part


def test_partition_of_a_prepared_dataset_records_it(rgb, tmp_path, capsys):
    data, part = rgb
    m = load_manifest(part)
    assert m.dataset is not None and m.dataset.name == "tiny-rgb" and m.dataset.sample_shape == [3, SIZE, SIZE]
    assert m.dataset.class_names == NAMES and m.num_classes == 3 and len(m.class_owner) == 3
    assert m.num_images == 48 and sorted(i for e in m.experts for i in e.indices) == list(range(48))
    assert all(len(e.class_counts) == 3 for e in m.experts)
    assert m.kmeans.pool == 2  # 16 px pooled to 8x8, over 3 channels
    assert len(m.kmeans.mean) == 3 * 8 * 8

    # the classes method groups the dataset's 3 classes
    out = tmp_path / "classes.json"
    assert main(["partition", "--data", str(data), "--method", "classes", "--experts", "2", "--out", str(out)]) == 0
    mc = load_manifest(out)
    assert [e.classes for e in mc.experts] == [[0, 1], [2]] and mc.class_owner == [0, 0, 1]
    capsys.readouterr()
    assert main(["partition", "--data", str(data), "--method", "classes", "--classes", "0-4,5-9", "--out", str(out)])
    assert "outside 0..2" in capsys.readouterr().err


def test_mnist_partition_files_are_unchanged():
    """MNIST stays the default: the shipped manifest loads with 10 classes and writes back without a
    dataset block."""
    m = load_manifest("checkpoints/partition.json")
    assert m.dataset is None and m.num_classes == 10
    assert "dataset" not in json.loads(m.model_dump_json(by_alias=True, exclude_none=True))


@pytest.mark.train
def test_train_expert_dit_on_rgb_spec_and_torch_worker_serves_it(rgb, tmp_path):
    from workers.backends.torch_backend import TorchBackend

    data, part = rgb
    out = tmp_path / "expert0"
    args = ["train-expert", "--data", str(data), "--partition", str(part), "--expert", "0", *DIT, *QUICK]
    assert main([*args, "--out", str(out), "--run-dir", str(tmp_path / "run")]) == 0
    meta, state = load_checkpoint(out.with_suffix(".safetensors"))
    assert meta["arch"] == "dit" and meta["config"]["in_channels"] == 3 and meta["config"]["image_size"] == SIZE
    assert meta["config"]["num_classes"] == 3 and meta["config"]["patch_size"] == 4
    spec = spec_of(meta)
    assert list(spec.sample_shape) == [3, SIZE, SIZE] and spec.arch == "dit"
    assert spec.conditioning.kind == "class" and spec.conditioning.class_names == NAMES
    assert spec.conditioning.null_label is False
    assert meta["partition"]["dataset"]["name"] == "tiny-rgb"

    backend = TorchBackend()
    backend.load(out.with_suffix(".safetensors"))
    assert backend.spec == spec and backend.input_shape == (3, SIZE, SIZE)
    x = np.random.default_rng(1).standard_normal((2, 3, SIZE, SIZE)).astype(np.float32)
    v = backend.forward(x, np.full(2, 0.5, np.float32), np.array([0, 2], np.int64))
    assert v.shape == (2, 3, SIZE, SIZE) and np.isfinite(v).all()

    # resuming with another size is refused, naming what differs
    with pytest.raises(ValueError, match="hidden_size"):
        from training.train_torch import train_expert

        cfg = TrainConfig(
            expert=0, partition=str(part), data=str(data), arch="dit", patch_size=4, hidden_size=16, depth=2,
            heads=2, steps=4, batch_size=8, out=str(out), run_dir=str(tmp_path / "run"), threads=1,
        )  # fmt: skip
        images, labels, info = load_expert_data(cfg)
        train_expert(cfg, images, labels, info, resume=True, progress=False)


@pytest.mark.train
def test_jax_backend_trains_a_dit_on_rgb(rgb, tmp_path):
    data, part = rgb
    out = tmp_path / "jexpert0"
    args = ["train-expert", "--backend", "jax", "--data", str(data), "--partition", str(part), "--expert", "0"]
    assert main([*args, *DIT, *QUICK, "--out", str(out), "--run-dir", str(tmp_path / "run")]) == 0
    meta, state = load_checkpoint(out.with_suffix(".safetensors"))
    assert meta["arch"] == "dit" and meta["training"]["backend"] == "jax" and meta["training"]["steps"] == 3
    assert list(spec_of(meta).sample_shape) == [3, SIZE, SIZE] and spec_of(meta).conditioning.class_names == NAMES
    assert all(np.isfinite(v).all() for v in state.values())


@pytest.mark.train
def test_train_router_on_rgb_stores_the_spec(rgb, tmp_path):
    data, part = rgb
    out = tmp_path / "router"
    args = ["train-router", "--partition", str(part), "--data", str(data), "--steps", "3", "--batch-size", "8"]
    assert main([*args, "--bins", "2", "--out", str(out), "--run-dir", str(tmp_path / "rrun")]) == 0
    meta = load_router_meta(out)
    assert meta["config"]["in_channels"] == 3 and meta["config"]["image_size"] == SIZE
    assert meta["config"]["num_classes"] == 3 and meta["accuracy_vs_t"]["n"] == 16
    spec = spec_of(meta)
    assert list(spec.sample_shape) == [3, SIZE, SIZE] and spec.conditioning.class_names == NAMES

    from coordinator.startup import router_spec

    assert router_spec(out.with_suffix(".safetensors")) == spec


def test_a_partition_of_other_data_is_refused(rgb, tmp_path, capsys):
    data, part = rgb
    other = _prepare(tmp_path / "other", seed=1)
    cfg = TrainConfig(expert=0, partition=str(part), data=str(other), batch_size=8)
    with pytest.raises(PartitionError, match=r"made from dataset 'tiny-rgb' \(.*ds.*but the data given is .*other"):
        load_expert_data(cfg)
    # the MNIST partition with a prepared dataset: refused, naming MNIST and the dataset
    cfg = TrainConfig(expert=0, partition="checkpoints/partition.json", data=str(data), batch_size=8)
    with pytest.raises(PartitionError, match="made from MNIST.*tiny-rgb"):
        load_expert_data(cfg)
    # train-router refuses too, through the CLI
    args = ["train-router", "--partition", str(part), "--data", str(other), "--steps", "1", "--out", str(tmp_path)]
    assert main(args) == 2
    assert "tiny-rgb" in capsys.readouterr().err
    # without --data the partition's own dataset is used
    images, labels, info = load_expert_data(TrainConfig(expert=0, partition=str(part), batch_size=8))
    assert images.shape[1:] == (3, SIZE, SIZE) and images.dtype == np.float32 and images.min() >= -1


@pytest.mark.train
def test_unlabelled_dataset_trains_unconditional_experts(tmp_path, capsys):
    data = _prepare(tmp_path / "u", seed=2, labelled=False)
    part = tmp_path / "p.json"
    assert main(["partition", "--data", str(data), "--method", "classes", "--out", str(part)]) == 2
    assert "unlabelled" in capsys.readouterr().err
    assert main(["partition", "--data", str(data), "--method", "random", "--experts", "2", "--out", str(part)]) == 0
    m = load_manifest(part)
    assert m.num_classes == 0 and m.class_owner == [] and m.dataset.num_classes == 0

    out = tmp_path / "u0"
    args = ["train-expert", "--partition", str(part), "--expert", "0", "--widths", "8,16", *QUICK]
    assert main([*args, "--out", str(out), "--run-dir", str(tmp_path / "run")]) == 0
    meta, _ = load_checkpoint(out.with_suffix(".safetensors"))
    assert meta["config"]["null_label"] is True and meta["config"]["num_classes"] == 1
    spec = spec_of(meta)
    assert spec.conditioning.kind == "none" and spec.conditioning.null_label and spec.arch == "unet"

    rout = tmp_path / "router"
    args = ["train-router", "--partition", str(part), "--steps", "2", "--batch-size", "8"]
    assert main([*args, "--out", str(rout), "--run-dir", str(tmp_path / "rrun")]) == 0
    assert spec_of(load_router_meta(rout)).conditioning.kind == "none"


def test_arch_flags_are_validated_with_the_fix(rgb, tmp_path):
    from training.train_torch import model_config

    with pytest.raises(ValueError, match="--hidden-size 30 must be divisible by --heads 4"):
        TrainConfig(expert=0, partition="p", arch="dit", hidden_size=30)
    with pytest.raises(ValueError, match="--arch must be one of unet, dit"):
        TrainConfig(expert=0, partition="p", arch="vit")
    with pytest.raises(ValueError, match="--depth must be a positive integer"):
        TrainConfig(expert=0, partition="p", arch="dit", depth=0)
    cfg = TrainConfig(expert=0, partition="p", arch="dit", patch_size=3)
    with pytest.raises(ValueError, match=r"--patch-size 3 must divide the data's image size 16; choose one of \[1, 2"):
        model_config(cfg, (3, 16, 16), 3, False)
    with pytest.raises(ValueError, match="--widths 8,16,32,64,128 has 5 levels"):
        model_config(TrainConfig(expert=0, partition="p", widths=(8, 16, 32, 64, 128)), (3, 16, 16), 3, False)
    # MNIST's model config is what it always was
    from models.config import UNetConfig

    mnist = model_config(TrainConfig(expert=0, partition="p"), (1, 32, 32), 10, False)
    assert mnist == UNetConfig(widths=(32, 64, 128))


@pytest.mark.train
def test_distilled_student_carries_the_teachers_spec(tmp_path):
    from models.tiny import make_tiny_experts, make_tiny_router
    from training.distill import DistillConfig, Teacher, distill

    make_tiny_experts(tmp_path, 2, jitter=0.05)
    make_tiny_router(tmp_path / "router", 2)
    teacher = Teacher.load(tmp_path)
    assert list(teacher.spec.sample_shape) == [1, 32, 32]
    rng = np.random.default_rng(0)
    x, y = rng.uniform(-1, 1, (16, 1, 32, 32)).astype(np.float32), rng.integers(0, 10, 16).astype(np.int64)
    cfg = DistillConfig(
        checkpoints=str(tmp_path), out=str(tmp_path / "student"), run_dir=str(tmp_path / "run"), steps=2,
        batch_size=8, save_every=100, log_every=1, save_dtype="float32", threads=1,
    )  # fmt: skip
    distill(cfg, teacher, x, y, progress=False)
    meta, _ = load_checkpoint(tmp_path / "student.safetensors")
    assert "spec" in meta and spec_of(meta).sample_shape == teacher.spec.sample_shape
    assert spec_of(meta).conditioning.num_classes == 10 and spec_of(meta).arch == meta["arch"]
    with pytest.raises(ValueError, match="teacher's experts make"):
        distill(cfg, teacher, np.zeros((16, 3, 16, 16), np.float32), y, progress=False)
