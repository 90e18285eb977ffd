"""Running ahead (coordinator/run_ahead.py) over a real nats-server with real workers (tiny UNets):
a lone job's expert requests compute the next steps on the worker, and the images are the same,
bit for bit, as without it; routing that moves a job mid-run, bad run-ahead fields and a worker
that refuses them lose nothing."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from client.jobs import run_job
from coordinator.local_fleet import LabelRouter
from coordinator.service import Coordinator
from schemas import ErrorCode, ErrorReply, JobRequest, StepReply, StepRequest, pack, subjects, unpack
from tests.coordinator.helpers import run_ahead_discovered, start_workers, stop_workers

C2E = [0] * 5 + [1] * 5


class TimeRouter:
    """Expert 0 before t = 0.5, expert 1 from then on (every label): moves each job mid-run."""

    num_experts = 2

    def weights(self, x, t, y):
        w = np.full((len(y), 2), 0.1)
        w[np.arange(len(y)), (np.asarray(t) >= 0.5).astype(int)] = 0.9
        return w


async def _run(nats_url, nc, router, jobs, **cfg):
    async with Coordinator(router, num_experts=2, class_to_expert=C2E, nats_url=nats_url, **cfg) as coord:
        if cfg.get("run_ahead", 8):  # what the workers run ahead is learned at discovery
            await run_ahead_discovered(coord.transport, {0: 16, 1: 16})
        done = [await run_job(nc, j) for j in jobs]  # one at a time: a lone job, as run ahead is for
        return done, coord.engine.ahead, coord.engine.rows_guessed


class SplitRouter:
    """Expert 0 for every row, but rows labelled 3 go to expert 1 from t = 0.5: splits a job's rows mid-run."""

    num_experts = 2

    def weights(self, x, t, y):
        w = np.full((len(y), 2), 0.1)
        moved = (np.asarray(y) == 3) & (np.asarray(t) >= 0.5)
        w[np.arange(len(y)), moved.astype(int)] = 0.9
        return w


JOBS = [
    JobRequest(digits=[3], steps=12, seed=5),
    JobRequest(digits=[7, 1], steps=9, seed=6, strategy="oracle"),
    JobRequest(digits=[2, 8, 4], steps=5, seed=7, strategy="sample"),
]


@pytest.mark.parametrize("wire", ["float32", "bfloat16", "float16"])
async def test_lone_jobs_run_ahead_and_their_images_do_not_change(nats_url, nc, experts, wire):
    ws = await start_workers(nats_url, experts, dtype="float32")
    try:
        plain, off, guessed_plain = await _run(nats_url, nc, LabelRouter(C2E, 2), JOBS, run_ahead=0, wire_dtype=wire)
        ahead, on, guessed_ahead = await _run(nats_url, nc, LabelRouter(C2E, 2), JOBS, run_ahead=4, wire_dtype=wire)
    finally:
        await stop_workers(ws)
    assert off.runs == 0 and off.rows_taken == 0
    # job 1: 12 steps in runs of 1 + 4 (the last cut to what is left): 3 requests, 9 velocities streamed
    # (all of them unless the box stalls a stream for 0.5 s: then that run ends, and the images stay the same)
    assert on.runs >= 3 and on.rows_taken >= 8, on
    # a step whose velocity a run streams is not also guessed (speculation is for requests that go out)
    assert guessed_ahead <= guessed_plain - on.rows_taken, (guessed_ahead, guessed_plain, on)
    for a, b in zip(plain, ahead):
        assert a.images.tobytes() == b.images.tobytes()
        np.testing.assert_array_equal(a.usage, b.usage)


