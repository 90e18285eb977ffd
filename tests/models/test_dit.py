"""DiT experts: config validation, shapes, adaLN-Zero, torch <-> flax parity through the checkpoint format,
the null label, the "arch" key of a checkpoint (absent = UNet), and a few real training steps."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from models.arch import arch_of, build_torch, config_from_meta
from models.checkpoint import (
    CheckpointError,
    load_checkpoint,
    load_meta,
    load_torch_model,
    save_checkpoint,
    state_shapes,
    torch_state_to_numpy,
    torch_to_flax_params,
)
from models.config import DiTConfig, UNetConfig
from models.dit_torch import DiT, NullLabelError
from models.tiny import make_tiny_dit, make_tiny_expert, tiny_dit_config
from models.unet_torch import UNet

REPO = Path(__file__).resolve().parents[2]


def _perturbed(cfg: DiTConfig, seed: int = 0, scale: float = 0.05) -> DiT:
    """A DiT whose zero-initialised adaLN / final weights were moved off zero, so its output is non-trivial."""
    torch.manual_seed(seed)
    model = DiT(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn_like(p))
    return model.eval()


def _batch(cfg: DiTConfig, n: int, seed: int = 0, labels=None):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, cfg.in_channels, cfg.image_size, cfg.image_size)).astype(np.float32)
    t = rng.uniform(0, 1, n).astype(np.float32)
    y = rng.integers(0, cfg.num_classes, n).astype(np.int64) if labels is None else np.asarray(labels, np.int64)
    return x, t, y


def _torch_out(model, x, t, y) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(x), torch.from_numpy(t), torch.from_numpy(y)).numpy()


def _flax_out(cfg, params, x, t, y) -> np.ndarray:
    import jax

    from models.arch_flax import build_flax

    with jax.default_matmul_precision("highest"):  # traced inside: the jitted net keeps it
        return np.asarray(jax.jit(build_flax(cfg).apply)({"params": params}, x, t, y.astype(np.int32)))


# ------------------------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(patch_size=3), "patch_size 3 must divide image_size 32"),
        (dict(hidden_size=30, num_heads=4), "divisible by num_heads"),
        (dict(hidden_size=18, num_heads=3), "multiple of 4"),
        (dict(depth=0), "depth must be a positive integer"),
        (dict(in_channels=0), "in_channels must be a positive integer"),
        (dict(mlp_ratio=0), "mlp_ratio must be positive"),
        (dict(time_freq_dim=7), "time_freq_dim must be a positive even number"),
        (dict(time_freq_dim=0), "time_freq_dim must be a positive integer"),
        (dict(hidden_size=32.0), "hidden_size must be a positive integer"),
        (dict(num_classes=0), "num_classes must be a positive integer"),
    ],
)
def test_config_refuses_bad_values_and_says_how_to_fix(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DiTConfig(**kwargs)


def test_config_round_trips_and_refuses_unknown_keys():
    cfg = DiTConfig(in_channels=3, patch_size=4, hidden_size=192, num_heads=6, null_label=True)
    assert DiTConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    assert cfg.grid == 8 and cfg.mlp_hidden == 768
    with pytest.raises(ValueError, match="unknown keys \\['widths'\\]"):
        DiTConfig.from_dict({**cfg.to_dict(), "widths": [8]})


# ------------------------------------------------------------------------------------------- shapes


@pytest.mark.parametrize("channels, size, patch", [(1, 28, 2), (1, 32, 4), (3, 32, 2), (3, 28, 4)])
def test_shapes_and_state_dict_match_state_shapes(channels, size, patch):
    cfg = DiTConfig(in_channels=channels, image_size=size, patch_size=patch, hidden_size=32, depth=2, num_heads=2)
    model = _perturbed(cfg)
    want = state_shapes(cfg)
    got = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert got == want  # pos_embed is a constant buffer, not saved
    x, t, y = _batch(cfg, 3)
    out = _torch_out(model, x, t, y)
    assert out.shape == (3, channels, size, size) and np.isfinite(out).all() and np.abs(out).max() > 1e-3


def test_unpatchify_inverts_the_patch_layout():
    """Each token's p*p*C outputs land on that token's own p x p pixels: a final layer that copies the patch
    embedding's input pixels back gives the identity (checks the row-major token order and channel order)."""
    cfg = DiTConfig(in_channels=3, image_size=8, patch_size=2, hidden_size=12, depth=1, num_heads=1)
    model = DiT(cfg)
    x = torch.randn(2, 3, 8, 8)
    g, p, c = cfg.grid, cfg.patch_size, cfg.in_channels
    tokens = x.reshape(2, c, g, p, g, p).permute(0, 2, 4, 3, 5, 1).reshape(2, g * g, p * p * c)
    assert torch.equal(model.unpatchify(tokens), x)


