"""ExpertWorker on a real nats-server: replies, bad input, discovery, scaling out, parity, failures,
reconnects. Models are the real tiny UNet from the `tiny_expert_checkpoint` fixture."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import msgpack
import numpy as np
import pytest

from bus.nats_server import NatsServer, free_port
from schemas import ErrorCode, ErrorReply, StepReply, StepRequest, StepResult, encode_tensor, pack, subjects, unpack
from tests.waiting import wait_until
from workers.service import SERVICE_NAME, ExpertWorker

SUBJECT = subjects.expert_velocity(0)


def make_request(n: int = 3, seed: int = 0, **kw) -> StepRequest:
    rng = np.random.default_rng(seed)
    fields = dict(
        expert=0,
        x_t=rng.standard_normal((n, 1, 32, 32)).astype(np.float32),
        t=rng.uniform(0, 1, n).astype(np.float32),
        y=rng.integers(0, 10, n).astype(np.int64),
        row_ids=[f"r{i}" for i in range(n)],
        request_id="req-1",
    )
    fields.update(kw)
    return StepRequest(**fields)


def raw_request(**overrides) -> bytes:
    """A hand-built wire message (bypasses client-side validation), fields overridable."""
    n = 2
    msg = {
        "v": 1,
        "kind": "step_request",
        "expert": 0,
        "x_t": encode_tensor(np.zeros((n, 1, 32, 32), np.float32)),
        "t": encode_tensor(np.full(n, 0.5, np.float32)),
        "y": encode_tensor(np.zeros(n, np.int64)),
        "row_ids": [],
        "deadline": None,
        "request_id": "bad-1",
    }
    msg.update(overrides)
    return msgpack.packb(msg, use_bin_type=True)


async def ask(nc, data: bytes, subject: str = SUBJECT, timeout: float = 10.0):
    msg = await nc.request(subject, data, timeout=timeout)
    return unpack(msg.data, StepResult), msg


@pytest.fixture(scope="module")
async def worker(nats_url, tiny_expert_checkpoint):
    async with ExpertWorker(
        0,
        tiny_expert_checkpoint,
        "torch",
        nats_url=nats_url,
        buckets=(1, 2, 4, 8),
        max_request_rows=16,
        metrics_port=free_port(),
        metrics_host="127.0.0.1",
        dtype="float32",
    ) as w:
        yield w


async def test_good_request_gets_the_model_velocity(worker, nc):
    req = make_request(5)
    reply, _ = await ask(nc, pack(req))
    assert isinstance(reply, StepReply), reply
    ref = worker.backend.forward(np.array(req.x_t), np.array(req.t), np.array(req.y))
    np.testing.assert_allclose(reply.velocity, ref, atol=1e-5)
    assert reply.row_ids == req.row_ids and reply.expert == 0
    assert reply.backend == "torch" and reply.device == "cpu" and reply.worker_id == worker.worker_id
    assert reply.batch_rows == 5 and reply.compute_ms > 0  # torch on a CPU runs the rows unpadded


def _nan_x():
    x = np.zeros((2, 1, 32, 32), np.float32)
    x[1, 0, 3, 3] = np.nan
    return encode_tensor(x)


BAD_INPUTS = {
    "undecodable bytes": (b"\xc1\x00 not msgpack", ErrorCode.BAD_REQUEST),
    "not a map": (msgpack.packb([1, 2, 3]), ErrorCode.BAD_REQUEST),
    "unknown protocol version": (raw_request(v=99), ErrorCode.UNSUPPORTED_VERSION),
    "wrong expert id": (raw_request(expert=3), ErrorCode.UNKNOWN_EXPERT),
    "wrong H/W for the model": (
        raw_request(x_t=encode_tensor(np.zeros((2, 1, 16, 16), np.float32))),
        ErrorCode.BAD_SHAPE,
    ),
    "wrong channels for the model": (
        raw_request(x_t=encode_tensor(np.zeros((2, 3, 32, 32), np.float32))),
        ErrorCode.BAD_SHAPE,
    ),
    "x not 4-d": (raw_request(x_t=encode_tensor(np.zeros((2, 32, 32), np.float32))), ErrorCode.BAD_SHAPE),
    "t length mismatch": (raw_request(t=encode_tensor(np.zeros(3, np.float32))), ErrorCode.BAD_SHAPE),
    "integer x": (raw_request(x_t=encode_tensor(np.zeros((2, 1, 32, 32), np.int32))), ErrorCode.BAD_DTYPE),
    "float labels": (raw_request(y=encode_tensor(np.zeros(2, np.float32))), ErrorCode.BAD_DTYPE),
    "NaN in x": (raw_request(x_t=_nan_x()), ErrorCode.NON_FINITE),
    "label out of range": (raw_request(y=encode_tensor(np.array([0, 10], np.int64))), ErrorCode.BAD_REQUEST),
    "t outside [0, 1]": (raw_request(t=encode_tensor(np.array([0.5, 1.5], np.float32))), ErrorCode.BAD_REQUEST),
    "rows over the worker limit": (
        raw_request(
            x_t=encode_tensor(np.zeros((17, 1, 32, 32), np.float32)),
            t=encode_tensor(np.zeros(17, np.float32)),
            y=encode_tensor(np.zeros(17, np.int64)),
        ),
        ErrorCode.TOO_LARGE,
    ),
    "deadline already passed": (raw_request(deadline=time.time() - 5), ErrorCode.DEADLINE_EXCEEDED),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
async def test_bad_input_gets_an_error_reply_and_the_worker_keeps_serving(worker, nc, case):
    data, code = BAD_INPUTS[case]
    reply, msg = await ask(nc, data)
    assert isinstance(reply, ErrorReply), reply
    assert reply.code == code, reply.message
    assert reply.message
    assert msg.headers and msg.headers.get("Nats-Service-Error-Code") == code.value
    good, _ = await ask(nc, pack(make_request(2)))
    assert isinstance(good, StepReply)


async def test_error_reply_echoes_the_request_id(worker, nc):
    reply, _ = await ask(nc, raw_request(expert=9, request_id="abc-7"))
    assert isinstance(reply, ErrorReply) and reply.request_id == "abc-7"


async def test_large_request_is_split_and_answered_whole(worker, nc):
    req = make_request(13, seed=4)  # over the largest bucket (8): chunks of 8 + 5
    reply, _ = await ask(nc, pack(req))
    assert isinstance(reply, StepReply) and reply.velocity.shape == (13, 1, 32, 32)
    ref = worker.backend.forward(np.array(req.x_t), np.array(req.t), np.array(req.y))
    np.testing.assert_allclose(reply.velocity, ref, atol=1e-5)


async def test_concurrent_requests_are_batched(nats_url, tiny_expert_checkpoint, nc):
    # merge="always": requests queued behind a running pass ride in the next one. The default
    # ("auto") merges on a CPU only where its timings say one pass is cheaper than two, which on a
    # tiny model on a busy machine can go either way (its decisions: tests/workers/test_batcher.py).
    # inline_forward_ms=0: every pass in the model thread, so requests arrive while one runs (a tiny
    # model's pass on the event loop holds arrivals back until it ends; on a loaded box each request
    # could then get a pass of its own)
    async with ExpertWorker(
        0,
        tiny_expert_checkpoint,
        "torch",
        nats_url=nats_url,
        buckets=(1, 2, 4, 8),
        max_request_rows=16,
        merge="always",
        dtype="float32",
        inline_forward_ms=0,
    ) as worker:
        before = worker.metrics.batches
        reqs = [make_request(1, seed=i) for i in range(8)]
        replies = await asyncio.gather(*(ask(nc, pack(r)) for r in reqs))
        for r, (rep, _) in zip(reqs, replies):
            assert isinstance(rep, StepReply)
            ref = worker.backend.forward(np.array(r.x_t), np.array(r.t), np.array(r.y))
            np.testing.assert_allclose(rep.velocity, ref, atol=1e-5)
        assert worker.metrics.batches - before < 8  # some rode together
        assert max(rep.batch_rows for rep, _ in replies) > 1


async def test_discovery_ping_info_stats(worker, nc):
    sid = worker.service_id
    ping = json.loads((await nc.request(f"$SRV.PING.{SERVICE_NAME}.{sid}", b"", timeout=5)).data)
    assert ping["metadata"]["expert"] == "0" and ping["metadata"]["backend"] == "torch"
    info = json.loads((await nc.request(f"$SRV.INFO.{SERVICE_NAME}.{sid}", b"", timeout=5)).data)
    md = info["metadata"]
    assert md["device"] == "cpu" and md["buckets"] == "1,2,4,8" and md["version"] and md["protocol"] == "1"
    assert md["input_shape"] == "1,32,32"
    assert md["dtype"] == md["precision"] == "float32"  # what it computes in (this fixture pins float32)
    from schemas.spec import ModelSpec  # the model spec travels as compact JSON; an old checkpoint's is implied

    spec = ModelSpec.from_json(json.loads(md["spec"]))
    assert spec.sample_shape == (1, 32, 32) and spec.num_classes == 10 and spec.space == "pixels"
    ep, direct = info["endpoints"]  # the queue group's, and this worker's own subject
    assert ep["subject"] == SUBJECT and ep["queue_group"] == subjects.expert_queue_group(0)
    assert direct["subject"] == subjects.expert_direct(0, subjects.worker_token(worker.worker_id))
    assert direct["subject"] == worker.direct_subject == md["direct_subject"] and direct["name"] == "direct"
    await ask(nc, pack(make_request(2)))
    stats = json.loads((await nc.request(f"$SRV.STATS.{SERVICE_NAME}.{sid}", b"", timeout=5)).data)
    data = stats["endpoints"][0]["data"]
    assert data["requests"] >= 1 and data["replies"] >= 1 and data["batches"] >= 1
    assert "batch_size" in data and "padding_fraction" in data and "compute_seconds" in data


async def test_prometheus_endpoint(worker, nc):
    import aiohttp

    await ask(nc, pack(make_request(2)))
    async with aiohttp.ClientSession() as s:
        async with s.get(f"http://127.0.0.1:{worker.metrics_port}/metrics") as r:
            body = await r.text()
    assert r.status == 200
    from prometheus_client.parser import text_string_to_metric_families

    fams = {f.name: f for f in text_string_to_metric_families(body)}  # valid exposition, conventional names
    (requests,) = [s for s in fams["ddm_worker_requests"].samples if s.name == "ddm_worker_requests_total"]
    assert requests.labels == {"backend": "torch", "expert": "0"} and requests.value >= 1
    assert fams["ddm_worker_padding_ratio"].type == "histogram" and "ddm_worker_forward_seconds" in fams


async def test_two_workers_of_one_expert_share_the_work(worker, nc, nats_url, tiny_expert_checkpoint):
    async with ExpertWorker(
        0, tiny_expert_checkpoint, "torch", nats_url=nats_url, buckets=(1, 2, 4, 8), dtype="float32"
    ) as second:
        replies = await asyncio.gather(*(ask(nc, pack(make_request(2, seed=i))) for i in range(24)))
        ids = {rep.worker_id for rep, _ in replies}
        assert ids == {worker.worker_id, second.worker_id}
        assert second.metrics.requests > 0


async def test_checkpoint_for_another_expert_is_refused(nats_url, tiny_expert_checkpoint):
    with pytest.raises(ValueError, match="is for expert 0, not expert 2"):
        async with ExpertWorker(2, tiny_expert_checkpoint, "torch", nats_url=nats_url, buckets=(1,), dtype="float32"):
            pass


async def test_torch_and_jax_workers_answer_with_the_same_velocity(worker, nc, tiny_expert_checkpoint):
    import nats

    req = make_request(5, seed=11)
    torch_reply, _ = await ask(nc, pack(req))
    with NatsServer() as srv:  # a private bus so the request certainly reaches the jax worker
        async with ExpertWorker(0, tiny_expert_checkpoint, "jax", nats_url=srv.url, buckets=(8,), dtype="float32"):
            nc2 = await nats.connect(srv.url)
            try:
                jax_reply, _ = await ask(nc2, pack(req), timeout=60)
            finally:
                await nc2.close()
    assert isinstance(torch_reply, StepReply) and isinstance(jax_reply, StepReply)
    assert torch_reply.backend == "torch" and jax_reply.backend == "jax"
    np.testing.assert_allclose(jax_reply.velocity, torch_reply.velocity, atol=1e-4, rtol=0)


class FlakyTorchBackend:
    """The real torch backend, made to fail (t == 0.125) or be slow (t == 0.875) on cue;
    `slow_started` (a threading.Event) is set when a slow forward pass begins."""

    def __new__(cls, checkpoint):
        from workers.backends.torch_backend import TorchBackend

        class Flaky(TorchBackend):
            def _forward(self, x, t, y):
                if np.any(t == np.float32(0.125)):
                    raise RuntimeError("simulated device fault")
                if np.any(t == np.float32(0.875)):
                    self.slow_started.set()
                    time.sleep(1.0)  # kept: the simulated compute time that keeps the worker busy
                return super()._forward(x, t, y)

        be = Flaky()
        be.slow_started = threading.Event()
        be.load(checkpoint)
        return be


@pytest.mark.bus
async def test_model_failure_is_an_internal_error_and_the_loop_stays_responsive(tiny_expert_checkpoint):
    import nats

    with NatsServer() as srv:
        be = FlakyTorchBackend(tiny_expert_checkpoint)
        # a forward far over its estimate: the loop answers meanwhile only if it runs in the model thread
        async with ExpertWorker(
            0, tiny_expert_checkpoint, be, nats_url=srv.url, buckets=(1, 2, 4), inline_forward_ms=0
        ) as w:
            nc = await nats.connect(srv.url)
            try:
                bad, _ = await ask(nc, pack(make_request(2, t=np.full(2, 0.125, np.float32))))
                assert isinstance(bad, ErrorReply) and bad.code == ErrorCode.INTERNAL
                assert "simulated device fault" in bad.message
                ok, _ = await ask(nc, pack(make_request(2)))
                assert isinstance(ok, StepReply)
                # a slow batch runs in the executor: PING still answers quickly meanwhile
                slow = asyncio.create_task(ask(nc, pack(make_request(1, t=np.full(1, 0.875, np.float32)))))
                await wait_until(be.slow_started.is_set, timeout=30, what="the slow forward pass to start")
                start = time.perf_counter()
                await nc.request(f"$SRV.PING.{SERVICE_NAME}.{w.service_id}", b"", timeout=2)
                assert time.perf_counter() - start < 0.5
                assert not slow.done()
                assert isinstance((await slow)[0], StepReply)
                assert w.metrics.errors.get("internal") == 1
            finally:
                await nc.close()


@pytest.mark.bus
async def test_expired_while_queued_is_dropped_not_computed(tiny_expert_checkpoint):
    import nats

    with NatsServer() as srv:
        be = FlakyTorchBackend(tiny_expert_checkpoint)
        async with ExpertWorker(
            0, tiny_expert_checkpoint, be, nats_url=srv.url, buckets=(1, 2, 4), max_batch=1, inline_forward_ms=0
        ) as w:
            nc = await nats.connect(srv.url)
            try:
                slow = asyncio.create_task(ask(nc, pack(make_request(1, t=np.full(1, 0.875, np.float32)))))
                await wait_until(be.slow_started.is_set, timeout=30, what="the slow forward pass to start")
                # the worker is now busy for ~1 s
                late = make_request(1, deadline=time.time() + 0.2)
                batches_before = w.metrics.batches
                reply, _ = await ask(nc, pack(late))
                assert isinstance(reply, ErrorReply) and reply.code == ErrorCode.DEADLINE_EXCEEDED
                await slow
                assert w.metrics.batches == batches_before + 1  # only the slow one ran
            finally:
                await nc.close()


@pytest.mark.bus
async def test_worker_reconnects_after_a_server_restart(tiny_expert_checkpoint):
    import nats

    srv = NatsServer().start()
    try:
        async with ExpertWorker(
            0, tiny_expert_checkpoint, "torch", nats_url=srv.url, buckets=(1, 2), reconnect_wait=0.2, dtype="float32"
        ):
            nc = await nats.connect(srv.url, reconnect_time_wait=0.2, max_reconnect_attempts=-1)
            try:
                assert isinstance((await ask(nc, pack(make_request(2))))[0], StepReply)
                srv.restart()

                async def answered():
                    try:
                        return (await ask(nc, pack(make_request(2)), timeout=1))[0]
                    except Exception:  # not reconnected yet (no responders, timeout, disconnected)
                        return None

                reply = await wait_until(answered, timeout=20, interval=0.2, what="a reply after the restart")
                assert isinstance(reply, StepReply)
            finally:
                await nc.close()
    finally:
        srv.stop()


@pytest.mark.bus
async def test_full_queue_answers_overloaded_at_once(tiny_expert_checkpoint):
    import nats

    with NatsServer() as srv:
        be = FlakyTorchBackend(tiny_expert_checkpoint)
        async with ExpertWorker(
            0,
            tiny_expert_checkpoint,
            be,
            nats_url=srv.url,
            buckets=(1, 2),
            max_batch=1,
            max_queue_rows=2,
            inline_forward_ms=0,  # the slow forward in the model thread: the loop queues and refuses meanwhile
        ) as w:
            nc = await nats.connect(srv.url)
            try:
                slow = asyncio.create_task(ask(nc, pack(make_request(1, t=np.full(1, 0.875, np.float32)))))
                await wait_until(be.slow_started.is_set, timeout=30, what="the slow forward pass to start")
                # running (not queued) for ~1 s: the two below must queue well within it
                queued = [asyncio.create_task(ask(nc, pack(make_request(1, seed=i)))) for i in range(2)]
                await wait_until(lambda: w._batcher.queued_rows == 2, timeout=0.8, what="two rows queued")
                start = time.perf_counter()
                reply, _ = await ask(nc, pack(make_request(1)))
                assert isinstance(reply, ErrorReply) and reply.code == ErrorCode.OVERLOADED
                assert time.perf_counter() - start < 0.6  # refused without waiting for the queue
                results = await asyncio.gather(slow, *queued)
                assert all(isinstance(r, StepReply) for r, _ in results)
            finally:
                await nc.close()


async def test_messages_without_a_reply_subject_are_ignored_safely(worker, nc):
    await nc.publish(SUBJECT, b"\xc1 garbage, nobody to answer")
    await nc.publish(SUBJECT, pack(make_request(2)))
    await nc.flush()
    reply, _ = await ask(nc, pack(make_request(2)))
    assert isinstance(reply, StepReply)


def test_worker_resolves_dtype_auto_for_its_device_and_advertises_it(tiny_expert_checkpoint):
    """`dtype="auto"` (the default) becomes what this CPU computes natively, in the backend and in the
    service metadata; an explicit dtype and the older `bf16=` keyword are kept as asked."""
    from models.precision import resolve_dtype

    want = resolve_dtype("auto", backend="torch", device="cpu")
    for kwargs, expected in (({}, want), ({"dtype": "bfloat16"}, "bfloat16"), ({"bf16": False}, "float32")):
        w = ExpertWorker(0, tiny_expert_checkpoint, "torch", buckets=(1,), **kwargs)
        w._prepare_backend()
        assert w.backend.dtype == expected and w.metadata()["dtype"] == expected, kwargs
    with pytest.raises(ValueError, match="unknown dtype 'float16'"):
        ExpertWorker(0, tiny_expert_checkpoint, dtype="float16")


def test_worker_arguments_are_validated(tiny_expert_checkpoint):
    with pytest.raises(ValueError, match="non-negative int"):
        ExpertWorker(-1, tiny_expert_checkpoint)
    with pytest.raises(ValueError, match="checkpoint=PATH"):
        ExpertWorker(0, None, "torch")
    with pytest.raises(ValueError, match="max_queue_rows"):
        ExpertWorker(0, tiny_expert_checkpoint, max_queue_rows=0)
    with pytest.raises(ValueError, match="largest bucket"):
        ExpertWorker(0, tiny_expert_checkpoint, buckets=(1, 2), max_batch=4, dtype="float32")
