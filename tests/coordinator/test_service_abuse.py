"""A client abusing the coordinator's NATS endpoints, against real processes: a real nats-server, real
`--backend sim` expert workers (real workers whose model is a sleep, so a job's length is chosen by
the test), a real Coordinator with the shipped defaults unless a test says otherwise.

* a client naming a new `session` for every job cannot take every row and queue slot (the quotas
  apply to the client, every session of it together): another client is still served at once;
* a cancel of a job whose submit is still being handled (its null-label probe awaited, or still
  queued behind another submit) cancels it: nothing runs for nobody;
* status requests for a finished job do not publish its result again for each one, and a client's
  status and submit requests are rate-limited (`rate_limited`), while other clients are served.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from bus.connect import flushed
from client.jobs import run_job
from coordinator.local_fleet import LabelRouter
from coordinator.service import Coordinator
from schemas import (
    CancelReply,
    CancelRequest,
    DoneEvent,
    ErrorCode,
    ErrorReply,
    JobAccepted,
    JobEvent,
    JobRejected,
    JobRequest,
    JobStatus,
    ProtocolError,
    SubmitReply,
    pack,
    subjects,
    unpack,
)
from schemas.errors import RETRY_AFTER_HEADER
from schemas.messages import Message
from tests.waiting import wait_until

C2E = [0] * 5 + [1] * 5

pytestmark = [pytest.mark.timeout(180)]


async def _sim_workers(nats_url, paths, batch_ms: float) -> list:
    """One sim worker per expert whose every forward pass lasts `batch_ms` ms (a sleep: no CPU)."""
    from workers.service import ExpertWorker

    ws = [
        ExpertWorker(
            k,
            str(path),
            "sim",
            nats_url=nats_url,
            buckets=(1, 16, 256, 512),
            backend_options={"batch_ms": batch_ms, "row_ms": 0.0},
        )
        for k, path in enumerate(paths)
    ]
    started = await asyncio.gather(*(w.start() for w in ws), return_exceptions=True)  # warm-ups side by side
    failed = [r for r in started if isinstance(r, BaseException)]
    if failed:
        await _stop(ws)
        raise failed[0]
    return ws


async def _stop(ws) -> None:
    for w in ws:
        await w.stop()


def _coordinator(nats_url, **kw) -> Coordinator:
    return Coordinator(LabelRouter(C2E, 2), num_experts=2, class_to_expert=C2E, nats_url=nats_url, **kw)


async def _request(nc, subject: str, data: bytes, kind: type[Message] = SubmitReply, timeout: float = 10, seen=None):
    """The reply, unpacked as `kind`; its NATS headers appended to `seen` when given."""
    msg = await nc.request(subject, data, timeout=timeout)
    if seen is not None:
        seen.append(msg.headers)
    return unpack(msg.data, kind)


def _retry_after(headers) -> float:
    """The seconds a `rate_limited` answer says to wait (RETRY_AFTER_HEADER, a decimal number)."""
    return float((headers or {})[RETRY_AFTER_HEADER])


# ---------------------------------------------------------------- quotas on the client, not its sessions


async def test_a_new_session_per_job_cannot_take_every_row_and_queue_slot(nats_url, nc, tiny_experts):
    """Shipped limits (1024 rows, 256 queued jobs, a client 256 rows and 64 queued jobs): `greedy`
    submits 256-image jobs that last about a minute, each under a fresh session. It gets one running
    and 64 waiting, then `overloaded` naming its client quota; a second client's job starts at once
    and finishes (before, greedy ran 4 jobs on all 1024 rows and filled the whole queue)."""
    ws = await _sim_workers(nats_url, tiny_experts, batch_ms=60.0)
    try:
        async with _coordinator(nats_url) as coord:
            accepted, refused = [], []
            for i in range(70):
                req = JobRequest(job_id=f"g{i}", count=256, steps=1000, stream=False, seed=i, session=f"tab{i}")
                reply = await _request(nc, subjects.jobs_submit("greedy"), pack(req))
                (accepted if isinstance(reply, JobAccepted) else refused).append(reply)
            assert len(accepted) == 65 and [a.queue_position for a in accepted[:2]] == [0, 1]
            assert {(r.code, r.reason.split(":")[0]) for r in refused} == {(ErrorCode.OVERLOADED, "client quota")}
            sched = coord.engine.scheduler
            assert sched.client_usage("greedy") == dict(running_rows=256, queued_jobs=64)
            assert coord.metrics.sample(
                "ddm_coordinator_jobs_rejected_by_limit_total", limit="max_client_queued_jobs"
            ) == len(refused)
            # another client is served at once, beside greedy's running job
            done = await asyncio.wait_for(
                run_job(nc, JobRequest(digits=[3, 8], steps=3, seed=1), client="light"), timeout=60
            )
            assert done.images.shape == (2, 1, 32, 32)
            assert sched.client_usage("greedy")["running_rows"] == 256  # greedy never got more
            assert (
                coord.scheduler_config.client_rows == 256 and coord.scheduler_config.client_queued_jobs == 64
            )  # shipped defaults
    finally:
        await _stop(ws)


# ---------------------------------------------------------------- cancels of submits not admitted yet


async def _events(nc, client: str) -> list:
    got: list = []

    async def cb(msg):
        got.append(unpack(msg.data, JobEvent))

    await nc.subscribe(f"{subjects.client_namespace(client)}.jobs.*.events", cb=cb)
    await flushed(nc)
    return got


async def test_a_cancel_during_the_null_label_probe_cancels_the_job(nats_url, nc, tiny_experts):
    """A job with a label-unknown row waits for the null-label probe (a forward pass of 1.5 s here)
    before the engine knows it; a cancel in that time is answered `cancelled` and the submit
    `rejected` / `cancelled`: the job never runs (before: "unknown job", and it ran to `done`)."""
    ws = await _sim_workers(nats_url, tiny_experts, batch_ms=1500.0)
    try:
        async with _coordinator(nats_url) as coord:
            events = await _events(nc, "tab")
            req = JobRequest(job_id="orphan", digits=[-1, 4], steps=2, stream=False, seed=5)
            submit = asyncio.create_task(_request(nc, subjects.jobs_submit("tab"), pack(req)))
            await asyncio.sleep(0.4)  # the probe is out: the submit handler awaits it
            assert not submit.done()
            cancel = await _request(
                nc, subjects.job_cancel("tab", "orphan"), pack(CancelRequest(job_id="orphan")), CancelReply
            )
            assert cancel.cancelled, cancel
            reply = await submit
            assert isinstance(reply, JobRejected) and reply.code == ErrorCode.CANCELLED, reply
            assert not coord.engine.scheduler.knows("orphan")
            st = await _request(nc, subjects.job_status("tab", "orphan"), b"", JobStatus)
            assert st.state == "unknown"
            await asyncio.sleep(0.5)
            assert events == [] and coord.status().jobs_done == 0
    finally:
        await _stop(ws)


async def test_a_cancel_that_overtakes_its_submit_is_remembered(nats_url, nc, tiny_experts):
    """Submits are handled one at a time: a submit queued behind another's null-label probe is not
    known when its client, tired of waiting, cancels it. The coordinator remembers that cancel, so
    the submit, once handled, is refused `cancelled` instead of running for nobody."""
    ws = await _sim_workers(nats_url, tiny_experts, batch_ms=1500.0)
    try:
        async with _coordinator(nats_url) as coord:
            events = await _events(nc, "tab")
            first = JobRequest(job_id="first", digits=[-1], steps=1, stream=False, seed=1)
            late = JobRequest(job_id="late", digits=[2, 7], steps=2, stream=False, seed=2)
            t_first = asyncio.create_task(_request(nc, subjects.jobs_submit("tab"), pack(first)))
            await asyncio.sleep(0.2)
            t_late = asyncio.create_task(_request(nc, subjects.jobs_submit("tab"), pack(late)))
            await asyncio.sleep(0.2)  # `late` waits behind `first`'s probe
            cancel = await _request(
                nc, subjects.job_cancel("tab", "late"), pack(CancelRequest(job_id="late")), CancelReply
            )
            assert not cancel.cancelled  # not known yet: answered as unknown, but remembered
            assert isinstance(await t_first, JobAccepted)
            reply = await t_late
            assert isinstance(reply, JobRejected) and reply.code == ErrorCode.CANCELLED, reply
            assert "before the coordinator took it" in reply.reason
            await wait_until(
                lambda: any(isinstance(e, DoneEvent) for e in events), timeout=30, what="`first`'s done event"
            )
            assert [e.job_id for e in events if isinstance(e, DoneEvent)] == ["first"]
            assert coord.status().jobs_done == 1
            assert not coord.engine.scheduler.knows("late")
            # the memory is for that job only: the same id submitted again later runs
            again = await _request(nc, subjects.jobs_submit("tab"), pack(late))
            assert isinstance(again, JobAccepted)
            # with no submit waiting here, a cancel of an unknown job is not remembered (a submit sent
            # before it went to another coordinator): the id stays free for a new job
            reuse = JobRequest(job_id="elsewhere", digits=[5], steps=1, stream=False)
            await _request(
                nc, subjects.job_cancel("tab", "elsewhere"), pack(CancelRequest(job_id="elsewhere")), CancelReply
            )
            assert isinstance(await _request(nc, subjects.jobs_submit("tab"), pack(reuse)), JobAccepted)
    finally:
        await _stop(ws)


# ---------------------------------------------------------------- status amplification and rate limits


async def test_status_requests_do_not_republish_a_result_each_and_are_rate_limited(nats_url, nc, tiny_experts):
    """A finished 64-image job; then 300 status requests for it at once. Its `done` (256 KiB) is
    published again once, not 300 times (before: every request re-published it); once the client's
    status budget (50/s, bursts of 100) is spent the rest get `rate_limited`, and another client's
    status request is still answered. Later (a v1 client that missed the result) a status request
    publishes it again."""
    ws = await _sim_workers(nats_url, tiny_experts, batch_ms=0.0)
    try:
        async with _coordinator(nats_url) as coord:
            done = await run_job(nc, JobRequest(job_id="big", count=64, steps=2, stream=False, seed=1), client="a")
            republished: list = []

            async def on_event(msg):
                republished.append(len(msg.data))

            await nc.subscribe(subjects.job_events("a", "big"), cb=on_event)
            inbox = nc.new_inbox()
            replies: list = []

            waits: list = []

            async def on_reply(msg):
                try:
                    replies.append(unpack(msg.data, JobStatus))
                    assert not msg.headers  # only a refusal for the rate carries a header
                except ProtocolError:
                    replies.append(unpack(msg.data, ErrorReply))
                    waits.append(_retry_after(msg.headers))

            await nc.subscribe(inbox, cb=on_reply)
            await flushed(nc)
            t0 = time.monotonic()
            for _ in range(300):
                await nc.publish(subjects.job_status("a", "big"), b"", reply=inbox)
            await nc.flush()
            await wait_until(lambda: len(replies) == 300, timeout=30, what="300 status replies")
            took = time.monotonic() - t0  # the buckets refill meanwhile: 50 status/s, a result every 2 s
            states = [r.state for r in replies if isinstance(r, JobStatus)]
            limited = [r for r in replies if isinstance(r, ErrorReply)]
            assert set(states) == {"done"} and 100 <= len(states) <= 101 + 50 * took, (len(states), took)
            assert limited and {r.code for r in limited} == {ErrorCode.RATE_LIMITED}
            assert "retry in" in limited[0].message
            # the wait, machine-readable: the message's "retry in" as a header, 0.01-2 s at 50/s
            assert len(waits) == len(limited) and all(0.01 <= w <= 2.0 for w in waits), waits
            assert f"retry in {waits[0]:.2f} s" in limited[0].message
            assert 1 <= len(republished) <= 1 + took / 2 and republished[0] > 64 * 1024 * 4  # the whole result
            assert coord.metrics.sample("ddm_coordinator_requests_rate_limited_total", kind="status") == len(limited)
            # another client's status request is answered meanwhile
            asked = await nc.request(subjects.job_status("b", "big"), b"", timeout=10, headers={"X-Mine": "1"})
            assert unpack(asked.data, JobStatus).state == "unknown"
            assert not asked.headers  # a reply never echoes the request's headers
            # a client that missed the result asks again later: published again (docs/PROTOCOL.md step 7)
            await asyncio.sleep(2.1)
            st = await _request(nc, subjects.job_status("a", "big"), b"", JobStatus)
            assert st.state == "done"
            await wait_until(lambda: len(republished) == 2, timeout=5, what="the result published again")
            assert done.images.shape[0] == 64
    finally:
        await _stop(ws)


async def test_submits_are_rate_limited_per_client(nats_url, nc, tiny_experts):
    """150 undecodable submits from one client at once: the first 100 (a burst of 2 s at 50/s) are
    read and refused `bad_request`, the rest `rate_limited` without being read; every refusal counts
    in fleet_status.jobs_rejected, and another client's job is accepted and finishes meanwhile."""
    ws = await _sim_workers(nats_url, tiny_experts, batch_ms=0.0)
    try:
        async with _coordinator(nats_url) as coord:
            t0 = time.monotonic()
            seen: list = []
            replies = await asyncio.gather(
                *(_request(nc, subjects.jobs_submit("flood"), b"\xc1not msgpack", seen=seen) for _ in range(150))
            )
            took = time.monotonic() - t0  # the bucket refills at 50/s meanwhile
            codes = [r.code for r in replies]
            assert set(codes) == {ErrorCode.BAD_REQUEST, ErrorCode.RATE_LIMITED}
            read = codes.count(ErrorCode.BAD_REQUEST)
            assert 100 <= read <= 101 + 50 * took, (read, took)
            limited = next(r for r in replies if r.code == ErrorCode.RATE_LIMITED)
            assert "'flood'" in limited.reason and "limit 50 per second" in limited.reason
            waits = [_retry_after(h) for h in seen if h]
            assert len(waits) == codes.count(ErrorCode.RATE_LIMITED) and all(0.01 <= w <= 2.0 for w in waits)
            done = await run_job(nc, JobRequest(digits=[1], steps=2, seed=3), client="calm")
            assert done.images.shape[0] == 1
            assert coord.status().jobs_rejected == 150
            assert coord.metrics.sample("ddm_coordinator_jobs_rejected_total", code="rate_limited") == codes.count(
                ErrorCode.RATE_LIMITED
            )
    finally:
        await _stop(ws)


