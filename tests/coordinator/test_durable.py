"""Durable jobs (coordinator.durable, `ddm-fleet coordinator --durable`): a real nats-server with
JetStream, a real coordinator process killed with SIGKILL mid-run, its restart under the same
name resumes every job from its JetStream checkpoint, and the waiting clients get images
bit-identical to an undisturbed run."""

from __future__ import annotations

import asyncio
import os
import sys

import numpy as np
import pytest

from bus.nats_server import NatsServer
from coordinator.client import run_job
from schemas import FrameEvent, JobRequest
from tests.coordinator.helpers import make_tiny_experts, make_tiny_router
from tests.waiting import wait_until


@pytest.fixture(scope="module")
def js_server(tmp_path_factory):
    store = tmp_path_factory.mktemp("jetstream")
    with NatsServer(extra_config=f"jetstream {{ store_dir: \"{store}\" }}") as srv:
        yield srv


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("durable-models")
    return make_tiny_experts(d), make_tiny_router(d / "router")


async def start_coordinator(url: str, router, *extra: str):
    """A `ddm-fleet coordinator --durable` process; returns it once it printed its ready line, and
    the lines before it."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "infra.cli", "coordinator", "--router", str(router), "--partition",
        "checkpoints/partition.json", "--nats", url, "--metrics-port", "0", "--step-timeout", "5", *extra,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env)
    lines = []
    while True:
        line = await asyncio.wait_for(proc.stdout.readline(), 120)
        if not line:
            raise AssertionError(b"".join(lines) + await proc.stderr.read())
        lines.append(line)
        if line.startswith(b"ready: coordinator"):
            return proc, b"".join(lines)


async def stop(proc) -> bytes:
    if proc.returncode is None:
        proc.kill()
    await proc.wait()
    return await proc.stderr.read()


async def sim_workers(url, experts, batch_ms=15.0):
    from workers.backends import get_backend
    from workers.service import ExpertWorker

    ws = []
    for k, path in enumerate(experts):
        w = ExpertWorker(expert=k, checkpoint=path, nats_url=url, buckets=(1, 4, 16),
                         backend=get_backend("sim", preset="instant", batch_ms=batch_ms))
        await w.start()
        ws.append(w)
    return ws


def jobs(tag: str) -> list[JobRequest]:
    # top1 / oracle: the tiny torch router's weights differ in the last bit with the rows batched beside
    # them, so `full` / `topk` images are bit-identical only when the batches are (pure test: test_checkpoint)
    kinds = [("top1", "euler"), ("top1", "heun"), ("oracle", "euler"), ("oracle", "heun")]
    return [JobRequest(job_id=f"{tag}-{i}", digits=[1 + i, 8 - i], steps=60, seed=900 + i, strategy=s, solver=v)
            for i, (s, v) in enumerate(kinds)]


async def test_durable_needs_jetstream_and_says_so(nats_url, tiny_files):
    _, router = tiny_files
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "infra.cli", "coordinator", "--router", str(router), "--partition",
        "checkpoints/partition.json", "--nats", nats_url, "--metrics-port", "0", "--durable",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode == 2, out + err
    assert b"--durable needs NATS JetStream" in err and b"Traceback" not in err


async def test_kill9_mid_run_then_restart_resumes_every_job_bit_identical(js_server, tiny_files):
    import nats

    experts, router = tiny_files
    url = js_server.url
    nc = await nats.connect(url, name="pytest-durable")
    ws = await sim_workers(url, experts)
    procs = []
    try:
        proc, head = await start_coordinator(url, router, "--durable", "--checkpoint-every", "10", "--name", "dur")
        procs.append(proc)
        assert b"durable jobs: on" in head and b"checkpoint every 10 steps" in head
        want = await asyncio.gather(*(run_job(nc, r, timeout=120) for r in jobs("ref")))

        steps: dict[str, list[int]] = {}

        def seen(ev):
            if isinstance(ev, FrameEvent):
                steps.setdefault(ev.job_id, []).append(ev.step)

        runs = [asyncio.ensure_future(run_job(nc, r, seen, timeout=180, lost_after=120, probe_every=1.0))
                for r in jobs("kill")]
        # mid-run: every job past its first periodic checkpoint, none finished
        await wait_until(lambda: len(steps) == 4 and min(max(s) for s in steps.values()) >= 12, timeout=60,
                         what="every job past step 12")
        assert max(max(s) for s in steps.values()) < 60
        proc.kill()  # SIGKILL: no hand-over, no last checkpoint
        await proc.wait()
        at_kill = {j: max(s) for j, s in steps.items()}
        proc2, head2 = await start_coordinator(url, router, "--durable", "--checkpoint-every", "10", "--name", "dur")
        procs.append(proc2)
        assert b"resumed 4 jobs" in head2, head2
        got = await asyncio.wait_for(asyncio.gather(*runs), 180)
        for w, g in zip(want, got):
            assert np.array_equal(w.images, g.images), g.job_id
            assert np.array_equal(w.usage, g.usage) and w.digits == g.digits
        for j, s in steps.items():  # frames paused, then went on from the last checkpoint (a multiple of 10)
            after = s[s.index(at_kill[j]) + 1:] if at_kill[j] in s else []
            assert s[-1] == 60 and (not after or after[0] <= at_kill[j] + 1), (j, s)
        js = nc.jetstream()
        kv = await js.key_value("ddm_jobs")
        import nats.js.errors

        async def empty():
            try:
                await kv.keys()
                return False
            except nats.js.errors.NoKeysError:
                return True

        await wait_until(empty, timeout=10, what="checkpoints deleted once the jobs are done")
    finally:
        for p in procs:
            await stop(p)
        for w in ws:
            await w.stop()
        await nc.drain()
