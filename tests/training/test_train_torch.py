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


def test_train_expert_takes_dtype_and_the_old_bf16_with_a_warning(capsys):
    """`train-expert --dtype` like every other command; `--bf16` still works (deprecated); the run
    records the answer as `bf16`, as its checkpoints always have."""
    from infra.cli import build_parser
    from training.train_torch import config_from_args

    def parse(*extra):
        return build_parser().parse_args(["train-expert", "--expert", "0", *extra])

    assert config_from_args(parse()).bf16 is False  # float32 by default, as before
    assert config_from_args(parse("--dtype", "bfloat16")).bf16 is True
    assert capsys.readouterr().err == ""
    args = parse("--bf16")
    assert args.dtype == "bfloat16" and config_from_args(args).bf16 is True
    assert "--bf16 is deprecated and will be removed; use --dtype bfloat16" in capsys.readouterr().err


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
    x, y, which, spec = sample_oracle([str(a), str(b)], [1, 7], per_class=3, steps=2, progress=False)
    assert spec.sample_shape == (1, 32, 32) and spec.num_classes == 10  # implied: no spec in the checkpoints
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


def test_sample_cli_takes_shape_and_class_names_from_the_spec(tmp_path, capsys):
    """RGB experts with a spec naming 4 classes: samples [N, 3, 16, 16], an RGB grid, class names in the npz;
    experts whose specs disagree are refused."""
    from PIL import Image

    from infra.cli import main
    from models.checkpoint import load_checkpoint, save_checkpoint
    from models.spec import with_spec
    from models.tiny import make_tiny_expert
    from schemas.spec import Conditioning, ModelSpec

    names = ["cat", "dog", "owl", "fox"]
    spec = ModelSpec(sample_shape=(3, 16, 16), conditioning=Conditioning(num_classes=4, class_names=names))
    paths = []
    for k in range(2):
        p = make_tiny_expert(tmp_path / f"e{k}", expert_id=k, classes=[2 * k, 2 * k + 1], in_channels=3,
                             image_size=16, num_classes=4)  # fmt: skip
        meta, state = load_checkpoint(p)
        paths.append(str(save_checkpoint(p, state, with_spec(meta, spec))))
    out, npz = tmp_path / "rgb.png", tmp_path / "rgb.npz"
    argv = ["sample", "--checkpoint", paths[0], "--checkpoint", paths[1], "--classes", "1,2", "--per-class", "3",
            "--steps", "2", "--out", str(out), "--npz", str(npz)]  # fmt: skip
    assert main(argv) == 0, capsys.readouterr().err
    im = Image.open(out)
    assert im.mode == "RGB" and im.size[1] == 2 * 34 + 2  # 2 rows of 16 px scaled 2x, 2 px gaps
    data = np.load(npz)
    assert data["images"].shape == (6, 3, 16, 16) and data["labels"].tolist() == [1, 1, 1, 2, 2, 2]
    assert data["class_names"].tolist() == names
    grey = make_tiny_expert(tmp_path / "grey", expert_id=2, classes=[0])
    assert main(["sample", "--checkpoint", paths[0], "--checkpoint", str(grey), "--classes", "1", "--out",
                 str(out)]) == 2  # fmt: skip
    assert "disagree" in capsys.readouterr().err
