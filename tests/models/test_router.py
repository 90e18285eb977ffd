"""Router: a tiny real training run that learns partitions from pixels, checkpoint round trip, input errors."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dataset.mnist import load_mnist
from dataset.partition import make_partition

torch = pytest.importorskip("torch")

from models.router import Router, RouterError, RouterNet, num_params, save_router  # noqa: E402
from training.train_router import RouterTrainConfig, accuracy_vs_t, train_router  # noqa: E402


@pytest.fixture(scope="module")
def trained():
    """Classes 0-4 / 5-9 on 2000 real images; labels always hidden, so the router must read pixels."""
    torch.set_num_threads(1)
    x, y = load_mnist("train", limit=2000)
    m = make_partition("classes", y, None, 2)
    net, stats = train_router(
        m, x, y, RouterTrainConfig(steps=300, batch_size=64, label_dropout=1.0, lr=3e-3), progress=False
    )
    return m, net, stats


@pytest.mark.slow  # ~6 s: trains a router (module fixture)
def test_router_learns_partition_from_pixels(trained):
    m, net, stats = trained
    xv, yv = load_mnist("val", limit=400)
    acc = accuracy_vs_t(net, m, xv, yv, bins=5, seed=7)
    assert 0.4 < acc["chance"] < 0.6
    # near the data end the digit is visible: clearly better than the ~0.5 of guessing
    assert acc["acc_no_label"][-1] > 0.75, acc
    # at pure noise there is nothing to see
    assert acc["acc_no_label"][0] < acc["acc_no_label"][-1]
    assert stats["steps"] == 300 and np.isfinite(stats["final_loss"])


@pytest.mark.slow  # ~6 s: trains a router (module fixture)
def test_checkpoint_roundtrip_and_weights(trained, tmp_path):
    m, net, _ = trained
    path = save_router(tmp_path / "router", net, {"training": {"steps": 300}})
    assert path.name == "router.safetensors" and (tmp_path / "router.json").is_file()
    r = Router.load(tmp_path / "router")
    assert r.num_experts == 2 and r.meta["training"]["steps"] == 300
    x, y = load_mnist("val", limit=16)
    t = np.linspace(0, 1, 16, dtype=np.float32)
    w = r.weights(x, t, y)
    assert w.shape == (16, 2) and w.dtype == np.float32
    np.testing.assert_allclose(w.sum(1), 1.0, atol=1e-5)
    with torch.no_grad():
        ref = torch.softmax(net(torch.from_numpy(x), torch.from_numpy(t), torch.from_numpy(y)), 1).numpy()
    np.testing.assert_allclose(w, ref, atol=1e-5)
    # unknown label: None and -1 agree; scalar t broadcasts
    np.testing.assert_allclose(r.weights(x, 1.0), r.weights(x, np.ones(16, np.float32), np.full(16, -1)), atol=1e-6)
    # Router.load accepts either file of the pair
    np.testing.assert_allclose(Router.load(tmp_path / "router.json").weights(x, t, y), w, atol=1e-6)


@pytest.mark.slow  # ~6 s: trains a router (module fixture)
def test_router_refuses_bad_input(trained, tmp_path):
    _, net, _ = trained
    r = Router(net)
    x = np.zeros((4, 1, 32, 32), np.float32)
    with pytest.raises(RouterError, match="x_t must be"):
        r.weights(np.zeros((4, 32, 32), np.float32), np.zeros(4), None)
    with pytest.raises(RouterError, match="t must be"):
        r.weights(x, np.zeros(3), None)
    with pytest.raises(RouterError, match="y must lie"):
        r.weights(x, np.zeros(4), np.array([0, 1, 2, 10]))
    with pytest.raises(RouterError, match="integer"):
        r.weights(x, np.zeros(4), np.zeros(4, np.float32))
    with pytest.raises(RouterError, match="finite"):
        r.weights(x * np.nan, np.zeros(4), None)
    with pytest.raises(RouterError, match="not found"):
        Router.load(tmp_path / "nope")
    save_router(tmp_path / "r", net, {})
    (tmp_path / "r.safetensors").write_bytes(b"garbage")
    with pytest.raises(RouterError, match="sha256"):
        Router.load(tmp_path / "r")
    doc = json.loads((tmp_path / "r.json").read_text())
    doc["format"] = "something-else"
    (tmp_path / "r.json").write_text(json.dumps(doc))
    with pytest.raises(RouterError, match="not a router checkpoint"):
        Router.load(tmp_path / "r")


def test_router_net_shapes_and_size():
    net = RouterNet(3)
    out = net(torch.zeros(5, 1, 32, 32), torch.rand(5), torch.tensor([0, 1, -1, 9, 3]))
    assert out.shape == (5, 3)
    assert 50_000 < num_params(net) < 500_000


def test_train_refuses_mismatched_manifest():
    x, y = load_mnist("train", limit=100)
    m = make_partition("classes", y[:50], None, 2)
    with pytest.raises(RouterError, match="manifest indexes"):
        train_router(m, x, y, RouterTrainConfig(steps=1), progress=False)
