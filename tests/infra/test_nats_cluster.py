"""A real 3-node nats-server cluster (the shipped cluster.conf) on loopback.

An expert responder on node B answers a coordinator on node A; when B stops, the responder
reconnects to a surviving node and requests keep succeeding. Queue groups spread across
nodes, and a leaf node on a worker host carries only its expert's traffic.
"""

from __future__ import annotations

import asyncio
import time
from urllib.parse import urlparse

import numpy as np
import pytest

from bus.connect import flushed
from bus.inbox import discovery_inbox
from bus.nats_server import nats_servers
from infra.nats_cluster import NatsCluster
from schemas import StepReply, StepRequest, StepResult, pack, subjects, unpack

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def cluster(tmp_path):
    with NatsCluster(3, log_dir=tmp_path / "nats-logs") as c:
        yield c


def _step_request(expert: int, rows: int = 4, seed: int = 0) -> StepRequest:
    x = np.random.default_rng(seed).standard_normal((rows, 1, 32, 32)).astype(np.float32)
    return StepRequest(
        expert=expert,
        x_t=x,
        t=np.full(rows, 0.25, np.float32),
        y=np.arange(rows, dtype=np.int64) % 10,
        row_ids=[f"r{i}" for i in range(rows)],
    )


async def _expert_responder(servers: list[str], expert: int, worker_id: str, **opts):
    """A stand-in worker: queue-group subscriber replying v = -x_t (the real worker is workers/service.py)."""
    import nats

    nc = await nats.connect(
        servers=servers,
        name=worker_id,
        dont_randomize=True,
        allow_reconnect=True,
        max_reconnect_attempts=-1,
        reconnect_time_wait=0.1,
        connect_timeout=2,
        **opts,
    )
    served: list[str] = []

    async def handle(msg):
        req = unpack(msg.data, StepRequest)
        served.append(worker_id)
        reply = StepReply(
            expert=req.expert, velocity=-np.asarray(req.x_t), row_ids=req.row_ids, backend="test", worker_id=worker_id
        )
        await msg.respond(pack(reply))

    await nc.subscribe(subjects.expert_velocity(expert), queue=subjects.expert_queue_group(expert), cb=handle)
    await flushed(nc)  # callers retry on no-responders: interest also has to cross routes / leaf links
    return nc, served


async def _request_until_ok(nc, req: StepRequest, deadline_s: float = 10.0, subject: str | None = None) -> StepReply:
    """Send until a reply comes: right after a subscribe or a failover, interest takes a
    moment to cross the routes, and until then the server answers 'no responders'.
    subject: where to send (default: the expert's queue-group subject)."""
    from nats.errors import NoRespondersError
    from nats.errors import TimeoutError as NatsTimeout

    deadline = time.monotonic() + deadline_s
    while True:
        try:
            msg = await nc.request(subject or subjects.expert_velocity(req.expert), pack(req), timeout=1.0)
            reply = unpack(msg.data, StepResult)
            assert isinstance(reply, StepReply), reply
            return reply
        except (NoRespondersError, NatsTimeout):
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.05)


def _port(url: str | None) -> int | None:
    return urlparse(url).port if url else None


@pytest.mark.bus
async def test_request_crosses_cluster_and_survives_node_loss(cluster):
    import nats

    node_b = 1
    # As a worker is configured: --nats with every node, credentials written once.
    servers = cluster.servers("worker-0", first=node_b)
    flag = ",".join([servers[0]] + [u.split("@", 1)[1] for u in servers[1:]])
    responder, served = await _expert_responder(nats_servers(flag), 0, "w-b")
    client = await nats.connect(cluster.url(0, "coordinator"), name="coordinator", connect_timeout=2)
    try:
        assert _port(str(responder.connected_url.geturl())) == cluster.nodes[node_b].port

        req = _step_request(0)
        reply = await _request_until_ok(client, req)
        np.testing.assert_array_equal(reply.velocity, -req.x_t)
        assert reply.row_ids == req.row_ids and reply.worker_id == "w-b"

        cluster.stop_node(node_b)
        req2 = _step_request(0, rows=8, seed=1)
        reply2 = await _request_until_ok(client, req2, deadline_s=15)
        np.testing.assert_array_equal(reply2.velocity, -req2.x_t)
        now_on = _port(str(responder.connected_url.geturl()))
        assert now_on in {cluster.nodes[0].port, cluster.nodes[2].port}, "responder did not move off node B"

        # After the failover every request succeeds first time.
        for seed in range(5):
            r = _step_request(0, seed=10 + seed)
            msg = await client.request(subjects.expert_velocity(0), pack(r), timeout=2)
            np.testing.assert_array_equal(unpack(msg.data, StepReply).velocity, -r.x_t)
        assert len(served) >= 7
    finally:
        await client.close()
        await responder.close()


