"""Fair sharing in the pure scheduler: per-client quotas, job cost and run-time limits, and fair
admission across clients, driven tick by tick with hand-made router weights and fake velocities."""

from __future__ import annotations

import numpy as np
import pytest

from coordinator.scheduler import Rejected, Scheduler, SchedulerConfig, job_cost
from schemas import DoneEvent, ErrorCode, FailedEvent, JobRequest

SHAPE = (1, 4, 4)


def make(**kw) -> Scheduler:
    return Scheduler(SchedulerConfig(num_experts=2, image_shape=SHAPE, **kw))


def tick(sched: Scheduler, now: float) -> list:
    """One schedule -> execute -> update round with expert 0 answering v = -x; the events."""
    return round_(sched, now)[1]


def round_(sched: Scheduler, now: float):
    """`tick`, returning (the batch's job ids or None, the events)."""
    batch = sched.schedule(now)
    if batch is not None:
        w = np.zeros((len(batch), 2))
        w[:, 0] = 1.0
        batch.route(w)
        while reqs := batch.requests():
            for k, idx in reqs.items():
                batch.record(k, idx, -batch.x[idx])
        sched.update(batch, now)
    return (batch.job_ids if batch is not None else None), sched.pop_events()


def started_at_tick(sched: Scheduler, job_ids, ticks: int) -> dict[str, int]:
    """Run `ticks` ticks; {job id: the tick whose schedule admitted it} for the ids given."""
    seen: dict[str, int] = {}
    for i in range(ticks):
        tick(sched, float(i))
        for j in sched.active_job_ids():
            if j in job_ids:
                seen.setdefault(j, i)
    return seen


def test_light_client_starts_within_one_heavy_job_despite_a_long_heavy_queue():
    """Heavy floods 40 jobs of 2 rows x 4 steps into a 4-row coordinator; light then submits 3
    one-row jobs. Under global FIFO light would wait for all 40 heavy jobs (~80 ticks); fairly,
    each light job starts as soon as rows free up (within one heavy job's 4 ticks) and finishes."""
    s = make(max_rows=4)
    for i in range(40):
        s.submit(JobRequest(job_id=f"h{i}", digits=[1, 2], steps=4, stream=False), 0.0, client="heavy")
    light = [f"l{i}" for i in range(3)]
    for j in light:
        s.submit(JobRequest(job_id=j, digits=[3], steps=4, stream=False), 0.0, client="light")
    assert s.client_usage("heavy") == dict(running_rows=4, queued_jobs=38)
    assert s.client_usage("light") == dict(running_rows=0, queued_jobs=3)
    started = started_at_tick(s, set(light), 20)
    # the first rows freed (tick 4: two heavy jobs done) go to light, then heavy, then light again
    assert started == {"l0": 4, "l1": 4, "l2": 8}, started
    done = {j for j in light if s.job_progress(j) is None}
    assert done == set(light)
    assert s.client_usage("light") == dict(running_rows=0, queued_jobs=0)
    assert s.client_usage("heavy")["queued_jobs"] > 25  # most of heavy's flood still waits: FIFO would starve light


def test_ties_go_round_robin_not_to_the_earliest_job():
    """max_rows 1: A has 3 jobs queued before B's one. When A's first finishes both clients run 0
    rows; B, never admitted, goes before A's second job (FIFO would run a1, a2, a3, b1)."""
    s = make(max_rows=1)
    for j in ("a0", "a1", "a2"):
        s.submit(JobRequest(job_id=j, digits=[1], steps=1, stream=False), 0.0, client="A")
    s.submit(JobRequest(job_id="b0", digits=[1], steps=1, stream=False), 0.0, client="B")
    order = []
    for i in range(6):
        ids, _ = round_(s, float(i))  # admits one job and finishes it (steps=1)
        if ids is None:
            break
        order.append(ids[0])
    assert order == ["a0", "b0", "a1", "a2"]


def test_client_row_quota_throttles_the_heavy_client_and_keeps_rows_for_others():
    s = make(max_rows=8, max_client_rows=4)
    a = [s.submit(JobRequest(job_id=f"h{i}", digits=[1, 2], steps=3), 0.0, client="heavy") for i in range(4)]
    assert [x.queue_position for x in a] == [0, 0, 1, 2]  # two jobs fill heavy's quota; the rest wait
    assert s.active_rows == 4 and s.queued_jobs == 2
    assert s.submit(JobRequest(job_id="l", digits=[1, 2, 3, 4], steps=3), 0.0, client="light").queue_position == 0
    assert s.active_rows == 8 and s.owner_of("l") == "light" and s.owner_of("h3") == "heavy"
    assert s.owner_of("nope") is None
    s.schedule(0.0)
    assert s.client_usage("heavy") == dict(running_rows=4, queued_jobs=2)  # still throttled
    with pytest.raises(Rejected) as err:
        s.submit(JobRequest(digits=[1] * 5), 0.0, client="heavy")
    assert err.value.code == ErrorCode.TOO_LARGE and err.value.limit == "max_client_rows"
    assert "client quota" in err.value.reason and "(limit 4)" in err.value.reason


