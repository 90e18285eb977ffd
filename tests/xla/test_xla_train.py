"""The torch trainer on an XLA device (`--device xla`): the Trainium training path, run on XLA:CPU.

Real data slice, tiny widths, a few steps: the point is that the XLA graph path (lazy import,
static shapes, one graph per step) trains and writes a checkpoint the CPU backends load.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import torch_xla  # noqa: F401  (must be importable: fail, do not skip)

ROOT = Path(__file__).resolve().parents[2]


def test_train_expert_on_xla_device_writes_a_loadable_checkpoint(tmp_path):
    out = tmp_path / "expert0"
    cmd = [
        sys.executable,
        "-m",
        "infra.cli",
        "train-expert",
        "--expert",
        "0",
        "--partition",
        str(ROOT / "checkpoints" / "partition.json"),
        "--device",
        "xla",
        "--widths",
        "8,16,32",
        "--steps",
        "4",
        "--batch-size",
        "16",
        "--limit",
        "512",
        "--threads",
        "1",
        "--out",
        str(out),
        "--run-dir",
        str(tmp_path / "run"),
        "--no-progress",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "device xla" in proc.stdout + proc.stderr

    from models.checkpoint import load_checkpoint
    from workers.backends import get_backend

    meta, state = load_checkpoint(out.with_suffix(".safetensors"))
    assert meta["training"]["steps"] == 4 and meta["training"]["device"] == "xla"
    assert np.isfinite(meta["training"]["final_loss"])
    assert all(np.isfinite(v).all() for v in state.values())
    be = get_backend("torch")
    be.load(out.with_suffix(".safetensors"))
    rng = np.random.default_rng(0)
    v = be.forward(
        rng.standard_normal((2, 1, 32, 32)).astype(np.float32),
        np.array([0.2, 0.8], np.float32),
        np.array([1, 3], np.int64),
    )
    assert v.shape == (2, 1, 32, 32) and np.isfinite(v).all()
