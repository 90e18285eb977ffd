"""The shipped smaller router (checkpoints/router-small.*): the same partition and interface as
checkpoints/router.*, a quarter of the compute per row, and at least its accuracy on held-out digits."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from dataset.mnist import load_mnist  # noqa: E402
from dataset.partition import load_manifest  # noqa: E402
from models.router import Router  # noqa: E402
from training.train_router import accuracy_vs_t  # noqa: E402

CKPT = Path(__file__).resolve().parents[2] / "checkpoints"


@pytest.fixture(scope="module")
def routers():
    torch.set_num_threads(1)
    return Router.load(CKPT / "router.safetensors"), Router.load(CKPT / "router-small.safetensors")


def _flops(net) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    x, t, y = torch.zeros(1, 1, 32, 32), torch.full((1,), 0.5), torch.zeros(1, dtype=torch.long)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        net(x, t, y)
    return counter.get_total_flops()


def test_small_router_serves_the_shipped_partition_for_a_quarter_of_the_compute(routers):
    big, small = routers
    meta = json.loads((CKPT / "router-small.json").read_text())
    manifest = load_manifest(CKPT / "partition.json")
    assert meta["partition"]["class_to_expert"] == [manifest.class_to_expert(y) for y in range(10)]
    assert small.num_experts == big.num_experts == manifest.num_experts
    assert meta["config"]["width"] == 8 and big.meta["config"]["width"] == 16
    assert 0 < _flops(small.net) < 0.3 * _flops(big.net)
    assert meta["num_params"] < 0.4 * big.meta["num_params"]


@pytest.mark.slow  # ~10 s: both routers over 1000 held-out digits in 5 t bins, with and without labels
def test_small_router_is_at_least_as_accurate_on_held_out_digits(routers):
    big, small = routers
    manifest = load_manifest(CKPT / "partition.json")
    x, y = load_mnist("val", limit=1000)
    acc = {name: accuracy_vs_t(r.net.eval(), manifest, x, y, bins=5, seed=11) for name, r in
           (("big", big), ("small", small))}
    # a class partition with the label given: every row to its class's expert, at every t
    assert acc["small"]["acc_label"] == [1.0] * 5, acc
    # from pixels alone: near chance at pure noise for both, and past t = 0.4 within a point of the
    # shipped router or better (same images, same noise draws)
    for b in range(2, 5):
        assert acc["small"]["acc_no_label"][b] >= acc["big"]["acc_no_label"][b] - 0.01, acc
    assert acc["small"]["acc_no_label"][-1] > 0.95, acc
    assert acc["small"]["acc_no_label"][0] < 0.7, acc


def test_small_router_weights_are_a_distribution_and_follow_the_label(routers):
    _, small = routers
    rng = np.random.default_rng(3)
    n = 50
    x = rng.standard_normal((n, 1, 32, 32)).astype(np.float32)
    t = np.full(n, 0.05, np.float32)  # nearly pure noise: only the label can say where a row belongs
    y = np.arange(n) % 10
    w = small.weights(x, t, y)
    assert w.shape == (n, 2) and np.allclose(w.sum(1), 1, atol=1e-5) and (w >= 0).all()
    manifest = load_manifest(CKPT / "partition.json")
    assert (w.argmax(1) == [manifest.class_to_expert(c) for c in y]).all()
