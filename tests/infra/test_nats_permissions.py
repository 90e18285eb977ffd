"""Per-role subject permissions (infra/nats/permissions.conf) enforced by a real nats-server.

Each test connects as the shipped users (web, client, coordinator, worker-0, ...) and checks
both sides: what a role may do works end to end, and what it may not do is refused by the
server (a permissions-violation error) and never delivered. Client users (web, client) connect
as our code does, with the inbox prefix `_INBOX_<user>`, and own the job namespace
`ddm.v1.c.<user>.`: one cannot cancel, probe or watch the other's jobs.
"""

from __future__ import annotations

import asyncio
import logging
import time

import numpy as np
import pytest

from bus.connect import flushed
from client.jobs import client_connect_options
from infra.nats_cluster import NatsCluster
from schemas import (
    CancelReply,
    CancelRequest,
    DoneEvent,
    FrameEvent,
    JobAccepted,
    JobRequest,
    JobStatus,
    StepReply,
    StepRequest,
    SubmitReply,
    pack,
    subjects,
    unpack,
)
from tests.waiting import wait_until

pytestmark = [pytest.mark.bus, pytest.mark.timeout(60)]

#: The shipped client users; each owns the job namespace ddm.v1.c.<user>. and the inbox _INBOX_<user>.
CLIENT_USERS = ("web", "client")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with NatsCluster(1, name="ddm-perm", log_dir=tmp_path_factory.mktemp("nats-logs")) as c:
        yield c


