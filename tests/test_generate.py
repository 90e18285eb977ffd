"""`ddm-fleet generate` end to end (a real CLI subprocess against a real fleet) and its helpers."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from coordinator.service import Coordinator
from infra.cmd_generate import local_buckets, parse_digits

from coordinator.local_fleet import LabelRouter
from coordinator_helpers import make_tiny_experts, make_tiny_router


def _cli(*args, timeout=120):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "infra.cli", "generate", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_local_buckets_cover_the_job():
    assert local_buckets(1) == (1,)
    assert local_buckets(10) == (1, 2, 4, 8, 16)
    assert local_buckets(256) == (1, 2, 4, 8, 16, 32, 64)


def test_parse_digits():
    assert parse_digits("3,7, 7") == [3, 7, 7]
    for bad in ("", "3,x", "10", "-1"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_digits(bad)


def test_bad_arguments_fail_clearly(tmp_path, capsys):
    from infra.cli import main

    assert main(["generate", "--digits", "3", "--out", str(tmp_path / "x.jpg")]) == 2
    assert ".png or .npz" in capsys.readouterr().err
    assert main(["generate", "--digits", "3", "--steps", "5000", "--out", "x.png"]) == 2
    assert "bad request" in capsys.readouterr().err
    for argv, msg in ((["--digits", "3,12"], "0-9"), (["--digits", "3", "--count", "2"], "not allowed with"),
                      (["--count", "0"], "positive")):
        with pytest.raises(SystemExit) as err:
            main(["generate", *argv])
        assert err.value.code == 2 and msg in capsys.readouterr().err


def test_no_fleet_is_a_clear_error(tmp_path, capsys):
    from infra.cli import main
    from infra.nats_server import free_port

    url = f"nats://127.0.0.1:{free_port()}"
    assert main(["generate", "--digits", "3", "--nats", url, "--out", str(tmp_path / "x.png"), "--no-progress"]) == 1
    assert "cannot reach NATS" in capsys.readouterr().err


@pytest.fixture(scope="module")
def experts(tmp_path_factory):
    return make_tiny_experts(tmp_path_factory.mktemp("gen-experts"))


async def test_generate_against_a_running_fleet(nats_url, experts, tmp_path):
    import torch

    from workers.service import ExpertWorker

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    ws = []
    try:
        for k, p in enumerate(experts):
            ws.append(ExpertWorker(expert=k, checkpoint=p, nats_url=nats_url, buckets=(1, 4)))
            await ws[-1].start()
        async with Coordinator(LabelRouter([0] * 5 + [1] * 5, 2), num_experts=2, class_to_expert=[0] * 5 + [1] * 5, nats_url=nats_url):
            npz = tmp_path / "out.npz"
            r = await asyncio.to_thread(_cli, "--digits", "3,7,7", "--steps", "3", "--seed", "5", "--out", str(npz),
                                        "--json", "--nats", nats_url, "--no-progress")
            assert r.returncode == 0, r.stderr
            summary = json.loads(r.stdout)
            assert summary["seed"] == 5 and [i["digit"] for i in summary["images"]] == [3, 7, 7]
            assert summary["images"][0]["usage"] == [1.0, 0.0] and summary["images"][1]["usage"] == [0.0, 1.0]
            data = np.load(npz)
            assert data["images"].shape == (3, 1, 32, 32) and data["labels"].tolist() == [3, 7, 7]
            assert np.abs(data["images"]).max() <= 1.0

            png = tmp_path / "out.png"
            r = await asyncio.to_thread(_cli, "--count", "4", "--steps", "2", "--solver", "heun", "--strategy", "oracle",
                                        "--seed", "5", "--out", str(png), "--nats", nats_url)
            assert r.returncode == 0, r.stderr
            assert "wrote 4 images" in r.stdout
            from PIL import Image

            assert Image.open(png).size == (4 * 66 + 2, 66 + 2)  # one row of 4 digits of 64 px, 2 px gaps
    finally:
        for w in ws:
            await w.stop()
        torch.set_num_threads(threads)


def test_generate_local_runs_its_own_fleet(experts, tmp_path):
    import shutil

    d = tmp_path / "ck"
    d.mkdir()
    for k, p in enumerate(experts):
        shutil.copy(p, d / f"expert{k}.safetensors")
        shutil.copy(p.with_suffix(".json"), d / f"expert{k}.json")
    make_tiny_router(d / "router")
    shutil.copy("checkpoints/partition.json", d / "partition.json")
    out = tmp_path / "local.npz"
    r = _cli("--local", "--checkpoints", str(d), "--digits", "1,8", "--steps", "2", "--seed", "3", "--out", str(out),
             "--json", timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    s = json.loads(r.stdout)
    assert [i["digit"] for i in s["images"]] == [1, 8]
    assert all(abs(sum(i["usage"]) - 1.0) < 1e-6 for i in s["images"])  # top1: one expert per step
    assert np.load(out)["images"].shape == (2, 1, 32, 32)


def test_generate_local_without_checkpoints_says_what_is_missing(tmp_path):
    r = _cli("--local", "--checkpoints", str(tmp_path), "--digits", "1", "--out", str(tmp_path / "x.png"))
    assert r.returncode == 2 and "router.safetensors" in r.stderr and "checkpoints/README.md" in r.stderr
