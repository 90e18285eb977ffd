"""`ddm-fleet bench fleet` under load: every job is counted (completed, rejected with its code,
failed, lost), admission control rejects what exceeds the coordinator's limits, and the peak RSS
of every fleet process is reported. Real processes: nats-server, `ddm-fleet coordinator`, one
`ddm-fleet worker` per expert (tiny random UNets)."""

from __future__ import annotations

import argparse
import asyncio
import time

import pytest

from benchmarks import fleet as bench
from bus.connect import flushed


def _args(**kw):
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    a = p.parse_args([])
    for k, v in kw.items():
        setattr(a, k, v)
    return a


@pytest.mark.slow  # 3-7 s: load runs through a real fleet
@pytest.mark.bus
async def test_load_through_the_fleet_counts_every_job_and_reports_memory(tmp_path):
    # 10 clients fit the limits (20 running + 20 queued); of 150 at once, at least 40 are admitted
    # and the rest must be rejected with `overloaded`, never dropped; the 150 level runs twice.
    # Each client runs 2 jobs back to back (the second after its first completed or was rejected).
    args = _args(
        concurrency="10,150,150",
        jobs_per_client=2,
        steps=4,
        widths="8,16,32",
        checkpoints=str(tmp_path / "none"),
        buckets="1,8,32",
        threads=1,
        only="fleet",
        max_rows=20,
        max_queued_jobs=20,
        job_timeout=60.0,
        min_level_s=0.0,  # exactly 2 jobs per client
        limit_batches="none",
        run_ahead=0,  # (a level's last few jobs would run ahead, and steps a run streams are not guessed)
    )
    t0 = time.monotonic()
    res = await bench.bench_fleet(args)
    elapsed = time.monotonic() - t0
    assert [r["concurrency"] for r in res["rows"]] == [10, 150, 150]
    assert all("ceiling" not in r for r in res["rows"])
    levels = [r["fleet"] for r in res["rows"]]
    for c, x in zip((10, 150, 150), levels):
        assert x["submitted"] == 2 * c
        assert x["completed"] + x["rejected"] == x["submitted"], x
        assert x["lost"] == 0 and x["failed"] == 0, x
        assert x["images"] == x["completed"] and x["images_per_s"] > 0
        # the coordinator process counted the same: what it refused, what it finished, nothing left held
        co = x["coordinator"]
        assert co["jobs_rejected"] == x["rejected"] and co["jobs_done"] == x["completed"], (co, x)
        assert co["active_jobs_after"] == 0 and co["queued_jobs_after"] == 0
        assert x["answer_p99_s"] is not None and x["answer_p99_s"] < 60
        assert x["peak_reset"] is True
        # speculation: every evaluation but a job's first went out before the router spoke (1 image, 4 steps)
        g = x["speculation"]
        assert g["rows_guessed"] == 3 * x["completed"] and 0 <= g["rows_guessed_unused"] <= g["rows_guessed"], g
        assert set(x["memory"]) == {"coordinator", "worker0", "worker1", "nats-server", "bench (clients)"}
        for name, m in x["memory"].items():
            assert m["peak"] > 0 and m["rss"] > 0 and m["peak"] >= m["rss"], (name, m)
    assert levels[0]["completed"] == 20 and levels[0]["rejected"] == 0
    for x in levels[1:]:
        assert 0 < x["rejected"] <= 300 - 40 and x["completed"] >= 40
        assert x["rejected_codes"] == {"overloaded": x["rejected"]}
    # the same load again leaves the coordinator no bigger (a loose bound: allocator noise, no leak)
    assert levels[2]["memory"]["coordinator"]["rss"] < levels[1]["memory"]["coordinator"]["rss"] + 50 * 2**20
    assert res["setup"]["max_rows"] == 20 and res["setup"]["max_queued_jobs"] == 20
    assert all(m["peak"] > 0 for m in res["fleet_memory_at_start"].values())

    table = bench.format_table(res)
    assert f"overloaded:{levels[1]['rejected']}" in table and "LOST" in table
    assert f"speculate on ({levels[0]['speculation']['rows_guessed']} rows guessed" in table
    for name in ("coordinator", "worker0", "worker1", "nats-server", "bench (clients)"):
        assert name in table
    assert elapsed < 120, f"bench took {elapsed:.0f} s"


