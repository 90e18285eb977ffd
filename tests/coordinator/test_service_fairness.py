"""Fair sharing and engine supervision with real processes: a real nats-server, tiny expert workers
(models.tiny via tests.coordinator.helpers), a Coordinator through its Python API, clients over NATS."""

from __future__ import annotations

import asyncio

import pytest

from client.jobs import JobFailed, run_job, submit_job
from coordinator.local_fleet import LabelRouter
from coordinator.service import Coordinator, EngineDied
from schemas import ErrorCode, JobRequest
from tests.coordinator.helpers import start_workers, stop_workers
from tests.waiting import wait_until

C2E = [0] * 5 + [1] * 5
HEAVY_STEPS = 30
LIGHT_STEPS = 4


async def test_a_flooding_client_is_throttled_while_a_light_one_keeps_finishing(nats_url, nc, experts):
    """`heavy` keeps its queue full of 2-image x 30-step jobs (the coordinator runs 4 rows); `light`
    runs three 1-image x 4-step jobs one after another. Each light job must finish within one heavy
    job plus its own steps (counted in engine ticks; global FIFO would make it wait for heavy's whole
    queue, >= 60 ticks), and heavy's surplus is refused with the quota, its limit and value."""
    ws = await start_workers(nats_url, experts, buckets=(1, 4))
    try:
        async with Coordinator(
            LabelRouter(C2E, 2),
            num_experts=2,
            class_to_expert=C2E,
            nats_url=nats_url,
            max_rows=4,
            max_client_queued_jobs=4,
            step_timeout=10,
        ) as coord:
            sched = coord.engine.scheduler
            refusals: list[JobFailed] = []
            accepted = 0

            stop = asyncio.Event()

            async def flood() -> None:
                nonlocal accepted
                i = 0
                while not stop.is_set():
                    i += 1
                    try:
                        await submit_job(
                            nc,
                            JobRequest(job_id=f"heavy-{i}", digits=[1, 6], steps=HEAVY_STEPS, stream=False),
                            client="heavy",
                        )
                        accepted += 1
                    except JobFailed as err:
                        refusals.append(err)
                        await asyncio.sleep(0.05)

            flooder = asyncio.create_task(flood())
            try:
                await wait_until(
                    lambda: sched.client_usage("heavy")["queued_jobs"] == 4 and len(refusals) >= 3,
                    timeout=30,
                    what="heavy's queue full and its surplus refused",
                )
                waits = []
                for i in range(3):
                    # light submits behind a full heavy queue (FIFO: 4 queued heavy jobs = 60 ticks first)
                    await wait_until(
                        lambda: sched.client_usage("heavy")["queued_jobs"] == 4,
                        timeout=30,
                        what="heavy's queue full again",
                    )
                    t0 = sched.stats.ticks
                    done = await asyncio.wait_for(
                        run_job(nc, JobRequest(digits=[2 + i], steps=LIGHT_STEPS, seed=i), client="light"), 120
                    )
                    assert done.images.shape == (1, 1, 32, 32)
                    waits.append(sched.stats.ticks - t0)
            finally:  # let the submit in flight get its answer, so every refusal the coordinator counted is seen
                stop.set()
                await asyncio.wait_for(flooder, 30)
            # one heavy job (30 steps) frees rows, light takes them first, then its own 4 steps (+ slack);
            # each of the engine's cohorts counts its own ticks, so a step of every job is `cohorts` ticks
            rounds = coord.engine.cohorts_now()
            assert all(w <= (HEAVY_STEPS + LIGHT_STEPS + 3) * rounds for w in waits), (waits, rounds)
            assert accepted >= 6 and len(refusals) >= 3
            err = refusals[0]
            assert err.code == ErrorCode.OVERLOADED
            assert "client quota: 4 queued jobs (limit 4)" in str(err)
            assert coord.metrics.sample(
                "ddm_coordinator_jobs_rejected_by_limit_total", limit="max_client_queued_jobs"
            ) == len(refusals)
    finally:
        await stop_workers(ws)


