"""What the coordinator answers, as docs/PROTOCOL.md states it, over a real nats-server with real
tiny expert workers: every rejected submit counts in `fleet_status.jobs_rejected` (undecodable
bytes too), `accepted.queue_position` / `job_status.queue_position` are 0 for a job that runs at
once and 1 for the next to start, a cancelled job's status reports the step it reached, and a cancel
whose body names another job is refused with `cancelled: false`."""

from __future__ import annotations

import asyncio

import pytest

from bus.connect import flushed
from client.jobs import JobFailed, cancel_job, fleet_status, job_status, run_job, submit_job
from coordinator.local_fleet import LabelRouter
from coordinator.service import Coordinator
from schemas import (
    CancelReply,
    CancelRequest,
    ErrorCode,
    FrameEvent,
    JobAccepted,
    JobEvent,
    JobRejected,
    JobRequest,
    SubmitReply,
    pack,
    subjects,
    unpack,
)
from tests.coordinator.helpers import make_tiny_fleet_experts
from tests.waiting import wait_until

C2E = [0] * 5 + [1] * 5


#: Tests that run on a UNet fleet and on a DiT fleet (the protocol does not depend on the architecture).
BOTH_ARCHS = pytest.mark.parametrize("experts", ["unet", "dit"], indirect=True)


@pytest.fixture(scope="module")
def experts(tmp_path_factory, request):
    """Two tiny experts (classes 0-4 | 5-9), UNets unless a test parametrizes the architecture (BOTH_ARCHS)."""
    import torch

    arch = getattr(request, "param", "unet")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield make_tiny_fleet_experts(tmp_path_factory.mktemp(f"reply-experts-{arch}"), arch)
    torch.set_num_threads(threads)


@pytest.fixture
async def workers(nats_url, experts):
    from workers.service import ExpertWorker

    ws = []
    try:
        for k, path in enumerate(experts):
            ws.append(ExpertWorker(expert=k, checkpoint=path, nats_url=nats_url, buckets=(1, 4)))
            await ws[-1].start()
        yield ws
    finally:
        for w in ws:
            await w.stop()


async def _submit_raw(nc, data: bytes):
    return unpack((await nc.request(subjects.jobs_submit("anon"), data, timeout=5)).data, SubmitReply)


async def test_every_rejected_submit_counts_and_carries_a_reason(nats_url, nc, workers):
    async with Coordinator(LabelRouter(C2E, 2), num_experts=2, nats_url=nats_url, max_rows=8):
        bad = [
            b"\xc1",  # undecodable: FormatError
            b"\x00garbage",  # undecodable: trailing bytes
            pack(JobRequest(digits=[1])).replace(b"\xa1v\x01", b"\xa1v\x07"),  # unsupported_version
            pack(JobRequest(digits=[1])).replace(b"\xa6digits", b"\xa6DIGITS"),  # unknown field
            pack(JobRequest(digits=[1] * 9)),  # too_large for max_rows 8 (scheduler)
            pack(JobRequest(digits=[1], strategy="oracle")),  # no partition manifest (scheduler)
        ]
        for data in bad:
            reply = await _submit_raw(nc, data)
            assert isinstance(reply, JobRejected), reply  # never `error`
            assert reply.reason.strip() and not reply.reason.rstrip().endswith(":"), reply.reason
        first = await _submit_raw(nc, b"\xc1")
        assert "FormatError: " in first.reason and "0xc1" in first.reason
        accepted = await _submit_raw(nc, pack(JobRequest(digits=[2], steps=2, seed=1)))
        assert isinstance(accepted, JobAccepted)
        st = await fleet_status(nc)
        assert st.jobs_rejected == len(bad) + 1 and st.jobs_submitted == 1


async def test_queue_position_is_zero_when_running_and_one_for_the_next(nats_url, nc, workers):
    async with Coordinator(LabelRouter(C2E, 2), num_experts=2, nats_url=nats_url, max_rows=2):
        running = await submit_job(nc, JobRequest(job_id="qp-run", digits=[1, 2], steps=1000, stream=False))
        next_up = await submit_job(nc, JobRequest(job_id="qp-next", digits=[3], steps=2, stream=False))
        after = await submit_job(nc, JobRequest(job_id="qp-after", digits=[4], steps=2, stream=False))
        assert (running.queue_position, next_up.queue_position, after.queue_position) == (0, 1, 2)
        assert (await job_status(nc, "qp-run")).queue_position == 0
        st = await job_status(nc, "qp-next")
        assert (st.state, st.queue_position) == ("queued", 1)
        for job_id in ("qp-after", "qp-next", "qp-run"):
            assert await cancel_job(nc, job_id)


