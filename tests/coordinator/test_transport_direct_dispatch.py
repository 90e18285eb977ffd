"""Join-shortest-queue dispatch over a real nats-server: one NatsTransport, real sim workers of one
expert (each serving its queue group and its own direct subject), and hand-written responders for
workers that lack a direct subject or hang on it."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from bus.connect import flushed
from coordinator.errors import ExpertUnavailable
from coordinator.transport import NatsTransport
from schemas import ErrorCode, ErrorReply, StepReply, StepRequest, StepResult, pack, subjects, unpack
from tests.coordinator.helpers import make_tiny_experts

pytestmark = pytest.mark.timeout(120)

ROUND = 6  # concurrent requests per round: 2 per worker, the dispatch depth
ROUNDS = 40


@pytest.fixture(scope="module")
def expert0(tmp_path_factory):
    return make_tiny_experts(tmp_path_factory.mktemp("jsq-experts"), 1)[0]


@pytest.fixture
async def workers(nats_url, expert0):
    from workers.backends import get_backend
    from workers.service import ExpertWorker

    ws = []
    try:
        for _ in range(3):  # 20 ms per batch: a round's requests overlap at the workers
            w = ExpertWorker(
                expert=0,
                checkpoint=expert0,
                nats_url=nats_url,
                buckets=(1, 2, 4, 8),
                backend=get_backend("sim", preset="instant", batch_ms=20.0),
            )
            await w.start()
            ws.append(w)
        yield ws
    finally:
        for w in ws:
            await w.stop()


def _inputs(n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    return (
        rng.standard_normal((n, 1, 32, 32)).astype(np.float32),
        rng.uniform(0, 1, n).astype(np.float32),
        rng.integers(0, 5, n).astype(np.int64),
        [f"r{seed}-{i}" for i in range(n)],
    )


async def _round(tr: NatsTransport, seed: int) -> None:
    calls = [tr.velocity(0, *_inputs(1, seed * ROUND + i)) for i in range(ROUND)]
    outs = await asyncio.gather(*calls)
    assert all(v.shape == (1, 1, 32, 32) and np.isfinite(v).all() for v in outs)


async def _learn_all(tr: NatsTransport, n: int) -> None:
    """Rounds until the transport knows all n workers (learned from queue-group replies)."""
    for i in range(50):
        if len(tr.dispatcher.known(0)) == n:
            return
        await _round(tr, 10_000 + i)
    raise AssertionError(f"the transport learned {tr.dispatcher.known(0)} of {n} workers in 50 rounds")


async def test_a_worker_serves_its_direct_subject_with_the_same_checks_until_it_stops(nc, workers):
    import nats.errors

    w = workers[0]
    assert w.direct_subject == subjects.expert_direct(0, subjects.worker_token(w.worker_id))
    x, t, y, ids = _inputs(3, 5)
    msg = await nc.request(w.direct_subject, pack(StepRequest(expert=0, x_t=x, t=t, y=y, row_ids=ids)), timeout=10)
    reply = unpack(msg.data, StepResult)
    assert isinstance(reply, StepReply) and reply.worker_id == w.worker_id and reply.row_ids == ids
    np.testing.assert_array_equal(reply.velocity, w.backend.forward(x, t, y))
    wrong = await nc.request(w.direct_subject, pack(StepRequest(expert=1, x_t=x, t=t, y=y)), timeout=10)
    refused = unpack(wrong.data, StepResult)
    assert isinstance(refused, ErrorReply) and refused.code == ErrorCode.UNKNOWN_EXPERT
    await w.stop()
    with pytest.raises(nats.errors.NoRespondersError):  # gone from its direct subject with the queue group
        await nc.request(w.direct_subject, pack(StepRequest(expert=0, x_t=x, t=t, y=y)), timeout=5)
    msg = await nc.request(subjects.expert_velocity(0), pack(StepRequest(expert=0, x_t=x, t=t, y=y)), timeout=10)
    assert unpack(msg.data, StepResult).worker_id in {o.worker_id for o in workers[1:]}


async def test_requests_in_flight_spread_evenly_over_the_workers(nc, workers):
    """Rounds of 6 concurrent requests over 3 workers. Join-shortest-queue gives each worker at most
    2 direct requests per round (depth 2) plus at most one exploring request (every 8th pick goes to
    the queue group: at most one of 6), so no worker ever holds 4 of a round's 6. Random assignment
    (the queue group alone) gives some worker >= 4 of 6 with probability 3 * P(Bin(6, 1/3) >= 4)
    = 3 * 73/729 = 0.300 per round; it would pass all 40 rounds with probability 0.700^40 = 6e-7.
    Over the whole run, each worker's share is within 20% of the mean (random: std 7.3 on a mean of
    80; the exploring requests alone, ~30, move a share by at most 30)."""
    tr = NatsTransport(nc, step_timeout=10, retries=0, hedge="off")
    await _learn_all(tr, len(workers))
    tokens = {subjects.worker_token(w.worker_id): w for w in workers}
    assert set(tr.dispatcher.known(0)) == set(tokens)
    before = [w.metrics.requests for w in workers]
    worst = []
    for r in range(ROUNDS):
        start = [w.metrics.requests for w in workers]
        await _round(tr, r)
        got = [w.metrics.requests - s for w, s in zip(workers, start)]
        assert sum(got) == ROUND
        worst.append(max(got))
        assert all(tr.dispatcher.outstanding(0, t) == 0 for t in tokens)  # every sent was finished
    totals = [w.metrics.requests - b for w, b in zip(workers, before)]
    mean = ROUNDS * ROUND / len(workers)
    print(f"\nper-round busiest worker: {sorted(worst)}; totals {totals}; legs {dict(tr.dispatch_counts)}")
    assert max(worst) <= 3, worst
    assert all(abs(n - mean) <= 0.2 * mean for n in totals), totals
    direct, queued = tr.dispatch_counts.get((0, "direct"), 0), tr.dispatch_counts.get((0, "queue"), 0)
    assert direct >= 0.8 * ROUNDS * ROUND and tr.direct_fallbacks == 0
    assert tr.retried == 0 and tr.bad_replies == 0 and queued > 0  # exploration kept going
    assert tr.workers_per_expert() == len(workers)  # what the engine's cohorts="auto" reads


async def test_a_worker_that_stops_mid_run_costs_no_request(nc, workers):
    """No retries, no hedges: a request that went to the stopping worker and was not answered would
    fail its round. Its held direct requests are answered while it drains; later direct requests
    meet "no responders" and go to the queue group at once; the worker is forgotten."""
    tr = NatsTransport(nc, step_timeout=10, retries=0, hedge="off")
    await _learn_all(tr, len(workers))
    victim = workers[0]
    token = subjects.worker_token(victim.worker_id)

    async def rounds(n: int, first: int) -> None:
        for r in range(n):
            await _round(tr, first + r)

    load = asyncio.create_task(rounds(30, 0))
    await _round(tr, 999)  # the victim is stopped while rounds are in flight
    await victim.stop()
    served = victim.metrics.requests
    await load  # raises if any request failed
    await rounds(5, 100)
    assert tr.direct_fallbacks >= 1 and token not in tr.dispatcher.known(0)
    assert victim.metrics.requests == served  # nothing reached it after its stop
    assert tr.retried == 0 and tr.dispatcher.outstanding(0, token) == 0


class Responder:
    """A hand-written worker of `expert` in the queue group, `worker_id` in its replies;
    `direct`: also subscribe its direct subject, where it answers only while `hang` is False
    (default True: a worker hung on its direct subject); `queue_hang`: it never answers its queue group either."""

    def __init__(
        self, nc, expert: int, worker_id: str, direct: bool = False, hang: bool = True, queue_hang: bool = False
    ):
        self.nc, self.expert, self.worker_id, self.direct, self.hang = nc, expert, worker_id, direct, hang
        self.queue_hang = queue_hang
        self.queue_requests = self.direct_requests = 0
        self.subs: list = []

    async def start(self) -> Responder:
        self.subs.append(
            await self.nc.subscribe(
                subjects.expert_velocity(self.expert), queue=subjects.expert_queue_group(self.expert), cb=self._on_queue
            )
        )
        if self.direct:
            subject = subjects.expert_direct(self.expert, subjects.worker_token(self.worker_id))
            self.subs.append(await self.nc.subscribe(subject, cb=self._on_direct))
        await flushed(self.nc)
        return self

    async def _on_queue(self, msg) -> None:
        self.queue_requests += 1
        if not self.queue_hang:
            await self._answer(msg)

    async def _answer(self, msg) -> None:
        step = unpack(msg.data, StepRequest)
        await msg.respond(
            pack(
                StepReply(
                    expert=step.expert, velocity=-np.asarray(step.x_t), row_ids=step.row_ids, worker_id=self.worker_id
                )
            )
        )

    async def _on_direct(self, msg) -> None:
        self.direct_requests += 1
        if not self.hang:
            await self._answer(msg)

    async def stop(self) -> None:
        for s in self.subs:
            await s.unsubscribe()


async def test_a_worker_without_a_direct_subject_costs_one_fallback_per_ttl(nc):
    """A worker of a release before direct subjects: its id is learned from its queue-group reply,
    the next request's direct send meets "no responders" and goes to the queue group in the same try
    (no retry, no ExpertUnavailable), and the worker is not tried directly again for the ttl."""
    legacy = await Responder(nc, 44, "legacy.host-1").start()
    try:
        tr = NatsTransport(nc, step_timeout=5, retries=0, hedge="off")
        for i in range(10):
            x, t, y, ids = _inputs(2, i)
            np.testing.assert_array_equal(await tr.velocity(44, x, t, y, ids), -x)
        assert legacy.queue_requests == 10
        assert tr.direct_fallbacks == 1 and tr.dispatch_counts == {(44, "queue"): 10, (44, "direct"): 1}
        assert tr.dispatcher.known(44) == [] and tr.retried == 0
    finally:
        await legacy.stop()


async def test_a_direct_send_that_times_out_is_retried_elsewhere(nc):
    """A worker that answers its queue group but hangs on its direct subject: the direct try times
    out, the worker is forgotten, and the retry goes to the queue group, not to it again."""
    hung = await Responder(nc, 45, "hung-1", direct=True).start()
    try:
        tr = NatsTransport(nc, step_timeout=0.5, retries=1, hedge="off")
        x, t, y, ids = _inputs(1, 1)
        await tr.velocity(45, x, t, y, ids)  # nothing known: queue group; learns hung-1
        assert tr.dispatcher.known(45) == [subjects.worker_token("hung-1")]
        np.testing.assert_array_equal(await tr.velocity(45, x, t, y, ids), -x)
        assert hung.direct_requests == 1 and hung.queue_requests == 2 and tr.retried == 1
        assert tr.dispatch_counts == {(45, "queue"): 2, (45, "direct"): 1}
        assert tr.dispatcher.outstanding(45, subjects.worker_token("hung-1")) == 0
    finally:
        await hung.stop()


async def test_a_retry_after_a_time_out_goes_to_a_worker_that_answers_not_the_queue_group(nc):
    """A worker that went silent with its subscriptions still on the bus (as behind a cut route,
    until nats-server's pings give up on it): the try sent to it directly times out, and the retry
    goes straight to the other known worker though it is busy (at `depth`), never to the queue
    group, where NATS would hand it to the silent one half of the time (10 rounds: 2^-10)."""
    silent = await Responder(nc, 48, "silent-1", direct=True, hang=True, queue_hang=True).start()
    good = await Responder(nc, 48, "good-1", direct=True, hang=False).start()
    try:
        # 0.6 s: each round waits out one time-out (the silent worker's); the good worker's answer must
        # come well within it on a loaded box (at 0.2 s one was late once, and its retry was the third try)
        tr = NatsTransport(nc, step_timeout=0.6, retries=2, hedge="off")
        tr.dispatcher.depth, tr.dispatcher.explore_every = 1, 0
        good_token = subjects.worker_token("good-1")
        tr.dispatcher.seen(48, "good-1")
        tr.dispatcher.sent(48, good_token)  # a request of another cohort in flight there: busy
        for i in range(10):
            tr.dispatcher.seen(48, "silent-1")  # it answered before going silent: known, idle
            x, t, y, ids = _inputs(1, 200 + i)
            np.testing.assert_array_equal(await tr.velocity(48, x, t, y, ids), -x)
        assert silent.direct_requests == 10 and silent.queue_requests == 0
        assert good.direct_requests == 10 and good.queue_requests == 0 and tr.retried == 10
    finally:
        await silent.stop()
        await good.stop()


async def test_after_a_try_goes_unanswered_the_expert_keeps_off_its_queue_group(nc):
    """A worker that went silent with its subscriptions still on the bus (a cut host, until nats-server's
    pings give up on it): once a try sent to it goes unanswered, the expert's tries go to the worker that
    answers, though it is busy (at `depth`) and every 2nd pick would explore, never to the queue group (where
    NATS hands a request to the silent one half of the time: without this, 6-8 of these 12 tries went there)."""
    silent = await Responder(nc, 45, "silent-1", direct=True, hang=True, queue_hang=True).start()
    good = await Responder(nc, 45, "good-1", direct=True, hang=False).start()
    try:
        tr = NatsTransport(nc, step_timeout=0.6, retries=2, hedge="off")
        tr.dispatcher.depth, tr.dispatcher.explore_every = 1, 2
        tr.legs.fence(set(), {45: ["good-1"]})  # a worker discovery: the live workers (the silent one is not)
        tr.dispatcher.sent(45, subjects.worker_token("good-1"))  # a request of another cohort in flight: busy
        tr.dispatcher.seen(45, "silent-1")  # it answered before going silent: known, idle
        for i in range(13):  # the first goes to the silent worker (the shortest queue), times out, is retried
            x, t, y, ids = _inputs(1, 300 + i)
            np.testing.assert_array_equal(await tr.velocity(45, x, t, y, ids), -x)
        assert silent.direct_requests == 1 and silent.queue_requests == 0 and tr.retried == 1
        assert good.direct_requests == 13 and good.queue_requests == 0
        assert tr.dispatcher.shunned() == [45]
    finally:
        await silent.stop()
        await good.stop()


async def test_a_worker_late_on_its_direct_subject_is_hedged_around_and_forgotten(nc):
    """A worker that freezes on its direct subject but stays subscribed: the try sent to it is
    hedged to the other worker, which wins, and the frozen one is forgotten, so later tries do not
    go to it; with a worker discovery running, the expert also keeps off its queue group (where the frozen one
    would answer an exploring request and be learned again) for the dispatch's ttl."""
    frozen = await Responder(nc, 47, "frozen-1", direct=True, hang=False).start()
    good = await Responder(nc, 47, "good-1", direct=True, hang=False).start()
    try:
        tr = NatsTransport(nc, step_timeout=5, retries=0, hedge_after_s=0.1)
        # learn both from queue-group replies (once one is known, only every 8th try explores the queue
        # group and NATS picks at random: 400 tries give ~50 of them, so missing one worker is < 1e-14)
        for i in range(400):
            if len(tr.dispatcher.known(47)) == 2 and tr.hedging.workers_seen(47) == 2:
                break
            await tr.velocity(47, *_inputs(1, i))
        assert len(tr.dispatcher.known(47)) == 2 and tr.hedging.workers_seen(47) == 2
        frozen.hang = True
        tr.legs.fence(set(), {})  # a worker discovery ran (these hand-written workers advertise nothing)
        direct0, queue0 = frozen.direct_requests, frozen.queue_requests
        for i in range(16):
            x, t, y, ids = _inputs(1, 100 + i)
            np.testing.assert_array_equal(await tr.velocity(47, x, t, y, ids), -x)
        hung = frozen.direct_requests - direct0
        relearned = frozen.queue_requests - queue0  # its good replies to exploring requests
        assert tr.hedge_counts.get((47, "won"), 0) == hung >= 1
        # (a copy of a slow reply of the good one may still go to the queue group, and reach the frozen one)
        assert hung <= 1 + relearned <= 3, (hung, relearned)  # without forgetting: about every other try
        assert tr.dispatcher.shunned() == [47]
    finally:
        await frozen.stop()
        await good.stop()


async def test_a_queue_group_try_that_goes_unanswered_keeps_the_expert_off_its_queue_group(nc):
    """Nothing known: the try goes to the queue group, whose member takes it and never answers; the expert's
    next tries go to the worker a discovery reports alive, however busy, not to the queue group again."""
    silent = await Responder(nc, 44, "silent-2", queue_hang=True).start()
    try:
        tr = NatsTransport(nc, step_timeout=1.0, retries=0, hedge="off")
        tr.dispatcher.depth = 1
        tr.legs.fence(set(), {})  # a discovery ran (the hand-written silent worker advertises nothing)
        with pytest.raises(ExpertUnavailable, match="timed out"):
            await tr.velocity(44, *_inputs(1, 400))
        assert silent.queue_requests == 1 and tr.dispatcher.shunned() == [44]
        good = await Responder(nc, 44, "good-2", direct=True, hang=False).start()
        try:
            tr.legs.fence(set(), {44: ["good-2"]})  # the next discovery finds the good worker
            tr.dispatcher.sent(44, subjects.worker_token("good-2"))  # busy: at depth
            for i in range(6):
                x, t, y, ids = _inputs(1, 410 + i)
                np.testing.assert_array_equal(await tr.velocity(44, x, t, y, ids), -x)
            assert silent.queue_requests == 1 and good.direct_requests == 6 and good.queue_requests == 0
        finally:
            await good.stop()
    finally:
        await silent.stop()


async def test_queue_dispatch_never_sends_direct(nc):
    legacy = await Responder(nc, 46, "w-1", direct=True).start()
    try:
        tr = NatsTransport(nc, step_timeout=5, dispatch="queue")
        for i in range(3):
            await tr.velocity(46, *_inputs(1, i))
        assert tr.dispatcher is None and tr.dispatch_counts == {(46, "queue"): 3} and legacy.direct_requests == 0
        assert tr.workers_per_expert() is None  # learns no workers: cohorts="auto" stays at its floor
    finally:
        await legacy.stop()
    with pytest.raises(ValueError, match="dispatch"):
        NatsTransport(nc, dispatch="random")


async def test_the_coordinator_and_its_cli_pass_the_dispatch_mode_on(nats_url):
    from coordinator.local_fleet import LabelRouter
    from coordinator.service import Coordinator
    from infra.cli import build_parser

    for mode in ("direct", "queue"):
        async with Coordinator(LabelRouter([0] * 10, 1), num_experts=1, nats_url=nats_url, dispatch=mode) as coord:
            assert coord.transport.dispatch == mode and (coord.transport.dispatcher is None) == (mode == "queue")
    parser = build_parser()
    assert parser.parse_args(["coordinator"]).dispatch == "direct"
    assert parser.parse_args(["coordinator", "--dispatch", "queue"]).dispatch == "queue"
    with pytest.raises(SystemExit):
        parser.parse_args(["coordinator", "--dispatch", "random"])


async def test_dispatch_counters_are_exported_as_metrics(nats_url, nc, workers):
    from client.jobs import run_job
    from coordinator.local_fleet import LabelRouter
    from coordinator.service import Coordinator
    from schemas import JobRequest

    async with Coordinator(  # run_ahead 0: a request (at least one leg) per step
        LabelRouter([0] * 10, 1), num_experts=1, nats_url=nats_url, step_timeout=10, run_ahead=0
    ) as coord:
        for i in range(3):
            await run_job(nc, JobRequest(job_id=f"m{i}", digits=[1, 2], steps=6, seed=i, stream=False))
        m, tr = coord.metrics, coord.transport
        direct = m.sample("ddm_coordinator_expert_dispatch_total", expert="0", route="direct")
        queue = m.sample("ddm_coordinator_expert_dispatch_total", expert="0", route="queue")
        assert direct == tr.dispatch_counts.get((0, "direct"), 0) and queue == tr.dispatch_counts.get((0, "queue"), 0)
        assert direct > 0 and direct + queue >= 18  # 3 jobs x 6 steps, at least one leg each
        assert m.sample("ddm_coordinator_direct_fallbacks_total") == tr.direct_fallbacks
        assert m.sample("ddm_coordinator_known_workers", expert="0") == len(tr.dispatcher.known(0)) >= 1


async def test_a_coordinator_with_auto_cohorts_grows_them_as_it_learns_workers(nats_url, nc, workers, expert0):
    """--cohorts auto end to end: 3 workers of the expert keep 2 cohorts; a 4th worker, once learned
    from its replies, makes it 3 (ddm_coordinator_cohorts says so too)."""
    from client.jobs import run_job
    from coordinator.engine import cohorts_for_workers
    from coordinator.local_fleet import LabelRouter
    from coordinator.service import Coordinator
    from schemas import JobRequest
    from workers.backends import get_backend
    from workers.service import ExpertWorker

    async def learn(coord, n: int) -> None:
        for r in range(30):
            if coord.transport.workers_per_expert() == n:
                return
            await asyncio.gather(
                *(
                    run_job(nc, JobRequest(job_id=f"auto{n}-{r}-{i}", digits=[1, 2], steps=4, seed=i, stream=False))
                    for i in range(6)
                )
            )
        raise AssertionError(f"learned {coord.transport.workers_per_expert()} of {n} workers in 30 rounds")

    async with Coordinator(
        LabelRouter([0] * 10, 1), num_experts=1, nats_url=nats_url, step_timeout=10, request_rows=1
    ) as coord:
        assert coord.engine.cohorts == "auto"
        await learn(coord, len(workers))
        assert coord.engine.cohorts_now() == 2 == coord.metrics.sample("ddm_coordinator_cohorts")
        fourth = ExpertWorker(
            expert=0,
            checkpoint=expert0,
            nats_url=nats_url,
            buckets=(1, 2, 4, 8),
            backend=get_backend("sim", preset="instant", batch_ms=20.0),
        )
        await fourth.start()
        try:
            await learn(coord, 4)
            assert coord.engine.cohorts_now() == 3 == cohorts_for_workers(4)
            assert coord.metrics.sample("ddm_coordinator_cohorts") == 3
            assert fourth.metrics.requests > 0
        finally:
            await fourth.stop()
