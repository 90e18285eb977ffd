"""Classifier-free guidance at the expert worker, over a real nats-server: a guided step's reply is
guide(v(x, y), v(x, -1), s) of the same backend's forward (rows at s = 1 and unconditional rows untouched),
steps run ahead are guided too, the twins count against the request limit, and a model without a
null label refuses guided requests with `bad_request` and keeps serving."""

from __future__ import annotations

import numpy as np
import pytest

from flow.guidance import guide
from flow.solver import euler_update
from schemas import ErrorCode, ErrorReply, StepReply, StepRequest, StepResult, pack, subjects, unpack
from workers.service import ExpertWorker

SUBJECT = subjects.expert_velocity(0)
U = -1


@pytest.fixture(scope="module")
def null_label_checkpoint(tmp_path_factory) -> str:
    """A tiny random-init expert UNet with a null label (as `train-expert --label-dropout > 0`)."""
    from models.tiny import make_tiny_expert

    return str(
        make_tiny_expert(
            tmp_path_factory.mktemp("guided-expert") / "expert0", expert_id=0, seed=98, jitter=0.05, null_label=True
        )
    )


def _request(y, scale, seed: int = 0, **extra) -> StepRequest:
    rng = np.random.default_rng(seed)
    n = len(y)
    return StepRequest(
        expert=0,
        x_t=rng.standard_normal((n, 1, 32, 32)).astype(np.float32),
        t=rng.uniform(0, 1, n).astype(np.float32),
        y=np.asarray(y, np.int64),
        row_ids=[f"r{i}" for i in range(n)],
        request_id="cfg-1",
        guidance=np.asarray(scale, np.float32),
        **extra,
    )


def _want(backend, x, t, y, s) -> np.ndarray:
    """What a guided request must answer, from the backend's own forward of each row and its null twin,
    in one pass as the worker makes it (the rows, then the twins of the guided rows)."""
    guided = np.nonzero((s != 1) & (y >= 0))[0]
    x2 = np.concatenate([x, x[guided]])
    t2 = np.concatenate([t, t[guided]])
    y2 = np.concatenate([y, np.full(len(guided), U, np.int64)])
    v2 = backend.forward(x2, t2, y2)
    out = np.array(v2[: len(y)])
    out[guided] = guide(v2[: len(y)][guided], v2[len(y) :], s[guided])
    return out


async def _ask(nc, req: StepRequest):
    msg = await nc.request(SUBJECT, pack(req), timeout=10)
    return unpack(msg.data, StepResult)


async def test_a_guided_reply_is_the_guided_velocity_of_the_same_forward(nats_url, nc, null_label_checkpoint):
    async with ExpertWorker(
        0, null_label_checkpoint, "torch", nats_url=nats_url, buckets=(1, 2, 4, 8), dtype="float32"
    ) as w:
        assert w.info()["metadata"]["guidance"] == "true"
        y = np.array([3, U, 7, 0], np.int64)
        s = np.array([2.5, 2.5, 1.0, 0.0], np.float32)
        req = _request(y, s, seed=1)
        reply = await _ask(nc, req)
        assert isinstance(reply, StepReply), reply
        x, t = np.array(req.x_t), np.array(req.t)
        want = _want(w.backend, x, t, y, s)
        np.testing.assert_array_equal(reply.velocity, want)  # the same pass: bit for bit
        plain = w.backend.forward(x, t, y)
        np.testing.assert_allclose(reply.velocity[[1, 2]], plain[[1, 2]], atol=1e-5)  # -1 and s = 1: unguided
        assert np.abs(reply.velocity[0] - plain[0]).max() > 1e-4  # guided: another velocity
        null = w.backend.forward(x[3:], t[3:], np.array([U], np.int64))
        np.testing.assert_allclose(reply.velocity[3], null[0], atol=1e-5)  # s = 0: the null velocity
        assert reply.batch_rows == 6  # 4 rows and 2 twins in one forward


async def test_guided_steps_run_ahead_step_with_the_guided_velocity(nats_url, nc, null_label_checkpoint):
    async with ExpertWorker(
        0, null_label_checkpoint, "torch", nats_url=nats_url, buckets=(1, 2, 4), dtype="float32"
    ) as w:
        y, s = np.array([4, 9], np.int64), np.array([3.0, 3.0], np.float32)
        ahead_t = np.array([[0.5, 0.5], [0.75, 0.75]], np.float32)
        ahead_dt = np.full((2, 2), 0.25, np.float32)
        req = _request(y, s, seed=2, ahead_t=ahead_t, ahead_dt=ahead_dt)
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox)
        await nc.publish(SUBJECT, pack(req), reply=inbox)
        replies = [unpack((await sub.next_msg(timeout=10)).data, StepResult) for _ in range(3)]
        await sub.unsubscribe()
        assert all(isinstance(r, StepReply) for r in replies), replies
        x, t = np.array(req.x_t), np.array(req.t)
        v = _want(w.backend, x, t, y, s)
        np.testing.assert_array_equal(replies[0].velocity, v)
        for a in range(2):  # x' = x + dt * (the guided v), then guided again at x'
            x = euler_update(x, ahead_dt[a], v)
            v = _want(w.backend, x, ahead_t[a], y, s)
            assert replies[a + 1].ahead_index == a + 1
            np.testing.assert_array_equal(replies[a + 1].velocity, v)


async def test_twins_count_against_the_request_limit(nats_url, nc, null_label_checkpoint):
    async with ExpertWorker(
        0, null_label_checkpoint, "torch", nats_url=nats_url, buckets=(1, 2, 4), dtype="float32", max_request_rows=4
    ):
        too_many = await _ask(nc, _request([1, 2, 3], [2.0, 2.0, 2.0]))
        assert isinstance(too_many, ErrorReply) and too_many.code == ErrorCode.TOO_LARGE, too_many
        assert "6 rows" in too_many.message and "twins" in too_many.message
        fits = await _ask(nc, _request([1, 2, 3], [2.0, 1.0, 1.0]))  # one twin: 4 rows
        assert isinstance(fits, StepReply), fits


async def test_a_model_without_a_null_label_refuses_guidance_and_keeps_serving(nats_url, nc, tiny_expert_checkpoint):
    async with ExpertWorker(
        0, tiny_expert_checkpoint, "torch", nats_url=nats_url, buckets=(1, 2, 4), dtype="float32"
    ) as w:
        for _ in range(2):
            reply = await _ask(nc, _request([3, 5], [2.0, 2.0]))
            assert isinstance(reply, ErrorReply) and reply.code == ErrorCode.BAD_REQUEST, reply
            assert "guidance" in reply.message and "null label" in reply.message and "--label-dropout" in reply.message
            assert reply.request_id == "cfg-1"
        same = _request([3, 5], [1.0, 1.0], seed=3)  # guidance at s = 1 everywhere: no twins, served as usual
        reply = await _ask(nc, same)
        assert isinstance(reply, StepReply), reply
        ref = w.backend.forward(np.array(same.x_t), np.array(same.t), np.array(same.y))
        np.testing.assert_allclose(reply.velocity, ref, atol=1e-5)