class Conn:
    """A connection as one user, recording the asynchronous errors the server sends."""

    def __init__(self, nc, errors: list[str]):
        self.nc = nc
        self.errors = errors

    async def violation(self, subject: str, timeout: float = 3.0) -> str:
        """Wait for the server's permissions-violation error naming `subject`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for e in self.errors:
                if "permissions violation" in e.lower() and subject.lower() in e.lower():  # nats-py lowercases it
                    return e
            await asyncio.sleep(0.02)
        raise AssertionError(f"no permissions violation for {subject!r}; errors seen: {self.errors}")


@pytest.fixture
async def connect(server):
    import nats

    opened: list = []

    async def _connect(user: str) -> Conn:
        errors: list[str] = []

        async def on_error(err):
            errors.append(str(err))

        opts = client_connect_options(user) if user in CLIENT_USERS else {}
        nc = await nats.connect(
            server.url(0, user), name=user, error_cb=on_error, connect_timeout=2, allow_reconnect=False, **opts
        )
        opened.append(nc)
        return Conn(nc, errors)

    yield _connect
    for nc in opened:
        await nc.close()


def _step(expert: int) -> StepRequest:
    return StepRequest(
        expert=expert, x_t=np.ones((2, 1, 32, 32), np.float32), t=np.zeros(2, np.float32), y=np.zeros(2, np.int64)
    )


async def _collect(conn: Conn, subject: str, **kw) -> list:
    got: list = []

    async def cb(msg):
        got.append(msg)

    await conn.nc.subscribe(subject, cb=cb, **kw)
    await flushed(conn.nc)
    return got


# ---------------------------------------------------------------- web / client


@pytest.mark.parametrize("user", ["web", "client"])
async def test_client_roles_submit_jobs_and_read_events(connect, user):
    coord, cli = await connect("coordinator"), await connect(user)

    async def on_submit(msg):
        req = unpack(msg.data, JobRequest)
        owner = subjects.parse_submit_subject(msg.subject)
        await msg.respond(
            pack(
                JobAccepted(
                    job_id=req.job_id, events_subject=subjects.job_events(owner, req.job_id), digits=req.digits, seed=1
                )
            )
        )

    await coord.nc.subscribe(subjects.ALL_JOBS_SUBMIT, cb=on_submit)
    await flushed(coord.nc)
    events = await _collect(cli, f"{subjects.client_namespace(user)}.jobs.*.events")

    msg = await cli.nc.request(subjects.jobs_submit(user), pack(JobRequest(job_id="j1", digits=[3])), timeout=2)
    accepted = unpack(msg.data, SubmitReply)
    assert isinstance(accepted, JobAccepted) and accepted.job_id == "j1"

    frame = FrameEvent(
        job_id="j1",
        step=0,
        steps=1,
        t=1.0,
        x=np.zeros((1, 1, 32, 32), np.float16),
        experts=[0],
        weights=np.ones((1, 2), np.float32),
    )
    await coord.nc.publish(subjects.job_events(user, "j1"), pack(frame))
    await coord.nc.flush()
    await wait_until(lambda: events, timeout=2, what="the frame event")
    assert len(events) == 1 and unpack(events[0].data, FrameEvent).job_id == "j1"
    assert coord.errors == [] and cli.errors == []


async def test_client_can_cancel_and_ask_status(connect):
    coord, web = await connect("coordinator"), await connect("web")

    async def on_cancel(msg):
        req = unpack(msg.data, CancelRequest)
        await msg.respond(pack(CancelReply(job_id=req.job_id, cancelled=True)))

    async def on_status(msg):
        await msg.respond(b"status")

    async def on_job_status(msg):
        await msg.respond(pack(JobStatus(job_id=subjects.parse_job_subject(msg.subject).job_id, state="queued")))

    await coord.nc.subscribe(subjects.ALL_JOB_CANCELS, cb=on_cancel)
    await coord.nc.subscribe(subjects.FLEET_STATUS, cb=on_status)
    await coord.nc.subscribe(subjects.ALL_JOB_STATUS, cb=on_job_status)
    await flushed(coord.nc)
    msg = await web.nc.request(subjects.job_cancel("web", "j9"), pack(CancelRequest(job_id="j9")), timeout=2)
    assert unpack(msg.data, CancelReply).cancelled
    assert (await web.nc.request(subjects.FLEET_STATUS, b"", timeout=2)).data == b"status"
    msg = await web.nc.request(subjects.job_status("web", "j9"), b"", timeout=2)
    assert unpack(msg.data, JobStatus).state == "queued"
    assert coord.errors == [] and web.errors == []


@pytest.mark.slow  # ~3.5 s each: a real coordinator answers the status probe
@pytest.mark.parametrize("user", ["web", "client"])
async def test_client_roles_status_probe_is_answered_by_a_real_coordinator(connect, server, user, caplog):
    """run_job as a restricted client, against a real Coordinator running as the `coordinator` user: a
    job kept silent (its only expert call held) for twice `unresponsive_after` must not fail, because
    its status probes get answers; once released it completes. Without the status subject in the
    client's publish rights or the coordinator's subscribe rights no probe is answered, and run_job
    fails after `unresponsive_after` ("the coordinator has not answered")."""
    from client.jobs import run_job
    from coordinator.local_fleet import LabelRouter
    from coordinator.service import Coordinator

    caplog.set_level(logging.WARNING, logger="coordinator.service")
    worker, cli, ops = await connect("worker-0"), await connect(user), await connect("ops")
    gate = asyncio.Event()

    async def held_velocity(msg):  # expert 0's only worker answers once the gate opens
        step = unpack(msg.data, StepRequest)
        await gate.wait()
        await msg.respond(pack(StepReply(expert=0, velocity=np.zeros_like(step.x_t), backend="test")))

    await worker.nc.subscribe(subjects.expert_velocity(0), queue=subjects.expert_queue_group(0), cb=held_velocity)
    await flushed(worker.nc)

    job_id = f"probe-{user}"
    unresponsive_after = 1.5
    answered: list[float] = []  # when ops saw a coordinator's job_status reply to this job's probes
    long_enough = asyncio.Event()

    async def tap(msg):  # ops may watch every subject, the reply inboxes too
        try:
            st = unpack(msg.data, JobStatus)
        except Exception:
            return  # submit replies, expert replies
        if st.job_id == job_id and st.state in ("queued", "running"):
            answered.append(time.monotonic())
            if answered[-1] - answered[0] >= 2 * unresponsive_after:
                long_enough.set()

    await ops.nc.subscribe(f"{subjects.inbox_prefix(user)}.>", cb=tap)
    await flushed(ops.nc)
    async with Coordinator(
        LabelRouter([0] * 10, 1),
        num_experts=1,
        nats_url=server.url(0, "coordinator"),
        step_timeout=30,
        retries=0,
        name=f"perm-coordinator-{user}",
    ):
        job = asyncio.create_task(
            run_job(
                cli.nc,
                JobRequest(job_id=job_id, digits=[3], steps=2),
                probe_every=0.3,
                lost_after=30,
                unresponsive_after=unresponsive_after,
            )
        )
        waiter = asyncio.create_task(long_enough.wait())
        try:
            await asyncio.wait({job, waiter}, timeout=30, return_when=asyncio.FIRST_COMPLETED)
            if job.done():
                job.result()  # raises the JobFailed that says why
            assert long_enough.is_set(), f"status replies seen: {len(answered)}"
            assert not job.done()
            gate.set()
            done = await asyncio.wait_for(job, 30)
        finally:
            gate.set()
            waiter.cancel()
            if not job.done():
                job.cancel()
        assert isinstance(done, DoneEvent) and done.images.shape == (1, 1, 32, 32)
    assert len(answered) >= 5
    assert cli.errors == [] and worker.errors == []
    assert not [r.getMessage() for r in caplog.records if "ermission" in r.getMessage()]


async def test_web_cannot_publish_to_experts(connect):
    worker, web = await connect("worker-0"), await connect("web")
    delivered = await _collect(worker, subjects.expert_velocity(0))

    await web.nc.publish(subjects.expert_velocity(0), pack(_step(0)))
    await web.nc.flush()
    await web.violation(subjects.expert_velocity(0))

    # A request is refused too: no reply, and the worker never sees it.
    from nats.errors import NoRespondersError
    from nats.errors import TimeoutError as NatsTimeout

    with pytest.raises((NatsTimeout, NoRespondersError)):
        await web.nc.request(subjects.expert_velocity(0), pack(_step(0)), timeout=0.5)
    await asyncio.sleep(0.1)  # grace for a message that must never arrive: no event marks its absence
    assert delivered == []
    assert web.nc.is_connected  # a violation is reported, the connection stays up


async def test_web_cannot_impersonate_the_coordinator(connect):
    web = await connect("web")
    await web.nc.publish(subjects.job_events("web", "j1"), b"fake frame")
    await web.violation(subjects.job_events("web", "j1"))
    await web.nc.subscribe(subjects.ALL_JOBS_SUBMIT)
    await web.violation(subjects.ALL_JOBS_SUBMIT)
    await web.nc.subscribe(subjects.jobs_submit("web"))
    await web.violation(subjects.jobs_submit("web"))


# ---------------------------------------------------------------- ownership: one client user vs another's jobs


async def test_client_user_cannot_reach_into_another_users_namespace_or_inbox(connect):
    """The server refuses `client` every subject of `web`'s namespace and inbox: no cancel, no status
    probe, no submit in its name, no watching its events or replies; nothing reaches the coordinator."""
    coord, client = await connect("coordinator"), await connect("client")
    seen = await _collect(coord, f"{subjects.CLIENTS_PREFIX}.>")
    for subject in (subjects.job_cancel("web", "wj"), subjects.job_status("web", "wj"), subjects.jobs_submit("web")):
        await client.nc.publish(subject, pack(CancelRequest(job_id="wj")))
        await client.violation(subject)
    for subject in (
        subjects.job_events("web", "wj"),
        f"{subjects.client_namespace('web')}.jobs.*.events",
        subjects.ALL_JOB_EVENTS,
        f"{subjects.inbox_prefix('web')}.>",
        "_INBOX.>",
        ">",
    ):
        await client.nc.subscribe(subject)
        await client.violation(subject)
    await flushed(client.nc)
    await asyncio.sleep(0.1)  # grace for a message that must never arrive: no event marks its absence
    assert seen == []


@pytest.mark.slow  # ~2 s: a real coordinator and a held expert
async def test_client_user_cannot_cancel_probe_or_watch_a_web_users_job(connect, server, caplog):
    """A real Coordinator as the `coordinator` user; `web` runs a job (its expert call held). User
    `client` tries everything its permissions let it publish: a cancel and a status probe of the job
    in its own namespace (answered "unknown job" / `unknown`, never acted on), `fleet.status` with the
    victim's events subject as reply subject (no reply at all: replies go only to _INBOX). The job
    then completes for `web`, whose events subject got only the job's own events."""
    from client.jobs import cancel_job, job_status, run_job
    from coordinator.local_fleet import LabelRouter
    from coordinator.service import UNKNOWN_JOB, Coordinator

    caplog.set_level(logging.WARNING, logger="coordinator.service")
    worker, web, client = await connect("worker-0"), await connect("web"), await connect("client")
    gate, called = asyncio.Event(), asyncio.Event()

    async def held_velocity(msg):
        step = unpack(msg.data, StepRequest)
        called.set()
        await gate.wait()
        await msg.respond(pack(StepReply(expert=0, velocity=np.zeros_like(step.x_t), backend="test")))

    await worker.nc.subscribe(subjects.expert_velocity(0), queue=subjects.expert_queue_group(0), cb=held_velocity)
    await flushed(worker.nc)
    events: list = []
    async with Coordinator(
        LabelRouter([0] * 10, 1),
        num_experts=1,
        nats_url=server.url(0, "coordinator"),
        step_timeout=30,
        retries=0,
        name="perm-owner",
    ) as coord:
        job = asyncio.create_task(
            run_job(web.nc, JobRequest(job_id="webjob", digits=[3], steps=2), on_event=events.append, probe_every=5)
        )
        try:
            await asyncio.wait_for(called.wait(), 10)
            assert coord.owner_of("webjob") == "web"
            # what the server lets `client` publish, in its own namespace: not acted on, nothing told
            msg = await client.nc.request(
                subjects.job_cancel("client", "webjob"), pack(CancelRequest(job_id="webjob")), timeout=5
            )
            assert (unpack(msg.data, CancelReply).cancelled, unpack(msg.data, CancelReply).reason) == (
                False,
                UNKNOWN_JOB,
            )
            assert await cancel_job(client.nc, "webjob") is False  # client_of(nc) -> "client"
            assert (await job_status(client.nc, "webjob")).state == "unknown"
            # what it may not publish: web's namespace
            await client.nc.publish(subjects.job_cancel("web", "webjob"), b"")
            await client.violation(subjects.job_cancel("web", "webjob"))
            # a reply subject that is not an inbox: the victim's events subject gets nothing from it
            before = len(events)
            await client.nc.publish(subjects.FLEET_STATUS, b"", reply=subjects.job_events("web", "webjob"))
            await client.nc.flush()
            await wait_until(lambda: coord.replies_dropped == 1, timeout=5, what="the coordinator to drop the request")
            assert (await job_status(web.nc, "webjob")).state == "running"  # web's own probe: alive
            assert len(events) == before and not job.done()
            gate.set()
            done = await asyncio.wait_for(job, 30)
        finally:
            gate.set()
            if not job.done():
                job.cancel()
    assert isinstance(done, DoneEvent) and done.job_id == "webjob"
    assert [type(e).__name__ for e in events if not isinstance(e, FrameEvent)] == ["JobAccepted", "DoneEvent"]
    assert web.errors == [] and worker.errors == []
    assert any("is not an inbox" in r.getMessage() for r in caplog.records)