@BOTH_ARCHS
async def test_a_cancelled_job_reports_the_step_it_reached(nats_url, nc, workers):
    async with Coordinator(LabelRouter(C2E, 2), num_experts=2, nats_url=nats_url):
        seen = asyncio.Event()

        def on(ev):
            if isinstance(ev, FrameEvent) and ev.step >= 3:
                seen.set()

        task = asyncio.create_task(run_job(nc, JobRequest(job_id="stop-me", digits=[1, 7], steps=1000), on))
        await asyncio.wait_for(seen.wait(), 60)
        before = await job_status(nc, "stop-me")
        assert await cancel_job(nc, "stop-me") is True
        with pytest.raises(JobFailed) as err:
            await asyncio.wait_for(task, 10)
        assert err.value.code == ErrorCode.CANCELLED
        st = await job_status(nc, "stop-me")
        assert st.state == "failed" and st.steps == 1000
        assert before.step <= st.step < 1000 and st.step >= 3, st

        done = await run_job(nc, JobRequest(job_id="run-out", digits=[2], steps=3))
        st = await job_status(nc, "run-out")
        assert (st.state, st.step, st.steps) == ("done", 3, 3) and done.steps == 3


async def test_a_cancel_whose_body_names_another_job_is_refused(nats_url, nc, workers):
    async with Coordinator(LabelRouter(C2E, 2), num_experts=2, nats_url=nats_url):
        await submit_job(nc, JobRequest(job_id="keep-me", digits=[1], steps=1000, stream=False))
        msg = await nc.request(subjects.job_cancel("anon", "keep-me"), pack(CancelRequest(job_id="other")), timeout=5)
        reply = unpack(msg.data, CancelReply)
        assert reply.cancelled is False and "does not match the subject" in reply.reason
        assert (await job_status(nc, "keep-me")).state in ("queued", "running")
        assert await cancel_job(nc, "keep-me") is True


@BOTH_ARCHS
async def test_last_frame_and_done_differ_by_float16_rounding_only(nats_url, nc, workers):
    import numpy as np

    async with Coordinator(LabelRouter(C2E, 2), num_experts=2, nats_url=nats_url):
        frames = []
        done = await run_job(
            nc,
            JobRequest(digits=[0, 3, 5, 9], steps=4, seed=11, strategy="full"),
            lambda ev: frames.append(ev) if isinstance(ev, FrameEvent) else None,
        )
    last = frames[-1]
    assert last.step == 4 and last.x.dtype == np.float16 and done.images.dtype == np.float32
    gap = np.abs(np.clip(last.x.astype(np.float32), -1, 1) - done.images)
    assert gap.max() <= 2.0**-12, gap.max()
    assert np.abs(done.images).max() <= 1.0
    # full: every expert has a router weight > 0 on every evaluation, and each one counts in usage
    assert (done.usage == 1.0).all(), done.usage


async def test_srv_replies_are_json(nc, workers):
    import json

    msg = await nc.request("$SRV.PING.ddm-expert", b"", timeout=5)
    info = json.loads(msg.data)  # nats.micro: JSON, not msgpack
    assert info["name"] == "ddm-expert" and info["type"].startswith("io.nats.micro")


# ------------------------------------------------------------------ ownership (client namespaces), open bus


async def _collect(nc, subject: str) -> list:
    got: list = []

    async def cb(msg):
        got.append(msg)

    await nc.subscribe(subject, cb=cb)
    await flushed(nc)
    return got


async def test_another_namespace_cannot_cancel_or_probe_a_job_and_sees_none_of_its_events(nats_url, nc, workers):
    """Even on an open bus, where anyone may pick any client token: a cancel or status request in
    namespace `mallory` for `alice`'s job is answered as for an unknown job and never acted on, and
    every event of the job goes to alice's namespace only."""
    async with Coordinator(LabelRouter(C2E, 2), num_experts=2, nats_url=nats_url) as coord:
        events = await _collect(nc, subjects.ALL_JOB_EVENTS)
        accepted = await submit_job(
            nc, JobRequest(job_id="alices", digits=[1], steps=1000, stream=False), client="alice"
        )
        assert accepted.events_subject == subjects.job_events("alice", "alices")
        assert coord.owner_of("alices") == "alice"

        msg = await nc.request(
            subjects.job_cancel("mallory", "alices"), pack(CancelRequest(job_id="alices")), timeout=5
        )
        reply = unpack(msg.data, CancelReply)
        assert (reply.cancelled, reply.reason) == (False, "unknown job")
        # a job nobody has is answered the same way: the reply tells mallory nothing
        msg = await nc.request(subjects.job_cancel("mallory", "nobodys"), b"", timeout=5)
        assert unpack(msg.data, CancelReply).reason == "unknown job"
        await nc.publish(subjects.job_cancel("mallory", "alices"), b"")  # a plain publish, no reply wanted
        assert await cancel_job(nc, "alices", client="mallory") is False
        assert (await job_status(nc, "alices", client="mallory")).state == "unknown"
        assert (await job_status(nc, "alices", client="alice")).state in ("queued", "running")

        assert await cancel_job(nc, "alices", client="alice") is True
        st = await job_status(nc, "alices", client="alice")
        assert st.state == "failed"
        assert (await job_status(nc, "alices", client="mallory")).state == "unknown"  # finished: still not theirs
        await nc.flush()
        assert events and {m.subject for m in events} == {subjects.job_events("alice", "alices")}, sorted(
            {m.subject for m in events}
        )


