"""Process helpers shared by the durable-job tests (test_durable.py, test_durable_cluster.py): a real
`ddm-fleet coordinator` process, sim expert workers, and what the tests read back (the owner of each
job in the ddm_job_owners bucket, every event each job's client saw)."""

from __future__ import annotations

import asyncio
import os
import sys
import time


async def start_coordinator(url: str, router, *extra: str):
    """A `ddm-fleet coordinator` process on `url` (one URL, or a comma-separated list of a cluster's
    nodes); returns it once it printed its ready line, and the lines before it. `extra`: more options
    (e.g. "--durable")."""
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
        url,
        "--metrics-port",
        "0",
        "--step-timeout-s",
        "5",
        *extra,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
    )
    lines = []
    while True:
        line = await asyncio.wait_for(proc.stdout.readline(), 120)
        if not line:
            raise AssertionError(b"".join(lines) + await proc.stderr.read())
        lines.append(line)
        if line.startswith(b"ready: coordinator"):
            return proc, b"".join(lines)


async def stop(proc) -> bytes:
    """SIGKILL `proc` unless it ended; returns its stderr."""
    if proc.returncode is None:
        proc.kill()
    await proc.wait()
    return await proc.stderr.read()


async def sim_workers(url, experts, batch_ms=15.0):
    """One started sim-backend ExpertWorker per expert checkpoint (`batch_ms` per batch) on `url`."""
    from workers.backends import get_backend
    from workers.service import ExpertWorker

    ws = []
    for k, path in enumerate(experts):
        w = ExpertWorker(
            expert=k,
            checkpoint=path,
            nats_url=url,
            buckets=(1, 4, 16),
            backend=get_backend("sim", preset="instant", batch_ms=batch_ms),
        )
        await w.start()
        ws.append(w)
    return ws


async def owners_of(nc, job_ids) -> dict[str, str | None]:
    """job id -> name of the coordinator holding its lease in ddm_job_owners (None: no lease)."""
    import json

    import nats.js.errors

    kv = await nc.jetstream().key_value("ddm_job_owners")
    out = {}
    for j in job_ids:
        try:
            out[j] = json.loads(bytes((await kv.get(j)).value))["name"]
        except nats.js.errors.KeyNotFoundError:
            out[j] = None
    return out


async def _wait_checkpoint_count(nc, ok, timeout: float, what: str) -> None:
    """Wait until `ok(n)` holds for n, the number of checkpoints in the `ddm_jobs` KV bucket."""
    from bus.kv_keys import live_keys
    from tests.waiting import wait_until

    js = nc.jetstream()

    async def count_ok():
        return ok(len(await live_keys(js, "ddm_jobs")))

    await wait_until(count_ok, timeout=timeout, what=what)


async def wait_no_checkpoints(nc, timeout: float) -> None:
    """Wait until the `ddm_jobs` KV bucket holds no checkpoint (the jobs are done and cleaned up)."""
    await _wait_checkpoint_count(nc, lambda n: n == 0, timeout, "checkpoints deleted once the jobs are done")


async def wait_checkpoints(nc, n: int, timeout: float) -> None:
    """Wait until the `ddm_jobs` KV bucket holds at least `n` checkpoints: the jobs' snapshots are on the
    server, not only queued in the coordinator (its bucket writes lag its frames on a loaded box)."""
    await _wait_checkpoint_count(nc, lambda have: have >= n, timeout, f"{n} job checkpoints in the ddm_jobs bucket")


async def reference_images(nc, reqs, tag):
    """The same requests, run undisturbed (new job ids "<tag>-<i>"): {job id of reqs: DoneEvent}."""
    from client.jobs import run_job

    refs = [r.model_copy(update={"job_id": f"{tag}-{i}"}) for i, r in enumerate(reqs)]
    got = await asyncio.gather(*(run_job(nc, r, timeout=120) for r in refs))
    return {r.job_id: g for r, g in zip(reqs, got)}


async def reference_images_apart(reqs, experts, router, tag):
    """The same requests on a fleet of their own in this process: a loopback nats-server, sim workers of
    `experts` without latency, a plain (not durable) coordinator with `router`; {job id of reqs:
    DoneEvent}. Images depend on neither latency nor durability (top1 / oracle jobs are bit-identical
    whatever is batched beside them), so this is the undisturbed run, in a few seconds instead of the
    disturbed fleet's tens (its workers' latency keeps its jobs long enough to be cut mid-run)."""
    import nats
    import torch

    from bus.nats_server import NatsServer
    from coordinator.service import Coordinator
    from coordinator.startup import load_router_and_partition, router_spec

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in the fleet's coordinator processes (OMP_NUM_THREADS=1)
    server = await asyncio.to_thread(NatsServer().start)
    ws, nc = [], None
    try:
        ws = await sim_workers(server.url, experts, batch_ms=0.0)
        model, k, c2e = load_router_and_partition(router, "checkpoints/partition.json")
        nc = await nats.connect(server.url)
        async with Coordinator(
            model, num_experts=k, class_to_expert=c2e, nats_url=server.url, spec=router_spec(router)
        ):
            return await reference_images(nc, reqs, tag)
    finally:
        if nc is not None:
            await nc.close()
        for w in ws:
            await w.stop()
        await asyncio.to_thread(server.stop)
        torch.set_num_threads(threads)


class EventLog:
    """Every event the client delivered for the watched jobs, in arrival order: (monotonic time, kind,
    step or None), and the owner epoch of each (`epochs`, in the same order: None when it carried none).
    Pass `log.stale` as run_job's `on_stale`: `stale_events` keeps the events the client dropped for a
    lower owner epoch than one it had seen, as (monotonic time, kind, step or None, epoch)."""

    def __init__(self):
        self.events: dict[str, list[tuple[float, str, int | None]]] = {}
        self.epochs: dict[str, list[int | None]] = {}
        self.stale_events: dict[str, list[tuple[float, str, int | None, int | None]]] = {}

    def __call__(self, ev):
        self.events.setdefault(ev.job_id, []).append((time.monotonic(), ev.kind, getattr(ev, "step", None)))
        self.epochs.setdefault(ev.job_id, []).append(getattr(ev, "epoch", None))

    def stale(self, ev):
        self.stale_events.setdefault(ev.job_id, []).append(
            (time.monotonic(), ev.kind, getattr(ev, "step", None), getattr(ev, "epoch", None))
        )

    def n_stale(self, job_ids=None) -> int:
        return sum(len(v) for j, v in self.stale_events.items() if job_ids is None or j in job_ids)

    def steps(self, job_id) -> list[int]:
        return [s for _, k, s in self.events.get(job_id, []) if k == "frame"]

    def dones(self, job_id) -> int:
        return sum(k == "done" for _, k, _ in self.events.get(job_id, []))
