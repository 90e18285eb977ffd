"""The coordinator over a real nats-server with real expert workers (tiny random UNets)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from bus.connect import flushed
from client.jobs import JobFailed, cancel_job, fleet_status, run_job
from coordinator.local_fleet import LabelRouter
from coordinator.scheduler import Rejected
from coordinator.service import Coordinator, wait_for_experts
from schemas import (
    DoneEvent,
    ErrorCode,
    FrameEvent,
    JobEvent,
    JobRejected,
    JobRequest,
    SubmitReply,
    pack,
    subjects,
    unpack,
)
from tests.coordinator.helpers import run_ahead_discovered, start_workers, stop_workers
from tests.waiting import wait_until

C2E = [0] * 5 + [1] * 5


async def _workers(nats_url, experts, per_expert=1):
    return await start_workers(nats_url, experts, buckets=(1, 4, 16, 64), dtype="float32", per_expert=per_expert)


def _jobs(n):
    rng = np.random.default_rng(7)
    out = []
    for i in range(n):
        out.append(
            JobRequest(
                digits=[int(d) for d in rng.integers(0, 10, size=int(rng.integers(1, 4)))],
                steps=int(rng.integers(2, 5)),
                seed=1000 + i,
                strategy=["top1", "topk", "full", "oracle"][i % 4],
                solver=["euler", "heun"][(i // 4) % 2],
                stream=bool(i % 3),
            )
        )
    return out


async def test_50_concurrent_jobs_match_their_solo_runs(nats_url, nc, experts):
    ws = await _workers(nats_url, experts)
    try:
        async with Coordinator(
            LabelRouter(C2E, 2), num_experts=2, class_to_expert=C2E, nats_url=nats_url, step_timeout=10
        ) as coord:
            jobs = _jobs(50)
            frames: dict[str, int] = {}

            def count(ev):
                if isinstance(ev, FrameEvent):
                    frames[ev.job_id] = frames.get(ev.job_id, 0) + 1

            crowd = await asyncio.wait_for(asyncio.gather(*(run_job(nc, j, count) for j in jobs)), 120)
            assert coord.engine.scheduler.stats.ticks < sum(j.steps * (1 + (j.solver == "heun")) for j in jobs) / 5
            picked = list(range(10))  # these solo runs cover every strategy x solver pair
            solo = {i: await run_job(nc, jobs[i]) for i in picked}
            status = await fleet_status(nc)
        assert status.jobs_done == 50 + len(picked) and status.active_rows == 0 and status.images_done > 0
        for j, a in zip(jobs, crowd):
            assert isinstance(a, DoneEvent) and a.digits == j.digits
            assert a.images.shape == (len(j.digits), 1, 32, 32)
        assert {(jobs[i].strategy, jobs[i].solver) for i in picked} == {
            (s, v) for s in ("top1", "topk", "full", "oracle") for v in ("euler", "heun")
        }
        for i, b in solo.items():
            np.testing.assert_allclose(crowd[i].images, b.images, atol=2e-4)
            np.testing.assert_allclose(crowd[i].usage, b.usage)
        streamed = [j for j in jobs if j.stream]
        assert all(frames[a.job_id] == j.steps for j, a in zip(jobs, crowd) if j.stream)
        assert len(frames) == len(streamed)
        assert status.rows_per_s > 0 and status.ticks > 0
    finally:
        await stop_workers(ws)


async def test_bad_requests_are_rejected_and_the_coordinator_keeps_serving(nats_url, nc, experts):
    ws = await _workers(nats_url, experts)
    try:
        async with Coordinator(LabelRouter(C2E, 2), num_experts=2, nats_url=nats_url, max_rows=8) as coord:

            async def submit_raw(data: bytes):
                return unpack((await nc.request(subjects.jobs_submit("anon"), data, timeout=5)).data, SubmitReply)

            r = await submit_raw(b"\x00garbage")
            assert isinstance(r, JobRejected) and r.code == ErrorCode.BAD_REQUEST
            r = await submit_raw(pack(JobRequest(digits=[1])).replace(b"\xa1v\x01", b"\xa1v\x07"))
            assert isinstance(r, JobRejected) and r.code == ErrorCode.UNSUPPORTED_VERSION
            with pytest.raises(JobFailed) as err:
                await run_job(nc, JobRequest(digits=[1] * 9))
            assert err.value.code == ErrorCode.TOO_LARGE
            with pytest.raises(JobFailed, match="partition manifest"):
                await run_job(nc, JobRequest(digits=[1], strategy="oracle"))
            # still serving; the in-process API too
            done = await run_job(nc, JobRequest(digits=[2, 8], steps=2, seed=3))
            assert done.images.shape == (2, 1, 32, 32)
            with pytest.raises(Rejected) as rej:
                await coord.submit(JobRequest(digits=[1] * 9))
            assert rej.value.code == ErrorCode.TOO_LARGE
            sub = await nc.subscribe(subjects.job_events("anon", "inproc"))
            # the server must have the SUB before the coordinator (another connection) publishes `accepted`
            await flushed(nc)
            accepted = await coord.submit(JobRequest(job_id="inproc", digits=[4], steps=2, stream=False))
            kinds = [unpack((await sub.next_msg(timeout=30)).data, JobEvent).kind for _ in range(2)]
            assert accepted.events_subject == subjects.job_events("anon", "inproc")
            assert kinds == ["accepted", "done"]
            assert (
                coord.status().jobs_rejected == 5
            )  # 2 undecodable / wrong-version submits + 3 refused by the scheduler
    finally:
        await stop_workers(ws)


async def _scrape(port: int) -> dict:
    """GET /metrics and parse it (prometheus_client's parser raises on invalid exposition):
    {(sample name, frozenset(labels)): value}."""
    import aiohttp
    from prometheus_client.parser import text_string_to_metric_families

    async with aiohttp.ClientSession() as s:
        async with s.get(f"http://127.0.0.1:{port}/metrics") as r:
            assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            text = await r.text()
    return {
        (smp.name, frozenset(smp.labels.items())): smp.value
        for fam in text_string_to_metric_families(text)
        for smp in fam.samples
    }


async def test_metrics_endpoint_counts_a_real_run(nats_url, nc, experts):
    """Only expert 0 has a worker: digit-7 rows fall back to it. Counters move between two scrapes."""
    ws = await _workers(nats_url, experts[:1])
    try:
        async with Coordinator(
            LabelRouter(C2E, 2),
            num_experts=2,
            nats_url=nats_url,
            max_rows=8,
            step_timeout=5,
            metrics_port=0,
            metrics_host="127.0.0.1",
        ) as coord:
            port = coord.metrics_port
            assert port and port > 0
            await run_ahead_discovered(coord.transport, {0: 16})  # only expert 0 is served: its first job runs ahead
            before = await _scrape(port)
            assert before[("ddm_coordinator_ticks_total", frozenset())] == 0
            assert before[("ddm_coordinator_queued_jobs", frozenset())] == 0
            await run_job(nc, JobRequest(digits=[2, 3], steps=3, seed=1))
            await run_job(nc, JobRequest(digits=[7], steps=2, seed=2, solver="heun"))
            with pytest.raises(JobFailed):
                await run_job(nc, JobRequest(digits=[1] * 9))
            r = unpack((await nc.request(subjects.jobs_submit("anon"), b"\x00garbage", timeout=5)).data, SubmitReply)
            assert isinstance(r, JobRejected)
            after = await _scrape(port)

            def at(name, **labels):
                return after.get((name, frozenset(labels.items())), 0.0)

            assert at("ddm_coordinator_ticks_total") == 3 + 4 == coord.status().ticks
            assert at("ddm_coordinator_rows_stepped_total") == 2 * 3 + 1 * 4
            assert at("ddm_coordinator_jobs_accepted_total") == 2
            assert at("ddm_coordinator_jobs_finished_total", outcome="done") == 2
            assert at("ddm_coordinator_jobs_rejected_total", code="too_large") == 1
            assert at("ddm_coordinator_jobs_rejected_total", code="bad_request") == 1
            assert at("ddm_coordinator_row_fallbacks_total") == 4  # the digit-7 row, every evaluation
            assert at("ddm_coordinator_expert_errors_total", expert="1", code="unavailable") == 4
            # the first job's 3 Euler steps: one request that runs 2 steps ahead (--run-ahead); heun: 4 requests
            assert at("ddm_coordinator_expert_request_seconds_count", expert="0") == 1 + 4
            assert at("ddm_coordinator_expert_request_seconds_bucket", expert="0", le="+Inf") == 1 + 4
            assert at("ddm_coordinator_run_ahead_requests_total") == 1
            assert at("ddm_coordinator_rows_run_ahead_total") == 2 * 2
            assert at("ddm_coordinator_run_ahead_steps_wasted_total") == 0
            assert at("ddm_coordinator_expert_request_seconds_sum", expert="0") > 0
            assert at("ddm_coordinator_active_jobs") == 0 and at("ddm_coordinator_active_rows") == 0
        with pytest.raises(OSError):  # the server went away with the coordinator
            await _scrape(port)
    finally:
        await stop_workers(ws)


async def test_metrics_port_taken_is_an_error_unless_optional(nats_url):
    from bus.nats_server import free_port
    from workers.metrics_http import serve_metrics

    port = free_port()
    blocker = await serve_metrics(CollectorRegistry(), port, host="127.0.0.1")
    try:
        with pytest.raises(OSError, match="cannot serve metrics"):
            async with Coordinator(
                LabelRouter(C2E, 2), num_experts=2, nats_url=nats_url, metrics_port=port, metrics_host="127.0.0.1"
            ):
                pass
        async with Coordinator(
            LabelRouter(C2E, 2),
            num_experts=2,
            nats_url=nats_url,
            metrics_port=port,
            metrics_host="127.0.0.1",
            metrics_optional=True,
        ) as coord:
            assert coord.metrics_port is None and coord.metrics is not None
    finally:
        await blocker.cleanup()


async def test_cancel_mid_run_frees_rows(nats_url, nc, experts):
    ws = await _workers(nats_url, experts)
    try:
        async with Coordinator(LabelRouter(C2E, 2), num_experts=2, nats_url=nats_url) as coord:
            seen = asyncio.Event()

            def on(ev):
                if isinstance(ev, FrameEvent) and ev.step >= 2:
                    seen.set()

            req = JobRequest(job_id="cancel-me", digits=[1, 2, 3], steps=1000)
            task = asyncio.create_task(run_job(nc, req, on))
            await asyncio.wait_for(seen.wait(), 30)
            assert await cancel_job(nc, "cancel-me") is True
            with pytest.raises(JobFailed) as err:
                await asyncio.wait_for(task, 10)
            assert err.value.code == ErrorCode.CANCELLED
            assert coord.status().active_rows == 0
            assert await cancel_job(nc, "cancel-me") is False
    finally:
        await stop_workers(ws)


async def test_expert_without_responders_falls_back_with_a_note(nats_url, nc, experts):
    ws = await _workers(nats_url, experts)
    try:
        router = LabelRouter([0, 0, 0, 0, 0, 1, 1, 2, 1, 1], 3)  # expert 2 has no workers at all
        async with Coordinator(router, num_experts=3, nats_url=nats_url):
            notes = []
            done = await run_job(
                nc, JobRequest(digits=[7, 1], steps=3, seed=1), lambda ev: notes.extend(getattr(ev, "notes", []))
            )
        assert notes and notes[0].startswith("row 0: expert 2 has no responders, fell back to")
        assert done.usage[0, 2] == 0 and done.usage[0, :2].sum() == 1
        assert any("fell back" in n for n in done.notes)
    finally:
        await stop_workers(ws)


WORKER_SCRIPT = """
import asyncio, sys
from workers.service import ExpertWorker
async def main():
    opts = dict(buckets=(1, 4, 16), dtype="float32")
    async with ExpertWorker(expert=0, checkpoint=sys.argv[1], nats_url=sys.argv[2], **opts) as w:
        print("ready", flush=True)
        await asyncio.Event().wait()
asyncio.run(main())
"""


@pytest.mark.procs
async def test_killing_one_of_two_worker_processes_loses_no_job(nats_url, nc, experts):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER_SCRIPT, str(experts[0]), nats_url],
            stdout=subprocess.PIPE,
            env=env,
            cwd=os.getcwd(),
        )
        for _ in range(2)
    ]
    from workers.service import ExpertWorker

    w1 = ExpertWorker(expert=1, checkpoint=experts[1], nats_url=nats_url, buckets=(1, 4, 16), dtype="float32")
    await w1.start()
    try:
        for p in procs:
            assert (await asyncio.to_thread(p.stdout.readline)).strip() == b"ready"
        await wait_for_experts(nc, 2, timeout=30)
        # dispatch="queue": the queue group's random pick keeps reaching the frozen worker, which this
        # test needs (join-shortest-queue would mostly avoid it; test_transport_direct_dispatch.py covers that)
        async with Coordinator(
            LabelRouter(C2E, 2), num_experts=2, nats_url=nats_url, step_timeout=1.0, retries=4, dispatch="queue"
        ) as coord:
            progress = time.monotonic()

            def on(ev):
                nonlocal progress
                progress = time.monotonic()

            victim = procs[0]
            victim.send_signal(signal.SIGSTOP)  # frozen but subscribed: the queue group still picks it
            jobs = [JobRequest(digits=[i % 5, (i + 1) % 5], steps=30, seed=i) for i in range(4)]
            progress = time.monotonic()
            tasks = [asyncio.create_task(run_job(nc, j, on)) for j in jobs]
            # a request is stuck on the frozen worker: no job has moved for 0.4 s (well under step_timeout) ...
            await wait_until(
                lambda: time.monotonic() - progress >= 0.4, timeout=60, what="the jobs to stall on the frozen worker"
            )
            assert not any(t.done() for t in tasks)
            victim.kill()  # ... kill it: that request is lost and must be retried on the other worker
            done = await asyncio.wait_for(asyncio.gather(*tasks), 120)
            assert len(done) == 4 and all(d.images.shape == (2, 1, 32, 32) for d in done)
            assert coord.transport.retried >= 1
            assert coord.status().jobs_done == 4
    finally:
        await w1.stop()
        for p in procs:
            p.kill()
            p.wait()


async def test_request_rows_spreads_an_experts_batch_over_its_workers(nats_url, nc, experts):
    ws = await _workers(nats_url, experts, per_expert=2)
    try:
        # hedging off: on a loaded box a hedged second try of a slow request is one more reply than the count
        async with Coordinator(LabelRouter(C2E, 2), num_experts=2, nats_url=nats_url, request_rows=2, hedge="off"):
            done = await run_job(nc, JobRequest(digits=[1] * 8, steps=6, seed=0))
            assert done.images.shape == (8, 1, 32, 32)
        expert0 = [w for w in ws if w.expert == 0]
        assert all(w.metrics.replies > 0 for w in expert0), [w.metrics.replies for w in expert0]
        assert sum(w.metrics.replies for w in expert0) == 4 * 6  # 8 rows in requests of 2, 6 ticks
    finally:
        await stop_workers(ws)


async def test_stopping_does_not_wait_out_a_tick_on_experts_that_never_answer(nats_url, nc):
    """Leaving the context while a tick waits on an expert that holds its request (a 60 s step timeout,
    2 retries): the job fails `unavailable` at once and the coordinator is gone in seconds, not minutes."""
    held = asyncio.Event()

    async def hold(msg):  # takes every expert request, answers none
        held.set()

    subs = [await nc.subscribe(subjects.expert_velocity(k), cb=hold) for k in range(2)]
    await flushed(nc)
    try:
        coord = Coordinator(LabelRouter(C2E, 2), num_experts=2, nats_url=nats_url, step_timeout=60.0, retries=2)
        await coord.__aenter__()
        failed = asyncio.create_task(run_job(nc, JobRequest(job_id="held", digits=[1, 7], steps=4)))
        await asyncio.wait_for(held.wait(), 30)
        started = time.monotonic()
        await asyncio.wait_for(coord.__aexit__(None, None, None), 20)
        took = time.monotonic() - started
        with pytest.raises(JobFailed) as err:
            await asyncio.wait_for(failed, 10)
        assert err.value.code == ErrorCode.UNAVAILABLE and "shutting down" in str(err.value)
        assert took < 10, f"stopping took {took:.1f} s"
    finally:
        for sub in subs:
            await sub.unsubscribe()
