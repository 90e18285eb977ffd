"""No password in any log line: `ddm-fleet worker`, `coordinator` and `web` as real processes on a
nats-server with the shipped per-role users (infra/nats/accounts.conf), each given its URL with the
password in it (a server list whose first node is down, so the connect path logs too), run with -v
until each is ready and serving a job, then stopped: nothing they printed holds a password."""

from __future__ import annotations

import asyncio
import os
import signal
import sys

import pytest

from bus.nats_server import free_port
from infra.nats_cluster import NatsCluster
from tests.coordinator.helpers import make_tiny_experts, make_tiny_router

pytestmark = [pytest.mark.bus, pytest.mark.procs, pytest.mark.timeout(240)]


async def _start(*argv: str) -> asyncio.subprocess.Process:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("NATS_URL", None)
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "infra.cli",
        "-v",
        *argv,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env=env,
    )


async def _until(proc: asyncio.subprocess.Process, marker: bytes, timeout: float = 120) -> bytes:
    """Everything `proc` printed up to and including the first line holding `marker`."""
    out = b""
    while marker not in out:
        line = await asyncio.wait_for(proc.stdout.readline(), timeout)
        if not line:
            raise AssertionError(f"process exited before printing {marker!r}:\n{out.decode(errors='replace')}")
        out += line
    return out


async def test_no_secret_in_the_logs_of_worker_coordinator_and_web(tmp_path):
    from client.jobs import client_connect_options, run_job
    from schemas import JobRequest

    experts = make_tiny_experts(tmp_path)
    router = make_tiny_router(tmp_path / "router")
    with NatsCluster(1, name="ddm-secrets", log_dir=tmp_path / "nats-logs") as cluster:
        dead = free_port()

        def url(user: str) -> str:  # a dead node first: the connect path has something to say
            live = cluster.url(0, user)
            return live.replace(f":{cluster.nodes[0].port}", f":{dead}") + "," + live

        procs: dict[str, asyncio.subprocess.Process] = {}
        logs: dict[str, bytes] = {}
        try:
            for k, path in enumerate(experts):
                argv = ["worker", "--expert", str(k), "--checkpoint", str(path), "--buckets", "1"]
                procs[f"worker-{k}"] = await _start(*argv, "--nats", url(f"worker-{k}"))
            for k in range(len(experts)):
                logs[f"worker-{k}"] = await _until(procs[f"worker-{k}"], b"ready: ")
            procs["coordinator"] = await _start(
                "coordinator",
                "--router",
                str(router),
                "--partition",
                "checkpoints/partition.json",
                "--metrics-port",
                "0",
                "--nats",
                url("coordinator"),
            )
            logs["coordinator"] = await _until(procs["coordinator"], b"ready: ")
            port = free_port()
            procs["web"] = await _start("web", "--port", str(port), "--nats", url("web"))
            logs["web"] = await _until(procs["web"], b"serving http")
            # a job through the fleet, so the serving path logs as well
            import nats

            nc = await nats.connect(cluster.url(0, "client"), **client_connect_options("client"))
            try:
                done = await run_job(nc, JobRequest(digits=[1, 7], steps=2, seed=3), timeout=60, client="client")
                assert done.images.shape[0] == 2
            finally:
                await nc.close()
        finally:
            for name, proc in procs.items():
                if proc.returncode is None:
                    proc.send_signal(signal.SIGTERM)
                try:
                    rest = await asyncio.wait_for(proc.stdout.read(), 60)
                except TimeoutError:
                    proc.kill()
                    rest = await proc.stdout.read()
                await proc.wait()
                logs[name] = logs.get(name, b"") + rest
        secrets = [pw.encode() for pw in cluster.passwords.values()]

    assert set(logs) == {"worker-0", "worker-1", "coordinator", "web"}
    for name, text in logs.items():
        leaked = [s for s in secrets if s in text]
        assert not leaked, f"{name} logged a password:\n{text.decode(errors='replace')}"
    ready = next(line for line in logs["coordinator"].splitlines() if line.startswith(b"ready: "))
    # the line still says where it connected, and as whom
    assert b"coordinator:***@127.0.0.1" in ready, ready
    assert b"web:***@127.0.0.1" in logs["web"], logs["web"]
