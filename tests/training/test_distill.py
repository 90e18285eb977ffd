"""Distillation: a dense student learns the tiny ensemble's velocity, saves a servable expert
checkpoint, resumes, and the `ddm-fleet distill` command runs end to end."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from models.checkpoint import load_checkpoint, load_torch_model
from models.tiny import make_tiny_experts, make_tiny_router
from training.distill import DistillConfig, DistillError, Teacher, distill, distill_batch, distill_loss
from workers.backends.torch_backend import TorchBackend

pytestmark = pytest.mark.train


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("teacher")
    make_tiny_experts(d, 2, jitter=0.05)
    make_tiny_router(d / "router", 2)
    return d


def _data(n=16, seed=0):
    rng = np.random.default_rng(seed)
    return rng.uniform(-1, 1, (n, 1, 32, 32)).astype(np.float32), rng.integers(0, 10, n).astype(np.int64)


def _cfg(tmp_path, teacher_dir, **kw):
    base = dict(
        checkpoints=str(teacher_dir),
        out=str(tmp_path / "student"),
        run_dir=str(tmp_path / "run"),
        steps=30,
        batch_size=16,
        lr=3e-3,
        warmup=3,
        ema_decay=0.0,
        save_every=1000,
        log_every=10,
        save_dtype="float32",
        threads=1,
    )
    base.update(kw)
    return DistillConfig(**base)


def test_teacher_is_the_router_weighted_sum(teacher_dir):
    teacher = Teacher.load(teacher_dir)
    x, y = _data(4)
    x_t, t, u = distill_batch(teacher, torch.from_numpy(x), torch.from_numpy(y), torch.Generator().manual_seed(0))
    w = teacher.weights(x_t, t, torch.from_numpy(y))
    with torch.no_grad():
        want = sum(w[:, k, None, None, None] * e(x_t, t, torch.from_numpy(y)) for k, e in enumerate(teacher.experts))
    assert torch.allclose(u, want, atol=1e-6) and torch.allclose(w.sum(1), torch.ones(4))
    top1 = Teacher.load(teacher_dir, strategy="top1")
    assert set(top1.weights(x_t, t, torch.from_numpy(y)).flatten().tolist()) <= {0.0, 1.0}


def test_distill_lowers_loss_on_a_fixed_batch_and_serves(tmp_path, teacher_dir):
    teacher = Teacher.load(teacher_dir)
    images, labels = _data(16)
    cfg = _cfg(tmp_path, teacher_dir)
    x_t, t, u = distill_batch(
        teacher, torch.from_numpy(images), torch.from_numpy(labels), torch.Generator().manual_seed(7)
    )
    y = torch.from_numpy(labels)

    torch.manual_seed(cfg.seed)  # the student's init, as distill() builds it
    from models.unet_torch import UNet

    with torch.no_grad():
        before = float(distill_loss(UNet(teacher.config).eval(), x_t, t, y, u))
    stats = distill(cfg, teacher, images, labels, progress=False)
    assert stats["steps"] == 30 and stats["complete"] and len(stats["loss_history"]) == 3

    student, meta = load_torch_model(tmp_path / "student.safetensors")
    with torch.no_grad():
        after = float(distill_loss(student, x_t, t, y, u))
    assert after < 0.5 * before, (before, after)
    assert meta["partition"]["method"] == "distilled" and meta["distilled_from"]["strategy"] == "full"
    assert len(meta["distilled_from"]["experts"]) == 2 and meta["config"] == teacher.config.to_dict()

    be = TorchBackend(channels_last=False)  # served like any expert / monolith checkpoint
    be.load(tmp_path / "student.safetensors")
    v = be.forward(x_t.numpy(), t.numpy(), labels)
    with torch.no_grad():
        np.testing.assert_allclose(v, student(x_t, t, y).numpy(), atol=1e-5)


def test_distill_resumes_and_refuses_another_teacher(tmp_path, teacher_dir):
    teacher = Teacher.load(teacher_dir)
    images, labels = _data(32)
    first = distill(
        _cfg(tmp_path, teacher_dir, steps=10, save_every=5, log_every=5), teacher, images, labels, progress=False
    )
    second = distill(
        _cfg(tmp_path, teacher_dir, steps=15, log_every=5), teacher, images, labels, resume=True, progress=False
    )
    assert second["steps"] == 15 and [h["step"] for h in second["loss_history"]] == [5, 10, 15]
    assert second["loss_history"][:2] == first["loss_history"]
    meta, _ = load_checkpoint(tmp_path / "student.safetensors")
    assert meta["training"]["steps"] == 15

    with pytest.raises(DistillError, match="strategy"):
        distill(
            _cfg(tmp_path, teacher_dir, steps=20, strategy="top1"),
            Teacher.load(teacher_dir, "top1"),
            images,
            labels,
            resume=True,
            progress=False,
        )
    with pytest.raises(DistillError, match="null label"):  # tiny experts have no null label
        distill(_cfg(tmp_path, teacher_dir, label_dropout=0.2), teacher, images, labels, progress=False)


def test_teacher_load_errors(tmp_path, teacher_dir):
    with pytest.raises(DistillError, match="router"):
        Teacher.load(tmp_path)
    make_tiny_router(tmp_path / "router", 3)
    make_tiny_experts(tmp_path, 2)
    with pytest.raises(DistillError, match="expert2.safetensors is missing"):
        Teacher.load(tmp_path)


def test_distill_cli(tmp_path, teacher_dir, capsys):
    from infra.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["distill", "--help"])
    assert exc.value.code == 0
    help_text = capsys.readouterr().out
    assert "noised training images" in help_text and "--resume" in help_text and "--strategy" in help_text

    out = tmp_path / "cli_student"
    assert (
        main(
            [
                "distill",
                "--checkpoints",
                str(teacher_dir),
                "--steps",
                "3",
                "--batch-size",
                "8",
                "--limit",
                "32",
                "--out",
                str(out),
                "--run-dir",
                str(tmp_path / "r"),
                "--threads",
                "1",
                "--no-progress",
            ]
        )
        == 0
    )
    assert "saved" in capsys.readouterr().out
    meta, _ = load_checkpoint(out.with_suffix(".safetensors"))
    assert meta["training"]["steps"] == 3 and meta["partition"]["num_images"] == 32
    assert main(["distill", "--checkpoints", str(tmp_path / "nowhere"), "--steps", "1", "--out", str(out)]) == 2
    assert "router" in capsys.readouterr().err


def test_dit_teachers_distil_into_a_dit_student(tmp_path):
    """Experts with "arch": "dit" load as DiTs; the student copies their architecture and saves as a DiT."""
    from models.dit_torch import DiT
    from models.tiny import make_tiny_dit

    d = tmp_path / "dit-teacher"
    for k in range(2):
        make_tiny_dit(d / f"expert{k}", expert_id=k)
    make_tiny_router(d / "router", 2)
    teacher = Teacher.load(d)
    assert all(isinstance(e, DiT) for e in teacher.experts) and type(teacher.config).__name__ == "DiTConfig"
    images, labels = _data(16)
    stats = distill(_cfg(tmp_path, d, steps=4, log_every=2), teacher, images, labels, progress=False)
    assert stats["steps"] == 4
    student, meta = load_torch_model(tmp_path / "student.safetensors")
    assert isinstance(student, DiT) and meta["arch"] == "dit" and meta["config"] == teacher.config.to_dict()
    with pytest.raises(DistillError, match="these teacher experts are DiTs"):
        distill(_cfg(tmp_path, d, widths=(8, 16)), teacher, images, labels, progress=False)