def test_each_client_users_permissions_name_only_its_own_namespace_and_inbox():
    """Static check of permissions.conf / accounts.conf: every client permission set (one per client
    user) allows job subjects only under ddm.v1.c.<that user>. and inboxes only under _INBOX_<user>.;
    the password users `web` and `client` get their own sets."""
    import re
    from pathlib import Path

    conf = Path(__file__).resolve().parents[2] / "infra" / "nats"
    perms = (conf / "permissions.conf").read_text()
    accounts = (conf / "accounts.conf").read_text()
    given = dict(re.findall(r"user:\s*([\w-]+),\s*password:\s*\$\w+,\s*permissions:\s*\$(\w+)", accounts))
    assert given["web"] == "WEB_PERMISSIONS" and given["client"] == "CLIENT_PERMISSIONS"
    for user in CLIENT_USERS:
        body = re.search(r"^" + given[user] + r" = \{(.*?)^\}", perms, re.M | re.S).group(1)
        named = set(re.findall(r'"([^"]+)"', body))
        jobs = {s for s in named if s.startswith(subjects.CLIENTS_PREFIX + ".")}
        assert jobs == {
            subjects.jobs_submit(user),
            f"{subjects.client_namespace(user)}.jobs.*.cancel",
            f"{subjects.client_namespace(user)}.jobs.*.status",
            f"{subjects.client_namespace(user)}.jobs.*.events",
        }, (user, jobs)
        assert {s for s in named if s.startswith(subjects.INBOX)} == {f"{subjects.inbox_prefix(user)}.>"}, user