@pytest.mark.bus
async def test_queue_group_spreads_over_nodes_one_reply_each(cluster):
    import nats

    r1, served1 = await _expert_responder(cluster.servers("worker-1", first=1), 1, "w1")
    r2, served2 = await _expert_responder(cluster.servers("worker", first=2), 1, "w2")
    client = await nats.connect(cluster.url(0, "coordinator"), connect_timeout=2)
    try:
        await _request_until_ok(client, _step_request(1))
        # wait until node 0 sees both queue members (interest from both nodes)
        who = set()
        deadline = time.monotonic() + 10
        n = 0
        while who != {"w1", "w2"} and time.monotonic() < deadline:
            msg = await client.request(subjects.expert_velocity(1), pack(_step_request(1, rows=1)), timeout=2)
            who.add(unpack(msg.data, StepReply).worker_id)
            n += 1
        assert who == {"w1", "w2"}, f"only {who} served after {n} requests"
        # a queue group delivers each request to exactly one member
        assert len(served1) + len(served2) == n + 1
    finally:
        await client.close()
        await r1.close()
        await r2.close()


@pytest.mark.parametrize("served_expert", [0, 1])
@pytest.mark.bus
async def test_leaf_node_carries_only_its_experts_requests(cluster, served_expert):
    """A worker host's leaf node (shipped leaf.conf, user leaf-expert-<K>): expert K requests
    from the hub reach the worker on the leaf; the other expert's requests do not cross the
    link even though a worker on the leaf subscribes to them."""
    import nats
    from nats.errors import NoRespondersError

    other = 1 - served_expert
    leaf = cluster.leaf(f"leaf-expert-{served_expert}")
    w_ok, _ = await _expert_responder([leaf.client_url], served_expert, "leaf-ok")
    w_other, served_other = await _expert_responder([leaf.client_url], other, "leaf-other")
    client = await nats.connect(cluster.url(2, "coordinator"), connect_timeout=2)
    try:
        req = _step_request(served_expert)
        reply = await _request_until_ok(client, req)
        assert reply.worker_id == "leaf-ok"
        np.testing.assert_array_equal(reply.velocity, -req.x_t)

        await asyncio.sleep(0.3)  # time for the other interest to propagate, were it allowed
        with pytest.raises(NoRespondersError):
            await client.request(subjects.expert_velocity(other), pack(_step_request(other)), timeout=1)
        assert served_other == []
    finally:
        await client.close()
        await w_ok.close()
        await w_other.close()


@pytest.mark.bus
async def test_leaf_node_fails_over_to_another_hub_node(cluster):
    """The hub node a worker host's leaf is linked to stops: the leaf re-links to a survivor
    and the worker behind it keeps answering a coordinator on yet another node."""
    import nats

    leaf = cluster.leaf("leaf-expert-0")
    worker, served = await _expert_responder([leaf.client_url], 0, "leaf-w0")
    hub = cluster.leaf_hub(leaf)
    assert hub is not None
    other = next(i for i in range(cluster.size) if i != hub)
    client = await nats.connect(cluster.url(other, "coordinator"), connect_timeout=2)
    try:
        await _request_until_ok(client, _step_request(0))
        cluster.stop_node(hub)
        req = _step_request(0, seed=5)
        reply = await _request_until_ok(client, req, deadline_s=20)
        np.testing.assert_array_equal(reply.velocity, -req.x_t)
        assert cluster.leaf_hub(leaf) not in (None, hub)
    finally:
        await client.close()
        await worker.close()