# ------------------------------------------------------------------------------------------- adaLN-Zero


def test_fresh_dit_outputs_exactly_zero_in_torch_and_flax():
    import jax

    from models.dit_flax import DiT as FlaxDiT

    cfg = tiny_dit_config(in_channels=3)
    x, t, y = _batch(cfg, 4)
    torch.manual_seed(0)
    assert not _torch_out(DiT(cfg).eval(), x, t, y).any()
    small = DiTConfig(in_channels=3, image_size=8, patch_size=2, hidden_size=8, depth=1, num_heads=2)  # compiles fast
    x, t, y = _batch(small, 2)
    out, variables = jax.jit(lambda key: FlaxDiT(small).init_with_output(key, x, t, y))(jax.random.PRNGKey(1))
    assert not np.asarray(out).any()
    assert np.abs(np.asarray(variables["params"]["blocks_0"]["attn"]["qkv"]["kernel"])).max() > 0  # not all zero


# ------------------------------------------------------------------------------------------- torch <-> flax


@pytest.mark.parametrize("channels, patch", [(1, 2), (3, 4)])
def test_torch_and_flax_agree_through_the_checkpoint_format(tmp_path, channels, patch):
    cfg = DiTConfig(in_channels=channels, patch_size=patch, hidden_size=32, depth=2, num_heads=4, null_label=True)
    model = _perturbed(cfg, seed=3)
    save_checkpoint(tmp_path / "dit", torch_state_to_numpy(model.state_dict()), {"config": cfg, "expert_id": 1})
    torch_model, meta = load_torch_model(tmp_path / "dit.safetensors")
    _, state = load_checkpoint(tmp_path / "dit.safetensors")
    assert isinstance(torch_model, DiT) and meta["arch"] == "dit"
    x, t, y = _batch(cfg, 6, seed=4, labels=[0, 9, -1, 3, -1, 5])
    ref = _torch_out(torch_model, x, t, y)
    out = _flax_out(cfg, torch_to_flax_params(state, cfg), x, t, y)
    assert np.abs(ref).max() > 1e-2  # the perturbation made the output non-trivial
    assert np.abs(out - ref).max() < 1e-4


# ------------------------------------------------------------------------------------------- null label


def test_null_label_selects_the_extra_row_and_is_refused_without_it():
    cfg = tiny_dit_config(null_label=True)
    model = _perturbed(cfg)
    assert model.class_emb.weight.shape[0] == cfg.num_classes + 1
    t = torch.rand(3)
    with torch.no_grad():
        c_unknown = model.embed(t, torch.full((3,), -1))
        c_zero = model.embed(t, torch.zeros(3, dtype=torch.long))
        want = c_zero - model.class_emb.weight[0] + model.class_emb.weight[cfg.num_classes]
    torch.testing.assert_close(c_unknown, want)
    x, t, y = _batch(cfg, 2, labels=[-1, -1])
    assert np.abs(_torch_out(model, x, t, y) - _torch_out(model, x, t, np.array([0, 0]))).max() > 1e-4

    plain = _perturbed(tiny_dit_config(null_label=False))
    assert plain.class_emb.weight.shape[0] == cfg.num_classes
    with pytest.raises(NullLabelError, match="without a null label"):
        _torch_out(plain, x, t, y)


# ------------------------------------------------------------------------------------------- checkpoint


