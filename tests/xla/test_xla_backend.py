"""The torch_xla backend (XLA's CPU device, PJRT_DEVICE=CPU): run by `make test-xla` in .venv-xla.

torch_xla is imported at module level on purpose: without it these tests FAIL at collection
instead of being skipped. A plain `pytest` run does not collect tests/xla/ (tests/conftest.py).
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import torch_xla  # noqa: F401  (must be importable: fail, do not skip)
import torch_xla.debug.metrics as met

from workers.backends import get_backend


def _batch(n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    return (
        rng.standard_normal((n, 1, 32, 32)).astype(np.float32),
        rng.uniform(0, 1, n).astype(np.float32),
        rng.integers(0, 10, n).astype(np.int64),
    )


def _compiles() -> int:
    data = met.metric_data("CompileTime")
    return int(data[0]) if data else 0


def test_pjrt_device_is_xla_cpu():
    assert os.environ.get("PJRT_DEVICE") == "CPU", "run with PJRT_DEVICE=CPU (make test-xla sets it)"
    be = get_backend("xla")
    assert be.name == "xla"


def test_xla_matches_torch_on_the_same_checkpoint_and_warm_buckets_do_not_recompile(tiny_expert_checkpoint):
    xla = get_backend("xla")
    xla.load(tiny_expert_checkpoint)
    ref = get_backend("torch")
    ref.load(tiny_expert_checkpoint)
    assert xla.device.startswith("xla:") and xla.device.endswith("CPU")

    xla.warmup([1, 2, 4])
    assert sorted(xla.warmup_s) == [1, 2, 4]
    compiled = _compiles()
    assert compiled >= 3  # at least one graph per bucket

    for n, seed in ((4, 1), (2, 2), (1, 3), (4, 4)):
        x, t, y = _batch(n, seed)
        v = xla.forward(x, t, y)
        assert v.dtype == np.float32 and v.shape == (n, 1, 32, 32)
        np.testing.assert_allclose(v, ref.forward(x, t, y), atol=1e-4, rtol=0)
    assert _compiles() == compiled, "a warmed bucket shape was compiled again"


async def test_xla_worker_serves_over_nats(tiny_expert_checkpoint, nc, nats_url):
    from schemas import StepReply, StepRequest, StepResult, pack, subjects, unpack
    from workers.service import ExpertWorker

    x, t, y = _batch(3, seed=9)
    ref = get_backend("torch")
    ref.load(tiny_expert_checkpoint)
    async with ExpertWorker(0, tiny_expert_checkpoint, "xla", nats_url=nats_url, buckets=(4,), dtype="float32") as w:
        assert w.metadata()["backend"] == "xla"
        msg = await nc.request(subjects.expert_velocity(0), pack(StepRequest(expert=0, x_t=x, t=t, y=y)), timeout=60)
    reply = unpack(msg.data, StepResult)
    assert isinstance(reply, StepReply) and reply.backend == "xla" and reply.batch_rows == 4
    np.testing.assert_allclose(reply.velocity, ref.forward(x, t, y), atol=1e-4, rtol=0)


def test_persistent_compile_cache_is_written(tiny_expert_checkpoint, tmp_path):
    cache = tmp_path / "xla-cache"
    code = (
        "from workers.backends import get_backend\n"
        "be = get_backend('xla')\n"
        f"be.load({tiny_expert_checkpoint!r})\n"
        "be.warmup([2])\n"
        "print(be.describe()['compile_cache'])\n"
    )
    env = dict(os.environ, XLA_PERSISTENT_CACHE_PATH=str(cache), PJRT_DEVICE="CPU")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().endswith(str(cache))
    assert cache.is_dir() and any(cache.iterdir()), "no compiled program was written to the cache"


def test_xla_bf16_autocast_is_close_to_fp32(tiny_expert_checkpoint):
    be = get_backend("xla", bf16=True)
    be.load(tiny_expert_checkpoint)
    ref = get_backend("torch")
    ref.load(tiny_expert_checkpoint)
    x, t, y = _batch(2, seed=5)
    v, r = be.forward(x, t, y), ref.forward(x, t, y)
    assert v.dtype == np.float32 and be.precision == "bfloat16"
    assert 0 < np.abs(v - r).max() < 0.05 * np.abs(r).max()  # bf16 really used, and close
