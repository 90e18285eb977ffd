"""The expert UNet's null label (y = -1, label unknown): opt-in per config, refused by old models."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from models.checkpoint import load_checkpoint, save_checkpoint, state_shapes, torch_state_to_numpy, torch_to_flax_params
from models.config import UNetConfig
from models.tiny import tiny_config
from models.unet_torch import NullLabelError, UNet


def _inputs(b=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, 1, 32, 32, generator=g), torch.rand(b, generator=g)


def test_old_config_keeps_its_json_and_refuses_unknown_label():
    cfg = tiny_config()
    assert "null_label" not in cfg.to_dict() and UNetConfig.from_dict(cfg.to_dict()) == cfg
    assert state_shapes(cfg)["class_emb.weight"][0] == 10
    model = UNet(cfg).eval()
    x, t = _inputs()
    with torch.no_grad():
        model(x, t, torch.tensor([0, 1, 2, 3]))
        with pytest.raises(NullLabelError, match="--label-dropout"):
            model(x, t, torch.tensor([0, -1, 2, 3]))


def test_null_label_model_takes_unknown_label_and_round_trips(tmp_path):
    cfg = UNetConfig(**{**tiny_config().to_dict(), "null_label": True})
    assert cfg.to_dict()["null_label"] is True and state_shapes(cfg)["class_emb.weight"][0] == 11
    torch.manual_seed(0)
    model = UNet(cfg).eval()
    with torch.no_grad():
        model.class_emb.weight[10].normal_(0, 5.0)  # make the null row visibly different
        x, t = _inputs()
        v_null = model(x, t, torch.full((4,), -1))
        v_row = model(x, t, torch.full((4,), 10))  # -1 is exactly the extra row
        v_three = model(x, t, torch.full((4,), 3))
    assert torch.equal(v_null, v_row) and not torch.allclose(v_null, v_three)

    save_checkpoint(tmp_path / "e", torch_state_to_numpy(model.state_dict()), {"config": cfg.to_dict()})
    meta, state = load_checkpoint(tmp_path / "e.safetensors")
    assert meta["config"]["null_label"] is True and state["class_emb.weight"].shape == (11, cfg.class_dim)
    # an old-format config cannot load null-label weights (shape check names the tensor)
    with pytest.raises(ValueError, match="class_emb"):
        save_checkpoint(tmp_path / "bad", state, {"config": tiny_config().to_dict()})


@pytest.mark.slow
def test_flax_unet_matches_torch_on_unknown_label():
    import jax
    import jax.numpy as jnp

    from models.unet_flax import UNet as FlaxUNet

    cfg = UNetConfig(**{**tiny_config().to_dict(), "null_label": True})
    torch.manual_seed(1)
    model = UNet(cfg).eval()
    x, t = _inputs(seed=2)
    y = torch.tensor([-1, 4, -1, 9])
    with torch.no_grad():
        want = model(x, t, y).numpy()
    params = torch_to_flax_params(torch_state_to_numpy(model.state_dict()), cfg)
    apply = jax.jit(FlaxUNet(cfg).apply)  # one compile (eagerly, flax compiles each operation on its own)
    got = np.asarray(apply({"params": params}, jnp.asarray(x.numpy()), jnp.asarray(t.numpy()), jnp.asarray(y.numpy())))
    np.testing.assert_allclose(got, want, atol=2e-4)
