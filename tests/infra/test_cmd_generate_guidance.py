"""`ddm-fleet generate --guidance S`: its argument checks, its job plan and summary, and a real run against
a real fleet whose experts have a null label (guided images differ from unguided ones of the same seed)."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from coordinator.local_fleet import LabelRouter
from coordinator.service import Coordinator
from tests.coordinator.helpers import JITTER, TINY_WIDTHS, start_workers, stop_workers

C2E = [0] * 5 + [1] * 5


def _args(*argv):
    from infra.cli import parse_args

    return parse_args(["generate", "--out", "x.npz", *argv])


@pytest.mark.parametrize("bad", ["-1", "21", "nan", "inf", "two"])
def test_bad_scales_fail_clearly(bad, capsys):
    with pytest.raises(SystemExit) as exit_:
        _args("--digits", "3", "--guidance", bad)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--guidance" in err and ("[0, 20]" in err or "a number" in err), err


def test_plan_carries_the_scale_and_the_summary_says_it():
    from infra.cmd_generate import RunResult, plan_requests, summary

    reqs, _ = plan_requests(_args("--digits", "3,7,1", "--seed", "2", "--guidance", "2.5", "--images-per-job", "2"))
    assert [r.guidance_scale for r in reqs] == [2.5, 2.5] and reqs[0].n_guided == 2
    (plain,), _ = plan_requests(_args("--digits", "3", "--seed", "2"))
    # no --guidance: the fleet's default, so nothing on the wire; --guidance 1: off, said explicitly
    assert plain.guidance_scale is None and "guidance_scale" not in plain.model_dump()
    (off,), _ = plan_requests(_args("--digits", "3", "--seed", "2", "--guidance", "1"))
    assert off.guidance_scale == 1.0 and off.model_dump()["guidance_scale"] == 1.0 and off.n_guided == 0
    result = RunResult(
        images=np.zeros((1, 1, 32, 32), np.float32),
        labels=np.array([3]),
        usage=np.ones((1, 2), np.float32),
        seed=2,
        elapsed_s=0.1,
        jobs=[{"job_id": "j", "seed": 2, "first_image": 0, "images": 1}],
        notes=[],
    )
    assert summary(result, 4, "top1", "x.npz", guidance=2.5)["guidance"] == 2.5
    assert "guidance" not in summary(result, 4, "top1", "x.npz")


async def test_generate_guided_against_a_running_fleet(nats_url, tmp_path, capsys, tmp_path_factory):
    import torch

    from infra.cli import main
    from models.tiny import make_tiny_experts

    experts = make_tiny_experts(
        tmp_path_factory.mktemp("gen-cfg"), 2, widths=TINY_WIDTHS, jitter=JITTER, groups=8, null_label=True
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    ws = await start_workers(nats_url, experts, buckets=(1, 4), dtype="float32")
    try:
        async with Coordinator(LabelRouter(C2E, 2), num_experts=2, class_to_expert=C2E, nats_url=nats_url):
            out = {}
            for name, extra in (("guided", ["--guidance", "4"]), ("plain", [])):
                argv = ["generate", "--digits", "2,8", "--steps", "3", "--seed", "5", "--json", "--no-progress"]
                argv += ["--out", str(tmp_path / f"{name}.npz"), "--nats", nats_url, *extra]
                assert await asyncio.to_thread(main, argv) == 0
                out[name] = json.loads(capsys.readouterr().out), np.load(tmp_path / f"{name}.npz")
    finally:
        await stop_workers(ws)
        torch.set_num_threads(threads)
    (summary, guided), (plain_summary, plain) = out["guided"], out["plain"]
    assert summary["guidance"] == 4.0 and "guidance" not in plain_summary
    assert guided["images"].shape == (2, 1, 32, 32) and guided["labels"].tolist() == [2, 8]
    assert np.isfinite(guided["images"]).all() and np.abs(guided["images"] - plain["images"]).max() > 1e-3