async def test_the_session_tag_is_a_fairness_key_not_an_owner(nats_url, nc, workers):
    async with Coordinator(LabelRouter(C2E, 2), num_experts=2, nats_url=nats_url) as coord:
        await submit_job(
            nc, JobRequest(job_id="tabbed", digits=[2], steps=1000, stream=False, session="tab-1"), client="web"
        )
        assert coord.engine.scheduler.owner_of("tabbed") == "web/tab-1" and coord.owner_of("tabbed") == "web"
        assert await cancel_job(nc, "tabbed", client="web-x") is False
        assert await cancel_job(nc, "tabbed", client="web") is True


async def test_replies_go_only_to_inboxes(nats_url, nc, workers):
    """A request whose reply subject is not an `_INBOX` (here: a victim's events subject) gets no
    reply at all; a request in alice's namespace may not send its reply to bob's inbox either."""
    async with Coordinator(LabelRouter(C2E, 2), num_experts=2, nats_url=nats_url) as coord:
        await submit_job(nc, JobRequest(job_id="victim", digits=[3], steps=1000, stream=False), client="bob")
        victim = await _collect(nc, subjects.job_events("bob", "victim"))
        bob_inbox = await _collect(nc, "_INBOX_bob.>")
        target = subjects.job_events("bob", "victim")
        await nc.publish(subjects.FLEET_STATUS, b"", reply=target)
        await nc.publish(subjects.job_status("bob", "victim"), b"", reply=target)
        await nc.publish(subjects.job_cancel("bob", "victim"), b"", reply=target)
        await nc.publish(subjects.jobs_submit("bob"), pack(JobRequest(job_id="forged", digits=[1])), reply=target)
        await nc.publish(subjects.job_status("alice", "victim"), b"", reply="_INBOX_bob.x.y")
        await nc.publish(subjects.FLEET_STATUS, b"", reply="_INBOXES.x")
        await nc.flush()
        st = await fleet_status(nc)  # the coordinator has read everything above by now
        await asyncio.sleep(2 * 0.25 + 0.3)  # past the delayed "unknown" answers
        await nc.flush()
        assert victim == [] and bob_inbox == []
        assert coord.replies_dropped == 6 and st.jobs_submitted == 1  # the forged submit was not taken either
        assert (await job_status(nc, "victim", client="bob")).state in ("queued", "running")  # cancel not acted on

        # the coordinator's own reply inbox (where its experts answer) is no reply subject for anyone
        async def echo(msg):
            await msg.respond(b"ok")

        await nc.subscribe("test.echo", cb=echo)
        await flushed(nc)

        async def mux_open() -> bool:  # nats-py opens its reply mux on the first request
            import nats.errors

            try:
                await coord.nc.request("test.echo", b"", timeout=5)
                return True
            except nats.errors.NoRespondersError:  # the echo's interest not seen yet (a loaded server)
                return False

        await wait_until(mux_open, timeout=15, what="the coordinator's connection to reach the echo responder")
        own = coord.nc._resp_sub_prefix.decode() + "x"
        await nc.publish(subjects.FLEET_STATUS, b"", reply=own)
        await fleet_status(nc)
        assert coord.replies_dropped == 7, coord.replies_dropped
        assert await cancel_job(nc, "victim", client="bob") is True


