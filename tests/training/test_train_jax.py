"""JAX trainer: a tiny real run on a real MNIST slice lowers the loss, its checkpoint is the shared format
(the torch UNet loaded from it gives the flax model's velocity), it resumes, and data-parallel training
over 2 (forced host) devices takes the same step as one device.

Every run here uses the same widths / batch so the jitted step compiles once per process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from models.checkpoint import load_checkpoint
from training.train_torch import TrainConfig, load_expert_data

pytest.importorskip("jax")
pytest.importorskip("flax")
# About 40 s of CPU in all, mostly XLA compiles (one train step per process, one forward); on a 2-core box
# shared with other jobs those compiles can stretch to many minutes of wall time.
pytestmark = [pytest.mark.train, pytest.mark.timeout(1800)]

PARTITION = "checkpoints/partition.json"
ROOT = Path(__file__).resolve().parents[2]
WIDTHS = (8,)
BATCH = 16


def _cfg(tmp_path, **kw):
    base = dict(
        expert=1,
        partition=PARTITION,
        widths=WIDTHS,
        steps=30,
        batch_size=BATCH,
        lr=3e-3,
        warmup=5,
        ema_decay=0.99,
        save_every=1000,
        log_every=10,
        limit=256,
        save_dtype="float32",
        out=str(tmp_path / "e1"),
        run_dir=str(tmp_path / "run"),
    )
    base.update(kw)
    return TrainConfig(**base)


@pytest.fixture(scope="module")
def expert1_data(tmp_path_factory):
    return load_expert_data(_cfg(tmp_path_factory.mktemp("d")))


@pytest.mark.slow  # ~20 s: jax training runs
def test_tiny_run_lowers_loss_checkpoint_matches_torch_and_resumes(tmp_path, expert1_data):
    import jax
    import torch

    from models.config import UNetConfig
    from models.unet_flax import UNet as FlaxUNet
    from models.unet_torch import UNet as TorchUNet
    from training.train_jax import RESUME_NAME, init_state, load_resume, make_optimizer, train_expert

    images, labels, info = expert1_data
    cfg = _cfg(tmp_path)
    stats = train_expert(cfg, images, labels, info, progress=False, devices=1)
    hist = [h["loss"] for h in stats["loss_history"]]
    assert stats["backend"] == "jax" and stats["steps"] == 30 and len(hist) == 3
    assert hist[-1] < 0.8 * hist[0], hist

    meta, state = load_checkpoint(tmp_path / "e1.safetensors")
    assert meta["expert_id"] == 1 and meta["weights"] == "ema" and meta["time_convention"] == "t0_noise_t1_data"
    assert meta["partition"]["classes"] == [5, 6, 7, 8, 9]
    assert meta["training"]["final_loss"] == pytest.approx(np.mean(hist), abs=1e-4)

    # the flax EMA params the run ended with (resume file) vs the torch UNet built from the checkpoint
    template = init_state(cfg, make_optimizer(cfg))
    saved, rmeta = load_resume(tmp_path / "run" / RESUME_NAME, template)
    assert int(saved.step) == 30 and rmeta["step"] == 30
    ucfg = UNetConfig(widths=WIDTHS)
    tmodel = TorchUNet(ucfg).eval()
    tmodel.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()})
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 1, 32, 32)).astype(np.float32)
    t = rng.random(4).astype(np.float32)
    y = np.array([5, 6, 8, 9])
    v_flax = np.asarray(jax.jit(FlaxUNet(ucfg).apply)({"params": saved.ema}, x, t, y))
    with torch.no_grad():
        v_torch = tmodel(torch.from_numpy(x), torch.from_numpy(t), torch.from_numpy(y)).numpy()
    assert np.abs(v_flax).mean() > 0.05  # a real, non-trivial output
    np.testing.assert_allclose(v_torch, v_flax, atol=1e-4, rtol=0)
    # the EMA is not just the raw params
    ema_w, raw_w = (np.asarray(p["conv_in"]["kernel"]) for p in (saved.ema, saved.params))
    assert not np.allclose(ema_w, raw_w)

    # resume to 40 steps: continues the same history from the saved state
    stats2 = train_expert(_cfg(tmp_path, steps=40), images, labels, info, resume=True, progress=False, devices=1)
    assert stats2["steps"] == 40 and [h["step"] for h in stats2["loss_history"]] == [10, 20, 30, 40]
    assert stats2["loss_history"][:3] == stats["loss_history"]
    assert json.loads((tmp_path / "e1.json").read_text())["training"]["steps"] == 40


def test_validation_and_same_init_as_torch(tmp_path, expert1_data):
    import torch

    from models.checkpoint import flax_to_torch_state
    from models.config import UNetConfig
    from models.unet_torch import UNet as TorchUNet
    from training.train_jax import initial_params, make_placement, train_expert

    torch.manual_seed(5)
    want = TorchUNet(UNetConfig(widths=WIDTHS)).state_dict()
    got = flax_to_torch_state(initial_params(_cfg(tmp_path, seed=5)))
    assert set(got) == set(want) and all(np.array_equal(got[k], want[k].numpy()) for k in want)
    other = flax_to_torch_state(initial_params(_cfg(tmp_path, seed=6)))
    assert not np.array_equal(other["conv_in.weight"], got["conv_in.weight"])

    images, labels, info = expert1_data
    with pytest.raises(ValueError, match="--devices 99"):
        make_placement(99, BATCH)
    with pytest.raises(FileNotFoundError, match="--resume"):
        train_expert(_cfg(tmp_path), images, labels, info, resume=True, progress=False)


def test_cli_backend_jax(tmp_path):
    from infra.cli import main

    # same widths / batch / update rule as the runs above: the jitted step is reused, not recompiled
    rc = main(
        [
            "train-expert",
            "--backend",
            "jax",
            "--expert",
            "0",
            "--partition",
            PARTITION,
            "--widths",
            ",".join(map(str, WIDTHS)),
            "--steps",
            "3",
            "--batch-size",
            str(BATCH),
            "--limit",
            "64",
            "--ema-decay",
            "0.99",
            "--no-progress",
            "--out",
            str(tmp_path / "cli"),
            "--run-dir",
            str(tmp_path / "r"),
        ]
    )
    assert rc == 0
    meta, _ = load_checkpoint(tmp_path / "cli.safetensors")
    assert meta["training"]["backend"] == "jax" and meta["training"]["steps"] == 3
    assert meta["partition"]["classes"] == [0, 1, 2, 3, 4]
    assert (tmp_path / "r" / "resume_jax.msgpack").exists()


# Runs in a fresh interpreter: XLA_FLAGS must be set before jax initialises its CPU backend.
SHARDED_SCRIPT = r"""
import json, sys
import jax, numpy as np
from training.train_torch import TrainConfig, load_expert_data
from training.train_jax import init_state, jit_step, make_optimizer, make_placement, put_batch, put_state, train_expert

