"""Durable jobs on a 3-node NATS cluster with JetStream R3 (the shipped infra/nats/cluster.conf, run by
infra.nats_cluster.NatsCluster with per-role users): two durable coordinator processes
(`--durable --js-replicas 3`, every node in --nats), one sim worker per expert, jobs in flight; the
NATS node that the owner of most running jobs is connected to is killed with SIGKILL mid-run. The
buckets keep their data on the two surviving nodes, the coordinators, the workers and the client
reconnect, leases are renewed or the jobs taken over, and every job ends with exactly one `done`
and images bit-identical to an undisturbed run."""

from __future__ import annotations

import asyncio
import os
import time
from collections import Counter

import numpy as np
import pytest

from client.jobs import client_connect_options, run_job
from infra.nats_cluster import NatsCluster, monitor
from schemas import JobRequest
from tests.coordinator.durable_procs import (
    EventLog,
    owners_of,
    reference_images_apart,
    sim_workers,
    start_coordinator,
    stop,
    wait_no_checkpoints,
)
from tests.waiting import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420), pytest.mark.bus, pytest.mark.procs]

#: lease of the coordinators' jobs (s): about a JetStream R3 leader election after a SIGKILLed node
#: (4-9 s in nats-server), so the owner may keep its jobs or lose them to either coordinator
LEASE_S = 4.0
#: sim expert latency per batch: a 60-step job lasts several seconds, so jobs are still running
#: when the last one passed its first checkpoint (step 10)
BATCH_MS = 60.0


@pytest.fixture
def js_cluster(tmp_path):
    with NatsCluster(3, jetstream=True, log_dir=tmp_path / "nats-logs") as cluster:
        yield cluster


def cluster_jobs(round_: int) -> list[JobRequest]:
    # top1 / oracle: bit-identical whatever else is batched beside them (see test_durable.jobs)
    kinds = [("top1", "euler"), ("top1", "heun"), ("oracle", "euler"), ("oracle", "heun")]
    return [
        JobRequest(
            job_id=f"cl-{round_}-{i}",
            digits=[(round_ + i) % 10, (3 + 7 * i) % 10],
            steps=60,
            seed=2000 + 10 * round_ + i,
            strategy=s,
            solver=v,
        )
        for i, (s, v) in enumerate(kinds + kinds)
    ]


def local_tcp_ports(pid: int) -> set[int]:
    """Local ports of the TCP sockets process `pid` holds (Linux /proc: its socket fds' inodes, looked
    up in /proc/<pid>/net/tcp{,6})."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    ports = set()
    for table in ("tcp", "tcp6"):
        try:
            lines = open(f"/proc/{pid}/net/{table}").read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if len(cols) > 9 and cols[9] in inodes:
                ports.add(int(cols[1].rsplit(":", 1)[1], 16))
    return ports


def connected_node(cluster: NatsCluster, pid: int) -> int | None:
    """Index of the cluster node that holds a client connection of process `pid`: the node's /connz
    lists each client's port, matched against the process's own sockets (None: none)."""
    mine = local_tcp_ports(pid)
    for i, node in enumerate(cluster.nodes):
        if node.proc is None or node.proc.poll() is not None:
            continue
        try:
            conns = monitor(node, "connz?limit=4096").get("connections") or []
        except OSError:  # a node going down between the check and the request
            continue
        if any(c.get("port") in mine for c in conns):
            return i
    return None


def replicas_of(cluster: NatsCluster, ask: int, stream: str) -> int | None:
    """num_replicas of `stream` in account DDM, from node `ask`'s /jsz."""
    jsz = monitor(cluster.nodes[ask], "jsz?acc=DDM&streams=true&config=true")
    for acc in jsz.get("account_details") or []:
        for st in acc.get("stream_detail") or []:
            if st.get("name") == stream:
                return (st.get("config") or {}).get("num_replicas")
    return None