async def test_a_dead_engine_fails_every_job_refuses_submits_and_raises_for_the_supervisor(nats_url, nc, experts):
    """A failure the tick cannot contain (here: the scheduler's update and fail_batch both break) kills
    the loop: the running and queued jobs' clients get `internal`, a new submit over NATS is refused
    `unavailable`, and serve_until raises EngineDied (`ddm-fleet coordinator` then exits 1)."""
    ws = await start_workers(nats_url, experts, buckets=(1, 4))
    try:
        async with Coordinator(
            LabelRouter(C2E, 2), num_experts=2, class_to_expert=C2E, nats_url=nats_url, max_rows=1
        ) as coord:
            sched = coord.engine.scheduler
            release = asyncio.Event()
            original_update = sched.update

            def update(batch, now):  # injected failure: breaks once the test releases it
                if release.is_set():
                    raise RuntimeError("injected update failure")
                original_update(batch, now)

            def fail_batch(batch, code, reason):
                raise RuntimeError("injected fail_batch failure")

            sched.update, sched.fail_batch = update, fail_batch
            jobs = [
                asyncio.create_task(run_job(nc, JobRequest(job_id=j, digits=[1], steps=1000), client="alice"))
                for j in ("dies-running", "dies-queued")
            ]
            await wait_until(
                lambda: sched.active_jobs == 1 and sched.queued_jobs == 1,
                timeout=30,
                what="one job running, one queued",
            )
            serving = asyncio.create_task(coord.serve_until(asyncio.Event()))
            release.set()
            with pytest.raises(EngineDied, match="injected fail_batch failure"):
                await asyncio.wait_for(serving, 30)
            for task in jobs:
                with pytest.raises(JobFailed) as err:
                    await asyncio.wait_for(task, 30)
                assert err.value.code == ErrorCode.INTERNAL and "coordinator engine stopped" in str(err.value)
            with pytest.raises(JobFailed) as err:
                await submit_job(nc, JobRequest(digits=[1]), client="alice")
            assert err.value.code == ErrorCode.UNAVAILABLE and "engine stopped" in str(err.value)
            assert coord.engine_error.startswith("coordinator engine stopped: RuntimeError")
    finally:
        await stop_workers(ws)


#: `ddm-fleet coordinator` with a failure injected into the scheduler class (its update and
#: fail_batch raise), so that the first tick kills the engine loop.
DOOMED_CLI = """
import sys
import coordinator.scheduler as s

def boom(self, *a, **k):
    raise RuntimeError("injected scheduler failure")

s.Scheduler.update = boom
s.Scheduler.fail_batch = boom
from infra.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.procs
async def test_ddm_fleet_coordinator_exits_nonzero_when_its_engine_dies(nats_url, nc, tmp_path):
    import os
    import sys

    from tests.coordinator.helpers import make_tiny_router

    router = make_tiny_router(tmp_path / "router")
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        DOOMED_CLI,
        "coordinator",
        "--router",
        str(router),
        "--partition",
        "checkpoints/partition.json",
        "--nats",
        nats_url,
        "--metrics-port",
        "0",
        "--step-timeout-s",
        "1",
        "--retries",
        "0",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), 120)
        assert line.startswith(b"ready: coordinator"), line + await proc.stderr.read()
        with pytest.raises(JobFailed) as err:  # no workers: the tick reaches update, which breaks
            await run_job(nc, JobRequest(digits=[1], steps=5), timeout=60)
        assert err.value.code == ErrorCode.INTERNAL and "injected scheduler failure" in str(err.value)
        assert await asyncio.wait_for(proc.wait(), 60) == 1
        stderr = await proc.stderr.read()
        assert b"coordinator engine stopped: RuntimeError: injected scheduler failure" in stderr
        assert b"exiting so that a supervisor restarts it" in stderr
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


def test_fair_sharing_flags_are_checked():
    from infra.cli import main

    assert main(["coordinator", "--max-client-queued-jobs", "0"]) == 2
    # 0 means "no quota of its own" for these (rows: --max-rows; a session's: its client's)
    for flag in ("--max-client-rows", "--max-session-rows", "--max-session-queued-jobs"):
        assert main(["coordinator", flag, "-1"]) == 2
    for flag in ("--max-job-cost", "--max-job-run-s", "--submit-rate", "--status-rate"):
        assert main(["coordinator", flag, "-1"]) == 2