async def _moved_mid_run(nats_url, nc, experts, router, job):
    """`job` alone through a fleet with `router`, without running ahead and with; asserts that its images and
    usage are the same bit for bit; returns (its done event, the run-ahead counters)."""
    ws = await start_workers(nats_url, experts, dtype="float32")
    try:
        (plain,), _, _ = await _run(nats_url, nc, router, [job], run_ahead=0)
        (ahead,), on, _ = await _run(nats_url, nc, router, [job], run_ahead=8)
    finally:
        await stop_workers(ws)
    assert plain.images.tobytes() == ahead.images.tobytes()
    np.testing.assert_array_equal(plain.usage, ahead.usage)
    return plain, on


async def test_a_job_the_router_moves_mid_run_keeps_its_images(nats_url, nc, experts):
    plain, on = await _moved_mid_run(nats_url, nc, experts, TimeRouter(), JobRequest(digits=[3, 6], steps=10, seed=11))
    assert (plain.usage > 0).all()  # both experts served each image: the job was moved
    # the run sent at step 0 (8 more steps, from expert 0) is left at step 5, where the router moves the rows
    assert sum(on.ended.values()) >= 1 and on.steps_wasted >= 1, on
    assert on.rows_taken >= 2 * 4, on


async def test_a_job_whose_rows_the_router_splits_mid_run_keeps_its_images(nats_url, nc, experts):
    """The run streams both rows' velocities from expert 0; when the router moves one row away, the other
    row's velocity is the one the same requests give without running ahead."""
    plain, on = await _moved_mid_run(nats_url, nc, experts, SplitRouter(), JobRequest(digits=[3, 4], steps=10, seed=12))
    assert (plain.usage[0] > 0).all() and plain.usage[1, 1] == 0  # row 0 moved to expert 1, row 1 stayed
    assert on.rows_taken >= 2, on


def _request(**kw):
    base = dict(
        expert=0,
        x_t=np.zeros((2, 1, 32, 32), np.float32),
        t=np.zeros(2, np.float32),
        y=np.array([1, 2]),
        ahead_t=np.array([[0.5, 0.5]], np.float32),
        ahead_dt=np.array([[0.5, 0.5]], np.float32),
    )
    base.update(kw)
    return base


async def test_a_worker_streams_its_steps_and_refuses_bad_run_ahead_fields(nats_url, nc, experts):
    from workers.service import ExpertWorker

    w = ExpertWorker(expert=0, checkpoint=experts[0], nats_url=nats_url, buckets=(1, 4), dtype="float32")
    await w.start()
    try:
        assert w.metadata()["run_ahead"] == "16"
        got: asyncio.Queue = asyncio.Queue()
        sub = await nc.subscribe("_INBOX.test.ahead", cb=got.put)  # every reply of one request comes here
        x0 = np.random.default_rng(0).standard_normal((2, 1, 32, 32)).astype(np.float32)
        req = StepRequest(
            **_request(
                x_t=x0,
                ahead_t=np.array([[0.25, 0.25], [0.5, 0.5]], np.float32),
                ahead_dt=np.array([[0.25, 0.25], [0.25, 0.25]], np.float32),
            )
        )
        await nc.publish(subjects.expert_velocity(0), pack(req), reply="_INBOX.test.ahead")
        first, *rest = [unpack((await asyncio.wait_for(got.get(), 10)).data, StepReply) for _ in range(3)]
        assert [r.ahead_index for r in (first, *rest)] == [0, 1, 2]
        # the same three steps asked one at a time, x stepped here
        x, t = x0, 0.0
        for r in (first, *rest):
            one = StepRequest(expert=0, x_t=x, t=np.full(2, t, np.float32), y=np.array([1, 2]))
            v = unpack((await nc.request(subjects.expert_velocity(0), pack(one), timeout=10)).data, StepReply)
            assert v.velocity.tobytes() == r.velocity.tobytes()
            x, t = (x + np.float32(0.25) * v.velocity).astype(np.float32), t + 0.25
        await sub.unsubscribe()
        bad = {
            "t range": (_request(ahead_t=np.array([[0.5, 1.5]], np.float32)), ErrorCode.BAD_REQUEST),
            "too far": (
                _request(ahead_t=np.full((17, 2), 0.5, np.float32), ahead_dt=np.zeros((17, 2), np.float32)),
                ErrorCode.BAD_SHAPE,
            ),
            "shape": (_request(ahead_t=np.zeros((1, 3), np.float32)), ErrorCode.BAD_SHAPE),
            "missing": ({k: v for k, v in _request().items() if k != "ahead_dt"}, ErrorCode.BAD_REQUEST),
            "dtype": (_request(x_t=np.zeros((2, 1, 32, 32), np.float16)), ErrorCode.BAD_DTYPE),
        }
        import msgpack

        for name, (fields, code) in bad.items():
            data = msgpack.packb({"v": 1, "kind": "step_request", **_wire(fields)})
            reply = unpack((await nc.request(subjects.expert_velocity(0), data, timeout=10)).data, ErrorReply)
            assert reply.code == code, (name, reply)
        ok = StepRequest(expert=0, x_t=x0, t=np.zeros(2, np.float32), y=np.array([1, 2]))
        assert unpack((await nc.request(subjects.expert_velocity(0), pack(ok), timeout=10)).data, StepReply)
    finally:
        await w.stop()


