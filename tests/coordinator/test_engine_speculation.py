"""Speculation: a tick sends each row's likely expert requests while the router runs, keeps the
answers the routing needs, asks again for the rest, and never changes a job's images."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading

import numpy as np

from coordinator.batch import Batch
from coordinator.engine import Engine
from coordinator.errors import ExpertUnavailable
from coordinator.rows import RowGroup
from coordinator.scheduler import Scheduler, SchedulerConfig
from schemas import DoneEvent, JobRequest

SHAPE = (1, 4, 4)
C2E = [0] * 5 + [1] * 5
STEPS = 4


class Experts:
    """v_k(x) = -(k + 1) x, elementwise (a row's answer never depends on the rows beside it).
    Experts in `down` raise ExpertUnavailable, in `broken` a RuntimeError. `on_call(t)` runs at each call."""

    def __init__(self, down=(), broken=(), on_call=None):
        self.down, self.broken, self.on_call = set(down), set(broken), on_call
        self.calls: list[tuple[int, list[str]]] = []

    async def velocity(self, k, x, t, y, row_ids):
        self.calls.append((k, list(row_ids)))
        if self.on_call is not None:
            self.on_call(t)
        await asyncio.sleep(0.001)  # a round trip: the router's thread runs meanwhile
        if k in self.down:
            raise ExpertUnavailable(k, "has no responders")
        if k in self.broken:
            raise RuntimeError("connection lost")
        return (-(k + 1) * x).astype(np.float32)


class StepRouter:
    """Top1 choice by the evaluation's time: `pick(step)` is the expert (weight 0.9) at t = step / STEPS."""

    num_experts = 2

    def __init__(self, pick):
        self.pick = pick

    def weights(self, x, t, y):
        w = np.full((len(y), 2), 0.1)
        for i, tt in enumerate(np.asarray(t)):
            w[i, self.pick(int(round(float(tt) * STEPS)))] = 0.9
        return w


def drive(
    router,
    experts,
    speculate=True,
    jobs=({"digits": [1, 7], "seed": 3}, {"digits": [4], "seed": 9}),
    strategy="top1",
    cohorts=2,
    one_at_a_time=False,
    setup=None,
):
    """Run the jobs to their end (router in a thread, as the coordinator runs it), all at once or
    each after the one before has ended; returns (events, engine). `setup(engine)` runs before it starts."""

    async def main():
        events = []
        sched = Scheduler(SchedulerConfig(num_experts=2, image_shape=SHAPE, class_to_expert=C2E))
        eng = Engine(sched, router, experts, events.append, cohorts=cohorts, speculate=speculate)
        if setup is not None:
            setup(eng)
        task = asyncio.create_task(eng.run())

        def ended(job_id):
            return any(ev.job_id == job_id and ev.kind in ("done", "failed") for ev in events)

        async def until(done):
            for _ in range(2000):
                if done() or task.done():
                    return
                await asyncio.sleep(0.005)

        reqs = [
            JobRequest(job_id=f"j{i}", steps=STEPS, strategy=strategy, stream=False, **job)
            for i, job in enumerate(jobs)
        ]
        for req in reqs:
            eng.submit(req)
            if one_at_a_time:
                await until(lambda req=req: ended(req.job_id))
        await until(lambda: all(ended(r.job_id) for r in reqs))
        await eng.stop()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return events, eng

    return asyncio.run(main())


def run(router, experts, speculate, **kw):
    """drive(...) -> ({job: images} of the jobs done, engine)."""
    events, eng = drive(router, experts, speculate, **kw)
    return {ev.job_id: ev.images for ev in events if isinstance(ev, DoneEvent)}, eng


# ---------------------------------------------------------------- the pure batch


def group(job_id, digits, route_w=None, strategy="top1"):
    g = RowGroup(
        job_id=job_id,
        y=np.array(digits),
        x=np.ones((len(digits),) + SHAPE, np.float32),
        steps=STEPS,
        strategy=strategy,
        num_experts=2,
        oracle_expert=np.array([C2E[d] for d in digits]),
    )
    if route_w is not None:
        g.remember_route(np.array(route_w, np.float64))
    return g


def test_guesses_follow_each_jobs_last_routing_among_the_experts_up_now():
    b = Batch(
        [
            group("new", [1]),
            group("a", [1, 2], [[0.2, 0.8], [0.7, 0.3]]),
            group("f", [3], [[0.6, 0.4]], strategy="full"),
        ],
        num_experts=2,
    )
    g = b.guess_requests()
    assert sorted(g) == [0, 1]
    assert g[0].tolist() == [2, 3] and g[1].tolist() == [1, 3]  # row 0 was never routed: no guess
    down = Batch([group("a", [1, 2], [[0.2, 0.8], [0.7, 0.3]])], num_experts=2, unavailable={1})
    assert {k: v.tolist() for k, v in down.guess_requests().items()} == {0: [0, 1]}  # top1's next best
    assert Batch([group("new", [1])], num_experts=2).guess_requests() == {}
    assert Batch([group("a", [1], [[0.2, 0.8]])], num_experts=2, unavailable={0, 1}).guess_requests() == {}


def test_record_guess_keeps_only_the_rows_the_routing_needs():
    b = Batch([group("a", [1, 2, 3], [[0.9, 0.1]] * 3)], num_experts=2)
    b.route(np.array([[0.9, 0.1], [0.2, 0.8], [0.9, 0.1]]))
    v = np.stack([np.full(SHAPE, i, np.float32) for i in range(3)])
    assert b.record_guess(0, np.array([0, 1, 2]), v) == 2  # row 1 went to expert 1
    assert {k: r.tolist() for k, r in b.requests().items()} == {1: [1]}
    assert b.record_guess(0, np.array([0, 2]), v[[0, 2]]) == 0  # nothing left to take
    b.record(1, np.array([1]), v[[1]])
    np.testing.assert_array_equal(b.combined(), v)


# ---------------------------------------------------------------- the engine


def test_guessed_requests_go_out_while_the_router_runs():
    """The router waits (up to 1 s) for an expert call at its own evaluation time to start: with
    speculation one has, for every evaluation after a job's first; without it none ever has."""
    seen: set[float] = set()
    cond = threading.Condition()

    def on_call(t):
        with cond:
            seen.update(np.asarray(t, np.float64).tolist())
            cond.notify_all()

    class WaitingRouter(StepRouter):
        def __init__(self):
            super().__init__(lambda step: 1)
            self.overlapped = []

        def weights(self, x, t, y):
            now = float(np.asarray(t, np.float64)[0])
            if now > 0:  # a job's first evaluation has nothing to guess from
                with cond:
                    self.overlapped.append(cond.wait_for(lambda: now in seen, timeout=1.0))
            return super().weights(x, t, y)

    for speculate in (True, False):
        seen.clear()
        router = WaitingRouter()
        done, eng = run(router, Experts(on_call=on_call), speculate, jobs=({"digits": [7], "seed": 1},))
        assert list(done) == ["j0"] and len(router.overlapped) == STEPS - 1
        assert all(router.overlapped) if speculate else not any(router.overlapped)
        assert eng.rows_guessed == (STEPS - 1 if speculate else 0) and eng.rows_guessed_unused == 0


def test_guessed_calls_leave_before_the_router_thread_is_handed_its_rows():
    """With more rows than the loop routes itself (the router's thread), a tick's guessed calls are under
    way before the router's thread gets the rows: the thread's Python would otherwise hold the GIL against
    the calls' encoding. Checked where the thread is handed its work, so no race decides it."""
    from coordinator.executor import INLINE_ROUTER_ROWS

    seen: set[float] = set()
    handed: list[tuple[list[float], bool]] = []  # (the rows' times, were their calls all under way)

    class Pool(concurrent.futures.ThreadPoolExecutor):
        def submit(self, fn, x, t, y):
            times = np.asarray(t, np.float64).tolist()
            handed.append((times, all(tt in seen for tt in times)))
            return super().submit(fn, x, t, y)

    digits = [1, 2, 3, 6, 7, 8]
    assert len(digits) > INLINE_ROUTER_ROWS
    pool = Pool(max_workers=1)
    try:
        done, eng = run(
            StepRouter(lambda step: step % 2),
            Experts(on_call=lambda t: seen.update(np.asarray(t, np.float64).tolist())),
            True,
            jobs=({"digits": digits, "seed": 2},),
            cohorts=1,
            setup=lambda eng: setattr(eng.executor, "_router_pool", pool),
        )
    finally:
        pool.shutdown()
    assert list(done) == ["j0"] and eng.rows_guessed == (STEPS - 1) * len(digits)
    assert len(handed) == STEPS
    assert sorted({tt for times, _ in handed for tt in times}) == [s / STEPS for s in range(STEPS)]
    first, *later = handed
    assert not first[1]  # a job's first evaluation has nothing to guess from: the router goes first
    assert all(under_way for _, under_way in later), handed


def test_speculation_never_changes_the_images_and_counts_wrong_guesses():
    def flip(step):
        return step % 2  # every evaluation overrules the last one's choice

    def stable(step):
        return 0

    for pick, strategy in ((flip, "top1"), (stable, "top1"), (flip, "full")):
        plain = Experts()
        base, _ = run(StepRouter(pick), plain, speculate=False, strategy=strategy)
        experts = Experts()
        got, eng = run(StepRouter(pick), experts, speculate=True, strategy=strategy)
        assert sorted(got) == ["j0", "j1"]
        for j in got:
            np.testing.assert_array_equal(got[j], base[j])  # the same bits
        guessed = 3 * (STEPS - 1) * (2 if strategy == "full" else 1)  # 3 rows to each expert they need,
        # at every evaluation but the first
        assert eng.rows_guessed == guessed
        if pick is flip and strategy == "top1":
            assert eng.rows_guessed_unused == guessed  # every guess was wrong ...
            assert len(experts.calls) > len(plain.calls)  # ... so those ticks called again
        else:  # stable choices, or `full`, which needs every expert whatever the weights
            assert eng.rows_guessed_unused == 0 and len(experts.calls) == len(plain.calls)


def test_a_failed_guess_falls_back_like_any_failed_call():
    """Expert 1 has no responders: the job's rows fall back to expert 0 at every evaluation; an
    unneeded guess that fails is only counted."""
    base, _ = run(StepRouter(lambda step: 1), Experts(down={1}), speculate=False)
    got, eng = run(StepRouter(lambda step: 1), Experts(down={1}), speculate=True)
    assert sorted(got) == ["j0", "j1"]
    for j in got:
        np.testing.assert_array_equal(got[j], base[j])
    # the router flips between the experts, and expert 1 breaks whenever it is asked: guesses of 1
    # that the router overrules fail unneeded; the needed ones fall back to expert 0
    flip = StepRouter(lambda step: step % 2)
    base, _ = run(flip, Experts(broken={1}), speculate=False)
    got, eng = run(flip, Experts(broken={1}), speculate=True)
    assert sorted(got) == ["j0", "j1"]
    for j in got:
        np.testing.assert_array_equal(got[j], base[j])
    assert eng.rows_guessed_unused > 0


def test_a_router_failing_after_the_guesses_went_out_fails_only_its_jobs():
    """The router breaks at the second evaluation of job j0: its tick fails j0 (internal), the call
    guessed for it finishes unwatched and counts as unused, and a later job still completes."""
    from schemas import FailedEvent

    class Breaks(StepRouter):
        def __init__(self):
            super().__init__(lambda step: 0)
            self.broke = False

        def weights(self, x, t, y):
            if not self.broke and float(np.max(t)) > 0:
                self.broke = True
                raise RuntimeError("router crashed")
            return super().weights(x, t, y)

    events, eng = drive(Breaks(), Experts(), jobs=({"digits": [2]}, {"digits": [3]}), cohorts=1, one_at_a_time=True)
    ends = {ev.job_id: ev for ev in events if ev.kind in ("done", "failed")}
    assert isinstance(ends["j0"], FailedEvent) and "router crashed" in ends["j0"].reason
    assert ends["j1"].kind == "done" and eng.dead is None
    assert eng.rows_guessed_unused == 1 and eng.rows_guessed == 1 + (STEPS - 1)
    assert not eng.executor._unwatched  # the abandoned call finished and was dropped


# ---------------------------------------------------------------- end to end


async def test_a_coordinator_speculates_over_nats_without_changing_a_job(nats_url, nc, tiny_experts, tiny_router):
    """A real coordinator (the tiny random router, whose choices move with x_t and t), two sim
    workers on a real nats-server: the same seeded jobs with and without speculation give the same
    bytes, and the metrics count the guessed rows."""
    from client.jobs import run_job
    from coordinator.service import Coordinator
    from models.router import Router
    from workers.backends import get_backend
    from workers.service import ExpertWorker

    ws = [
        ExpertWorker(
            expert=k,
            checkpoint=p,
            nats_url=nats_url,
            buckets=(1, 2, 4, 8),
            backend=get_backend("sim", preset="instant", batch_ms=3.0),
        )
        for k, p in enumerate(tiny_experts)
    ]
    for w in ws:
        await w.start()
    try:
        jobs = [
            JobRequest(digits=[-1, 3, -1, 8], seed=5, steps=6),
            JobRequest(digits=[-1], seed=6, steps=6, strategy="full"),
        ]
        images = {}
        for speculate in (True, False):
            async with Coordinator(
                Router.load(tiny_router),
                num_experts=2,
                class_to_expert=C2E,
                nats_url=nats_url,
                step_timeout=10,
                speculate=speculate,
                run_ahead=0,  # (steps that runs ahead stream are not guessed: the count below would move)
            ) as coord:
                images[speculate] = [(await run_job(nc, job, timeout=60)).images for job in jobs]
                guessed = coord.metrics.sample("ddm_coordinator_rows_guessed_total")
                unused = coord.metrics.sample("ddm_coordinator_rows_guessed_unused_total")
                assert (guessed, unused) == (coord.engine.rows_guessed, coord.engine.rows_guessed_unused)
                assert guessed == ((4 + 2) * 5 if speculate else 0)  # full: 1 row to both experts
        for on, off in zip(images[True], images[False]):
            np.testing.assert_array_equal(on, off)
    finally:
        for w in ws:
            await w.stop()
