"""No lock-step: the scheduler hands out cohorts (a job in at most one batch at a time), the engine
keeps several batches out at once, and a seeded job's images do not depend on any of it."""

from __future__ import annotations

import argparse
import asyncio

import numpy as np
import pytest

from client.jobs import run_job
from coordinator.engine import Engine, cohorts_for_workers, parse_cohorts
from coordinator.local_fleet import LabelRouter
from coordinator.scheduler import Scheduler, SchedulerConfig
from coordinator.service import Coordinator, load_router_and_partition
from schemas import DoneEvent, JobRequest
from tests.coordinator.helpers import make_tiny_experts
from tests.waiting import wait_until

SHAPE = (1, 4, 4)
C2E = [0] * 5 + [1] * 5


def make(**kw) -> Scheduler:
    return Scheduler(SchedulerConfig(num_experts=2, image_shape=SHAPE, class_to_expert=C2E, **kw))


def finish(sched: Scheduler, batch) -> None:
    """Serve a batch with expert 0 answering v = -x, and apply it."""
    w = np.zeros((len(batch), 2))
    w[:, 0] = 1.0
    batch.route(w)
    while reqs := batch.requests():
        for k, idx in reqs.items():
            batch.record(k, idx, -batch.x[idx])
    sched.update(batch, 0.0)


# ---------------------------------------------------------------- the pure scheduler


def test_cohorts_split_the_free_rows_and_a_job_rides_in_one_batch_at_a_time():
    s = make()
    for i in range(4):
        s.submit(JobRequest(job_id=f"j{i}", digits=[1], steps=3, stream=False), 0.0)
    a = s.schedule(0.0, cohorts=2)
    b = s.schedule(0.0, cohorts=2)
    assert a.job_ids == ["j0", "j1"] and b.job_ids == ["j2", "j3"]
    assert s.schedule(0.0, cohorts=2) is None  # every job is out
    assert s.in_flight_rows == 4
    finish(s, a)
    assert s.in_flight_rows == 2
    again = s.schedule(0.0, cohorts=2)
    assert again.job_ids == ["j0", "j1"]  # only the jobs that came back
    finish(s, b)
    finish(s, again)
    assert s.job_progress("j0")["step"] == 2 and s.job_progress("j3")["step"] == 1


def test_one_cohort_takes_every_free_job_and_a_big_job_goes_whole():
    s = make()
    s.submit(JobRequest(job_id="big", digits=[1] * 5, steps=2, stream=False), 0.0)
    s.submit(JobRequest(job_id="small", digits=[2], steps=2, stream=False), 0.0)
    assert s.schedule(0.0, cohorts=3).job_ids == ["big"] * 5  # over the cap of ceil(6 / 3), but whole
    assert s.schedule(0.0, cohorts=3).job_ids == ["small"]
    t = make()
    t.submit(JobRequest(job_id="x", digits=[1, 2], steps=2, stream=False), 0.0)
    t.submit(JobRequest(job_id="y", digits=[3], steps=2, stream=False), 0.0)
    assert t.schedule(0.0).job_ids == ["x", "x", "y"]  # cohorts=1: the lock-step tick
    with pytest.raises(ValueError, match="cohorts"):
        t.schedule(0.0, cohorts=0)


def test_cancel_and_fail_release_an_in_flight_job():
    s = make()
    s.submit(JobRequest(job_id="a", digits=[1], steps=3, stream=False), 0.0)
    s.submit(JobRequest(job_id="b", digits=[2], steps=3, stream=False), 0.0)
    out = s.schedule(0.0)
    assert s.cancel("a", 0.0) and s.in_flight_rows == 1
    s.fail_batch(out, "internal", "test")  # b fails; a is gone already and is not failed twice
    assert s.in_flight_rows == 0 and s.active_jobs == 0
    assert [e.code.value for e in s.pop_events()] == ["cancelled", "internal"]


# ---------------------------------------------------------------- the engine keeps cohorts out at once


class GatedTransport:
    """Holds every call until `gate` opens; records how many calls were out at once."""

    def __init__(self):
        self.gate = asyncio.Event()
        self.out = 0
        self.most_out = 0

    async def velocity(self, k, x, t, y, row_ids):
        self.out += 1
        self.most_out = max(self.most_out, self.out)
        try:
            await self.gate.wait()
        finally:
            self.out -= 1
        return -x


