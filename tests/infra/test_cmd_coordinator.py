"""`ddm-fleet coordinator` as a real process: serves a job, answers status, stops cleanly on SIGTERM."""

from __future__ import annotations

import asyncio
import os
import signal
import sys

import pytest

from client.jobs import fleet_status, run_job
from schemas import JobRequest
from tests.coordinator.helpers import make_tiny_experts, make_tiny_router


def test_missing_files_are_a_clear_error(tmp_path, capsys):
    from infra.cli import main

    assert (
        main(
            [
                "coordinator",
                "--router",
                str(tmp_path / "nope.safetensors"),
                "--partition",
                "checkpoints/partition.json",
                "--nats",
                "nats://127.0.0.1:1",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "router" in err and "does not exist" in err


def test_a_deeply_nested_router_json_is_a_one_line_error_not_a_traceback(tmp_path):
    """Issue 44: a router.json of 100000 `[` killed the coordinator with a RecursionError traceback."""
    import shutil
    import subprocess

    shutil.copy("checkpoints/router.safetensors", tmp_path / "router.safetensors")
    (tmp_path / "router.json").write_text("[" * 100_000)
    proc = subprocess.run(
        [sys.executable, "-m", "infra.cli", "coordinator", "--router", str(tmp_path / "router.safetensors")]
        + ["--partition", "checkpoints/partition.json", "--nats", "nats://127.0.0.1:1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"ddm-fleet coordinator: RouterError: {tmp_path / 'router.json'}: JSON nested deeper than 64 levels"
    ], proc.stderr


def test_bad_limits_are_refused():
    from infra.cli import main

    assert main(["coordinator", "--max-rows", "0"]) == 2
    assert main(["coordinator", "--step-timeout-s", "0"]) == 2
    assert main(["coordinator", "--step-timeout", "0"]) == 2  # the deprecated spelling is checked alike


@pytest.mark.procs
async def test_coordinator_process_serves_and_stops(nats_url, nc, tmp_path):
    import torch

    from workers.service import ExpertWorker

    experts = make_tiny_experts(tmp_path)
    router = make_tiny_router(tmp_path / "router")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "infra.cli",
        "coordinator",
        "--router",
        str(router),
        "--partition",
        "checkpoints/partition.json",
        "--nats",
        nats_url,
        "--max-rows",
        "64",
        "--step-timeout-s",
        "5",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    ws = []
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), 120)
        assert line.startswith(b"ready: coordinator for 2 experts"), line + await proc.stderr.read()
        for k, p in enumerate(experts):
            ws.append(ExpertWorker(expert=k, checkpoint=p, nats_url=nats_url, buckets=(1, 2, 4)))
            await ws[-1].start()
        done = await run_job(nc, JobRequest(digits=[0, 9], steps=3, seed=2, strategy="oracle"), timeout=60)
        assert done.usage.tolist() == [[1.0, 0.0], [0.0, 1.0]]  # oracle follows partition.json (0-4 | 5-9)
        st = await fleet_status(nc)
        assert st.jobs_done == 1 and st.max_rows == 64 and st.num_experts == 2
        proc.send_signal(signal.SIGTERM)
        out = await asyncio.wait_for(proc.stdout.read(), 60)
        assert await proc.wait() == 0
        assert b"stopped: 1 jobs done, 2 images" in out
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        for w in ws:
            await w.stop()
        torch.set_num_threads(threads)