# ---------------------------------------------------------------- workers


async def test_worker_cannot_publish_job_events(connect):
    worker, web = await connect("worker-0"), await connect("web")
    events = await _collect(web, f"{subjects.client_namespace('web')}.jobs.*.events")

    await worker.nc.publish(subjects.job_events("web", "j1"), b"forged")
    await worker.nc.flush()
    await worker.violation(subjects.job_events("web", "j1"))
    await worker.nc.publish(subjects.jobs_submit("web"), b"forged")
    await worker.violation(subjects.jobs_submit("web"))
    await asyncio.sleep(0.1)  # grace for a message that must never arrive: no event marks its absence
    assert events == []


async def test_worker_cannot_ask_or_serve_job_status(connect):
    """A worker has no business with jobs: it may neither probe a job's status nor answer such probes."""
    worker, coord, web = await connect("worker-0"), await connect("coordinator"), await connect("web")
    probes: list[str] = []

    async def on_job_status(msg):
        probes.append(msg.subject)
        await msg.respond(pack(JobStatus(job_id=subjects.parse_job_subject(msg.subject).job_id, state="running")))

    await coord.nc.subscribe(subjects.ALL_JOB_STATUS, cb=on_job_status)
    await flushed(coord.nc)
    await worker.nc.publish(subjects.job_status("web", "j1"), b"")
    await worker.nc.flush()
    await worker.violation(subjects.job_status("web", "j1"))  # refused by the server: never routed
    await worker.nc.subscribe(subjects.ALL_JOB_STATUS)
    await worker.violation(subjects.ALL_JOB_STATUS)
    # a client's probe, after the refused one, is the only one the coordinator ever got
    msg = await web.nc.request(subjects.job_status("web", "j2"), b"", timeout=2)
    assert unpack(msg.data, JobStatus).state == "running"
    assert probes == [subjects.job_status("web", "j2")]


