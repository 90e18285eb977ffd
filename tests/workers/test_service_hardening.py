"""Worker defaults and bounds from issue 15, on a real nats-server with the real tiny UNet:
metrics bind loopback unless told otherwise, replies go only to `_INBOX` subjects, and the
number of requests a worker holds is bounded (past it: `overloaded`)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from bus.nats_server import free_port
from schemas import ErrorCode, ErrorReply, StepReply, StepRequest, StepResult, pack, subjects, unpack
from schemas.subjects import is_reply_inbox  # the rule the worker applies
from tests.waiting import wait_until
from workers.metrics_http import DEFAULT_METRICS_HOST
from workers.service import ExpertWorker

SUBJECT = subjects.expert_velocity(0)


def _request(n: int = 2, request_id: str = "q") -> bytes:
    rng = np.random.default_rng(0)
    return pack(
        StepRequest(
            expert=0,
            x_t=rng.standard_normal((n, 1, 32, 32)).astype(np.float32),
            t=np.full(n, 0.5, np.float32),
            y=np.zeros(n, np.int64),
            row_ids=[f"r{i}" for i in range(n)],
            request_id=request_id,
        )
    )


def test_inbox_subjects():
    for ok in ("_INBOX.abc.def", "_INBOX_web.x", "_INBOX_client-1.a.b"):
        assert is_reply_inbox(ok), ok
    for bad in ("", "ddm.v1.jobs.j1.events", "_INBOX", "_INBOXfoo.x", "_INBOX_", "_inbox.x", "x._INBOX.y"):
        assert not is_reply_inbox(bad), bad


async def test_metrics_bind_loopback_by_default(nats_url, tiny_expert_checkpoint):
    assert DEFAULT_METRICS_HOST == "127.0.0.1"
    async with ExpertWorker(
        0, tiny_expert_checkpoint, "torch", nats_url=nats_url, buckets=(1, 2), metrics_port=free_port()
    ) as w:
        hosts = {addr[0] for addr in w._metrics_runner.addresses}
    assert hosts == {"127.0.0.1"}


async def test_reply_subject_outside_inbox_is_dropped(nats_url, nc, tiny_expert_checkpoint):
    """A request whose reply subject is another client's events subject is never answered there;
    the worker keeps serving proper requests."""
    victim = "ddm.v1.jobs.victim-job.events"
    got: list = []

    async def on_victim(msg):
        got.append(msg)

    sub = await nc.subscribe(victim, cb=on_victim)
    port = free_port()
    async with ExpertWorker(
        0, tiny_expert_checkpoint, "torch", nats_url=nats_url, buckets=(1, 2), metrics_port=port
    ) as w:
        await nc.publish(SUBJECT, _request(), reply=victim)
        await nc.publish(SUBJECT, _request(), reply="_INBOXevil.x")
        await nc.flush()
        await wait_until(lambda: w.dropped_requests == 2, timeout=10)
        assert await asyncio.to_thread(_scraped, port, "ddm_worker_requests_dropped_total") == 2  # on /metrics
        msg = await nc.request(SUBJECT, _request(), timeout=10)  # an _INBOX reply still works
        assert isinstance(unpack(msg.data, StepResult), StepReply)
        await asyncio.sleep(0.2)
    await sub.unsubscribe()
    assert got == [] and w.metrics.replies == 1


def _scraped(port: int, series: str) -> float:
    """The value of `series` (any labels) on GET http://127.0.0.1:port/metrics."""
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(series)]
    assert len(values) == 1, (series, values)
    return values[0]


async def test_held_requests_are_bounded(nats_url, nc, tiny_expert_checkpoint):
    """max_inflight=1: requests that arrive while one is held are refused `overloaded` at once."""
    with pytest.raises(ValueError, match="max_inflight"):
        ExpertWorker(0, tiny_expert_checkpoint, "torch", max_inflight=0)
    async with ExpertWorker(0, tiny_expert_checkpoint, "torch", nats_url=nats_url, buckets=(1, 2), max_inflight=1) as w:
        replies = await asyncio.gather(
            *(nc.request(SUBJECT, _request(request_id=f"q{i}"), timeout=10) for i in range(6))
        )
        results = [unpack(m.data, StepResult) for m in replies]
        assert len(w._inflight) <= 1
    ok = [r for r in results if isinstance(r, StepReply)]
    refused = [r for r in results if isinstance(r, ErrorReply)]
    assert ok and refused, results
    assert all(r.code == ErrorCode.OVERLOADED and "limit 1" in r.message for r in refused)


async def test_coordinator_metrics_use_the_same_loopback_default(nats_url):
    """The coordinator serves /metrics with the same helper and the same default interface."""
    from coordinator.local_fleet import LabelRouter
    from coordinator.service import Coordinator

    async with Coordinator(LabelRouter([0] * 10, 1), num_experts=1, nats_url=nats_url, metrics_port=0) as coord:
        assert coord.endpoint.host == DEFAULT_METRICS_HOST
        hosts = {addr[0] for addr in coord.endpoint._runner.addresses}
    assert hosts == {"127.0.0.1"}
