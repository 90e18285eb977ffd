"""Hedged expert requests: the latency estimator and the hedge decision (pure), then the
transport racing two hand-written responders of one queue group over a real nats-server."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from coordinator.hedging import HEDGE_FLOOR_S, HEDGE_MARGIN, HEDGE_START_S, HedgePolicy, LatencyWindow
from coordinator.reply_check import BadReply, ReplyError
from coordinator.transport import NatsTransport
from coordinator.try_legs import _worse
from schemas import ErrorCode, StepReply, StepRequest, pack, subjects, unpack
from tests.waiting import wait_until

EXPERT = 43  # a subject no other test serves


# ------------------------------------------------------------------ pure: estimator and decision


def test_latency_window_quantiles_are_nearest_rank_over_the_last_samples():
    w = LatencyWindow(size=100)
    assert w.quantile(0.99) is None
    for ms in range(1, 201):  # 1..200 ms; the window keeps 101..200
        w.add(ms / 1000)
    assert len(w) == 100
    assert w.quantile(0.99) == pytest.approx(0.199) and w.quantile(0.5) == pytest.approx(0.150)
    assert w.quantile(1.0) == pytest.approx(0.200)
    w.add(float("nan"))
    w.add(-1.0)
    assert len(w) == 100  # nonsense is not a latency


def _seen_two_workers(p: HedgePolicy, k: int, latencies) -> None:
    for i, s in enumerate(latencies):
        p.observe(k, s, f"w{i % 2}")


def test_no_hedge_without_two_workers_or_when_off():
    p = HedgePolicy()
    assert p.delay(0) is None  # nothing known yet
    for _ in range(50):
        p.observe(0, 0.01, "only-one")
    assert p.workers_seen(0) == 1 and p.delay(0) is None  # a copy would queue behind the original
    p.observe(0, 0.01, "another")
    assert p.delay(0) is not None
    off = HedgePolicy("off")
    _seen_two_workers(off, 0, [0.01] * 50)
    assert off.delay(0) is None


def test_delay_starts_patient_then_follows_p99_with_a_floor():
    p = HedgePolicy(min_samples=20)
    _seen_two_workers(p, 1, [0.2] * 19)
    assert p.delay(1) == HEDGE_START_S  # fewer than min_samples: the start value
    _seen_two_workers(p, 1, [0.2] * 80 + [0.5])  # 100 samples, one slow: p99 is 0.2, the max 0.5
    assert p.delay(1) == pytest.approx(HEDGE_MARGIN * 0.2)
    fast = HedgePolicy()
    _seen_two_workers(fast, 2, [0.001] * 100)
    assert fast.delay(2) == HEDGE_FLOOR_S  # never sooner than the floor
    fixed = HedgePolicy(after_s=0.3)
    _seen_two_workers(fixed, 3, [0.001] * 5)
    assert fixed.delay(3) == 0.3
    assert p.delay(7) is None  # experts are independent


def test_the_hedge_budget_is_a_token_bucket_per_expert():
    p = HedgePolicy(budget=0.25, burst=2)
    assert p.take(0) and p.take(0) and not p.take(0)  # starts full, 2 at once
    assert p.take(1)  # another expert's bucket
    for _ in range(3):
        p.on_request(0)
    assert not p.take(0)  # 0.75 tokens
    p.on_request(0)
    assert p.take(0) and not p.take(0)
    for _ in range(100):
        p.on_request(0)
    assert p.take(0) and p.take(0) and not p.take(0)  # capped at burst


def test_bad_hedge_options_are_refused():
    for kw in ({"mode": "always"}, {"after_s": 0}, {"quantile": 0}, {"burst": 0.5}, {"margin": 0.5}):
        with pytest.raises(ValueError):
            HedgePolicy(**kw)
    with pytest.raises(ValueError, match="hedge"):
        NatsTransport(None, hedge="sometimes")


def test_the_failure_reported_for_two_failed_legs_is_the_most_telling():
    import nats.errors

    timeout, none = nats.errors.TimeoutError(), nats.errors.NoRespondersError()
    reply = ReplyError(ErrorCode.OVERLOADED, "busy")
    assert _worse(None, timeout) is timeout
    assert _worse(timeout, none) is none and _worse(none, timeout) is none
    assert _worse(reply, timeout) is reply and _worse(timeout, reply) is reply
    bad = BadReply("NaN")
    assert _worse(reply, bad) is bad  # the later of two replies


# ------------------------------------------------------------------ the transport over a real nats-server


def _inputs(n):
    x = np.arange(n * 16, dtype=np.float32).reshape(n, 1, 4, 4)
    return x, np.full(n, 0.5, np.float32), np.zeros(n, np.int64), [f"r{i}" for i in range(n)]


async def test_a_late_request_is_hedged_to_the_other_worker_and_the_late_reply_dropped_quietly(nc):
    slow = {"on": False}
    seen: dict[str, list[str]] = {"fast": [], "slow": []}

    def responder(name: str):
        async def cb(msg):
            req = unpack(msg.data, StepRequest)
            seen[name].append(req.request_id)
            if name == "slow" and slow["on"]:
                await asyncio.sleep(0.8)
            reply = StepReply(expert=req.expert, velocity=-np.asarray(req.x_t), row_ids=req.row_ids, worker_id=name)
            await msg.respond(pack(reply))

        return cb

    subs = [
        await nc.subscribe(
            subjects.expert_velocity(EXPERT), queue=subjects.expert_queue_group(EXPERT), cb=responder(name)
        )
        for name in ("fast", "slow")
    ]
    tr = NatsTransport(nc, step_timeout=5, hedge_after_s=0.1)
    try:
        x, t, y, ids = _inputs(2)
        while tr.hedging.workers_seen(EXPERT) < 2:  # both workers answered at least once: hedging is on
            np.testing.assert_array_equal(await tr.velocity(EXPERT, x, t, y, ids), -x)
        assert tr.hedges_sent == 0  # nobody was late
        slow["on"] = True
        won = 0
        for _ in range(40):  # until the queue group hands a first try to the slow worker
            loop = asyncio.get_running_loop()
            started = loop.time()
            np.testing.assert_array_equal(await tr.velocity(EXPERT, x, t, y, ids), -x)
            if tr.hedge_counts.get((EXPERT, "won"), 0) > won:
                won += 1
                assert loop.time() - started < 0.6  # hedged after 0.1 s, not the slow worker's 0.8 s
                break
        assert won == 1, tr.hedge_counts
        # a copy carries its original's request_id (the slow worker may still be busy with older ones)
        await wait_until(lambda: set(seen["slow"]) & set(seen["fast"]), timeout=10, what="one id at both workers")
        # the slow worker's answer to the won try comes after the try ended: dropped, quietly
        await wait_until(lambda: tr.late_replies >= 1, timeout=10, what="the slow worker's late reply")
        assert tr.stray_replies == 0 and tr.bad_replies == 0 and tr.retried == 0
    finally:
        for s in subs:
            await s.unsubscribe()


async def test_hedge_off_waits_for_the_slow_worker(nc):
    async def cb(msg):
        req = unpack(msg.data, StepRequest)
        await asyncio.sleep(0.3)
        await msg.respond(
            pack(
                StepReply(
                    expert=req.expert,
                    velocity=-np.asarray(req.x_t),
                    row_ids=req.row_ids,
                    worker_id=f"w{len(req.row_ids)}",
                )
            )
        )

    sub = await nc.subscribe(subjects.expert_velocity(EXPERT), queue=subjects.expert_queue_group(EXPERT), cb=cb)
    tr = NatsTransport(nc, step_timeout=5, hedge="off", hedge_after_s=0.05)
    try:
        for n in (1, 2, 1, 2):  # two "workers" by id, always late: still no hedge
            x, t, y, ids = _inputs(n)
            np.testing.assert_array_equal(await tr.velocity(EXPERT, x, t, y, ids), -x)
        assert tr.hedges_sent == 0 and tr.requests_sent[EXPERT] == 4
    finally:
        await sub.unsubscribe()