@pytest.mark.slow  # 3-7 s: load runs through a real fleet
async def test_fleet_job_tells_rejected_failed_and_lost_apart(nats_url, nc):
    """The classification the bench relies on, against a real coordinator: no coordinator ->
    rejected (unavailable); no workers -> failed (unavailable); a hung expert -> lost after the
    bound (and the lost jobs are cancelled, so the coordinator holds nothing); over the limits ->
    rejected (overloaded)."""
    from coordinator.local_fleet import LabelRouter
    from coordinator.service import Coordinator
    from schemas import JobRequest, subjects

    def req(i):
        return JobRequest(job_id=f"cls{i}-{time.monotonic_ns()}", count=1, steps=2, seed=i)

    outcome, code, _ = await bench.fleet_job(nc, req(0), 5.0)
    assert (outcome, code) == ("rejected", "unavailable")

    async with Coordinator(
        LabelRouter([0] * 5 + [1] * 5, 2),
        num_experts=2,
        nats_url=nats_url,
        max_rows=1,
        max_queued_jobs=1,
        step_timeout=3.0,
        retries=0,
    ) as coord:
        outcome, code, answer = await bench.fleet_job(nc, req(1), 20.0)
        assert (outcome, code) == ("failed", "unavailable") and answer is not None

        hung = [
            await nc.subscribe(subjects.expert_velocity(k), queue=subjects.expert_queue_group(k)) for k in range(2)
        ]  # experts that take requests and never answer
        await flushed(nc)
        try:
            results = await asyncio.gather(*(bench.fleet_job(nc, req(i), 1.5) for i in range(2, 5)))
        finally:
            for sub in hung:
                await sub.unsubscribe()
        assert sorted((o, c) for o, c, _ in results) == [("lost", None), ("lost", None), ("rejected", "overloaded")]
        st = coord.status()
        assert st.jobs_rejected == 1 and st.jobs_cancelled == 2
        assert st.active_jobs == 0 and st.queued_jobs == 0


@pytest.mark.slow  # 3-7 s: load runs through a real fleet
async def test_jobs_finishing_together_are_not_reported_lost_by_the_status_probe(nats_url, nc, tiny_expert_checkpoint):
    """Regression (found by `bench fleet --concurrency 1000`: 1 of 1000 jobs failed with "coordinator lost
    the job" although the coordinator finished it): many jobs finish in one tick, more than the
    coordinator keeps for status requests, while their clients probe. A probe answered "unknown" after
    the job's DoneEvent was published must not fail the job: run_job reads the events that came first."""
    from client.jobs import JobFailed, run_job
    from coordinator.local_fleet import LabelRouter
    from coordinator.service import Coordinator
    from schemas import JobRequest
    from workers.service import ExpertWorker

    async def one(i):
        try:
            await run_job(
                nc,
                JobRequest(job_id=f"probe{i}-{time.monotonic_ns()}", count=1, steps=3, seed=i, stream=False),
                probe_every=0.05,
                timeout=60,
            )
            return "done"
        except JobFailed as err:
            return f"{err.code.value}: {err.reason}"

    async with ExpertWorker(0, tiny_expert_checkpoint, "torch", nats_url=nats_url, buckets=(1, 8, 64)):
        # keep_finished=1: the coordinator forgets a finished job at once, as it does for most of
        # 1000 jobs that finish in the same tick with the default 256
        async with Coordinator(LabelRouter([0] * 10, 1), num_experts=1, nats_url=nats_url, keep_finished=1) as coord:
            for _ in range(4):
                outcomes = await asyncio.gather(*(one(i) for i in range(60)))
                assert [o for o in outcomes if o != "done"] == []
            assert coord.status().jobs_done == 240 and coord.status().jobs_failed == 0
