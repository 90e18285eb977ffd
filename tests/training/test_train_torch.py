"""Torch trainer: a tiny real run on a real MNIST slice lowers the loss, saves EMA weights, resumes."""

from __future__ import annotations

import numpy as np
import pytest

from models.checkpoint import load_checkpoint
from training.train_torch import TrainConfig, ema_decay_at, load_expert_data, lr_at, train_expert

PARTITION = "checkpoints/partition.json"


def _cfg(tmp_path, **kw):
    base = dict(
        expert=1,
        partition=PARTITION,
        widths=(8, 16, 16),
        steps=60,
        batch_size=16,
        lr=3e-3,
        warmup=5,
        ema_decay=0.99,
        threads=1,
        save_every=1000,
        log_every=10,
        limit=512,
        save_dtype="float32",
        out=str(tmp_path / "e1"),
        run_dir=str(tmp_path / "run"),
    )
    base.update(kw)
    return TrainConfig(**base)


@pytest.fixture(scope="module")
def expert1_data(tmp_path_factory):
    cfg = _cfg(tmp_path_factory.mktemp("d"))
    return load_expert_data(cfg)


def test_loads_only_the_partition(expert1_data):
    images, labels, info = expert1_data
    assert images.shape == (512, 1, 32, 32) and images.dtype == np.float32
    assert images.min() >= -1.0 and images.max() <= 1.0
    assert set(np.unique(labels)) <= {5, 6, 7, 8, 9}
    assert info["classes"] == [5, 6, 7, 8, 9] and info["num_images"] == 512
    assert sum(info["class_counts"][:5]) == 0


@pytest.mark.train
def test_tiny_run_lowers_loss_and_resumes(tmp_path, expert1_data):
    images, labels, info = expert1_data
    cfg = _cfg(tmp_path, steps=40)
    stats = train_expert(cfg, images, labels, info, progress=False)
    hist = [h["loss"] for h in stats["loss_history"]]
    assert stats["steps"] == 40 and len(hist) == 4
    assert hist[-1] < 0.8 * hist[0], hist

    meta, state = load_checkpoint(tmp_path / "e1.safetensors")
    assert meta["expert_id"] == 1 and meta["weights"] == "ema"
    assert meta["partition"]["classes"] == [5, 6, 7, 8, 9]
    assert meta["training"]["final_loss"] == pytest.approx(np.mean(hist[-5:]), abs=1e-4)
    assert all(v.dtype == np.float32 for v in state.values())

    # resume to 60 steps: continues the same history, ends at step 60
    stats2 = train_expert(_cfg(tmp_path, steps=60), images, labels, info, resume=True, progress=False)
    assert stats2["steps"] == 60 and [h["step"] for h in stats2["loss_history"]] == [10, 20, 30, 40, 50, 60]
    assert stats2["loss_history"][:4] == stats["loss_history"]


def test_resume_refuses_other_widths(tmp_path, expert1_data):
    images, labels, info = expert1_data
    train_expert(_cfg(tmp_path, steps=2, log_every=1), images, labels, info, progress=False)
    with pytest.raises(ValueError, match="widths"):
        train_expert(_cfg(tmp_path, steps=4, widths=(8, 16, 32)), images, labels, info, resume=True, progress=False)
    with pytest.raises(FileNotFoundError):
        train_expert(
            _cfg(tmp_path, steps=4, run_dir=str(tmp_path / "none")), images, labels, info, resume=True, progress=False
        )


def test_schedules_and_validation(tmp_path):
    cfg = _cfg(tmp_path, steps=100, warmup=10, lr=1e-3)
    assert lr_at(0, cfg) == pytest.approx(1e-4)
    assert lr_at(9, cfg) == pytest.approx(1e-3)
    assert lr_at(100, cfg) == pytest.approx(cfg.min_lr_ratio * 1e-3)
    assert ema_decay_at(0, 0.999) < 0.2 and ema_decay_at(10**6, 0.999) == 0.999
    with pytest.raises(ValueError, match="--steps"):
        _cfg(tmp_path, steps=0)
    with pytest.raises(ValueError, match="--device"):
        _cfg(tmp_path, device="tpu")
    with pytest.raises(ValueError, match="--expert 5"):
        load_expert_data(_cfg(tmp_path, expert=5))


@pytest.mark.train
def test_cli_train_expert(tmp_path, capsys):
    from infra.cli import main

    rc = main(
        [
            "train-expert",
            "--expert",
            "0",
            "--partition",
            PARTITION,
            "--widths",
            "8,16,16",
            "--steps",
            "3",
            "--batch-size",
            "8",
            "--limit",
            "64",
            "--threads",
            "1",
            "--no-progress",
            "--out",
            str(tmp_path / "cli"),
            "--run-dir",
            str(tmp_path / "r"),
        ]
    )
    assert rc == 0
    meta, _ = load_checkpoint(tmp_path / "cli.safetensors")
    assert meta["weights_dtype"] == "float16" and meta["training"]["steps"] == 3
    assert main(["train-expert", "--expert", "0", "--widths", "8,x"]) == 2
    assert "train-expert: error" in capsys.readouterr().err


def test_sample_cli_routes_by_partition(tmp_path, capsys):
    from PIL import Image

    from infra.cli import main
    from infra.cmd_sample import parse_classes, sample_oracle
    from models.tiny import make_tiny_expert

    a = make_tiny_expert(tmp_path / "a", expert_id=0, classes=[0, 1, 2, 3, 4])
    b = make_tiny_expert(tmp_path / "b", expert_id=1, classes=[5, 6, 7, 8, 9])
    x, y, which = sample_oracle([str(a), str(b)], [1, 7], per_class=3, steps=2, progress=False)
    assert x.shape == (6, 1, 32, 32) and x.dtype == np.float32 and np.isfinite(x).all()
    assert y.tolist() == [1, 1, 1, 7, 7, 7] and which.tolist() == [0, 0, 0, 1, 1, 1]

    out = tmp_path / "g.png"
    assert (
        main(
            [
                "sample",
                "--checkpoint",
                str(a),
                "--checkpoint",
                str(b),
                "--classes",
                "3,8",
                "--per-class",
                "2",
                "--steps",
                "2",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    assert Image.open(out).size[1] == 2 * 66 + 2
    assert main(["sample", "--checkpoint", str(a), "--classes", "0-9", "--steps", "1", "--out", str(out)]) == 2
    assert "no checkpoint's partition holds class(es) [5, 6, 7, 8, 9]" in capsys.readouterr().err
    assert parse_classes("0-2,9") == [0, 1, 2, 9]
    with pytest.raises(ValueError):
        parse_classes("5-1")