async def test_a_client_over_its_submit_rate_waits_as_told_and_every_job_runs(nats_url, nc, tiny_experts):
    """A coordinator taking 2 submits per second (bursts of 4) and 8 jobs submitted at once by one client:
    the ones over the rate are refused `rate_limited` with a Ddm-Retry-After header, and `run_job` sends
    each again after that wait (the coordinator read nothing of it), so all 8 run; with no time left for
    the wait, `submit_job` raises, carrying the wait."""
    from client.jobs import JobFailed, submit_job

    ws = await _sim_workers(nats_url, tiny_experts, batch_ms=0.0)
    try:
        async with _coordinator(nats_url, submit_rate=2.0) as coord:
            t0 = time.monotonic()
            jobs = [JobRequest(digits=[i % 10], steps=2, seed=i, stream=False) for i in range(8)]
            done = await asyncio.gather(*(run_job(nc, job, client="eager", timeout=60) for job in jobs))
            took = time.monotonic() - t0
            assert [d.images.shape[0] for d in done] == [1] * 8
            limited = coord.metrics.sample("ddm_coordinator_jobs_rejected_total", code="rate_limited")
            assert limited >= 4 and took >= 1.5, (limited, took)  # 4 at once, then 2 per second
            with pytest.raises(JobFailed) as refused:
                for i in range(8):  # past the burst; a 0.1 s budget leaves no room for the wait
                    await submit_job(nc, JobRequest(digits=[1], steps=2, seed=100 + i), client="eager", timeout=0.1)
            assert refused.value.code == ErrorCode.RATE_LIMITED and 0 < refused.value.retry_after_s <= 2.0
    finally:
        await _stop(ws)


