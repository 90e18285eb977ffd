"""--label-dropout: the torch trainer gives the expert a null label that it learns, and the torch
backend serves y = -1 from the checkpoint; the JAX trainer refuses the option clearly."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from models.checkpoint import load_checkpoint
from models.config import UNetConfig
from models.unet_torch import UNet
from training.train_torch import TrainConfig, load_expert_data, train_expert
from workers.backends.torch_backend import TorchBackend


def _cfg(tmp_path, **kw):
    base = dict(
        expert=0,
        partition="checkpoints/partition.json",
        widths=(8, 16),
        steps=6,
        batch_size=16,
        lr=3e-3,
        warmup=2,
        threads=1,
        save_every=1000,
        log_every=3,
        limit=64,
        save_dtype="float32",
        out=str(tmp_path / "e0"),
        run_dir=str(tmp_path / "run"),
        label_dropout=0.5,
    )
    base.update(kw)
    return TrainConfig(**base)


@pytest.mark.train
def test_label_dropout_trains_and_serves_the_null_label(tmp_path):
    cfg = _cfg(tmp_path)
    images, labels, info = load_expert_data(cfg)
    train_expert(cfg, images, labels, info, progress=False)
    meta, state = load_checkpoint(tmp_path / "e0.safetensors")
    assert meta["config"]["null_label"] is True and meta["training"]["config"]["label_dropout"] == 0.5
    torch.manual_seed(cfg.seed)
    init = UNet(UNetConfig(widths=cfg.widths, null_label=True)).class_emb.weight.detach().numpy()
    assert state["class_emb.weight"].shape == (11, init.shape[1])
    assert not np.allclose(state["class_emb.weight"][10], init[10])  # the null row was trained

    be = TorchBackend()
    be.load(tmp_path / "e0.safetensors")
    x = np.random.default_rng(0).standard_normal((3, 1, 32, 32)).astype(np.float32)
    t = np.full(3, 0.5, np.float32)
    v_null = be.forward(x, t, np.full(3, -1, np.int64))
    v_two = be.forward(x, t, np.full(3, 2, np.int64))
    assert v_null.shape == (3, 1, 32, 32) and np.isfinite(v_null).all() and not np.allclose(v_null, v_two)

    # resuming without label dropout would change the architecture: refused
    with pytest.raises(ValueError, match="null label"):
        train_expert(_cfg(tmp_path, label_dropout=0.0, steps=8), images, labels, info, resume=True, progress=False)


def test_label_dropout_range_and_jax_refusal(tmp_path):
    with pytest.raises(ValueError, match="label-dropout"):
        _cfg(tmp_path, label_dropout=1.0)
    from training.train_jax import train_expert as train_jax

    with pytest.raises(ValueError, match="torch trainer only"):
        train_jax(_cfg(tmp_path), np.zeros((16, 1, 32, 32), np.float32), np.zeros(16, np.int64), {}, progress=False)