async def test_worker_subscribes_only_to_its_own_expert(connect):
    worker = await connect("worker-0")
    await worker.nc.subscribe(subjects.expert_velocity(1))
    await worker.violation(subjects.expert_velocity(1))
    await worker.nc.subscribe(subjects.ALL_JOB_EVENTS)
    await worker.violation(subjects.ALL_JOB_EVENTS)


async def test_worker_serves_its_direct_subject_but_no_other_experts(connect):
    """Join-shortest-queue dispatch: a worker-0 user serves its own ddm.v1.expert.0.velocity.<token>
    to the coordinator (and replies under allow_responses), may not subscribe to expert 1's direct
    subjects, and a web user may not publish to a direct subject."""
    worker, coord, web = await connect("worker-0"), await connect("coordinator"), await connect("web")
    mine = subjects.expert_direct(0, subjects.worker_token("perm-worker-0"))
    theirs = subjects.expert_direct(1, subjects.worker_token("perm-worker-1"))

    async def velocity(msg):
        step = unpack(msg.data, StepRequest)
        await msg.respond(
            pack(StepReply(expert=0, velocity=-np.asarray(step.x_t), backend="test", worker_id="perm-worker-0"))
        )

    await worker.nc.subscribe(mine, queue=subjects.expert_queue_group(0), cb=velocity)
    await flushed(worker.nc)
    msg = await coord.nc.request(mine, pack(_step(0)), timeout=2)
    assert unpack(msg.data, StepReply).worker_id == "perm-worker-0"

    await worker.nc.subscribe(theirs)
    await worker.violation(theirs)
    await worker.nc.subscribe(subjects.ALL_EXPERTS_DIRECT)
    await worker.violation(subjects.ALL_EXPERTS_DIRECT)

    delivered = await _collect(worker, subjects.expert_direct(0, subjects.worker_token("perm-worker-2")))
    await web.nc.publish(mine, pack(_step(0)))
    await web.nc.flush()
    await web.violation(mine)
    await asyncio.sleep(0.1)  # grace for a message that must never arrive: no event marks its absence
    assert delivered == [] and coord.errors == []


