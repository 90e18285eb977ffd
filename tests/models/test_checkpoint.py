"""Checkpoint format: round trip, refusal of mismatches, and torch <-> flax parity on one file."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from models.checkpoint import (
    CheckpointError,
    flax_to_torch_state,
    load_checkpoint,
    load_torch_model,
    save_checkpoint,
    torch_state_to_numpy,
    torch_to_flax_params,
)
from models.config import SMALL, UNetConfig
from models.unet_torch import UNet

TINY = UNetConfig(widths=(8, 16, 32))


def _meta(cfg):
    return {
        "config": cfg.to_dict(),
        "expert_id": 0,
        "partition": {"file": "p.json", "classes": [0, 1]},
        "training": {"steps": 1},
    }


def _random_model(cfg, seed=0):
    torch.manual_seed(seed)
    m = UNet(cfg)
    with torch.no_grad():  # make norms/biases non-trivial so the mapping is really exercised
        for p in m.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return m.eval()


def test_roundtrip_fp32_exact(tmp_path):
    m = _random_model(TINY)
    state = torch_state_to_numpy(m.state_dict())
    path = save_checkpoint(tmp_path / "e0", state, _meta(TINY))
    assert path.name == "e0.safetensors" and (tmp_path / "e0.json").exists()
    meta, loaded = load_checkpoint(path)
    assert meta["time_convention"] == "t0_noise_t1_data" and meta["expert_id"] == 0
    assert meta["weights_dtype"] == "float32"
    assert set(loaded) == set(state)
    for k in state:
        assert loaded[k].dtype == np.float32
        np.testing.assert_array_equal(loaded[k], state[k])


def test_fp16_loads_as_fp32_and_halves_size(tmp_path):
    state = torch_state_to_numpy(_random_model(TINY).state_dict())
    p32 = save_checkpoint(tmp_path / "a", state, _meta(TINY))
    p16 = save_checkpoint(tmp_path / "b", state, _meta(TINY), dtype="float16")
    assert p16.stat().st_size < 0.55 * p32.stat().st_size
    meta, loaded = load_checkpoint(p16)
    assert meta["weights_dtype"] == "float16"
    for k in state:
        assert loaded[k].dtype == np.float32
        np.testing.assert_allclose(loaded[k], state[k], rtol=1e-3, atol=1e-4)


def test_refuses_shape_mismatch(tmp_path):
    state = torch_state_to_numpy(_random_model(TINY).state_dict())
    with pytest.raises(CheckpointError, match="shape mismatches|missing"):
        save_checkpoint(tmp_path / "x", state, _meta(SMALL))
    # a hand-edited json that lies about the widths is refused on load
    path = save_checkpoint(tmp_path / "y", state, _meta(TINY))
    meta = json.loads((tmp_path / "y.json").read_text())
    meta["config"]["widths"] = [8, 16, 64]
    (tmp_path / "y.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="do not match config"):
        load_checkpoint(path)


def test_refuses_wrong_expected_config_and_convention(tmp_path):
    state = torch_state_to_numpy(_random_model(TINY).state_dict())
    path = save_checkpoint(tmp_path / "z", state, _meta(TINY))
    with pytest.raises(CheckpointError, match="does not match the expected"):
        load_checkpoint(path, expect=SMALL)
    meta = json.loads((tmp_path / "z.json").read_text())
    meta["time_convention"] = "t0_data_t1_noise"
    (tmp_path / "z.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="time_convention"):
        load_checkpoint(path)


def test_refuses_mismatched_pair_and_missing_files(tmp_path):
    a = save_checkpoint(tmp_path / "a", torch_state_to_numpy(_random_model(TINY, 1).state_dict()), _meta(TINY))
    save_checkpoint(tmp_path / "b", torch_state_to_numpy(_random_model(TINY, 2).state_dict()), _meta(TINY))
    (tmp_path / "a.json").write_text((tmp_path / "b.json").read_text())
    with pytest.raises(CheckpointError, match="sha256"):
        load_checkpoint(a)
    with pytest.raises(CheckpointError, match="not found"):
        load_checkpoint(tmp_path / "nope.safetensors")
    (tmp_path / "c.safetensors").write_bytes(b"garbage")
    (tmp_path / "c.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_checkpoint(tmp_path / "c.safetensors")


@pytest.mark.slow  # 5-8 s: full-size UNets in torch and flax
def test_torch_flax_parity(tmp_path):
    """One checkpoint, loaded by torch and by flax, gives the same velocity (fp32, max abs diff < 1e-4)."""
    import jax
    import jax.numpy as jnp

    from models.unet_flax import UNet as FlaxUNet

    cfg = UNetConfig(widths=(16, 32, 64))
    path = save_checkpoint(tmp_path / "p", torch_state_to_numpy(_random_model(cfg, 3).state_dict()), _meta(cfg))
    model, meta = load_torch_model(path)
    _, state = load_checkpoint(path)
    params = torch_to_flax_params(state, cfg)

    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 1, 32, 32)).astype(np.float32)
    t = np.array([0.0, 0.25, 0.7, 1.0], np.float32)
    y = np.array([0, 3, 7, 9], np.int64)
    with torch.no_grad():
        v_torch = model(torch.from_numpy(x), torch.from_numpy(t), torch.from_numpy(y)).numpy()
    # jitted: one XLA compile of the whole net (about 1.5 CPU-s) instead of one per op run eagerly (about 8)
    apply = jax.jit(FlaxUNet(cfg).apply)
    v_flax = np.asarray(apply({"params": params}, jnp.asarray(x), jnp.asarray(t), jnp.asarray(y)))
    assert v_flax.shape == v_torch.shape == (4, 1, 32, 32)
    assert np.abs(v_torch).max() > 1e-2  # not trivially zero
    assert np.abs(v_torch - v_flax).max() < 1e-4

    # and back: flax params -> torch names reproduce the state exactly
    back = flax_to_torch_state(params)
    assert set(back) == set(state)
    for k in state:
        np.testing.assert_array_equal(back[k], state[k])


@pytest.mark.slow  # 5-8 s: full-size UNets in torch and flax
@pytest.mark.parametrize("expert,classes", [(0, [0, 1, 2, 3, 4]), (1, [5, 6, 7, 8, 9])])
def test_shipped_expert_checkpoints(expert, classes):
    """The committed experts load, describe their partition, and run identically in torch and flax, the
    null label (y = -1, they were trained with label dropout) included."""
    import dataclasses

    import jax
    import jax.numpy as jnp

    from models.config import SMALL
    from models.unet_flax import UNet as FlaxUNet

    path = f"checkpoints/expert{expert}.safetensors"
    cfg = dataclasses.replace(SMALL, null_label=True)
    meta, state = load_checkpoint(path, expect=cfg)
    assert meta["expert_id"] == expert and meta["partition"]["classes"] == classes
    assert meta["weights_dtype"] == "float16" and meta["weights"] == "ema"
    assert meta["training"]["steps"] >= 1000 and meta["training"]["final_loss"] < 0.2

    model, _ = load_torch_model(path)
    rng = np.random.default_rng(expert)
    x = rng.standard_normal((2, 1, 32, 32)).astype(np.float32)
    t = np.array([0.1, 0.8], np.float32)
    y = np.array([classes[0], -1], np.int64)
    with torch.no_grad():
        v_torch = model(torch.from_numpy(x), torch.from_numpy(t), torch.from_numpy(y)).numpy()
    params = torch_to_flax_params(state, cfg)
    # jitted: one XLA compile of the whole net (about 1.5 CPU-s) instead of one per op run eagerly (about 8)
    apply = jax.jit(FlaxUNet(cfg).apply)
    v_flax = np.asarray(apply({"params": params}, jnp.asarray(x), jnp.asarray(t), jnp.asarray(y)))
    assert np.abs(v_torch - v_flax).max() < 1e-4