async def test_a_rate_limited_status_probe_keeps_the_job_waiting(nats_url, nc, tiny_experts, caplog):
    """`client.jobs.JobProbe` (run_job's and the viewer's probe) takes a `rate_limited` answer as an
    answer: the job is neither lost nor the coordinator frozen, and the log says why."""
    import logging

    from client.jobs import JobProbe

    ws = await _sim_workers(nats_url, tiny_experts, batch_ms=200.0)
    try:
        async with _coordinator(nats_url, status_rate=0.2) as coord:
            acc = await _request(nc, subjects.jobs_submit("p"), pack(JobRequest(job_id="slow", digits=[1], steps=50)))
            assert isinstance(acc, JobAccepted)
            probe = JobProbe(nc, "slow", lost_after=1, timeout=1, unresponsive_after=2, client="p")
            probe.accepted_by(acc)
            with caplog.at_level(logging.INFO, logger="client.jobs"):
                assert await probe.check() is None  # answered `running` (the bucket's one token)
                assert await probe.check() is None  # then `rate_limited`: still an answer
            assert "status request refused: too many job status requests from client 'p'" in caplog.text
            assert coord.metrics.sample("ddm_coordinator_requests_rate_limited_total", kind="status") >= 1
    finally:
        await _stop(ws)


_FLOODER = """
import asyncio, json, sys, time
import nats

async def main(url, n):
    nc = await nats.connect(url, name="flooder", inbox_prefix="_INBOX_flood")
    replies = {"cancel": 0, "status": 0, "fleet": 0}
    limited = dict(replies)
    timed = dict(replies)  # rate_limited answers that say when to retry (the Ddm-Retry-After header)

    def counter(kind):
        async def on_reply(msg):
            replies[kind] += 1
            limited[kind] += b"rate_limited" in msg.data
            timed[kind] += b"rate_limited" in msg.data and 0 < float((msg.headers or {}).get("Ddm-Retry-After", 0))
        return on_reply

    for kind in replies:
        await nc.subscribe(f"_INBOX_flood.{kind}", cb=counter(kind))
    await nc.flush()
    t0 = time.monotonic()
    for i in range(n):
        await nc.publish(f"ddm.v1.c.flood.jobs.j{i}.cancel", b"", reply="_INBOX_flood.cancel")
        await nc.publish(f"ddm.v1.c.flood.jobs.j{i}.status", b"", reply="_INBOX_flood.status")
        await nc.publish("ddm.v1.fleet.status", b'{"spec": true}', reply="_INBOX_flood.fleet")
    await nc.flush()
    took = time.monotonic() - t0
    end = time.monotonic() + 20
    while sum(replies.values()) < 3 * n and time.monotonic() < end:
        await asyncio.sleep(0.05)
    print(json.dumps({"published_s": took, "replies": replies, "limited": limited, "timed": timed}))
    await nc.close()

asyncio.run(main(sys.argv[1], int(sys.argv[2])))
"""