async def test_worker_serves_its_expert_with_nats_micro_and_answers_discovery(connect):
    """The way a real worker runs: a nats.micro service on its expert subject. It replies to
    the coordinator (allow_responses) and answers $SRV discovery that any client may send."""
    import json

    from nats import micro

    worker, coord, web = await connect("worker-0"), await connect("coordinator"), await connect("web")

    async def velocity(req):
        step = unpack(req.data, StepRequest)
        await req.respond(pack(StepReply(expert=0, velocity=-np.asarray(step.x_t), backend="test")))

    svc = await micro.add_service(worker.nc, name="ddm-expert-0", version="1.0.0", description="test worker")
    try:
        await svc.add_endpoint(
            name="velocity",
            subject=subjects.expert_velocity(0),
            queue_group=subjects.expert_queue_group(0),
            handler=velocity,
        )
        await flushed(worker.nc)
        msg = await coord.nc.request(subjects.expert_velocity(0), pack(_step(0)), timeout=2)
        assert unpack(msg.data, StepReply).velocity.shape == (2, 1, 32, 32)

        for verb in ("PING", "INFO", "STATS"):
            info = json.loads((await web.nc.request(f"$SRV.{verb}.ddm-expert-0", b"", timeout=2)).data)
            assert info["name"] == "ddm-expert-0", (verb, info)
        info = json.loads((await coord.nc.request("$SRV.INFO", b"", timeout=2)).data)
        assert [e["subject"] for e in info["endpoints"]] == [subjects.expert_velocity(0)]
        assert worker.errors == []
    finally:
        await svc.stop()