@pytest.mark.bus
async def test_real_worker_serves_under_worker_role_permissions(cluster, tiny_expert_checkpoint, caplog):
    """workers.service.ExpertWorker, connected to node 1 as user worker-0 (replies only, its
    expert only), answers a coordinator on node 0 and $SRV discovery from the web user on
    node 2, with no permissions violation logged."""
    import json
    import logging

    import nats

    from client.jobs import client_connect_options
    from workers.service import SERVICE_NAME, ExpertWorker

    caplog.set_level(logging.WARNING)
    async with ExpertWorker(
        0, tiny_expert_checkpoint, "torch", nats_url=cluster.url(1, "worker-0"), buckets=(1, 4), dtype="float32"
    ) as worker:
        coord = await nats.connect(cluster.url(0, "coordinator"), connect_timeout=2)
        # a client user receives replies only on its own inbox prefix (_INBOX_web.>)
        web = await nats.connect(cluster.url(2, "web"), connect_timeout=2, **client_connect_options("web"))
        try:
            req = _step_request(0, rows=3)
            reply = await _request_until_ok(coord, req)
            ref = worker.backend.forward(np.array(req.x_t), np.array(req.t), np.array(req.y))
            np.testing.assert_allclose(reply.velocity, ref, atol=1e-5)
            assert reply.worker_id == worker.worker_id

            info = json.loads((await web.request(f"$SRV.INFO.{SERVICE_NAME}", b"", timeout=2)).data)
            assert info["metadata"]["expert"] == "0"
            assert [e["subject"] for e in info["endpoints"]] == [subjects.expert_velocity(0), worker.direct_subject]
            # its own direct subject (join-shortest-queue dispatch) answers the coordinator across nodes
            reply = await _request_until_ok(coord, req, subject=worker.direct_subject)
            np.testing.assert_allclose(reply.velocity, ref, atol=1e-5)
        finally:
            await coord.close()
            await web.close()
    violations = [r.getMessage() for r in caplog.records if "permission" in r.getMessage().lower()]
    assert violations == []


@pytest.mark.bus
async def test_whole_fleet_runs_under_role_permissions(cluster, tmp_path, caplog):
    """The production shape on loopback: expert 0's worker on hub node 1 as `worker-0`, expert
    1's worker behind a leaf node (`leaf-expert-1`), the real coordinator on node 0 as
    `coordinator`, a `client` on node 2 running jobs, cancelling and asking status. Every
    message the real code sends fits its role: jobs finish and nothing is refused."""
    import json
    import logging

    import nats
    import nats.errors
    import torch

    from client.jobs import cancel_job, client_connect_options, fleet_status, run_job
    from coordinator.local_fleet import LabelRouter
    from coordinator.service import Coordinator, wait_for_experts
    from schemas import DoneEvent, JobRequest
    from tests.coordinator.helpers import make_tiny_experts
    from workers.service import ExpertWorker

    caplog.set_level(logging.WARNING)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    c2e = [0] * 5 + [1] * 5
    paths = make_tiny_experts(tmp_path)
    leaf = cluster.leaf("leaf-expert-1")
    workers = [
        ExpertWorker(0, paths[0], nats_url=cluster.url(1, "worker-0"), buckets=(1, 4), dtype="float32"),
        ExpertWorker(1, paths[1], nats_url=leaf.client_url, buckets=(1, 4), dtype="float32"),
    ]
    client = None
    try:
        for w in workers:
            await w.start()
        async with Coordinator(
            LabelRouter(c2e, 2),
            num_experts=2,
            class_to_expert=c2e,
            nats_url=cluster.url(0, "coordinator"),
            step_timeout=10,
        ):
            client = await nats.connect(cluster.url(2, "client"), connect_timeout=2, **client_connect_options("client"))
            probe = await nats.connect(cluster.url(0, "coordinator"), connect_timeout=2)
            try:  # until both experts' interest has reached node 0 (across a route and a leaf link)
                await wait_for_experts(probe, 2, timeout=15)
            finally:
                await probe.close()
            done = await run_job(client, JobRequest(digits=[1, 8], steps=3, strategy="oracle", seed=3))
            assert isinstance(done, DoneEvent) and done.images.shape == (2, 1, 32, 32)
            assert done.notes == [], done.notes  # no fallback: both experts answered
            np.testing.assert_allclose(done.usage, [[1, 0], [0, 1]])
            status = await fleet_status(client)
            assert status.jobs_done >= 1
            assert await cancel_job(client, "j-nonexistent") is False
            # discovery from the client user reaches both workers, the leaf one too (its reply goes
            # up the leaf link to the client's discovery inboxes, _INBOX_client.d.>)
            inbox = discovery_inbox(client)
            pongs = await client.subscribe(inbox)
            await client.publish("$SRV.PING.ddm-expert", b"", reply=inbox)
            ids = set()
            deadline = time.monotonic() + 5
            while len(ids) < 2 and time.monotonic() < deadline:
                try:
                    ids.add(json.loads((await pongs.next_msg(timeout=0.5)).data)["id"])
                except nats.errors.TimeoutError:
                    pass
            assert ids == {w.service_id for w in workers}, ids
    finally:
        if client is not None:
            await client.close()
        for w in workers:
            await w.stop()
        torch.set_num_threads(threads)
    refused = [r.getMessage() for r in caplog.records if "permission" in r.getMessage().lower()]
    assert refused == []