async def test_a_flood_of_cancels_and_status_requests_is_rate_limited_and_jobs_keep_stepping(
    nats_url, nc, tiny_experts
):
    """Another process floods the coordinator as one client: 6,000 cancels of unknown jobs, 6,000 job
    status requests and 6,000 fleet status requests (with the spec), as fast as it can publish, while
    another client's job runs. Each kind is answered `rate_limited` past the flooder's budget (50/s,
    bursts of 100), the other client's job keeps stepping (no gap of seconds between its frames) and
    ends, and its own status request is answered meanwhile."""
    import json
    import sys

    ws = await _sim_workers(nats_url, tiny_experts, batch_ms=20.0)
    try:
        async with _coordinator(nats_url) as coord:
            frames: list[float] = []

            def on_event(ev):
                frames.append(time.monotonic())

            job = asyncio.ensure_future(
                run_job(nc, JobRequest(job_id="calm", digits=[1, 2], steps=200, seed=5), on_event, client="calm")
            )
            await wait_until(lambda: len(frames) >= 5, timeout=30, what="the calm job's first frames")
            t0 = time.monotonic()
            flooder = await asyncio.create_subprocess_exec(
                sys.executable, "-c", _FLOODER, nats_url, "6000", stdout=asyncio.subprocess.PIPE
            )
            out, _ = await asyncio.wait_for(flooder.communicate(), 60)
            got = json.loads(out)
            st = await _request(nc, subjects.job_status("calm", "calm"), b"", JobStatus)
            assert st.state in ("running", "done")
            done = await asyncio.wait_for(job, 120)
            assert done.images.shape[0] == 2
            during = [b - a for a, b in zip(frames, frames[1:]) if b > t0]
            limited = got["limited"]
            print(
                f"\nflood of 18,000 requests published in {got['published_s']:.2f} s; the calm job's longest frame "
                f"gap since {max(during):.3f} s; replies {got['replies']}, rate_limited {limited}"
            )
            assert all(limited[k] > 0 for k in limited), limited
            assert got["timed"] == limited  # every refusal says when to retry
            for kind, name in (("cancel", "cancel"), ("status", "status"), ("fleet", "fleet_status")):
                assert coord.metrics.sample("ddm_coordinator_requests_rate_limited_total", kind=name) >= limited[kind]
            assert max(during) < 3.0, max(during)
    finally:
        await _stop(ws)