@pytest.mark.parametrize("where", ["hub", "leaf"])
async def test_discovery_cannot_make_a_worker_write_onto_a_clients_job_subject(
    connect, server, tiny_expert_checkpoint, where
):
    """A client may publish $SRV discovery with any reply subject, and a worker answers the reply
    subject a request names: a real worker (as `worker-0` on the hub, or behind a worker host's leaf
    node) must not answer discovery whose reply subject is another client's job events (nor any
    non-inbox subject), while discovery on an inbox still works."""
    import json

    from bus.inbox import discovery_inbox
    from workers.service import ExpertWorker

    async def discover(subject: str, timeout: float) -> dict:  # as the viewer asks: on its discovery inbox
        inbox = discovery_inbox(web.nc)
        sub = await web.nc.subscribe(inbox, max_msgs=1)
        await web.nc.publish(subject, b"", reply=inbox)
        return json.loads((await sub.next_msg(timeout=timeout)).data)

    attacker, web = await connect("client"), await connect("web")
    target = subjects.job_events("web", "j1")
    events = await _collect(web, f"{subjects.client_namespace('web')}.jobs.*.events")
    url = server.url(0, "worker-0") if where == "hub" else server.leaf("leaf-expert-0", name="leaf-srv").client_url
    worker = ExpertWorker(expert=0, checkpoint=tiny_expert_checkpoint, nats_url=url, buckets=(1,))
    await worker.start()
    try:
        sid = worker.service_id
        ask = f"$SRV.INFO.ddm-expert.{sid}"
        # discovery on the asker's own inbox is answered (once interest has crossed the leaf link)
        info = None
        for _ in range(50):
            try:
                info = await discover(ask, 1)
                break
            except Exception:
                await asyncio.sleep(0.1)
        assert info is not None and info["id"] == sid
        for verb in ("PING", "INFO", "STATS"):
            for subject in (f"$SRV.{verb}", f"$SRV.{verb}.ddm-expert", f"$SRV.{verb}.ddm-expert.{sid}"):
                await attacker.nc.publish(subject, b"", reply=target)
        await attacker.nc.flush()
        assert (await discover(ask, 2))["id"] == sid  # after them too
        await asyncio.sleep(0.3)  # grace for a message that must never arrive: no event marks its absence
        assert [m.subject for m in events] == [] and attacker.errors == [] and web.errors == []
        assert worker.dropped_requests == 9
    finally:
        await worker.stop()


async def test_a_worker_host_receives_no_other_hosts_direct_requests(connect, server, tiny_expert_checkpoint):
    """Direct subjects under a scope: a leaf host (user leaf-expert-0) runs its worker with
    `--direct-scope leaf-expert-0`, and may subscribe to expert 0's queue subject and to its own scope's
    direct subjects only. Another process on that host subscribing to every direct subject of expert 0
    receives none of the requests the coordinator sends the hub's worker, while both workers answer their
    own. (Before scopes, the leaf received the hub worker's direct requests and could answer them first.)"""
    from workers.service import ExpertWorker

    leaf = server.leaf("leaf-expert-0", name="leaf-scoped")
    coord = await connect("coordinator")
    workers = [
        ExpertWorker(0, tiny_expert_checkpoint, nats_url=server.url(0, "worker-0"), buckets=(2,)),
        ExpertWorker(0, tiny_expert_checkpoint, nats_url=leaf.client_url, buckets=(2,), direct_scope="leaf-expert-0"),
    ]
    import nats

    spy = await nats.connect(leaf.client_url, name="same-host-spy", connect_timeout=2, allow_reconnect=False)
    try:
        for w in workers:
            await w.start()
        hub, remote = workers
        assert remote.worker_id.startswith("leaf-expert-0:")
        assert remote.direct_subject.startswith("ddm.v1.expert.0.velocity.leaf-expert-0.")
        stolen: list[str] = []

        async def steal(msg):
            stolen.append(msg.subject)

        for pattern in ("ddm.v1.expert.0.velocity.*", "ddm.v1.expert.0.velocity.>"):
            await spy.subscribe(pattern, cb=steal)
        await flushed(spy)
        for w in (hub, remote):  # as the transport addresses a worker: expert_direct(k, worker_token(id))
            subject = subjects.expert_direct(0, subjects.worker_token(w.worker_id))
            assert subject == w.direct_subject
            for _ in range(50):  # until the leaf's interest has crossed the link
                try:
                    msg = await coord.nc.request(subject, pack(_step(0)), timeout=1)
                    break
                except Exception:
                    await asyncio.sleep(0.1)
            assert unpack(msg.data, StepReply).worker_id == w.worker_id
        for _ in range(5):
            await coord.nc.request(hub.direct_subject, pack(_step(0)), timeout=2)
        await asyncio.sleep(0.3)  # grace for a message that must never arrive: no event marks its absence
        assert hub.direct_subject not in stolen and all(s.split(".")[5] == "leaf-expert-0" for s in stolen)
    finally:
        for w in workers:
            await w.stop()
        await spy.close()
        leaf.stop()


# ---------------------------------------------------------------- operators


