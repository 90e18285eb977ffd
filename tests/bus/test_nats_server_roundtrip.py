"""An encoded StepRequest crosses a real nats-server and the reply decodes."""

from __future__ import annotations

import numpy as np

from schemas import ErrorReply, StepReply, StepRequest, StepResult, pack, subjects, unpack


async def test_step_request_reply_through_nats(nc):
    subject = subjects.expert_velocity(0)

    async def responder(msg):
        req = unpack(msg.data, StepRequest)
        v = -2.0 * np.asarray(req.x_t)  # any deterministic function of the input
        await msg.respond(pack(StepReply(expert=req.expert, velocity=v, row_ids=req.row_ids, backend="test")))

    sub = await nc.subscribe(subject, queue=subjects.expert_queue_group(0), cb=responder)
    x = np.random.default_rng(0).standard_normal((8, 1, 32, 32)).astype(np.float32)
    req = StepRequest(
        expert=0,
        x_t=x,
        t=np.full(8, 0.5, np.float32),
        y=np.arange(8, dtype=np.int64) % 10,
        row_ids=[f"r{i}" for i in range(8)],
    )
    msg = await nc.request(subject, pack(req), timeout=5)
    reply = unpack(msg.data, StepResult)
    assert isinstance(reply, StepReply)
    assert reply.row_ids == req.row_ids
    np.testing.assert_array_equal(reply.velocity, -2.0 * x)
    await sub.unsubscribe()


async def test_bad_bytes_get_error_reply_and_server_keeps_serving(nc):
    from schemas import ErrorCode, ProtocolError

    subject = subjects.expert_velocity(7)

    async def responder(msg):
        try:
            req = unpack(msg.data, StepRequest)
        except ProtocolError as err:
            await msg.respond(pack(ErrorReply(code=err.code, message=err.message)))
            return
        await msg.respond(pack(StepReply(expert=7, velocity=np.asarray(req.x_t))))

    sub = await nc.subscribe(subject, cb=responder)
    bad = await nc.request(subject, b"\xc1\xff garbage", timeout=5)
    err = unpack(bad.data, StepResult)
    assert isinstance(err, ErrorReply) and err.code == ErrorCode.BAD_REQUEST
    good = StepRequest(
        expert=7, x_t=np.zeros((1, 1, 4, 4), np.float32), t=np.zeros(1, np.float32), y=np.zeros(1, np.int64)
    )
    ok = unpack((await nc.request(subject, pack(good), timeout=5)).data, StepResult)
    assert isinstance(ok, StepReply) and ok.velocity.shape == (1, 1, 4, 4)
    await sub.unsubscribe()