def _wire(fields: dict) -> dict:
    from schemas.tensor import encode_tensor

    return {k: encode_tensor(v) if isinstance(v, np.ndarray) else v for k, v in fields.items()}


async def test_a_stream_that_stalls_pauses_running_ahead_for_its_expert(nats_url, nc, experts):
    """A server that lets workers answer only once (allow_responses max 1) drops every reply after the
    first: the coordinator waits a few forwards' time, asks plainly, and stops running that expert ahead.
    Simulated by a worker that answers only the first reply of each request (its later ones dropped)."""
    ws = await start_workers(nats_url, experts, dtype="float32")
    for w in ws:  # the worker's further replies never reach the coordinator
        sent = w._send

        async def first_only(req, data, headers=None, _sent=sent):
            if getattr(req, "_answered", False):
                return True
            req._answered = True
            return await _sent(req, data, headers)

        w._send = first_only
    job = JobRequest(digits=[3], steps=6, seed=2)
    try:
        (plain,), _, _ = await _run(nats_url, nc, LabelRouter(C2E, 2), [job], run_ahead=0)
        async with Coordinator(LabelRouter(C2E, 2), num_experts=2, class_to_expert=C2E, nats_url=nats_url) as coord:
            await run_ahead_discovered(coord.transport, {0: 16, 1: 16})
            began = asyncio.get_running_loop().time()
            stalled = await run_job(nc, job)
            took = asyncio.get_running_loop().time() - began
            again = await run_job(nc, job)
            ahead, tr = coord.engine.ahead, coord.transport
    finally:
        await stop_workers(ws)
    assert plain.images.tobytes() == stalled.images.tobytes() == again.images.tobytes()
    assert ahead.runs == 1 and ahead.ended == {"stream ended": 1}, ahead
    assert 0 in tr.no_ahead_until and took < 5  # one short wait (>= 0.5 s), not the 10 s step time-out