def test_client_queue_quota_refuses_the_flooder_with_the_limit_and_not_others():
    s = make(max_rows=1, max_client_queued_jobs=3)
    for i in range(4):  # one running, three queued
        s.submit(JobRequest(job_id=f"h{i}", digits=[1]), 0.0, client="heavy")
    with pytest.raises(Rejected) as err:
        s.submit(JobRequest(job_id="h4", digits=[1]), 0.0, client="heavy")
    assert err.value.code == ErrorCode.OVERLOADED and err.value.limit == "max_client_queued_jobs"
    assert err.value.reason.startswith("client quota: 3 queued jobs (limit 3)")
    assert s.submit(JobRequest(job_id="l0", digits=[1]), 0.0, client="light").queue_position == 4
    assert s.stats.rejected_by_limit == {"max_client_queued_jobs": 1} and s.stats.jobs_rejected == 1
    # the global queue limit still applies, and names itself
    g = make(max_rows=1, max_queued_jobs=2, max_client_queued_jobs=2)
    for i, c in enumerate("abc"):
        g.submit(JobRequest(job_id=f"j{i}", digits=[1]), 0.0, client=c)
    with pytest.raises(Rejected) as err:
        g.submit(JobRequest(digits=[1]), 0.0, client="d")
    assert err.value.limit == "max_queued_jobs" and "(limit 2)" in err.value.reason


def test_a_new_session_per_job_does_not_escape_the_client_quotas():
    """A client naming a fresh session for every job ("heavy/s0", "heavy/s1", ...) counts as one
    client: its sessions together stop at max_client_rows running rows and max_client_queued_jobs
    waiting jobs, and another client's job is admitted before heavy's next one."""
    s = make(max_rows=8, max_queued_jobs=8, max_client_rows=4, max_client_queued_jobs=3)
    for i in range(4):  # 2 running (4 rows, heavy's quota), then 2 waiting
        s.submit(JobRequest(job_id=f"h{i}", digits=[1, 2], steps=2), 0.0, client=f"heavy/s{i}")
    s.submit(JobRequest(job_id="h4", digits=[1, 2], steps=2), 0.0, client="heavy/s4")
    assert s.client_usage("heavy") == dict(running_rows=4, queued_jobs=3)
    assert s.client_usage("heavy/s0") == dict(running_rows=2, queued_jobs=0)
    with pytest.raises(Rejected) as err:
        s.submit(JobRequest(job_id="h5", digits=[1]), 0.0, client="heavy/s5")
    assert err.value.code == ErrorCode.OVERLOADED and err.value.limit == "max_client_queued_jobs"
    assert err.value.reason.startswith("client quota: 3 queued jobs (limit 3)")
    with pytest.raises(Rejected) as err:
        s.submit(JobRequest(job_id="h6", digits=[1] * 5), 0.0, client="heavy/s6")
    assert err.value.code == ErrorCode.TOO_LARGE and err.value.limit == "max_client_rows"
    # light starts at once: heavy's waiting jobs are held by heavy's quota, not by free rows
    assert s.submit(JobRequest(job_id="l0", digits=[3] * 4, steps=2), 0.0, client="light/x").queue_position == 0
    assert s.active_rows == 8


def test_session_quotas_apply_within_a_client_and_sessions_share_its_turns():
    """max_session_rows / max_session_queued_jobs bound each "<client>/<session>"; when rows free up,
    the sessions of one client take turns (fewest running rows first), and the client's own quota
    bounds them all."""
    s = make(max_rows=2, max_queued_jobs=16, max_client_queued_jobs=8, max_session_rows=1, max_session_queued_jobs=2)
    with pytest.raises(Rejected) as err:
        s.submit(JobRequest(digits=[1, 2]), 0.0, client="c/a")
    assert err.value.code == ErrorCode.TOO_LARGE and err.value.limit == "max_session_rows"
    for j in ("a0", "a1", "a2"):  # a0 runs (a's 1 row), a1 and a2 wait
        s.submit(JobRequest(job_id=j, digits=[1], steps=1, stream=False), 0.0, client="c/a")
    with pytest.raises(Rejected) as err:
        s.submit(JobRequest(job_id="a3", digits=[1]), 0.0, client="c/a")
    assert err.value.limit == "max_session_queued_jobs" and "session quota: 2 queued jobs (limit 2)" in err.value.reason
    s.submit(JobRequest(job_id="b0", digits=[1], steps=1, stream=False), 0.0, client="c/b")
    assert s.client_usage("c") == dict(running_rows=2, queued_jobs=2)
    order = []
    for i in range(6):
        ids, _ = round_(s, float(i))
        if ids is None:
            break
        order.append(sorted(ids))
    assert order == [["a0", "b0"], ["a1"], ["a2"]]  # session a never runs 2 rows at once
    # (config checks)
    with pytest.raises(ValueError, match="max_session_rows"):
        make(max_session_rows=0)


