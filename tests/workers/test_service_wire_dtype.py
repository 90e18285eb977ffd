"""A real expert worker over a real nats-server answering in the precision a request asks for
(`StepRequest.reply_dtype`), and the coordinator's transport using it (`wire_dtype`)."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from coordinator.transport import NatsTransport
from schemas import ErrorCode, ErrorReply, StepReply, StepRequest, StepResult, pack, subjects, unpack
from schemas.tensor import to_wire_dtype
from workers.service import ExpertWorker


def _inputs(n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    return (
        rng.standard_normal((n, 1, 32, 32)).astype(np.float32),
        rng.uniform(0, 1, n).astype(np.float32),
        rng.integers(0, 10, n).astype(np.int64),
    )


async def _ask(nc, expert, x_wire, t, y, reply_dtype=None):
    req = StepRequest(expert=expert, x_t=x_wire, t=t, y=y, reply_dtype=reply_dtype, request_id="w1")
    msg = await nc.request(subjects.expert_velocity(expert), pack(req), timeout=30)
    return msg.data, unpack(msg.data, StepResult)


@pytest.fixture(scope="module")
def sim_checkpoint(tmp_path_factory) -> str:
    from models.tiny import make_tiny_expert

    return str(make_tiny_expert(tmp_path_factory.mktemp("wire-sim") / "expert5", expert_id=5, seed=3))


async def test_a_torch_worker_answers_float16_to_float16_and_float32_by_default(nats_url, nc, tiny_expert_checkpoint):
    x, t, y = _inputs(4)
    async with ExpertWorker(  # batch-invariant: the same bits from the worker's thread as from this one
        0, tiny_expert_checkpoint, "torch", nats_url=nats_url, buckets=(1, 4), dtype="float32", batch_quantum=16
    ) as w:
        raw32, r32 = await _ask(nc, 0, x, t, y)
        assert isinstance(r32, StepReply) and r32.velocity.dtype == np.float32
        assert msgpack.unpackb(raw32, raw=False)["velocity"]["dtype"] == "<f4"
        np.testing.assert_array_equal(r32.velocity, w.backend.forward(x, t, y))  # float32: unchanged

        raw16, r16 = await _ask(nc, 0, to_wire_dtype(x, "float16"), t, y, reply_dtype="float16")
        assert isinstance(r16, StepReply) and r16.velocity.dtype == np.float16
        wire = msgpack.unpackb(raw16, raw=False)["velocity"]
        assert wire["dtype"] == "<f2" and len(wire["data"]) == x.size * 2
        # the model saw x rounded to float16, and the velocity is rounded once more
        want = w.backend.forward(x.astype(np.float16).astype(np.float32), t, y)
        np.testing.assert_allclose(r16.velocity.astype(np.float32), want, rtol=2**-10, atol=1e-3)

        _, rbf = await _ask(nc, 0, to_wire_dtype(x, "bfloat16"), t, y, reply_dtype="bfloat16")
        assert isinstance(rbf, StepReply) and rbf.velocity.dtype == np.float32  # bfloat16 decodes widened
        np.testing.assert_allclose(rbf.velocity, r32.velocity, rtol=0.05, atol=0.05)


async def test_a_velocity_beyond_float16_is_a_clear_error_and_the_transport_falls_back(nats_url, nc, sim_checkpoint):
    """The sim expert's velocity (template - x) / (1 - t) reaches ~1e6 at t = 1 for |x| ~ 1e3 (a
    finite, sane-sized input): float16 cannot carry it."""
    x, t, y = _inputs(2, seed=1)
    x[:] = 1000.0
    t[:] = 1.0
    async with ExpertWorker(
        5, sim_checkpoint, "sim", nats_url=nats_url, buckets=(1, 2), backend_options={"preset": "instant"}
    ) as w:
        _, err = await _ask(nc, 5, to_wire_dtype(x, "float16"), t, y, reply_dtype="float16")
        assert isinstance(err, ErrorReply) and err.code == ErrorCode.NON_FINITE and err.request_id == "w1"
        assert "velocity overflows float16" in err.message and "use float32" in err.message
        assert w.metrics.snapshot()["errors_by_code"].get("non_finite") == 1

        tr = NatsTransport(nc, step_timeout=10, wire_dtype="float16")
        v = await tr.velocity(5, x, t, y, ["a", "b"])
        assert v.dtype == np.float32 and np.isfinite(v).all() and np.abs(v).max() > 65504
        np.testing.assert_array_equal(v, w.backend.forward(x, t, y))  # the float32 retry, exact
        assert tr.wire_fallbacks == 1 and tr.bad_replies == 0

        x2, t2, y2 = _inputs(3, seed=2)
        v16 = await tr.velocity(5, x2, t2, y2, ["c", "d", "e"])  # an ordinary step stays float16
        np.testing.assert_allclose(v16, w.backend.forward(x2, t2, y2), rtol=2**-9, atol=2e-3)
        assert tr.wire_fallbacks == 1


def test_transport_refuses_an_unknown_wire_dtype():
    with pytest.raises(ValueError, match="wire_dtype"):
        NatsTransport(None, wire_dtype="float8")
