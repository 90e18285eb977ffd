"""A job the viewer gives up on is cancelled, never left running for nobody: its submit timed out, its
probe declared it lost (the coordinator froze), or its tab closed. Real processes: the session's
nats-server, a real `ddm-fleet coordinator` subprocess (frozen with SIGSTOP / thawed with SIGCONT), the
real web app; expert requests go to a subscriber that never answers, so a job stays running until cancelled.
The coordinator's own job status and fleet status show the cancel."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from client.jobs import fleet_status, job_status
from schemas import subjects
from tests.waiting import wait_until
from web.app import WebConfig, create_app
from web.session import WEB_CLIENT  # the namespace the viewer's jobs live in on an open bus

pytestmark = pytest.mark.procs

ROOT = Path(__file__).resolve().parents[2]
CLI = str(Path(sys.executable).parent / "ddm-fleet")


@pytest.fixture(scope="module")
def coordinator_proc(nats_url, tmp_path_factory):
    """A real coordinator (shipped router + partition) on the session's nats-server."""
    log = tmp_path_factory.mktemp("orphans") / "coordinator.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [
                CLI,
                "coordinator",
                "--router",
                str(ROOT / "checkpoints" / "router.safetensors"),
                "--partition",
                str(ROOT / "checkpoints" / "partition.json"),
                "--nats",
                nats_url,
                "--metrics-port",
                "0",
                "--step-timeout-s",
                "60",
                "--default-guidance",  # its workers answer nothing, not even a null-label probe
                "1",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    try:
        yield proc, log
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture
async def fleet(coordinator_proc, nc):
    """The coordinator, answering, with both experts served by a worker that never replies."""
    proc, log = coordinator_proc

    async def answers() -> bool:
        try:
            await fleet_status(nc, timeout=1)
            return True
        except Exception:
            assert proc.poll() is None, log.read_text()
            return False

    await wait_until(answers, timeout=90, what="the coordinator to serve fleet status")
    subs = [
        await nc.subscribe(subjects.expert_velocity(e), queue=subjects.expert_queue_group(e), cb=_swallow)
        for e in (0, 1)
    ]
    try:
        yield proc
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        for s in subs:
            await s.unsubscribe()


async def _swallow(_msg) -> None:
    pass  # a worker that never answers: the step waits, the job stays running


async def cancelled_by_coordinator(nc, job_id: str, before: int) -> None:
    async def shows_it() -> bool:
        try:
            st = await job_status(nc, job_id, timeout=1, client=WEB_CLIENT)
        except Exception:
            return False
        return st.state == "failed"

    await wait_until(shows_it, timeout=30, what=f"the coordinator to report job {job_id} cancelled")
    assert (await fleet_status(nc)).jobs_cancelled >= before + 1


async def next_of(ws, types, timeout=30.0):
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while True:
        msg = await ws.receive_json(timeout=max(0.01, end - loop.time()))
        if msg["type"] in types:
            return msg


async def test_timed_out_submit_is_cancelled(aiohttp_client, nats_url, nc, fleet):
    client = await aiohttp_client(create_app(WebConfig(nats_url=nats_url, submit_timeout=0.5)))
    ws = await client.ws_connect("/ws")
    before = (await fleet_status(nc)).jobs_cancelled
    os.kill(fleet.pid, signal.SIGSTOP)  # the submit reaches it, the answer comes too late
    try:
        await ws.send_json({"type": "generate", "digits": "1,2", "steps": 50})
        err = await next_of(ws, {"error", "accepted"})
        assert err["type"] == "error" and err["code"] == "deadline_exceeded", err
        job_id = err["job_id"]
    finally:
        os.kill(fleet.pid, signal.SIGCONT)
    await cancelled_by_coordinator(nc, job_id, before)
    await ws.close()


async def test_job_of_a_frozen_coordinator_declared_lost_is_cancelled(aiohttp_client, nats_url, nc, fleet):
    client = await aiohttp_client(create_app(WebConfig(nats_url=nats_url, unresponsive_after=1.0)))
    ws = await client.ws_connect("/ws")
    before = (await fleet_status(nc)).jobs_cancelled
    await ws.send_json({"type": "generate", "digits": "3", "steps": 50})
    job_id = (await next_of(ws, {"accepted"}))["job_id"]
    os.kill(fleet.pid, signal.SIGSTOP)
    try:
        failed = await next_of(ws, {"failed"}, timeout=60)
        assert failed["job_id"] == job_id and failed["code"] == "unavailable" and "not answered" in failed["reason"]
    finally:
        os.kill(fleet.pid, signal.SIGCONT)  # it wakes up with the job: the viewer's cancel is waiting for it
    await cancelled_by_coordinator(nc, job_id, before)
    await ws.close()


async def test_closed_tab_job_is_cancelled(aiohttp_client, nats_url, nc, fleet):
    client = await aiohttp_client(create_app(WebConfig(nats_url=nats_url)))
    ws = await client.ws_connect("/ws")
    before = (await fleet_status(nc)).jobs_cancelled
    await ws.send_json({"type": "generate", "digits": "4,5", "steps": 50})
    job_id = (await next_of(ws, {"accepted"}))["job_id"]
    assert (await job_status(nc, job_id, client=WEB_CLIENT)).state in ("queued", "running")
    await ws.close()
    await cancelled_by_coordinator(nc, job_id, before)