async def test_only_experts_whose_workers_say_they_run_ahead_are_asked_to(nats_url, nc, experts):
    """Discovery learns each expert's `run_ahead` (the least of its workers'); an expert served by a
    responder that does not advertise it (an older release, another implementation) is asked plainly."""
    from coordinator.transport import NatsTransport
    from workers.service import ExpertWorker

    w = ExpertWorker(expert=0, checkpoint=experts[0], nats_url=nats_url, buckets=(1, 4), dtype="float32")
    await w.start()

    asked: list[int] = []  # steps run ahead asked of the responder, per request

    async def plain(msg):  # expert 1: answers steps, says nothing in discovery
        step = unpack(msg.data, StepRequest)
        asked.append(step.ahead)
        await msg.respond(pack(StepReply(expert=1, velocity=np.zeros_like(step.x_t), row_ids=step.row_ids)))

    sub = await nc.subscribe(subjects.expert_velocity(1), queue=subjects.expert_queue_group(1), cb=plain)
    try:
        tr = NatsTransport(nc, step_timeout=5)
        await run_ahead_discovered(tr, {0: 16})
        x = np.zeros((1, 1, 32, 32), np.float32)
        t, y, ids = np.zeros(1, np.float32), np.array([1]), ["r0"]
        at, dt = np.full((20, 1), 0.5, np.float32)[:16], np.full((16, 1), 0.01, np.float32)
        v, stream = await tr.velocity_ahead(1, x, t, y, ids, at, dt)
        assert stream is None and v.shape == x.shape and asked == [0]  # asked plainly
        v, stream = await tr.velocity_ahead(0, x, t, y, ids, at[:3], dt[:3])
        assert stream is not None and stream.steps == 3
        for _ in range(3):
            assert (await stream.next(5.0)).shape == x.shape
        stream.close()
    finally:
        await sub.unsubscribe()
        await w.stop()


async def test_a_hedged_request_runs_ahead_on_the_worker_that_answered(nats_url, nc, experts):
    """Expert 0 has two workers, one late with every reply (a loaded host): its requests are hedged to
    the other, both legs run ahead, and only the answering leg's stream is used; the late leg's further
    replies never reach an image. The images are those of the same jobs asked without running ahead."""
    # batch-invariant workers: the late worker may still run a lost leg ahead when the next job's try
    # reaches it, and the two rows then share a forward, whose float32 last bits depend on its rows
    ws = await start_workers(nats_url, experts, dtype="float32", batch_quantum=16)
    ws += await start_workers(nats_url, experts[:1], dtype="float32", batch_quantum=16)  # a 2nd of expert 0
    late, sent = {"on": False}, ws[2]._send

    async def late_send(req, data, headers=None, _sent=sent):
        if late["on"]:
            await asyncio.sleep(0.3)
        return await _sent(req, data, headers)

    ws[2]._send = late_send
    jobs = [JobRequest(digits=[d % 5], steps=10, seed=40 + d) for d in range(10)]  # expert 0's classes
    try:
        plain, _, _ = await _run(nats_url, nc, LabelRouter(C2E, 2), jobs, run_ahead=0)
        late["on"] = True
        # queue-group dispatch: NATS hands each try to either worker, so both are seen and hedging is on
        async with Coordinator(
            LabelRouter(C2E, 2),
            num_experts=2,
            class_to_expert=C2E,
            nats_url=nats_url,
            run_ahead=4,
            dispatch="queue",
            hedge_after_s=0.05,
        ) as coord:
            tr = coord.transport
            await run_ahead_discovered(tr, {0: 16, 1: 16})
            ahead = [await run_job(nc, j) for j in jobs]
            hedges, runs, bad = sum(tr.hedge_counts.values()), coord.engine.ahead, tr.bad_replies
    finally:
        await stop_workers(ws)
    # the late worker's tries were hedged (about half of them, NATS picking at random: 20 requests); the
    # legs that lost streamed too, and their replies were dropped, not taken into a run
    assert hedges >= 1 and tr.late_replies >= 1, (tr.hedge_counts, tr.late_replies)
    # the runs streamed to their ends (20 runs of 4 further steps): a reply of the other leg taken into a
    # run would break its order and end it, in every hedged run (about 8 of 20). A loaded box may stall
    # one stream: that run ends and the expert stops running ahead for minutes (fewer runs, none ended)
    assert runs.runs >= 1 and sum(runs.ended.values()) <= 1 and runs.rows_taken >= 4 * (runs.runs - 1), runs
    assert bad == 0
    for a, b in zip(plain, ahead):
        assert a.images.tobytes() == b.images.tobytes()
        np.testing.assert_array_equal(a.usage, b.usage)
