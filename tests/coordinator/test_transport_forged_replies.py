"""Forged expert replies never reach an image (issue 15).

A real nats-server, real tiny expert workers, a Coordinator through its Python API, and a second
NATS client (the forger) that sees every expert request (as a malicious worker of that expert, or
any client on an open bus, would) and answers with a finite, well-formed but wrong velocity on
the reply subjects it can construct: the observed reply prefix with other tokens (random ones and
NUID-like ones), and, once the real reply has gone by, the observed subject itself (a replay).
The job's images must equal a run without the forger, and every forgery must be dropped.
"""

from __future__ import annotations

import asyncio
import secrets

import numpy as np
import pytest

from bus.connect import flushed
from client.jobs import run_job
from coordinator.local_fleet import LabelRouter
from coordinator.service import Coordinator
from coordinator.transport import NatsTransport
from schemas import JobRequest, StepReply, StepRequest, pack, subjects, unpack
from tests.coordinator.helpers import start_workers, stop_workers

pytestmark = pytest.mark.timeout(120)

C2E = [0] * 5 + [1] * 5
FORGED_V = 7.5  # a finite velocity far from anything the tiny experts answer


class Forger:
    """Watches ddm.v1.expert.*.velocity (not in the queue group), every worker's direct subject
    ddm.v1.expert.*.velocity.* and `_INBOX.>` (open bus), and
    publishes forged StepReplies: `guesses` per observed request on the observed prefix with another
    token, and one replay on the observed subject after the real reply to it has gone by."""

    def __init__(self, nc, guesses: int = 3):
        self.nc = nc
        self.guesses = guesses
        self.requests: dict[str, StepRequest] = {}  # reply subject -> request
        self.forged = 0  # forgeries published to a subject under a reply prefix
        self.replayed = 0

    def _forgery(self, req: StepRequest) -> bytes:
        v = np.full(np.asarray(req.x_t).shape, FORGED_V, np.float32)
        return pack(StepReply(expert=req.expert, velocity=v, row_ids=list(req.row_ids), worker_id="forger"))

    async def start(self) -> None:
        await self.nc.subscribe(subjects.ALL_EXPERTS, cb=self._on_request)
        await self.nc.subscribe(subjects.ALL_EXPERTS_DIRECT, cb=self._on_request)  # one worker's requests
        await self.nc.subscribe("_INBOX.>", cb=self._on_reply)
        await flushed(self.nc)

    async def _on_request(self, msg) -> None:
        if not msg.reply:
            return
        req = unpack(msg.data, StepRequest)
        self.requests[msg.reply] = req
        prefix, token = msg.reply.rsplit(".", 1)
        data = self._forgery(req)
        guesses = [secrets.token_hex(16) for _ in range(self.guesses)]
        guesses.append(token[:-1] + ("0" if token[-1] != "0" else "1"))  # one bit off the real token
        guesses.append(self.nc._nuid.next().decode())  # what nats-py's own mux tokens look like
        for g in guesses:
            await self.nc.publish(f"{prefix}.{g}", data)
            self.forged += 1
        await self.nc.flush()

    async def _on_reply(self, msg) -> None:
        req = self.requests.pop(msg.subject, None)
        if req is None:  # our own forgeries, or replies of other tests
            return
        await self.nc.publish(msg.subject, self._forgery(req))  # after the real one: a duplicate
        self.replayed += 1
        self.forged += 1


async def _images(nats_url, nc, request: JobRequest, forger: Forger | None = None):
    """(images, transport, the stray-reply count on the coordinator's GET /metrics)."""
    async with Coordinator(
        LabelRouter(C2E, 2), num_experts=2, class_to_expert=C2E, nats_url=nats_url, step_timeout=10, metrics_port=0
    ) as coord:
        assert isinstance(coord.transport, NatsTransport)
        done = await run_job(nc, request, timeout=60)
        if forger is not None:  # let the last forgeries arrive before reading the counters
            await forger.nc.flush()
            await asyncio.sleep(0.2)
        scraped = await asyncio.to_thread(_scraped, coord.metrics_port, "ddm_coordinator_expert_stray_replies_total")
        return np.asarray(done.images), coord.transport, scraped