async def test_ops_watches_and_asks_but_changes_nothing(connect):
    coord, ops = await connect("coordinator"), await connect("ops")

    async def on_status(msg):
        await msg.respond(b"status")

    await coord.nc.subscribe(subjects.FLEET_STATUS, cb=on_status)
    await coord.nc.subscribe(subjects.ALL_JOB_STATUS, cb=on_status)
    await flushed(coord.nc)
    seen = await _collect(ops, "ddm.>")  # ops may watch every subject
    assert (await ops.nc.request(subjects.FLEET_STATUS, b"", timeout=2)).data == b"status"
    assert (await ops.nc.request(subjects.job_status("web", "j5"), b"", timeout=2)).data == b"status"
    await coord.nc.publish(subjects.job_events("web", "j5"), b"frame")
    await wait_until(
        lambda: any(m.subject == subjects.job_events("web", "j5") for m in seen),
        timeout=2,
        what="ops to see the job event",
    )
    for subject in (subjects.expert_velocity(0), subjects.jobs_submit("web"), subjects.job_cancel("web", "j5")):
        await ops.nc.publish(subject, b"x")
        await ops.violation(subject)


async def test_sys_user_reaches_the_system_account(server):
    """`nats server ls` and friends need the SYS account: a server ping answers."""
    import json

    import nats

    nc = await nats.connect(server.url(0, "sys"), connect_timeout=2, allow_reconnect=False)
    try:
        msg = await nc.request("$SYS.REQ.SERVER.PING", b"", timeout=2)
        assert json.loads(msg.data)["server"]["name"] == server.node_name(0)
    finally:
        await nc.close()


# ---------------------------------------------------------------- authentication


@pytest.mark.parametrize("password", [None, "wrong"])
async def test_unknown_or_wrong_credentials_are_refused(server, password):
    import nats

    async def quiet(err):
        pass

    node = server.nodes[0]
    userinfo = "" if password is None else f"web:{password}@"
    with pytest.raises(nats.errors.Error) as err:
        await nats.connect(
            f"nats://{userinfo}{node.host}:{node.port}", allow_reconnect=False, connect_timeout=2, error_cb=quiet
        )
    assert "authorization violation" in str(err.value).lower()


# ---------------------------------------------------------------- decoders (latent fleets)
async def test_only_the_coordinator_may_call_a_decoder(connect):
    """A decoder user serves ddm.v1.decoder.<H>.decode; the coordinator's requests reach it and
    its replies come back; a client user's are refused by the server and never delivered; a
    decoder may not serve experts or watch jobs."""
    from schemas import DecodeReply, DecodeRequest

    h = "ab" * 32
    decoder, coord, web = await connect("decoder"), await connect("coordinator"), await connect("web")
    delivered: list = []

    async def serve(msg):
        delivered.append(msg)
        req = unpack(msg.data, DecodeRequest)
        await msg.respond(pack(DecodeReply(decoder=h, images=np.zeros((len(req.latents), 3, 4, 4), np.float32))))

    await decoder.nc.subscribe(subjects.decoder_decode(h), queue=subjects.decoder_queue_group(h), cb=serve)
    await flushed(decoder.nc)
    body = pack(DecodeRequest(decoder=h, latents=np.ones((2, 4, 2, 2), np.float32)))
    reply = unpack((await coord.nc.request(subjects.decoder_decode(h), body, timeout=5)).data, DecodeReply)
    assert reply.images.shape == (2, 3, 4, 4) and len(delivered) == 1

    await web.nc.publish(subjects.decoder_decode(h), body)
    await web.nc.flush()
    await web.violation(subjects.decoder_decode(h))
    await asyncio.sleep(0.1)  # grace for a message that must never arrive
    assert len(delivered) == 1

    await decoder.nc.subscribe(subjects.expert_velocity(0))
    await decoder.violation(subjects.expert_velocity(0))
    await decoder.nc.subscribe(subjects.ALL_JOB_EVENTS)
    await decoder.violation(subjects.ALL_JOB_EVENTS)