async def test_engine_keeps_one_batch_per_cohort_out_at_once():
    events = []
    tr = GatedTransport()
    e = Engine(make(), LabelRouter([0] * 10, 2, confidence=1.0), tr, events.append, router_in_thread=False, cohorts=3)
    task = asyncio.create_task(e.run())
    for i in range(6):
        e.submit(JobRequest(job_id=f"j{i}", digits=[1], steps=2, stream=False))
    await wait_until(lambda: tr.out == 3, timeout=5, what="three cohorts out at once")
    assert e.scheduler.in_flight_rows == 6
    tr.gate.set()
    await wait_until(lambda: sum(ev.kind == "done" for ev in events) == 6, timeout=5, what="every job done")
    assert tr.most_out == 3
    await e.stop()
    await asyncio.wait_for(task, 5)


class KnownWorkersTransport(GatedTransport):
    """A GatedTransport that says how many workers it knows per expert (as direct dispatch does)."""

    def __init__(self, workers):
        super().__init__()
        self.workers = workers

    def workers_per_expert(self):
        if self.workers == "broken":
            raise RuntimeError("bookkeeping broke")
        return self.workers


def test_cohorts_for_workers_and_the_cohorts_option():
    assert [cohorts_for_workers(w) for w in (None, 0, 1, 2, 3, 4, 7, 8, 64)] == [2, 2, 2, 2, 2, 3, 3, 4, 4]
    assert max(cohorts_for_workers(w) for w in range(1000)) == 4  # the most "auto" ever keeps out
    assert parse_cohorts("auto") == "auto" and parse_cohorts(" AUTO ") == "auto" and parse_cohorts("3") == 3
    for bad in ("0", "-2", "two", "2.5", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="'auto' or an int >= 1"):
            parse_cohorts(bad)
    for bad in (0, "three", True, 2.0):
        with pytest.raises(ValueError, match="cohorts"):
            Engine(make(), LabelRouter(C2E, 2), EchoTransport(), cohorts=bad)


def test_one_cohort_only_where_the_fleet_fills_a_host_without_accelerators_one_worker_per_expert():
    from coordinator.cohorts import cohorts_on_shared_cores

    assert cohorts_on_shared_cores(1, 2, cores=2, accelerator=False) == 1
    assert cohorts_on_shared_cores(1, 2, cores=4, accelerator=False) == 1  # worker processes + 2 cores
    assert cohorts_on_shared_cores(1, 2, cores=5, accelerator=False) is None  # a core to spare: overlap pays
    assert cohorts_on_shared_cores(1, 2, cores=2, accelerator=True) is None  # the workers may be on a device
    assert cohorts_on_shared_cores(2, 4, cores=2, accelerator=False) is None  # cohorts feed several workers


@pytest.mark.parametrize("workers, want", [(None, 2), (1, 2), (4, 3), (8, 4), (50, 4), ("broken", 2)])
async def test_auto_cohorts_keep_as_many_batches_out_as_the_known_workers_call_for(workers, want):
    """cohorts="auto": 8 one-row jobs are dealt into cohorts_for_workers(known workers) batches, all
    out at once, and no more than that many, one lane each."""
    events = []
    tr = KnownWorkersTransport(workers)
    e = Engine(
        make(), LabelRouter([0] * 10, 2, confidence=1.0), tr, events.append, router_in_thread=False, cohorts="auto"
    )
    assert e.cohorts_now() == want and e.metrics.sample("ddm_coordinator_cohorts") == want
    task = asyncio.create_task(e.run())
    for i in range(8):
        e.submit(JobRequest(job_id=f"j{i}", digits=[1], steps=2, stream=False))
    await wait_until(
        lambda: e.scheduler.in_flight_rows == 8 and tr.out == want, timeout=5, what=f"{want} cohorts out at once"
    )
    for _ in range(20):  # the idle lanes stay idle
        await asyncio.sleep(0)
    assert tr.out == want and e.batches_out == want and len(e._lanes) == want
    assert e.metrics.sample("ddm_coordinator_batches_out") == want
    tr.gate.set()
    await wait_until(lambda: sum(ev.kind == "done" for ev in events) == 8, timeout=5, what="every job done")
    assert tr.most_out == want and e.batches_out == 0
    await e.stop()
    await asyncio.wait_for(task, 5)