async def test_kill9_of_a_nats_node_mid_run_every_durable_job_completes_bit_identical(
    js_cluster, tiny_experts, tiny_router
):
    import nats

    cluster = js_cluster
    coord_url = ",".join(cluster.servers("coordinator"))
    procs, ws, ncs = {}, [], []
    log = EventLog()
    try:
        ws = await sim_workers(",".join(cluster.servers("worker")), tiny_experts, batch_ms=BATCH_MS)
        for name in ("cla", "clb"):
            proc, head = await start_coordinator(
                coord_url,
                tiny_router,
                "--durable",
                "--js-replicas",
                "3",
                "--checkpoint-every",
                "10",
                "--lease-s",
                str(LEASE_S),
                "--name",
                name,
            )
            assert b"durable jobs: on (JetStream KV ddm_jobs + ddm_job_owners, R3" in head, head
            procs[name] = proc
        for stream in ("KV_ddm_jobs", "KV_ddm_job_owners"):
            assert replicas_of(cluster, 0, stream) == 3, stream
        # the client and the test's JetStream reader fail over like the rest
        client = await nats.connect(
            servers=cluster.servers("client"),
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.2,
            **client_connect_options("client"),
        )
        ncs.append(client)
        reader = await nats.connect(
            servers=cluster.servers("coordinator"), max_reconnect_attempts=-1, reconnect_time_wait=0.2
        )
        ncs.append(reader)

        reqs, runs = [], []
        for round_ in range(6):  # rounds of 8 jobs, until both coordinators own some
            batch = cluster_jobs(round_)
            reqs += batch
            runs += [
                asyncio.ensure_future(run_job(client, r, log, timeout=240, probe_every=1.0, lost_after=60))
                for r in batch
            ]
            ids = [r.job_id for r in reqs]

            async def all_owned(ids=ids):
                owners = await owners_of(reader, ids)
                return owners if all(owners.values()) else None

            owners = await wait_until(all_owned, timeout=30, what="every job has a lease")
            if len(set(owners.values())) == 2:
                break
        ids = [r.job_id for r in reqs]
        await wait_until(
            lambda: all(log.dones(j) or max(log.steps(j), default=0) >= 12 for j in ids),
            timeout=90,
            what="every job past step 12 (its first checkpoint)",
        )
        running = [j for j in ids if not log.dones(j)]
        owners = await owners_of(reader, running)
        held = Counter(o for o in owners.values() if o)
        assert held, ("every job ended before the fault: make the jobs longer", log.events)
        owner = held.most_common(1)[0][0]
        node = connected_node(cluster, procs[owner].pid)
        assert node is not None, f"coordinator {owner} holds no connection to a cluster node"
        leaders = {s: cluster.jetstream_leader(node, s) for s in ("KV_ddm_jobs", "KV_ddm_job_owners")}
        meta = cluster.jetstream_leader(node)

        cluster.kill_node(node)  # SIGKILL: no lame duck, its raft groups lose a member (maybe their leader)
        killed_at = time.monotonic()
        await wait_until(
            lambda: connected_node(cluster, procs[owner].pid) not in (None, node),
            timeout=30,
            what=f"coordinator {owner} reconnected to a surviving node",
        )

        got = await asyncio.wait_for(asyncio.gather(*runs), 240)  # 0 failed, 0 lost: run_job raises otherwise
        gaps = {
            j: max((b - a for (a, _, _), (b, _, _) in zip(log.events[j], log.events[j][1:])), default=0.0)
            for j in running
        }
        print(
            f"\nkilled node {node} ({owner}'s; leader of {[s for s, i in leaders.items() if i == node] or 'none'}"
            f"{', meta leader' if meta == node else ''}) with {len(running)}/{len(ids)} jobs running "
            f"({dict(held)}): all done {time.monotonic() - killed_at:.1f} s later; longest pause of a job "
            f"{max(gaps.values()):.1f} s (lease {LEASE_S:g} s)"
        )
        for j in ids:
            assert log.dones(j) == 1 and log.steps(j)[-1] == 60, (j, log.events[j])
        want = await asyncio.wait_for(reference_images_apart(reqs, tiny_experts, tiny_router, "clref"), 180)
        for g in got:
            w = want[g.job_id]
            assert np.array_equal(w.images, g.images), g.job_id
            assert np.array_equal(w.usage, g.usage) and w.digits == g.digits

        await wait_no_checkpoints(reader, timeout=20)
    finally:
        errs = {name: await stop(p) for name, p in procs.items()}
        for w in ws:
            await w.stop()
        for nc in ncs:
            await nc.close()
    for name, err in errs.items():
        assert b"Traceback" not in err, (name, err[-3000:])
