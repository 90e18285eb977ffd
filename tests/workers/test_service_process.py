"""`ddm-fleet worker` as a real process: start-up, SIGTERM drain, clear errors for bad arguments."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from schemas import StepReply, StepRequest, StepResult, pack, subjects, unpack

pytestmark = pytest.mark.procs

CLI = [sys.executable, "-m", "infra.cli"]
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def medium_checkpoint(tmp_path_factory) -> str:
    """A UNet a little bigger than the tiny one (widths 16,32), so a queue of batches takes a while."""
    from models.tiny import make_tiny_expert

    path = tmp_path_factory.mktemp("medium-expert") / "expert0"
    return str(make_tiny_expert(path, expert_id=0, seed=7, widths=(16, 32), time_dim=32, class_dim=32, groups=8))


async def _start_worker(checkpoint: str, nats_url: str, *extra: str):
    proc = await asyncio.create_subprocess_exec(
        *CLI,
        "worker",
        "--expert",
        "0",
        "--checkpoint",
        checkpoint,
        "--nats",
        nats_url,
        *extra,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=ROOT,
    )
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), 300)
    except TimeoutError:
        proc.kill()
        raise
    if not line.startswith(b"ready:"):
        err = await proc.stderr.read()
        proc.kill()
        raise AssertionError(f"worker did not start: {line!r} {err.decode()[-2000:]}")
    return proc


async def test_sigterm_during_a_batch_still_answers_every_held_request(medium_checkpoint, nats_url, nc):
    proc = await _start_worker(medium_checkpoint, nats_url, "--buckets", "32")
    try:
        n = 6
        rng = np.random.default_rng(0)
        reqs = [
            StepRequest(
                expert=0,
                x_t=rng.standard_normal((32, 1, 32, 32)).astype(np.float32),
                t=np.full(32, 0.5, np.float32),
                y=np.zeros(32, np.int64),
                request_id=f"q{i}",
            )
            for i in range(n)
        ]
        tasks = [asyncio.create_task(nc.request(subjects.expert_velocity(0), pack(r), timeout=120)) for r in reqs]
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        proc.send_signal(signal.SIGTERM)  # the worker holds the other requests, one batch running
        answered_before = sum(t.done() for t in tasks)
        assert answered_before < n, "the worker finished everything before SIGTERM; the test proves nothing"
        replies = [unpack((await t).data, StepResult) for t in tasks]
        assert all(isinstance(r, StepReply) and r.velocity.shape == (32, 1, 32, 32) for r in replies)
        rc = await asyncio.wait_for(proc.wait(), 60)
        out = (await proc.stdout.read()).decode()
        assert rc == 0, (await proc.stderr.read()).decode()[-2000:]
        assert f"stopped: {n} replies, 0 errors" in out
        # it left the queue group: nobody answers now
        import nats.errors

        with pytest.raises(nats.errors.NoRespondersError):
            await nc.request(subjects.expert_velocity(0), pack(reqs[0]), timeout=2)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


def _cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)


@pytest.mark.slow  # ~4 s: four worker processes start and fail
def test_worker_cli_rejects_bad_arguments_clearly(tiny_expert_checkpoint, tmp_path, nats_url):
    r = _cli("worker", "--expert", "0", "--checkpoint", str(tmp_path / "missing.safetensors"))
    assert r.returncode == 2 and "not found" in r.stderr and "Traceback" not in r.stderr
    r = _cli("worker", "--expert", "0", "--checkpoint", tiny_expert_checkpoint, "--buckets", "1,x")
    assert r.returncode == 2 and "comma-separated" in r.stderr
    r = _cli("worker", "--expert", "0", "--checkpoint", tiny_expert_checkpoint, "--buckets", "1,2", "--max-batch", "8")
    # checked with the other options (WorkerConfig), before anything loads: a usage error
    assert r.returncode == 2 and "larger than the largest bucket" in r.stderr and "Traceback" not in r.stderr
    r = _cli("worker", "--expert", "1", "--checkpoint", tiny_expert_checkpoint, "--buckets", "1", "--nats", nats_url)
    assert r.returncode == 1 and "is for expert 0" in r.stderr and "Traceback" not in r.stderr
    from bus.nats_server import free_port

    r = _cli(
        "worker",
        "--expert",
        "0",
        "--checkpoint",
        tiny_expert_checkpoint,
        "--buckets",
        "1",
        "--nats",
        f"nats://127.0.0.1:{free_port()}",
        "--connect-attempts",
        "1",
    )
    assert r.returncode == 1 and "cannot connect to NATS" in r.stderr and "Traceback" not in r.stderr