@pytest.mark.bus
def test_routes_need_the_route_credentials(cluster, tmp_path):
    """cluster.conf's routes authenticate: a server that dials a node's route port without the
    route password (no credentials, a client user's, or a wrong one) never joins the mesh, so
    it cannot relay messages past the permissions; the members keep their full mesh."""
    from bus.nats_server import NatsServer, free_port
    from infra.nats_cluster import monitor

    target = cluster.cluster_ports[0]
    attempts = {"none": "", "client": f"client:{cluster.passwords['client']}@", "wrong": "route:not-the-password@"}
    rogues = []
    try:
        for name, userinfo in attempts.items():
            rogue = NatsServer(
                extra_config=(
                    f"server_name: rogue-{name}\ncluster {{ name: {cluster.name}, "
                    f"listen: 127.0.0.1:{free_port()}, "
                    f'routes: ["nats-route://{userinfo}127.0.0.1:{target}"] }}\n'
                ),
                log_file=tmp_path / f"rogue-{name}.log",
            )
            rogue.start()
            rogues.append(rogue)
        time.sleep(1.5)  # several route attempts (the rogue retries every second)
        peers = {r.get("remote_name") for r in monitor(cluster.nodes[0], "routez").get("routes", [])}
        assert peers == {cluster.node_name(1), cluster.node_name(2)}, peers
        for rogue in rogues:
            assert monitor(rogue, "routez").get("routes", []) == []
        logs = "".join((tmp_path / f"rogue-{n}.log").read_text() for n in attempts)
        assert "Authorization Violation" in logs or "authentication" in logs.lower(), logs[-2000:]
    finally:
        for rogue in rogues:
            rogue.stop()
    cluster.wait_formed(5)


@pytest.mark.bus
async def test_leaf_port_refuses_local_clients_without_the_password(cluster):
    """leaf.conf: a process on the worker host cannot use the leaf without its local password."""
    import nats
    from nats.errors import NoServersError

    leaf = cluster.leaf("leaf-expert-0")

    async def quiet(_err):
        pass

    for url in (leaf.url, leaf.client_url.replace("@", "x@")):  # no credentials / a wrong password
        with pytest.raises((NoServersError, nats.errors.Error, OSError)):
            await nats.connect(url, connect_timeout=2, allow_reconnect=False, max_reconnect_attempts=0, error_cb=quiet)
    nc = await nats.connect(leaf.client_url, connect_timeout=2, allow_reconnect=False)
    await nc.flush()
    await nc.close()