def _scraped(port: int, series: str) -> float:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(series + " ")]
    assert len(values) == 1, (series, values)
    return values[0]


async def test_forged_replies_never_reach_an_image(nats_url, nc, tiny_experts):
    import nats

    ws = await start_workers(nats_url, tiny_experts, dtype="float32")
    try:
        request = JobRequest(digits=[1, 3, 7, 8], steps=4, seed=11, strategy="full", solver="euler")
        clean, clean_tr, clean_scraped = await _images(nats_url, nc, request)
        assert clean_tr.stray_replies == 0 and clean_scraped == 0

        forger_nc = await nats.connect(nats_url, name="forger")
        try:
            forger = Forger(forger_nc)
            await forger.start()
            forged, tr, scraped = await _images(nats_url, nc, request, forger)
        finally:
            await forger_nc.drain()
    finally:
        await stop_workers(ws)

    assert forger.requests or forger.replayed, "the forger never saw a request: the test proves nothing"
    assert forger.forged >= 5 * 2 * 4 and forger.replayed >= 1
    # every forgery reached the coordinator's reply subscription and was dropped there
    assert tr.stray_replies == forger.forged
    assert scraped == forger.forged  # and counted on the coordinator's /metrics
    assert tr.bad_replies == 0 and tr.retried == 0
    np.testing.assert_allclose(forged, clean, rtol=0, atol=1e-5)
    # and the forged velocity would have shown: one Euler step of 7.5 moves pixels by >1
    assert np.abs(clean).max() < FORGED_V


async def test_reply_on_an_unknown_token_is_dropped_and_counted(nc):
    """The transport's mux alone: a message on a token it never handed out is dropped; a real
    reply is accepted once, and a second reply on the same subject is dropped too."""
    expert = 43
    seen: list[str] = []

    async def respond(msg):
        seen.append(msg.reply)
        req = unpack(msg.data, StepRequest)
        prefix = msg.reply.rsplit(".", 1)[0]
        bad = pack(
            StepReply(
                expert=expert,
                velocity=np.full(np.asarray(req.x_t).shape, 9.0, np.float32),
                row_ids=req.row_ids,
                worker_id="forger",
            )
        )
        await nc.publish(f"{prefix}.{secrets.token_hex(16)}", bad)  # guessed token: dropped
        await nc.publish(msg.reply, pack(StepReply(expert=expert, velocity=-np.asarray(req.x_t), row_ids=req.row_ids)))
        await nc.publish(msg.reply, bad)  # second reply on the real subject: dropped

    sub = await nc.subscribe(subjects.expert_velocity(expert), queue=subjects.expert_queue_group(expert), cb=respond)
    try:
        tr = NatsTransport(nc, step_timeout=5)
        x = np.arange(32, dtype=np.float32).reshape(2, 1, 4, 4)
        v = await tr.velocity(expert, x, np.full(2, 0.5, np.float32), np.zeros(2, np.int64), ["a", "b"])
        np.testing.assert_array_equal(v, -x)
        await nc.flush()
        for _ in range(50):
            if tr.stray_replies >= 2:
                break
            await asyncio.sleep(0.02)
        assert tr.stray_replies == 2
        token = seen[0].rsplit(".", 1)[1]
        assert len(token) == 32 and int(token, 16) >= 0  # 128 random bits, hex
        assert not tr.mux._pending  # nothing left waiting
    finally:
        await sub.unsubscribe()


def test_bad_workers_is_bounded():
    from coordinator.transport import BoundedCounter

    c = BoundedCounter(3)
    for i in range(10):
        c[f"w{i}"] += 1
    c["w9"] += 1
    assert list(c) == ["w7", "w8", "w9"] and c["w9"] == 2 and c["nobody"] == 0
    assert c.most_common(1) == [("w9", 2)]
    tr = NatsTransport(None)
    for i in range(10_000):
        tr.bad_workers[f"claimed-{i}"] += 1
    assert len(tr.bad_workers) <= 256