async def test_auto_cohorts_follow_workers_learned_while_running():
    """Workers learned mid-run (here: the transport's count changes) add lanes at the next tick, and
    fewer workers later retire the surplus lanes once they are idle."""
    events = []
    tr = KnownWorkersTransport(1)
    e = Engine(
        make(), LabelRouter([0] * 10, 2, confidence=1.0), tr, events.append, router_in_thread=False, cohorts="auto"
    )
    task = asyncio.create_task(e.run())
    for i in range(8):
        e.submit(JobRequest(job_id=f"a{i}", digits=[1], steps=3, stream=False))
    await wait_until(lambda: tr.out == 2, timeout=5, what="two cohorts out")
    assert len(e._lanes) == 2  # one worker per expert: exactly the lanes of a fixed 2
    tr.workers = 8

    def release():  # let the calls out now answer; later ones wait on a fresh gate
        gate, tr.gate = tr.gate, asyncio.Event()
        gate.set()

    release()
    await wait_until(lambda: tr.out == 4, timeout=5, what="four cohorts out after the workers grew")
    assert len(e._lanes) == 4 and e.scheduler.in_flight_rows == 8
    tr.workers = 1
    release()
    await wait_until(lambda: tr.out == 2 and len(e._lanes) == 2, timeout=5, what="back to two lanes")
    tr.gate.set()
    await wait_until(lambda: sum(ev.kind == "done" for ev in events) == 8, timeout=5, what="every job done")
    assert e.batches_out == 0 and tr.most_out == 4
    await e.stop()
    await asyncio.wait_for(task, 5)


class BrokenRouter:
    def weights(self, x, t, y):
        raise RuntimeError("router broke")


async def test_a_failed_tick_gives_its_cohort_slot_back():
    events = []
    e = Engine(make(), BrokenRouter(), KnownWorkersTransport(1), events.append, router_in_thread=False, cohorts="auto")
    task = asyncio.create_task(e.run())
    for i in range(3):
        e.submit(JobRequest(job_id=f"f{i}", digits=[1], steps=2, stream=False))
    await wait_until(lambda: sum(ev.kind == "failed" for ev in events) == 3, timeout=5, what="every job failed")
    assert e.batches_out == 0 and not task.done()
    await e.stop()
    await asyncio.wait_for(task, 5)


# ---------------------------------------------------------------- bit-identical through a real fleet


@pytest.fixture(scope="module")
def sim_experts(tmp_path_factory):
    return make_tiny_experts(tmp_path_factory.mktemp("sim-experts"))


async def _sim_workers(nats_url, experts, per_expert):
    from workers.backends import get_backend
    from workers.service import ExpertWorker

    ws = []
    for k, path in enumerate(experts):
        for _ in range(per_expert):
            w = ExpertWorker(
                expert=k,
                checkpoint=path,
                nats_url=nats_url,
                buckets=(1, 4, 16, 64),
                backend=get_backend("sim", preset="instant"),
            )
            await w.start()
            ws.append(w)
    return ws


def _probe_jobs() -> list[JobRequest]:
    return [
        JobRequest(job_id=f"probe-{i}", digits=[3, 8, 1, 6], steps=6, seed=77 + i, stream=True, strategy=s, solver=v)
        for i, (s, v) in enumerate(
            [("top1", "euler"), ("top1", "heun"), ("full", "euler"), ("oracle", "heun"), ("sample", "heun")]
        )
    ]


def _crowd(n: int) -> list[JobRequest]:
    rng = np.random.default_rng(3)
    return [
        JobRequest(
            digits=[int(d) for d in rng.integers(0, 10, size=int(rng.integers(1, 5)))],
            steps=int(rng.integers(3, 9)),
            seed=500 + i,
            stream=bool(i % 2),
        )
        for i in range(n)
    ]


@pytest.mark.parametrize("router_name", ["shipped", "label"])
async def test_seeded_images_are_bit_identical_whatever_the_cohorts_crowd_or_workers(
    nats_url, nc, sim_experts, router_name
):
    """Each probe job alone (cohorts=1, one worker per expert) and amid 40 other jobs (cohorts 3, two
    workers per expert, requests split over them): the same bytes. The shipped router's weights can
    differ in the last bits between batch sizes (1e-11 at B=1), so with it only top1, oracle and sample
    routing (which use the weights to choose, not to mix) are held to bit-identity."""
    if router_name == "shipped":
        router, k, c2e = load_router_and_partition("checkpoints/router.safetensors", "checkpoints/partition.json")
        probes = [p for p in _probe_jobs() if p.strategy in ("top1", "oracle", "sample")]
    else:
        router, k, c2e = LabelRouter(C2E, 2), 2, C2E
        probes = _probe_jobs()
    results = {}
    for setting in ("alone", "crowded"):
        per_expert, cohorts = (1, 1) if setting == "alone" else (2, 3)
        ws = await _sim_workers(nats_url, sim_experts, per_expert)
        try:
            async with Coordinator(
                router,
                num_experts=k,
                class_to_expert=c2e,
                nats_url=nats_url,
                step_timeout=10,
                cohorts=cohorts,
                request_rows=None if setting == "alone" else 8,
            ) as coord:
                if setting == "alone":
                    results[setting] = [await run_job(nc, p) for p in probes]
                else:
                    done = await asyncio.wait_for(
                        asyncio.gather(*(run_job(nc, j) for j in _crowd(40)), *(run_job(nc, p) for p in probes)), 120
                    )
                    results[setting] = done[40:]
                    assert coord.engine.scheduler.stats.ticks > 0
        finally:
            for w in ws:
                await w.stop()
    for p, a, b in zip(probes, results["alone"], results["crowded"]):
        assert isinstance(a, DoneEvent) and isinstance(b, DoneEvent)
        assert np.array_equal(a.images, b.images), (p.strategy, p.solver, float(np.abs(a.images - b.images).max()))
        assert np.array_equal(a.usage, b.usage)


