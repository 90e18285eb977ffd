"""Label unknown (y = -1) at the expert worker, over a real nats-server: a model with a null label
serves it, one without answers a clear `bad_request` and keeps serving, and the sim backend serves
it with the templates' mixture velocity."""

from __future__ import annotations

import numpy as np
import pytest

from schemas import UNCONDITIONAL, ErrorCode, ErrorReply, StepReply, StepRequest, StepResult, pack, subjects, unpack
from workers.backends import get_backend
from workers.backends.sim_backend import sim_template
from workers.service import ExpertWorker

SUBJECT = subjects.expert_velocity(0)


@pytest.fixture(scope="module")
def null_label_checkpoint(tmp_path_factory) -> str:
    """A tiny random-init expert UNet with a null label (as `train-expert --label-dropout > 0`)."""
    from models.tiny import make_tiny_expert

    return str(
        make_tiny_expert(
            tmp_path_factory.mktemp("null-expert") / "expert0", expert_id=0, seed=99, jitter=0.05, null_label=True
        )
    )


def _request(y, seed: int = 0) -> StepRequest:
    rng = np.random.default_rng(seed)
    n = len(y)
    return StepRequest(
        expert=0,
        x_t=rng.standard_normal((n, 1, 32, 32)).astype(np.float32),
        t=rng.uniform(0, 1, n).astype(np.float32),
        y=np.asarray(y, np.int64),
        row_ids=[f"r{i}" for i in range(n)],
        request_id="unc-1",
    )


async def _ask(nc, req: StepRequest):
    msg = await nc.request(SUBJECT, pack(req), timeout=10)
    return unpack(msg.data, StepResult)


async def test_a_model_without_a_null_label_refuses_minus_one_and_keeps_serving(nats_url, nc, tiny_expert_checkpoint):
    async with ExpertWorker(
        0, tiny_expert_checkpoint, "torch", nats_url=nats_url, buckets=(1, 2, 4), dtype="float32"
    ) as w:
        assert w.backend.null_label is False and "null_label" not in w.info()["metadata"]
        for _ in range(3):  # again and again: the worker never dies of it
            reply = await _ask(nc, _request([3, UNCONDITIONAL]))
            assert isinstance(reply, ErrorReply) and reply.code == ErrorCode.BAD_REQUEST, reply
            assert "null label" in reply.message and "--label-dropout" in reply.message
            assert "expert 0" in reply.message and reply.request_id == "unc-1"
        bad = await _ask(nc, _request([-2, 1]))
        assert isinstance(bad, ErrorReply) and bad.code == ErrorCode.BAD_REQUEST and "[0, 9]" in bad.message
        good = _request([3, 7], seed=1)
        reply = await _ask(nc, good)
        assert isinstance(reply, StepReply), reply
        ref = w.backend.forward(np.array(good.x_t), np.array(good.t), np.array(good.y))
        np.testing.assert_allclose(reply.velocity, ref, atol=1e-5)


async def test_a_model_with_a_null_label_serves_minus_one(nats_url, nc, null_label_checkpoint):
    async with ExpertWorker(
        0, null_label_checkpoint, "torch", nats_url=nats_url, buckets=(1, 2, 4), dtype="float32"
    ) as w:
        assert w.backend.null_label is True and w.info()["metadata"]["null_label"] == "true"
        req = _request([UNCONDITIONAL, 3, UNCONDITIONAL], seed=2)
        reply = await _ask(nc, req)
        assert isinstance(reply, StepReply), reply
        ref = w.backend.forward(np.array(req.x_t), np.array(req.t), np.array(req.y))
        np.testing.assert_allclose(reply.velocity, ref, atol=1e-5)
        # the null label is its own embedding: the same inputs with label 0 give another velocity
        as_zero = w.backend.forward(np.array(req.x_t), np.array(req.t), np.array([0, 3, 0], np.int64))
        assert np.abs(as_zero[0] - ref[0]).max() > 1e-4
        np.testing.assert_allclose(as_zero[1], ref[1], atol=1e-5)  # row 1 untouched by its neighbours
        bad = await _ask(nc, _request([-2, 1]))
        assert isinstance(bad, ErrorReply) and "or -1 (label unknown)" in bad.message


def test_sim_backend_serves_minus_one_and_lands_near_a_template(tiny_expert_checkpoint):
    be = get_backend("sim", preset="instant")
    be.load(tiny_expert_checkpoint)  # a checkpoint without a null label: the sim serves -1 anyway
    assert be.null_label is True
    rng = np.random.default_rng(5)
    x = rng.standard_normal((4, 1, 32, 32)).astype(np.float32)
    y = np.array([UNCONDITIONAL, 2, UNCONDITIONAL, UNCONDITIONAL], np.int64)
    t = np.zeros(4, np.float32)
    v = be.forward(x, t, y)
    np.testing.assert_array_equal(v, be.forward(x, t, y))  # deterministic
    np.testing.assert_array_equal(v[1], be.forward(x[1:2], t[1:2], y[1:2])[0])  # rows independent
    np.testing.assert_array_equal(v[0], be.forward(x[:1], t[:1], y[:1])[0])
    templates = np.stack([sim_template(0, c, 10, (1, 32, 32)) for c in range(10)])
    steps = 20
    for i in range(steps):  # Euler from noise to data
        tt = np.full(4, i / steps, np.float32)
        x = x + be.forward(x, tt, y) / steps
    dist = np.abs(x[:, None] - templates[None]).reshape(4, 10, -1).max(axis=2)  # [rows, classes]
    assert dist[1, 2] < 1e-3  # the conditional row reaches its own template
    for r in (0, 2, 3):  # each unconditional row reaches one of the templates (not their blurry mean)
        assert dist[r].min() < 0.05, dist[r]


async def test_sim_worker_answers_minus_one(nats_url, nc, tiny_expert_checkpoint):
    be = get_backend("sim", preset="instant")
    be.load(tiny_expert_checkpoint)
    async with ExpertWorker(0, None, be, nats_url=nats_url, buckets=(1, 2)) as w:
        req = _request([UNCONDITIONAL, 5])
        reply = await _ask(nc, req)
        assert isinstance(reply, StepReply), reply
        np.testing.assert_array_equal(
            reply.velocity, w.backend.forward(np.array(req.x_t), np.array(req.t), np.array(req.y))
        )