@pytest.mark.parametrize(
    "solver,strategy,top_k,evals,experts",
    [
        ("euler", "top1", 2, 1, 1),
        ("heun", "top1", 2, 2, 1),
        ("euler", "topk", 2, 1, 2),
        ("euler", "topk", 9, 1, 3),
        ("heun", "full", 2, 2, 3),
        ("euler", "oracle", 2, 1, 1),
    ],
)
def test_job_cost_is_images_steps_evaluations_and_experts(solver, strategy, top_k, evals, experts):
    req = JobRequest(digits=[1, 2, 3, 4], steps=10, solver=solver, strategy=strategy, top_k=top_k)
    assert job_cost(req, 3) == 4 * 10 * evals * experts
    limit = 4 * 10 * evals * experts
    s = Scheduler(
        SchedulerConfig(
            num_experts=3, image_shape=SHAPE, class_to_expert=[0] * 4 + [1] * 3 + [2] * 3, max_job_cost=limit
        )
    )
    s.submit(req, 0.0)  # exactly at the limit: accepted
    tight = Scheduler(
        SchedulerConfig(
            num_experts=3, image_shape=SHAPE, class_to_expert=[0] * 4 + [1] * 3 + [2] * 3, max_job_cost=limit - 1
        )
    )
    with pytest.raises(Rejected) as err:
        tight.submit(req, 0.0)
    assert err.value.code == ErrorCode.TOO_LARGE and err.value.limit == "max_job_cost"
    assert f"job cost {limit} row-evaluations" in err.value.reason and f"limit of {limit - 1}" in err.value.reason


def test_default_cost_limit_refuses_the_hour_long_job_of_the_issue():
    """256 images x 1000 heun steps x full routing over 2 experts: about an hour of fleet time."""
    with pytest.raises(Rejected, match="job cost 1024000 row-evaluations") as err:
        make().submit(JobRequest(count=256, steps=1000, solver="heun", strategy="full"), 0.0)
    assert err.value.limit == "max_job_cost"
    assert make().submit(JobRequest(count=256, steps=1000), 0.0).queue_position == 0  # euler top1: allowed


def test_run_time_limit_counts_from_start_not_from_submit():
    s = make(max_rows=1, max_job_run_s=5.0)
    s.submit(JobRequest(job_id="a", digits=[1], steps=1000), 0.0)
    s.submit(JobRequest(job_id="b", digits=[1], steps=1000), 0.0)  # waits behind a
    s.schedule(4.0)
    assert s.pop_events() == [] and s.active_job_ids() == ["a"]
    s.schedule(5.5)  # a ran 5.5 s > 5 s; b starts now
    (f,) = s.pop_events()
    assert isinstance(f, FailedEvent) and f.job_id == "a" and f.code == ErrorCode.DEADLINE_EXCEEDED
    assert "maximum run time of 5 s" in f.reason
    assert s.active_job_ids() == ["b"] and s.stats.jobs_over_run_time == 1
    s.schedule(10.0)  # b has run 4.5 s: still fine although it was submitted 10 s ago
    assert s.pop_events() == [] and s.active_job_ids() == ["b"]
    s.schedule(10.6)
    assert [e.job_id for e in s.pop_events()] == ["b"]


def test_single_client_defaults_keep_fifo_and_every_job_finishes():
    s = make(max_rows=3)
    ids = [
        s.submit(JobRequest(job_id=f"j{i}", digits=[1] * (1 + i % 3), steps=2, stream=False), 0.0).job_id
        for i in range(9)
    ]
    done, started = [], []
    for i in range(40):
        for j in s.active_job_ids():
            if j not in started:
                started.append(j)
        done += [e.job_id for e in tick(s, float(i)) if isinstance(e, DoneEvent)]
    assert started == ids and sorted(done) == sorted(ids)  # admitted in arrival order
    assert s.client_usage("anon") == dict(running_rows=0, queued_jobs=0)


def test_client_bookkeeping_is_empty_after_cancel_fail_and_done():
    s = make(max_rows=2)
    s.submit(JobRequest(job_id="a", digits=[1, 2], steps=1), 0.0, client="x")
    s.submit(JobRequest(job_id="b", digits=[1], steps=1), 0.0, client="y")
    s.submit(JobRequest(job_id="c", digits=[1], steps=1), 0.0, client="z")
    s.cancel("b", 0.0)
    s.fail("c", ErrorCode.INTERNAL, "test")
    tick(s, 0.0)
    assert s.active_rows == 0 and s.queued_jobs == 0
    assert s._jobs.client_rows == {} and s._jobs.client_queued == {}  # no entry outlives its jobs


def test_limits_are_checked_at_config_time():
    for kw, word in (
        (dict(max_client_rows=0), "max_client_rows"),
        (dict(max_client_queued_jobs=0), "max_client_queued"),
        (dict(max_job_cost=0), "max_job_cost"),
        (dict(max_job_run_s=0), "max_job_run_s"),
    ):
        with pytest.raises(ValueError, match=word):
            make(**kw)
    with pytest.raises(Rejected, match="client key"):
        make().submit(JobRequest(digits=[1]), 0.0, client="")
