"""NatsTransport against a real nats-server and hand-written responders (the transport is the unit)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from coordinator.errors import ExpertUnavailable
from coordinator.transport import NatsTransport
from schemas import ErrorCode, ErrorReply, StepReply, StepRequest, pack, subjects, unpack

EXPERT = 41  # a subject no other test serves


def _inputs(n):
    x = np.arange(n * 16, dtype=np.float32).reshape(n, 1, 4, 4)
    return x, np.full(n, 0.5, np.float32), np.zeros(n, np.int64), [f"r{i}" for i in range(n)]


async def _serve(nc, handler, expert=EXPERT):
    async def cb(msg):
        req = unpack(msg.data, StepRequest)
        out = await handler(req)
        if out is not None:
            await msg.respond(pack(out))

    return await nc.subscribe(subjects.expert_velocity(expert), queue=subjects.expert_queue_group(expert), cb=cb)


def _ok(req):
    return StepReply(expert=req.expert, velocity=-np.asarray(req.x_t), row_ids=req.row_ids)


async def test_large_batches_split_and_come_back_in_order(nc):
    sizes = []

    async def h(req):
        sizes.append(len(req.row_ids))
        return _ok(req)

    sub = await _serve(nc, h)
    try:
        x, t, y, ids = _inputs(10)
        v = await NatsTransport(nc, max_rows=4).velocity(EXPERT, x, t, y, ids)
        np.testing.assert_array_equal(v, -x)
        assert sorted(sizes) == [2, 4, 4]
    finally:
        await sub.unsubscribe()


async def test_transient_errors_and_silence_are_retried(nc):
    calls = []

    async def h(req):
        calls.append(req.request_id)
        if len(calls) == 1:
            return ErrorReply(code=ErrorCode.OVERLOADED, message="busy")
        if len(calls) == 2:
            return None  # never answers: a timeout
        return _ok(req)

    sub = await _serve(nc, h)
    try:
        tr = NatsTransport(nc, step_timeout=0.3, retries=2)
        x, t, y, ids = _inputs(3)
        np.testing.assert_array_equal(await tr.velocity(EXPERT, x, t, y, ids), -x)
        assert len(calls) == 3 and tr.retried == 2 and len(set(calls)) == 3
    finally:
        await sub.unsubscribe()


async def test_bad_replies_and_refusals_make_the_expert_unavailable(nc):
    async def wrong_rows(req):
        return StepReply(expert=req.expert, velocity=np.asarray(req.x_t), row_ids=list(reversed(req.row_ids)))

    sub = await _serve(nc, wrong_rows)
    try:
        with pytest.raises(ExpertUnavailable, match="row_ids do not match"):
            await NatsTransport(nc, step_timeout=1, retries=1).velocity(EXPERT, *_inputs(2))
    finally:
        await sub.unsubscribe()

    async def refuse(req):
        return ErrorReply(code=ErrorCode.BAD_SHAPE, message="x_t must be [B, 1, 32, 32]")

    sub = await _serve(nc, refuse)
    try:
        tr = NatsTransport(nc, retries=3)
        with pytest.raises(ExpertUnavailable, match="bad_shape"):
            await tr.velocity(EXPERT, *_inputs(2))
        assert tr.retried == 0  # our request is wrong: asking again cannot help
    finally:
        await sub.unsubscribe()


async def test_on_a_checked_fleet_bad_shape_means_an_odd_worker_and_is_asked_again(nc):
    """With the fleet's spec known (the coordinator checked it at start), requests carry the right shape:
    a bad_shape answer comes from a worker of another spec in the queue group; the request goes again."""
    from schemas.spec import legacy_spec

    calls = []

    async def odd_then_good(req):
        calls.append(req.request_id)
        if len(calls) == 1:
            return ErrorReply(code=ErrorCode.BAD_SHAPE, message="x_t must be [B, 3, 32, 32]")
        return _ok(req)

    sub = await _serve(nc, odd_then_good)
    try:
        tr = NatsTransport(nc, retries=0, bad_reply_retries=1, dispatch="queue")
        tr.fleet_spec = legacy_spec()
        x, t, y, ids = _inputs(2)
        np.testing.assert_array_equal(await tr.velocity(EXPERT, x, t, y, ids), -x)
        assert len(calls) == 2 and tr.rejected_replies == 1 and tr.bad_replies == 1
    finally:
        await sub.unsubscribe()


async def test_replies_of_a_rejected_worker_are_not_used(nc):
    from coordinator.fleet_spec import RejectedWorker

    async def claims(req):
        return StepReply(expert=req.expert, velocity=-np.asarray(req.x_t), row_ids=req.row_ids, worker_id="odd-1")

    sub = await _serve(nc, claims)
    try:
        tr = NatsTransport(nc, step_timeout=1, retries=0, bad_reply_retries=1, dispatch="queue")
        tr.discovery.rejected_workers = {"odd-1": RejectedWorker("odd-1", "svc", "h", EXPERT, "num_classes: 10 != 4")}
        with pytest.raises(ExpertUnavailable, match="model spec differs"):
            await tr.velocity(EXPERT, *_inputs(1))
        assert tr.rejected_replies == 2
    finally:
        await sub.unsubscribe()


async def test_no_responders_fails_at_once(nc):
    tr = NatsTransport(nc, step_timeout=30, retries=5)
    with pytest.raises(ExpertUnavailable, match="no responders"):
        await asyncio.wait_for(tr.velocity(EXPERT + 1, *_inputs(1)), 5)


def test_config_is_checked():
    with pytest.raises(ValueError, match="step_timeout"):
        NatsTransport(None, step_timeout=0)
    with pytest.raises(ValueError, match="max_rows"):
        NatsTransport(None, max_rows=10_000)


async def test_a_worker_older_than_running_ahead_is_asked_plainly(nc):
    """An older worker refuses the run-ahead fields as unknown keys (`bad_request`): the transport asks
    again without them, not counting a try, and does not ask that expert to run ahead for a while."""
    from schemas import loads

    seen = []

    async def cb(msg):
        raw = loads(msg.data)
        seen.append(sorted(k for k in raw if k.startswith("ahead")))
        if "ahead_t" in raw:  # what pydantic's extra="forbid" of an older release answers
            await msg.respond(
                pack(ErrorReply(code=ErrorCode.BAD_REQUEST, message="ahead_t: Extra inputs are not permitted"))
            )
        else:
            await msg.respond(pack(_ok(unpack(msg.data, StepRequest))))

    sub = await nc.subscribe(subjects.expert_velocity(EXPERT), queue=subjects.expert_queue_group(EXPERT), cb=cb)
    try:
        tr = NatsTransport(nc, step_timeout=2, retries=0)
        tr.run_ahead_of[EXPERT] = 16  # as if discovery had said so (a worker that claims it, then refuses)
        x, t, y, ids = _inputs(2)
        ahead_t, ahead_dt = np.full((3, 2), 0.75, np.float32), np.full((3, 2), 0.25, np.float32)
        v, stream = await tr.velocity_ahead(EXPERT, x, t, y, ids, ahead_t, ahead_dt)
        np.testing.assert_array_equal(v, -x)
        assert stream is None and seen == [["ahead_dt", "ahead_t"], []] and tr.retried == 1
        assert EXPERT in tr.no_ahead_until
        v, stream = await tr.velocity_ahead(EXPERT, x, t, y, ids, ahead_t, ahead_dt)  # asked plainly at once
        assert stream is None and seen[2:] == [[]]
    finally:
        await sub.unsubscribe()


async def test_a_run_ahead_stream_checks_each_reply_like_the_first(nc):
    """The further replies of a request that runs ahead go to its stream in order; one that is not a usable
    velocity (wrong shape, an error reply) ends the stream instead of reaching a sample."""
    from coordinator.run_ahead import AheadEnded

    async def cb(msg):
        req = unpack(msg.data, StepRequest)
        await msg.respond(pack(_ok(req)))
        good = StepReply(expert=req.expert, velocity=np.ones_like(req.x_t), row_ids=req.row_ids, ahead_index=1)
        await msg.respond(pack(good))
        bad = StepReply(expert=req.expert, velocity=np.ones((1, 1, 4, 4), np.float32), ahead_index=2)
        await msg.respond(pack(bad))

    sub = await nc.subscribe(subjects.expert_velocity(EXPERT), queue=subjects.expert_queue_group(EXPERT), cb=cb)
    try:
        tr = NatsTransport(nc, step_timeout=2)
        tr.run_ahead_of[EXPERT] = 16  # as discovery learns it from a worker's metadata
        x, t, y, ids = _inputs(2)
        v, stream = await tr.velocity_ahead(
            EXPERT, x, t, y, ids, np.full((2, 2), 0.75, np.float32), np.full((2, 2), 0.25, np.float32)
        )
        np.testing.assert_array_equal(v, -x)
        np.testing.assert_array_equal(await stream.next(2.0), np.ones_like(x))
        with pytest.raises(AheadEnded, match="shape"):
            await stream.next(2.0)
        stream.close()
        assert not tr.mux._streams and tr.stray_replies == 0
    finally:
        await sub.unsubscribe()