# ---------------------------------------------------------------- routing less often


class CountingRouter:
    """Row-independent weights (label decides, t nudges the second expert) that count rows weighed."""

    def __init__(self):
        self.rows = 0

    def weights(self, x, t, y):
        self.rows += len(y)
        w = np.zeros((len(y), 2))
        w[:, 0] = 0.7 + 0.2 * (np.asarray(y) < 5) - 0.1 * t
        w[:, 1] = 1.0 - w[:, 0]
        return w


class EchoTransport:
    async def velocity(self, k, x, t, y, row_ids):
        return (-(k + 1) * x).astype(np.float32)


async def _run_engine(route_every: int, cohorts: int, jobs: list[JobRequest]):
    events, router = [], CountingRouter()
    e = Engine(
        make(), router, EchoTransport(), events.append, router_in_thread=False, cohorts=cohorts, route_every=route_every
    )
    task = asyncio.create_task(e.run())
    for j in jobs:
        e.submit(j)
    await wait_until(lambda: sum(ev.kind == "done" for ev in events) == len(jobs), timeout=10, what="all done")
    await e.stop()
    await asyncio.wait_for(task, 5)
    done = {ev.job_id: ev for ev in events if ev.kind == "done"}
    return done, router.rows, e.rows_routed


async def test_route_every_asks_the_router_every_nth_evaluation_whatever_the_cohorts():
    jobs = [
        JobRequest(job_id="e", digits=[1, 7], steps=8, seed=1, strategy="full", stream=False),
        JobRequest(job_id="h", digits=[3], steps=4, seed=2, strategy="full", solver="heun", stream=False),
    ]
    every1, rows1, _ = await _run_engine(1, 1, jobs)
    assert rows1 == 2 * 8 + 1 * 8  # every evaluation: heun evaluates twice per step
    every4, rows4, routed = await _run_engine(4, 1, jobs)
    assert rows4 == routed == 2 * 2 + 1 * 2  # evaluations 0 and 4 of each job
    every4_c3, _, _ = await _run_engine(4, 3, jobs)
    for j in ("e", "h"):
        assert np.array_equal(every4[j].images, every4_c3[j].images)  # cohorts change nothing
    # the router's weights move with t, so reusing them changes the mix a little, not much
    diff = float(np.abs(every1["e"].images - every4["e"].images).max())
    assert 0 < diff < 0.5, diff
    with pytest.raises(ValueError, match="route_every"):
        Engine(make(), CountingRouter(), EchoTransport(), route_every=0)


@pytest.mark.bus
async def test_an_experts_batch_is_split_to_fit_the_servers_max_payload(sim_experts):
    """A nats-server with its default 1 MiB max_payload (the project's configs raise it to 8 MB):
    512 rows of 1x32x32 float32 are 2 MiB. The transport splits under max_payload, so two 128-image
    `full` jobs (one 256-row batch for each expert) run instead of failing with MaxPayloadError."""
    import nats

    from bus.nats_server import NatsServer
    from coordinator.transport import NatsTransport

    with NatsServer(extra_config="max_payload: 1048576") as srv:
        nc = await nats.connect(srv.url)
        try:
            assert nc.max_payload == 1024 * 1024
            assert NatsTransport(nc).rows_per_request(np.zeros((512, 1, 32, 32), np.float32)) < 256
            ws = await _sim_workers(srv.url, sim_experts, 1)
            try:
                async with Coordinator(
                    LabelRouter(C2E, 2),
                    num_experts=2,
                    class_to_expert=C2E,
                    nats_url=srv.url,
                    step_timeout=10,
                    cohorts=1,
                ) as coord:
                    done = await asyncio.wait_for(
                        asyncio.gather(
                            *(
                                run_job(nc, JobRequest(count=128, steps=2, seed=i, strategy="full", stream=False))
                                for i in range(2)
                            )
                        ),
                        60,
                    )  # one batch of 256 rows for each expert
                    assert [d.images.shape for d in done] == [(128, 1, 32, 32)] * 2
                    assert coord.engine.scheduler.stats.jobs_failed == 0
            finally:
                for w in ws:
                    await w.stop()
        finally:
            await nc.close()
