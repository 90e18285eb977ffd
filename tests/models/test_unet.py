"""Expert UNet: parameter counts, shapes, and the torch <-> flax name/shape mapping."""

from __future__ import annotations

import pytest
import torch

from models.checkpoint import state_shapes, torch_state_to_numpy, torch_to_flax_params
from models.config import DEFAULT, SMALL, UNetConfig, parse_widths
from models.unet_torch import UNet, count_params


@pytest.mark.parametrize("cfg,lo,hi", [(DEFAULT, 6.3e6, 7.0e6), (SMALL, 1.7e6, 1.9e6)])
def test_param_count_torch(cfg, lo, hi):
    n = count_params(UNet(cfg))
    assert lo < n < hi, n


def test_exact_param_counts():
    assert count_params(UNet(DEFAULT)) == 6_686_849
    assert count_params(UNet(SMALL)) == 1_790_785


def test_forward_shape_and_conditioning():
    torch.manual_seed(0)
    m = UNet(UNetConfig(widths=(8, 16, 16))).eval()
    x = torch.randn(3, 1, 32, 32)
    t = torch.tensor([0.0, 0.5, 1.0])
    v = m(x, t, torch.tensor([0, 1, 9]))
    assert v.shape == (3, 1, 32, 32) and v.dtype == torch.float32
    # class and time change the output (embeddings are wired in)
    v_other_y = m(x, t, torch.tensor([5, 5, 5]))
    v_other_t = m(x, torch.tensor([0.3, 0.3, 0.3]), torch.tensor([0, 1, 9]))
    assert (v - v_other_y).abs().max() > 1e-4
    assert (v - v_other_t).abs().max() > 1e-4


def test_channels_last_matches():
    m = UNet(UNetConfig(widths=(8, 16, 16))).eval()
    x, t, y = torch.randn(2, 1, 32, 32), torch.rand(2), torch.tensor([3, 4])
    ref = m(x, t, y)
    m2 = m.to(memory_format=torch.channels_last)
    out = m2(x.contiguous(memory_format=torch.channels_last), t, y)
    assert torch.allclose(ref, out, atol=1e-5)


@pytest.mark.parametrize("cfg", [DEFAULT, SMALL, UNetConfig(widths=(16, 32)), UNetConfig(widths=(8, 16, 32, 32))])
def test_state_shapes_match_torch(cfg):
    sd = UNet(cfg).state_dict()
    assert {k: tuple(v.shape) for k, v in sd.items()} == state_shapes(cfg)


def test_flax_tree_matches_mapping():
    """The mapped torch state has exactly the flax init tree's structure and shapes (names 1:1)."""
    import jax

    from models.unet_flax import count_params as flax_count
    from models.unet_flax import param_shapes

    shapes = lambda tree: jax.tree_util.tree_map(lambda a: tuple(a.shape), tree)  # noqa: E731
    for cfg in (UNetConfig(widths=(8, 16, 32)), SMALL):
        mapped = torch_to_flax_params(torch_state_to_numpy(UNet(cfg).state_dict()), cfg)
        flax_tree = param_shapes(cfg)
        assert shapes(mapped) == shapes(dict(flax_tree))
        assert flax_count(flax_tree) == count_params(UNet(cfg))


@pytest.mark.parametrize("bad", [dict(widths=()), dict(widths=(30, 64)), dict(widths=(8,) * 6), dict(time_dim=7)])
def test_bad_config_rejected(bad):
    with pytest.raises(ValueError):
        UNetConfig(**bad)


def test_config_roundtrip_and_unknown_keys():
    assert UNetConfig.from_dict(SMALL.to_dict()) == SMALL
    with pytest.raises(ValueError, match="unknown keys"):
        UNetConfig.from_dict({**SMALL.to_dict(), "depth": 3})
    assert parse_widths("32,64,128") == (32, 64, 128)
    with pytest.raises(ValueError):
        parse_widths("32,x")
