"""Router trainer resume: an interrupted run continued with --resume ends with the same weights as an
uninterrupted one (bit-identical on CPU: the numpy and torch RNG streams are restored), and the CLI
refuses a resume file from another partition manifest or another network width."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dataset.mnist import load_mnist
from dataset.partition import make_partition, save_manifest

torch = pytest.importorskip("torch")

from infra.cli import main  # noqa: E402
from models.router import RouterError  # noqa: E402
from training.train_router import RESUME_NAME, RouterTrainConfig, train_router  # noqa: E402

LIMIT = 256


@pytest.fixture(scope="module")
def data():
    """The first LIMIT train images and a classes partition (0-4 / 5-9) of them."""
    torch.set_num_threads(1)
    x, y = load_mnist("train", limit=LIMIT)
    return make_partition("classes", y, None, 2), x, y


def _cfg(run_dir, **kw):
    base = dict(
        steps=8, batch_size=16, width=8, lr=3e-3, seed=3, save_every=4, run_dir=str(run_dir) if run_dir else None
    )
    base.update(kw)
    return RouterTrainConfig(**base)


def _state(net) -> dict:
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def test_interrupted_run_resumes_to_identical_weights(tmp_path, data):
    m, x, y = data
    full, full_stats = train_router(m, x, y, _cfg(tmp_path / "a"), progress=False)
    assert full_stats["steps"] == 8 and full_stats["complete"] is True

    half, half_stats = train_router(m, x, y, _cfg(tmp_path / "b"), progress=False, stop_after=4)
    assert half_stats["steps"] == 4 and half_stats["complete"] is False
    half_w = _state(half)
    ck = torch.load(tmp_path / "b" / RESUME_NAME, map_location="cpu", weights_only=True)
    assert ck["step"] == 4 and ck["kind"] == "router" and len(ck["history"]) == 4

    torch.manual_seed(999)  # a fresh process would hold other RNG states: resume must not depend on them
    resumed, stats = train_router(m, x, y, _cfg(tmp_path / "b"), progress=False, resume=True)
    assert stats["steps"] == 8 and stats["complete"] is True
    a, b = _state(full), _state(resumed)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs after resume"
    assert stats["final_loss"] == full_stats["final_loss"]
    assert stats["final_train_acc"] == full_stats["final_train_acc"]
    # the resumed call really trained the second half
    assert any(not torch.equal(half_w[k], b[k]) for k in b)
    # the final resume file is at the last step
    assert torch.load(tmp_path / "b" / RESUME_NAME, map_location="cpu", weights_only=True)["step"] == 8


def test_resume_refuses_missing_file_and_other_config(tmp_path, data):
    m, x, y = data
    with pytest.raises(RouterError, match="does not exist"):
        train_router(m, x, y, _cfg(tmp_path / "none"), progress=False, resume=True)
    with pytest.raises(RouterError, match="needs a run directory"):
        train_router(m, x, y, _cfg(None), progress=False, resume=True)
    train_router(m, x, y, _cfg(tmp_path / "r", steps=4), progress=False)
    with pytest.raises(RouterError, match="beyond --steps 2"):
        train_router(m, x, y, _cfg(tmp_path / "r", steps=2), progress=False, resume=True)
    with pytest.raises(RouterError, match="--save-every|save_every"):
        _cfg(tmp_path, save_every=0)


def _cli(partition, run_dir, out, *extra):
    return main(
        [
            "train-router",
            "--partition",
            str(partition),
            "--limit",
            str(LIMIT),
            "--val-limit",
            "20",
            "--bins",
            "2",
            "--batch-size",
            "16",
            "--width",
            "8",
            "--save-every",
            "2",
            "--run-dir",
            str(run_dir),
            "--out",
            str(out),
            *extra,
        ]
    )


def test_cli_resume_continues_and_refuses_mismatches(tmp_path, data, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["train-router", "--help"])
    assert exc.value.code == 0
    help_text = capsys.readouterr().out
    assert "--resume" in help_text and "--save-every" in help_text and "router_resume.pt" in help_text

    m, _, y = data
    part = save_manifest(m, tmp_path / "partition.json")
    run, out = tmp_path / "run", tmp_path / "router"
    assert _cli(part, run, out, "--steps", "4") == 0
    assert json.loads(out.with_suffix(".json").read_text())["training"]["steps"] == 4
    assert (run / RESUME_NAME).is_file()
    capsys.readouterr()

    # resume up to 6 steps: the bar starts at step 4, the checkpoint records 6
    assert _cli(part, run, out, "--steps", "6", "--resume") == 0
    err = capsys.readouterr().err
    assert "4/6" in err and " 0/6" not in err
    meta = json.loads(out.with_suffix(".json").read_text())
    assert meta["training"]["steps"] == 6 and meta["training"]["complete"] is True

    # another network width: refused with a clear error, the resume file untouched
    before = (run / RESUME_NAME).read_bytes()
    assert _cli(part, run, out, "--steps", "8", "--width", "16", "--resume") == 2
    assert "keep the same --width" in capsys.readouterr().err
    # another partition manifest (same images, other class groups): refused
    other = save_manifest(
        make_partition("classes", y, None, 2, classes=[[0, 1, 2], list(range(3, 10))]), tmp_path / "other.json"
    )
    assert _cli(other, run, out, "--steps", "8", "--resume") == 2
    assert "another partition manifest" in capsys.readouterr().err
    assert (run / RESUME_NAME).read_bytes() == before
    assert np.isfinite(meta["training"]["final_loss"])