@pytest.mark.bus
def test_cluster_start_retries_on_fresh_ports_when_a_port_is_taken(tmp_path, monkeypatch):
    """A port chosen up front can be bound by someone else before the node starts (a CI run lost
    this race once): the node exits, and the cluster starts again on fresh ports."""
    import socket

    import infra.nats_cluster as nc

    squatter = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    squatter.bind(("127.0.0.1", 0))
    squatter.listen(1)
    taken = squatter.getsockname()[1]
    real_free_port, calls = nc.free_port, []

    def first_one_taken(host="127.0.0.1"):
        calls.append(host)
        return taken if len(calls) == 1 else real_free_port(host)

    monkeypatch.setattr(nc, "free_port", first_one_taken)
    try:
        with NatsCluster(2, log_dir=tmp_path / "logs") as c:
            assert taken not in c.cluster_ports + c.leaf_ports
            assert len(c.nodes) == 2 and all(n.proc is not None for n in c.nodes)
        log_text = (tmp_path / "logs" / "ddm-test-0.log").read_text().lower()
        assert "address already in use" in log_text  # the first attempt really lost its port
    finally:
        squatter.close()


def test_free_port_never_hands_out_the_same_port_twice():
    from bus.nats_server import free_port

    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)


# ---------------------------------------------------------------- JetStream (NatsCluster(jetstream=True))


@pytest.mark.bus
async def test_jetstream_is_off_unless_asked(cluster):
    """cluster.conf runs JetStream; NatsCluster turns it off by default (`jetstream: disabled`), and a
    durable coordinator is told so."""
    import nats

    from coordinator.durable_store import jetstream_available

    nc = await nats.connect(cluster.url(0, "coordinator"), connect_timeout=2)
    try:
        assert await jetstream_available(nc) is not None
    finally:
        await nc.close()
    assert cluster.jetstream_leader() is None


@pytest.mark.bus
async def test_jetstream_r3_buckets_survive_a_node_kill_under_the_coordinator_role(tmp_path):
    """cluster.conf's JetStream on all three nodes, each with its own store: the `coordinator` user
    (its permissions name only the durable buckets) creates the R3 buckets, writes a checkpoint and a
    lease; the node leading the checkpoint bucket is SIGKILLed; after the election the survivors
    serve the same value and take revision-checked writes again."""
    import nats
    import nats.js.errors

    from coordinator.durable_store import JobStore
    from infra.nats_cluster import monitor
    from tests.waiting import wait_until

    with NatsCluster(3, jetstream=True, log_dir=tmp_path / "nats-logs") as cluster:
        assert cluster.jetstream_leader() is not None
        from pathlib import Path

        stores = sorted(p.name for p in Path(cluster._tmp.name).glob("js-*"))  # one store per node
        assert stores == [f"js-{cluster.node_name(i)}" for i in range(3)], stores
        nc = await nats.connect(
            servers=cluster.servers("coordinator"),
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.2,
            connect_timeout=2,
        )
        try:
            store = await JobStore(nc, "c", "run-1", lease_s=30.0, replicas=3).open()
            assert await store.adopt("job-1", b"checkpoint-1")
            leader = cluster.jetstream_leader(stream="KV_ddm_jobs")
            assert leader is not None
            jsz = monitor(cluster.nodes[leader], "jsz?acc=DDM&streams=true&config=true")
            (stream,) = [s for a in jsz["account_details"] for s in a["stream_detail"] if s["name"] == "KV_ddm_jobs"]
            assert stream["config"]["num_replicas"] == 3 and len(stream["cluster"]["replicas"]) == 2

            cluster.kill_node(leader)

            async def saved():
                try:
                    await store.save("job-1", b"checkpoint-2")
                    return True
                except (nats.errors.Error, OSError):
                    return False

            await wait_until(saved, timeout=30, interval=0.2, what="a checkpoint write after the election")
            survivor = next(i for i in range(3) if i != leader)
            assert cluster.jetstream_leader(survivor, "KV_ddm_jobs") not in (None, leader)
            assert bytes((await store.jobs.get("job-1")).value) == b"checkpoint-2"
            assert await store.renew() == [] and store.holds("job-1")
            with pytest.raises(nats.js.errors.KeyWrongLastSequenceError):  # still revision-checked
                await store.jobs.update("job-1", b"stale", last=1)
        finally:
            await nc.close()