out = sys.argv[1]
assert jax.device_count() == 2, jax.devices()
cfg = TrainConfig(expert=0, partition="checkpoints/partition.json", widths=(8,), steps=20, batch_size=16,
                  lr=3e-3, warmup=3, ema_decay=0.99, save_every=1000, log_every=5, limit=256,
                  save_dtype="float32", out=out + "/e0", run_dir=out + "/run")
images, labels, info = load_expert_data(cfg)
host = jax.device_get(init_state(cfg, make_optimizer(cfg)))
x, y = images[:16], labels[:16].astype(np.int32)
key, lr = jax.random.PRNGKey(7), np.float32(1e-3)
res = {}
for n in (1, 2):
    place = make_placement(n, 16)
    st, loss = jit_step(cfg, place)(put_state(host, place), *put_batch(x, y, place), key, lr)
    res[n] = (float(loss), jax.device_get(st), st.params["conv_in"]["kernel"].sharding)
def maxdiff(a, b):
    return max(float(np.abs(u - v).max()) for u, v in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)))
leaves = jax.tree_util.tree_leaves
grad1, grad2 = res[1][1].opt_state[1].mu, res[2][1].opt_state[1].mu  # Adam's first moment = 0.1 * clipped grad
grad_scale = max(float(np.abs(g).max()) for g in leaves(grad1))
diff = maxdiff(res[1][1].params, res[2][1].params)
moved = maxdiff(host.params, res[1][1].params)
x2 = put_batch(x, y, make_placement(2, 16))[0]
try:
    make_placement(2, 15)
    odd_batch = "accepted"
except ValueError as e:
    odd_batch = str(e)
stats = train_expert(cfg, images, labels, info, progress=False, devices=0)
print(json.dumps({"loss1": res[1][0], "loss2": res[2][0], "max_param_diff": diff, "moved": moved,
                  "grad_diff": maxdiff(grad1, grad2), "grad_scale": grad_scale,
                  "batch_shards": len(x2.addressable_shards), "shard_rows": x2.addressable_shards[0].data.shape[0],
                  "params_replicated": bool(res[2][2].is_fully_replicated),
                  "stats_dp": stats["data_parallel"], "odd_batch": odd_batch,
                  "hist": [h["loss"] for h in stats["loss_history"]]}))
"""


@pytest.mark.slow  # ~20 s: jax training runs
def test_sharded_step_equals_single_device_and_trains(tmp_path):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, "-c", SHARDED_SCRIPT, str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1700,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["batch_shards"] == 2 and r["shard_rows"] == 8 and r["params_replicated"]
    assert r["loss2"] == pytest.approx(r["loss1"], rel=1e-5)
    # the same gradient on 1 and 2 devices (up to summation order) ...
    assert r["grad_scale"] > 1e-4 and r["grad_diff"] < 1e-4 * r["grad_scale"], r
    # ... and the same real step (lr 1e-3): Adam's first update g / (|g| + eps) turns float noise in
    # near-zero gradients into up to lr, so params agree to a fraction of lr, not to 1e-7
    assert r["moved"] > 5e-4 and r["max_param_diff"] < 3e-4, r
    assert r["stats_dp"] == 2 and "divisible by the 2 devices" in r["odd_batch"]
    hist = r["hist"]
    assert len(hist) == 4 and hist[-1] < 0.8 * hist[0], hist
    meta, _ = load_checkpoint(tmp_path / "e0.safetensors")
    assert meta["training"]["data_parallel"] == 2 and meta["partition"]["classes"] == [0, 1, 2, 3, 4]
