"""Backends load the same checkpoint and compute the same velocity (torch vs jax, fp32)."""

from __future__ import annotations

import numpy as np
import pytest

from workers.backends import Backend, BackendError, get_backend


def _batch(n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 1, 32, 32)).astype(np.float32)
    t = rng.uniform(0, 1, n).astype(np.float32)
    y = rng.integers(0, 10, n).astype(np.int64)
    return x, t, y


@pytest.fixture(scope="module")
def torch_backend(tiny_expert_checkpoint):
    be = get_backend("torch")
    be.load(tiny_expert_checkpoint)
    return be


def test_torch_backend_matches_the_model_run_directly(torch_backend, tiny_expert_checkpoint):
    import torch

    from models.checkpoint import load_torch_model

    model, meta = load_torch_model(tiny_expert_checkpoint)
    x, t, y = _batch(5)
    with torch.no_grad():
        ref = model(torch.from_numpy(x), torch.from_numpy(t), torch.from_numpy(y)).numpy()
    out = torch_backend.forward(x, t, y)
    assert isinstance(torch_backend, Backend)
    assert out.dtype == np.float32 and out.shape == (5, 1, 32, 32) and out.flags.c_contiguous
    np.testing.assert_allclose(out, ref, atol=1e-5)
    assert torch_backend.expert == 0 and torch_backend.input_shape == (1, 32, 32)
    assert torch_backend.num_classes == 10 and torch_backend.describe()["backend"] == "torch"


def test_torch_backend_accepts_read_only_wire_arrays(torch_backend):
    x, t, y = _batch(2)
    x.setflags(write=False)
    assert torch_backend.forward(x, t, y).shape == (2, 1, 32, 32)


def test_torch_bf16_is_close_to_fp32(tiny_expert_checkpoint, torch_backend):
    be = get_backend("torch", bf16=True)
    be.load(tiny_expert_checkpoint)
    x, t, y = _batch(4)
    ref = torch_backend.forward(x, t, y)
    out = be.forward(x, t, y)
    assert out.dtype == np.float32 and be.precision == "bfloat16"
    assert np.abs(out - ref).max() < 0.1 * (np.abs(ref).max() + 1e-3)


@pytest.fixture(scope="module")
def jax_backend(tiny_expert_checkpoint):
    be = get_backend("jax")
    be.load(tiny_expert_checkpoint)
    return be


@pytest.mark.slow
def test_jax_and_torch_agree_on_the_same_checkpoint(jax_backend, torch_backend):
    jx = jax_backend
    x, t, y = _batch(8, seed=3)
    v_torch = torch_backend.forward(x, t, y)
    v_jax = jx.forward(x, t, y)
    assert v_jax.dtype == np.float32 and v_jax.shape == v_torch.shape
    np.testing.assert_allclose(v_jax, v_torch, atol=1e-4, rtol=0)
    assert np.abs(v_torch).max() > 1e-3  # not a trivially zero model
    assert jx.device.startswith("jax:cpu")


@pytest.mark.slow
def test_warmup_runs_every_bucket(torch_backend, jax_backend):
    torch_backend.warmup([4, 1, 2])
    assert sorted(torch_backend.warmup_s) == [1, 2, 4]
    jax_backend.warmup([8])  # jax compiles per shape (jit is slow on CPU: one shape here)
    assert list(jax_backend.warmup_s) == [8]


def test_backend_errors_are_clear(tiny_expert_checkpoint, tmp_path):
    with pytest.raises(BackendError, match="unknown backend 'tpu'"):
        get_backend("tpu")
    with pytest.raises(BackendError, match="CUDA is not available|cpu or cuda"):
        get_backend("torch", device="cuda:0") if not _has_cuda() else get_backend("torch", device="mps")
    be = get_backend("torch")
    with pytest.raises(BackendError, match="call load"):
        be.forward(*_batch(1))
    with pytest.raises(BackendError, match="does not exist"):
        be.load(tmp_path / "nope.safetensors")
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not a safetensors file")
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(BackendError, match="cannot read checkpoint"):
        be.load(bad)


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()
