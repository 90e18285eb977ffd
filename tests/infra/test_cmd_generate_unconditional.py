"""`ddm-fleet generate --unconditional --count N`: label-unknown images (digit -1), its argument
checks, its job plan, and a real CLI run against a real fleet whose experts have a null label."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from coordinator.local_fleet import LabelRouter
from coordinator.service import Coordinator
from tests.coordinator.helpers import JITTER, TINY_WIDTHS

C2E = [0] * 5 + [1] * 5


def _args(*argv):
    from infra.cli import parse_args

    return parse_args(["generate", "--out", "x.npz", *argv])


def test_bad_combinations_fail_clearly(tmp_path, capsys):
    from infra.cli import main

    out = str(tmp_path / "x.png")
    assert main(["generate", "--unconditional", "--digits", "3", "--out", out]) == 2
    assert "--unconditional takes --count" in capsys.readouterr().err
    assert main(["generate", "--unconditional", "--count", "2", "--strategy", "oracle", "--out", out]) == 2
    assert "oracle needs each image's class" in capsys.readouterr().err


def test_plan_sends_minus_one_digits_split_like_any_run():
    from infra.cmd_generate import job_seed, plan_requests

    (one,), seed = plan_requests(_args("--unconditional", "--count", "3", "--seed", "8"))
    assert one.digits == [-1, -1, -1] and one.count is None and one.seed == 8 == seed
    reqs, base = plan_requests(
        _args("--unconditional", "--count", "5", "--seed", "8", "--images-per-job", "2", "--strategy", "full")
    )
    assert [r.digits for r in reqs] == [[-1, -1], [-1, -1], [-1]]
    assert [r.seed for r in reqs] == [job_seed(8, j) for j in range(3)] and base == 8
    assert all(r.strategy == "full" for r in reqs)
    (plain,), _ = plan_requests(_args("--count", "3", "--seed", "8"))  # without the flag: as before
    assert plain.count == 3 and plain.digits is None


def test_strategy_sample_reaches_the_requests():
    """--strategy sample (the routing that keeps the class mix of unconditional images) is sent as is."""
    from infra.cmd_generate import plan_requests

    reqs, _ = plan_requests(_args("--unconditional", "--count", "4", "--seed", "3", "--strategy", "sample"))
    assert [r.strategy for r in reqs] == ["sample"] and reqs[0].digits == [-1] * 4


@pytest.fixture(scope="module")
def null_experts(tmp_path_factory):
    from models.tiny import make_tiny_experts

    return make_tiny_experts(
        tmp_path_factory.mktemp("gen-null-experts"), 2, widths=TINY_WIDTHS, jitter=JITTER, groups=8, null_label=True
    )


@pytest.mark.procs
async def test_generate_unconditional_against_a_running_fleet(nats_url, null_experts, tmp_path):
    import torch

    from workers.service import ExpertWorker

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    ws = []
    env = dict(os.environ, OMP_NUM_THREADS="1")

    def cli(*argv):
        return subprocess.run(
            [sys.executable, "-m", "infra.cli", "generate", *argv], capture_output=True, text=True, timeout=120, env=env
        )

    try:
        for k, p in enumerate(null_experts):
            ws.append(ExpertWorker(expert=k, checkpoint=p, nats_url=nats_url, buckets=(1, 4), dtype="float32"))
            await ws[-1].start()
        async with Coordinator(LabelRouter(C2E, 2), num_experts=2, class_to_expert=C2E, nats_url=nats_url):
            runs = []
            for name in ("a.npz", "b.npz"):
                r = await asyncio.to_thread(
                    cli,
                    "--unconditional",
                    "--count",
                    "3",
                    "--steps",
                    "2",
                    "--seed",
                    "4",
                    "--strategy",
                    "full",
                    "--out",
                    str(tmp_path / name),
                    "--json",
                    "--nats",
                    nats_url,
                    "--no-progress",
                )
                assert r.returncode == 0, r.stderr[-3000:]
                runs.append((json.loads(r.stdout), np.load(tmp_path / name)))
            (summary, data), (_, again) = runs
            assert [i["digit"] for i in summary["images"]] == [-1, -1, -1] and summary["seed"] == 4
            assert summary["images"][0]["usage"] == [1.0, 1.0]  # full: uniform router weights, both experts
            assert data["labels"].tolist() == [-1, -1, -1] and data["images"].shape == (3, 1, 32, 32)
            np.testing.assert_array_equal(data["images"], again["images"])  # same seed, same images
    finally:
        for w in ws:
            await w.stop()
        torch.set_num_threads(threads)
