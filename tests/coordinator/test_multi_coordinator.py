"""Several coordinators on one bus (the submit queue group): every one of them answers a job status
request, and one that does not hold the job says `unknown` after half a second. A client must take
`unknown` as "the job is lost" only from the job's own coordinator (the name in its `accepted`: the
coordinator itself, or its restart), never from another one while the owner is slow to answer.

Real parts: the session's nats-server, two tiny expert workers (`models.tiny` checkpoints), real
coordinators with the tiny router. The owner's lag is a subclass that answers status requests
`status_lag` seconds late (a loaded host); its engine and everything else run as shipped.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from client.jobs import JobProbe, cancel_job, run_job, submit_job
from coordinator.service import Coordinator
from schemas import DoneEvent, JobAccepted, JobRequest
from tests.coordinator.lagging import LaggingCoordinator
from tests.waiting import wait_until

C2E = [0] * 5 + [1] * 5


@pytest.fixture
async def workers(nats_url, tiny_experts):
    import torch

    from workers.service import ExpertWorker

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # spinning OpenMP threads make tiny forwards slower on a shared box
    ws = []
    try:
        for k, path in enumerate(tiny_experts):
            ws.append(ExpertWorker(expert=k, checkpoint=path, nats_url=nats_url, buckets=(1, 2, 4)))
            await ws[-1].start()
        yield ws
    finally:
        for w in ws:
            await w.stop()
        torch.set_num_threads(threads)


@pytest.fixture
def router(tiny_router):
    from models.router import Router

    return Router.load(tiny_router)


def coordinator(router, nats_url, name: str, cls=Coordinator, **kw) -> Coordinator:
    return cls(
        router,
        num_experts=2,
        class_to_expert=C2E,
        nats_url=nats_url,
        name=name,
        **{"max_rows": 16, "step_timeout": 5.0, **kw},
    )


async def test_accepted_and_job_status_name_the_coordinator_and_its_run(router, nats_url, nc, workers):
    async with coordinator(router, nats_url, "coord-a") as a:
        accepted = await submit_job(nc, JobRequest(job_id="mc-named", digits=[1], steps=1000, stream=False))
        try:
            assert (accepted.coordinator, accepted.instance) == ("coord-a", a.instance)
            assert a.instance and len(a.instance) <= 128
            probe = JobProbe(nc, "mc-named", timeout=3.0, accepted=accepted)
            assert await probe.check() is None
            assert (probe.last.coordinator, probe.last.instance) == ("coord-a", a.instance)
            assert probe.last.state in ("queued", "running")
        finally:
            await cancel_job(nc, "mc-named")
    async with coordinator(router, nats_url, "coord-a") as again:  # a new run: a new instance, same name
        assert again.instance != a.instance


async def test_another_coordinators_unknown_is_not_believed_while_the_owner_lags(router, nats_url, nc, workers):
    """The owner answers after 1 s, the other coordinator says `unknown` after 0.5 s: the probe that
    knows the owner (from `accepted`) waits for the owner's answer; one that does not (the old
    first-answer rule) would have declared the healthy job lost."""
    a = coordinator(router, nats_url, "coord-a", LaggingCoordinator, status_lag=1.0)
    async with a:
        accepted = await submit_job(nc, JobRequest(job_id="mc-lag", digits=[2, 7], steps=1000, stream=False))
        assert accepted.coordinator == "coord-a"
        a.ticking.clear()  # the job stays alive (held) however fast this box would run it
        try:
            async with coordinator(router, nats_url, "coord-b", LaggingCoordinator) as b:
                probe = JobProbe(nc, "mc-lag", timeout=3.0, accepted=accepted)
                t0 = time.monotonic()
                assert await probe.check() is None
                assert time.monotonic() - t0 >= 0.9  # it waited for the lagging owner ...
                assert probe.last.coordinator == "coord-a" and probe.last.state in ("queued", "running")
                assert probe.ignored >= 1 and b.status_requests >= 1  # ... past coord-b's earlier "unknown"

                first_answer = JobProbe(nc, "mc-lag", timeout=3.0)  # no owner known: the first answer counts
                verdict = await first_answer.check()
                assert verdict is not None and "coordinator lost the job" in verdict and "coord-b" in verdict
                assert a.engine.job_state("mc-lag") is not None  # ... yet the job was alive all along
        finally:
            await cancel_job(nc, "mc-lag")


async def test_run_job_completes_on_a_lagging_owner_beside_another_coordinator(router, nats_url, nc, workers):
    """End to end: run_job probes a silent job (queued behind another one, so no event comes) every
    0.3 s while its coordinator answers status 1 s late and another coordinator answers `unknown`
    after 0.5 s; the job is not declared lost, and once it gets rows it completes with its images."""
    a = coordinator(router, nats_url, "coord-a", LaggingCoordinator, status_lag=1.0, max_rows=2)
    async with a:
        blocker = await submit_job(nc, JobRequest(job_id="mc-blocker", digits=[1, 6], steps=1000, stream=False))
        assert blocker.coordinator == "coord-a" and blocker.queue_position == 0
        seen: list = []
        accepted = asyncio.Event()

        def on_event(ev) -> None:
            seen.append(ev)
            if isinstance(ev, JobAccepted):
                accepted.set()

        job = asyncio.create_task(
            run_job(
                nc,
                JobRequest(job_id="mc-run", digits=[3, 8], steps=20, seed=4),
                on_event,
                probe_every=0.3,
                lost_after=5,
                unresponsive_after=60,
                timeout=120,
            )
        )
        try:
            await asyncio.wait_for(accepted.wait(), 30)  # taken by coord-a, the only coordinator yet
            assert seen[0].coordinator == "coord-a" and seen[0].queue_position == 1  # waits: silent
            a.ticking.clear()  # hold it queued (the blocker would otherwise end in a few seconds here)
            async with coordinator(router, nats_url, "coord-b", LaggingCoordinator) as b:
                # several probes: each sees coord-b's "unknown" (0.5 s) before coord-a's "queued" (1 s)
                await wait_until(lambda: b.status_requests >= 4 or job.done(), timeout=30, what="4 probes")
                assert not job.done(), job  # not declared lost (nor anything else) while it waits
                assert a.engine.job_state("mc-run")["state"] == "queued"
                assert await cancel_job(nc, "mc-blocker")  # rows free: the job runs
                a.ticking.set()
                done = await asyncio.wait_for(job, 120)
            assert isinstance(done, DoneEvent) and done.images.shape == (2, 1, 32, 32)
            assert np.isfinite(done.images).all()
            assert a.status_requests >= 4
        finally:
            job.cancel()
            await cancel_job(nc, "mc-blocker")


async def test_an_unknown_from_the_owners_restart_is_believed_at_once(router, nats_url, nc, workers):
    """The owner's connection dies (as in kill -9: no `failed` event) and a coordinator of the same
    name starts: its "unknown" (another run) means the job is lost, even with coord-b on the bus."""
    import nats

    conn_a = await nats.connect(nats_url, name="coord-a")
    a = coordinator(router, None, "coord-a", nc=conn_a)
    try:
        async with a, coordinator(router, nats_url, "coord-b"):
            accepted = await submit_job(nc, JobRequest(job_id="mc-restart", digits=[4], steps=1000, stream=False))
            if accepted.coordinator != "coord-a":  # the queue group gave it to coord-b: not this case
                await cancel_job(nc, "mc-restart")
                accepted = None
                for i in range(20):
                    got = await submit_job(
                        nc, JobRequest(job_id=f"mc-restart{i}", digits=[4], steps=1000, stream=False)
                    )
                    if got.coordinator == "coord-a":
                        accepted = got
                        break
                    await cancel_job(nc, got.job_id)
                assert accepted is not None, "the queue group never picked coord-a in 20 submits"
            await conn_a.close()  # coord-a is gone without a word
            async with coordinator(router, nats_url, "coord-a") as restarted:
                probe = JobProbe(nc, accepted.job_id, timeout=3.0, accepted=accepted)
                t0 = time.monotonic()
                verdict = await probe.check()
                assert verdict is not None and "coordinator lost the job (restarted?)" in verdict, verdict
                assert "coord-a" in verdict and restarted.instance in verdict and accepted.instance in verdict
                assert time.monotonic() - t0 < 3.0
    finally:
        if not conn_a.is_closed:
            await conn_a.close()


async def test_the_cli_coordinator_takes_its_name_from_dash_dash_name(router, tiny_router, nats_url, nc, workers):
    """`ddm-fleet coordinator --name coord-cli` signs its `accepted` with that name; an empty name is refused."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    cli = str(Path(sys.executable).with_name("ddm-fleet"))
    partition = str(Path(__file__).resolve().parents[2] / "checkpoints" / "partition.json")  # classes 0-4 | 5-9
    args = [
        "coordinator",
        "--router",
        str(tiny_router),
        "--partition",
        partition,
        "--nats",
        nats_url,
        "--metrics-port",
        "0",
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    bad = await asyncio.to_thread(
        subprocess.run, [cli, *args, "--name", ""], capture_output=True, text=True, env=env, timeout=120
    )
    assert bad.returncode == 2 and "--name must be 1-128 characters" in bad.stderr, bad.stderr
    proc = await asyncio.create_subprocess_exec(
        cli, *args, "--name", "coord-cli", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL, env=env
    )
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), 120)
        assert line.startswith(b"ready"), line
        accepted = await submit_job(nc, JobRequest(job_id="mc-cli", digits=[1], steps=2, stream=False))
        assert accepted.coordinator == "coord-cli" and accepted.instance
    finally:
        proc.kill()
        await proc.wait()