def test_the_own_inboxes_are_the_request_and_transport_reply_prefixes():
    """`Coordinator.own_inbox_prefixes`, the reply subjects `Intake` refuses: nats-py's request replies
    and the transport's, each once its first request made it; a prefix only, not any longer name."""
    from types import SimpleNamespace

    from coordinator.transport import NatsTransport

    nc = SimpleNamespace(_resp_sub_prefix=None)
    transport = NatsTransport(nc)
    coord = Coordinator(LabelRouter(C2E, 2), num_experts=2, nc=nc, transport=transport)
    assert coord.own_inbox_prefixes() == [] and transport.reply_prefix is None
    nc._resp_sub_prefix = bytearray(b"_INBOX.req.")  # as nats-py's first request sets it
    transport.mux._prefix = "_INBOX.mux"  # as the transport's first request sets it
    assert coord.own_inbox_prefixes() == ["_INBOX.req.", "_INBOX.mux"]
    replies = ["_INBOX.req.x", "_INBOX.mux.x", "_INBOX.other.x", "_INBOX.muxy.x"]
    may = [coord.intake._may_reply(SimpleNamespace(reply=r, subject=subjects.FLEET_STATUS)) for r in replies]
    assert may == [False, False, True, True] and coord.replies_dropped == 2


def test_the_dropped_reply_log_is_rate_limited_and_counts_what_it_held_back(caplog):
    import logging

    from bus.ratelimited_log import RateLimitedLog

    now = [100.0]
    limited = RateLimitedLog(logging.getLogger("test.ratelimit"), every_s=10.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="test.ratelimit"):
        assert limited.warning("dropped %s", "a") is True
        for _ in range(500):  # a flood inside the window: not one more line
            assert limited.warning("dropped %s", "b") is False
        now[0] += 10.0
        assert limited.warning("dropped %s", "c") is True
    lines = [r.getMessage() for r in caplog.records if r.name == "test.ratelimit"]
    assert lines == ["dropped a", "dropped c (500 more since the last such line)"]
    assert limited.total == 502 and limited.suppressed == 0


async def test_job_ids_are_per_client_two_clients_may_both_run_abc(nats_url, nc, workers):
    """Job ids name a job within its client's namespace: alice and bob both submit job "abc" at once,
    both are accepted and run to their own images, and each namespace carries only its own job's
    events (under the id its client chose). A second "abc" of the same client, while the first runs,
    is refused as before; the refusal never names the id another client's job runs under."""
    async with Coordinator(LabelRouter(C2E, 2), num_experts=2, class_to_expert=C2E, nats_url=nats_url):
        alice_events = await _collect(nc, subjects.job_events("alice", "abc"))
        bob_events = await _collect(nc, subjects.job_events("bob", "abc"))
        everything = await _collect(nc, subjects.ALL_JOB_EVENTS)
        a = await submit_job(nc, JobRequest(job_id="abc", digits=[1], steps=400, stream=True, seed=1), client="alice")
        b = await submit_job(nc, JobRequest(job_id="abc", digits=[8, 8], steps=3, stream=True, seed=2), client="bob")
        assert (a.job_id, b.job_id) == ("abc", "abc")
        assert b.events_subject == subjects.job_events("bob", "abc")
        again = unpack(
            (
                await nc.request(
                    subjects.jobs_submit("bob"), pack(JobRequest(job_id="abc", digits=[3], steps=2)), timeout=5
                )
            ).data,
            SubmitReply,
        )
        if isinstance(again, JobRejected):  # bob's job may have finished already: then "abc" is free again
            assert again.code == ErrorCode.BAD_REQUEST and "'abc' is already in use" in again.reason
        # bob's jobs end; alice's (400 steps) is still running, then cancelled by alice
        await wait_until(lambda: any(unpack(m.data, JobEvent).kind == "done" for m in bob_events), timeout=60)
        assert (await job_status(nc, "abc", client="alice")).state in ("queued", "running")
        assert await cancel_job(nc, "abc", client="alice") is True
        await wait_until(lambda: any(unpack(m.data, JobEvent).kind == "failed" for m in alice_events), timeout=30)
        await nc.flush()
        bob_kinds = [unpack(m.data, JobEvent).kind for m in bob_events]
        alice_kinds = [unpack(m.data, JobEvent).kind for m in alice_events]
        assert bob_kinds[0] == "accepted" and "done" in bob_kinds and "failed" not in bob_kinds
        assert alice_kinds[0] == "accepted" and alice_kinds[-1] == "failed" and "done" not in alice_kinds
        bob_done = next(ev for ev in (unpack(m.data, JobEvent) for m in bob_events) if ev.kind == "done")
        assert bob_done.job_id == "abc" and bob_done.images.shape[0] in (1, 2)
        assert all(unpack(m.data, JobEvent).job_id == "abc" for m in everything)
        assert {m.subject for m in everything} == {
            subjects.job_events("alice", "abc"),
            subjects.job_events("bob", "abc"),
        }
        assert (await job_status(nc, "abc", client="alice")).state == "failed"
        assert (await job_status(nc, "abc", client="bob")).state == "done"
        assert (await job_status(nc, "abc", client="carol")).state == "unknown"