def test_dit_checkpoint_round_trip_records_arch(tmp_path):
    path = make_tiny_dit(tmp_path / "e3", expert_id=3, classes=[7, 8], dtype="float16", in_channels=3)
    raw = json.loads(path.with_suffix(".json").read_text())
    assert raw["arch"] == "dit" and raw["config"]["patch_size"] == 4 and raw["weights_dtype"] == "float16"
    cfg = tiny_dit_config(in_channels=3)
    meta, state = load_checkpoint(path, expect=cfg)
    assert arch_of(meta) == "dit" and config_from_meta(meta) == cfg and meta["partition"]["classes"] == [7, 8]
    assert set(state) == set(state_shapes(cfg)) and all(v.dtype == np.float32 for v in state.values())
    again = save_checkpoint(tmp_path / "again", state, meta)
    assert load_checkpoint(again)[1].keys() == state.keys()
    with pytest.raises(CheckpointError, match="does not match the expected unet config"):
        load_checkpoint(path, expect=UNetConfig())


def test_checkpoint_arch_mistakes_are_clear(tmp_path):
    cfg = tiny_dit_config()
    state = torch_state_to_numpy(DiT(cfg).state_dict())
    with pytest.raises(CheckpointError, match="weights do not match DiT config hidden_size=64 depth=2"):
        save_checkpoint(tmp_path / "x", state, {"config": tiny_dit_config(hidden_size=64)})
    with pytest.raises(CheckpointError, match="weights do not match config widths"):  # dit weights, unet config
        save_checkpoint(tmp_path / "x", state, {"config": UNetConfig(widths=(8, 16))})
    with pytest.raises(CheckpointError, match='looks like a dit config: add "arch": "dit"'):
        save_checkpoint(tmp_path / "x", state, {"config": cfg.to_dict()})  # no arch -> read as unet
    with pytest.raises(CheckpointError, match="meta says arch 'unet' but its config is a DiTConfig"):
        save_checkpoint(tmp_path / "x", state, {"arch": "unet", "config": cfg})
    path = save_checkpoint(tmp_path / "ok", state, {"config": cfg})
    js = path.with_suffix(".json")
    js.write_text(js.read_text().replace('"arch": "dit"', '"arch": "vit"'))
    with pytest.raises(CheckpointError, match="unknown arch 'vit'; known architectures are unet, dit"):
        load_meta(js)


def test_existing_unet_checkpoints_load_as_unet(tmp_path):
    shipped = REPO / "checkpoints" / "monolith.json"
    assert "arch" not in json.loads(shipped.read_text())  # made before DiT: no key
    meta = load_meta(shipped)
    assert arch_of(meta) == "unet" and isinstance(config_from_meta(meta), UNetConfig)
    assert isinstance(build_torch(meta), UNet)
    tiny = make_tiny_expert(tmp_path / "u", seed=1)
    model, meta = load_torch_model(tiny)
    assert isinstance(model, UNet) and meta["arch"] == "unet"


# ------------------------------------------------------------------------------------------- training smoke


def test_a_few_adam_steps_reduce_the_flow_matching_loss():
    from flow.path import interpolate, target_velocity

    start = time.perf_counter()
    cfg = DiTConfig(image_size=16, patch_size=4, hidden_size=32, depth=2, num_heads=2)
    torch.manual_seed(0)
    model = DiT(cfg)
    gen = torch.Generator().manual_seed(1)
    x = torch.tanh(torch.randn(32, 1, 16, 16, generator=gen))  # "data" in [-1, 1]
    y = torch.randint(0, 10, (32,), generator=gen)
    noise = torch.randn(x.shape, generator=gen)
    t = torch.rand(32, generator=gen)

    def loss() -> torch.Tensor:
        return ((model(interpolate(x, noise, t), t, y) - target_velocity(x, noise)) ** 2).mean()

    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: one thread is ~40x faster than two fighting for a busy CPU
    try:
        with torch.no_grad():
            before = float(loss())
        for _ in range(25):
            opt.zero_grad()
            loss().backward()
            opt.step()
        with torch.no_grad():
            after = float(loss())
    finally:
        torch.set_num_threads(threads)
    assert after < 0.8 * before, (before, after)
    assert time.perf_counter() - start < 10
