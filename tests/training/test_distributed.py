"""Torch data parallel: `torchrun --nproc_per_node 2 -m infra.cli train-expert` (DDP over gloo on CPU)
trains a tiny real expert, only rank 0 writes, both ranks end with identical weights, the loss falls."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from models.checkpoint import load_checkpoint
from training import distributed as ddp

ROOT = Path(__file__).resolve().parents[2]
PARTITION = "checkpoints/partition.json"


def test_detect_reads_torchrun_env():
    assert ddp.detect({}) == ddp.DistInfo(1, 0, 0) and not ddp.detect({}).enabled
    info = ddp.detect({"WORLD_SIZE": "4", "RANK": "3", "LOCAL_RANK": "1"})
    assert info == ddp.DistInfo(4, 3, 1) and info.enabled and not info.is_main
    assert ddp.local_device(info, "cuda") == "cuda:1" and ddp.local_device(info, "cpu") == "cpu"
    with pytest.raises(RuntimeError, match="RANK"):
        ddp.detect({"WORLD_SIZE": "2", "RANK": "2"})
    with pytest.raises(RuntimeError, match="WORLD_SIZE"):
        ddp.detect({"WORLD_SIZE": "two"})


def test_shards_are_disjoint_and_cover_the_global_batch():
    idx = np.random.default_rng(0).permutation(1000)[:12]
    parts = [ddp.shard(idx, ddp.DistInfo(3, r, r)) for r in range(3)]
    assert all(len(p) == 4 for p in parts)
    assert np.array_equal(np.concatenate(parts), idx)
    with pytest.raises(ValueError, match="divisible"):
        ddp.shard(idx[:10], ddp.DistInfo(4, 0, 0))
    assert ddp.rank_seed(0, 1, 0) != ddp.rank_seed(0, 2, 0) != ddp.rank_seed(0, 1, 50)


@pytest.mark.slow  # ~12 s: two torchrun ranks
@pytest.mark.timeout(1200)  # ~20 s of CPU; two torch processes start slowly on a loaded 2-core box
@pytest.mark.procs
@pytest.mark.train
def test_torchrun_two_ranks(tmp_path):
    out = tmp_path / "ck"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        "-m",
        "infra.cli",
        "train-expert",
        "--backend",
        "torch",
        "--expert",
        "1",
        "--partition",
        PARTITION,
        "--widths",
        "8,16,16",
        "--steps",
        "24",
        "--batch-size",
        "16",
        "--limit",
        "256",
        "--lr",
        "3e-3",
        "--warmup",
        "4",
        "--ema-decay",
        "0.99",
        "--log-every",
        "6",
        "--save-every",
        "1000",
        "--save-dtype",
        "float32",
        "--threads",
        "1",
        "--no-progress",
        "--out",
        str(out / "e1"),
        "--run-dir",
        str(tmp_path / "run"),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1100)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert proc.stdout.count("saved ") == 1 and "data parallel x2" in proc.stdout  # rank 0 only prints

    assert sorted(p.name for p in out.iterdir()) == ["e1.json", "e1.safetensors"]
    meta, _ = load_checkpoint(out / "e1.safetensors")
    tr = meta["training"]
    assert tr["world_size"] == 2 and tr["steps"] == 24 and tr["images_seen"] == 24 * 16
    assert meta["partition"]["classes"] == [5, 6, 7, 8, 9]
    digests = tr["param_digests"]
    assert len(digests) == 2 and digests[0] == digests[1]  # both ranks hold the same weights

    # rank 0's raw weights (resume file) hash to the digest both ranks reported
    import torch

    from models.config import UNetConfig
    from models.unet_torch import UNet

    ck = torch.load(tmp_path / "run" / "resume.pt", map_location="cpu", weights_only=True)
    model = UNet(UNetConfig(widths=(8, 16, 16)))
    model.load_state_dict(ck["model"])
    assert ddp.param_digests(model.parameters(), ddp.DistInfo()) == [digests[0]]
    assert ck["step"] == 24

    hist = [h["loss"] for h in tr["loss_history"]]
    assert len(hist) == 4 and hist[-1] < 0.8 * hist[0], hist
