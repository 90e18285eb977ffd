"""The pure scheduler, driven with hand-made router weights and fake expert velocities."""

from __future__ import annotations

import numpy as np
import pytest

from coordinator.rows import RowGroup, initial_noise
from coordinator.scheduler import Rejected, Scheduler, SchedulerConfig
from flow.solver import sample, time_grid
from schemas import DoneEvent, ErrorCode, FailedEvent, FrameEvent, JobRequest

SHAPE = (1, 4, 4)


def make(num_experts=2, **kw) -> Scheduler:
    return Scheduler(SchedulerConfig(num_experts=num_experts, image_shape=SHAPE, **kw))


def prefer(k: int, K: int = 2):
    """Router that always puts 0.7 on expert k."""

    def router(x, t, y):
        w = np.full((len(y), K), 0.3 / (K - 1))
        w[:, k] = 0.7
        return w

    return router


def class_router(x, t, y):
    """Digits 0-4 -> expert 0, 5-9 -> expert 1, with a little mass on the other."""
    w = np.full((len(y), 2), 0.2)
    w[np.arange(len(y)), (y >= 5).astype(int)] = 0.8
    return w


def fake_velocity(k):
    """A per-row function of (x, t, y) that differs per expert; exact in float32."""

    def v(x, t, y):
        return (-(k + 1) * 0.5 * x + t[:, None, None, None] + 0.1 * y[:, None, None, None]).astype(np.float32)

    return v


def tick(sched, router, velocities, now=0.0, down=()):
    """One schedule -> execute -> update round; returns the batch (or None)."""
    batch = sched.schedule(now)
    if batch is None:
        return None
    batch.route(router(batch.x, batch.t, batch.y))
    while reqs := batch.requests():
        for k, idx in reqs.items():
            if k in down:
                batch.mark_failed(k, "has no responders")
            else:
                batch.record(k, idx, velocities[k](batch.x[idx], batch.t[idx], batch.y[idx]))
    sched.update(batch, now)
    return batch


def run_all(sched, router, velocities, down=(), max_ticks=10_000):
    events = []
    for i in range(max_ticks):
        if tick(sched, router, velocities, now=float(i), down=down) is None:
            break
        events += sched.pop_events()
    return events + sched.pop_events()


def done_of(events, job_id) -> DoneEvent:
    (d,) = [e for e in events if isinstance(e, DoneEvent) and e.job_id == job_id]
    return d


V2 = [fake_velocity(0), fake_velocity(1)]


def test_euler_with_constant_velocity_reaches_x0_plus_c():
    s = make()
    s.submit(JobRequest(job_id="a", digits=[3, 4], steps=7, seed=5), 0.0)
    const = [lambda x, t, y: np.full(x.shape, 0.25, np.float32), lambda x, t, y: np.full(x.shape, 9.0, np.float32)]
    ev = run_all(s, prefer(0), const)
    d = done_of(ev, "a")
    x0 = np.stack([initial_noise(5, i, SHAPE) for i in range(2)])
    np.testing.assert_allclose(d.images, np.clip(x0 + 0.25, -1, 1), atol=1e-5)
    np.testing.assert_array_equal(d.usage, [[1, 0], [1, 0]])
    frames = [e for e in ev if isinstance(e, FrameEvent)]
    assert [f.step for f in frames] == list(range(1, 8))
    np.testing.assert_allclose([f.t for f in frames], time_grid(7)[1:])


def test_heun_takes_two_ticks_per_step_and_matches_hand_computation():
    s = make()
    s.submit(JobRequest(job_id="h", digits=[1], steps=4, solver="heun", seed=1, frame_every=2), 0.0)
    lin = [lambda x, t, y: x.copy(), lambda x, t, y: 0 * x]  # dx/dt = x on expert 0
    frames, ticks = [], 0
    while tick(s, prefer(0), lin) is not None:
        ticks += 1
        # stage 1 evaluates at t[n+1] (x predicted by Euler), stage 0 at t[n]
        frames += [e for e in s.pop_events() if isinstance(e, FrameEvent)]
    assert ticks == 8
    assert [f.step for f in frames] == [2, 4]
    h = 0.25
    x0 = initial_noise(1, 0, SHAPE)
    x = x0.copy()
    for _ in range(4):
        v0 = x
        v1 = x + h * v0
        x = x + h / 2 * (v0 + v1)
    np.testing.assert_allclose(frames[-1].x[0].astype(np.float32), x.astype(np.float16).astype(np.float32), rtol=1e-3)
    np.testing.assert_allclose(x, x0 * (1 + h + h * h / 2) ** 4, rtol=1e-5)


def test_heun_row_eval_points():
    r = RowGroup(job_id="j", y=[0, 1], x=np.ones((2,) + SHAPE, np.float32), steps=2, solver="heun")
    x, t = r.eval_point()
    assert t == 0.0 and np.all(x == 1)
    assert r.advance(np.full((2,) + SHAPE, 2.0, np.float32)) is False and r.stage == 1
    x, t = r.eval_point()
    assert t == 0.5 and np.allclose(x, 2.0)  # 1 + 0.5 * 2
    assert r.advance(np.full((2,) + SHAPE, 4.0, np.float32)) is True
    assert r.step == 1 and r.stage == 0 and np.allclose(r.x, 1 + 0.25 * 6)
    with pytest.raises(ValueError, match="does not match"):
        r.advance(np.zeros((1,) + SHAPE, np.float32))


def test_noise_depends_only_on_seed_and_row_index():
    a = RowGroup.from_seed("a", 42, [1, 2, 3], SHAPE, steps=3)
    b = RowGroup.from_seed("b", 42, [9, 9, 9, 9], SHAPE, steps=7, solver="heun")
    np.testing.assert_array_equal(a.x, b.x[:3])
    assert not np.array_equal(a.x[0], a.x[1])
    assert not np.array_equal(a.x, RowGroup.from_seed("c", 43, [1, 2, 3], SHAPE, steps=3).x)


def test_rows_at_mixed_t_share_a_tick_join_and_leave():
    s = make()
    s.submit(JobRequest(job_id="long", digits=[0, 1], steps=4, seed=1), 0.0)
    tick(s, prefer(0), V2)
    tick(s, prefer(0), V2)
    s.submit(JobRequest(job_id="short", digits=[7], steps=2, solver="heun", strategy="full", seed=2), 0.0)
    b = tick(s, prefer(0), V2)  # short joins now
    np.testing.assert_allclose(b.t, [0.5, 0.5, 0.0])
    assert b.job_ids == ["long", "long", "short"]
    b = tick(s, prefer(0), V2)
    np.testing.assert_allclose(b.t, [0.75, 0.75, 0.5])  # heun stage 1 of short at t[1]
    ev = s.pop_events()
    assert any(isinstance(e, DoneEvent) and e.job_id == "long" for e in ev)
    b = tick(s, prefer(0), V2)
    assert b.job_ids == ["short"]  # long left at once
    np.testing.assert_allclose(b.t, [0.5])
    tick(s, prefer(0), V2)
    assert done_of(s.pop_events(), "short").usage.tolist() == [[1.0, 1.0]]  # full: both experts every eval
    assert s.schedule(10.0) is None


@pytest.mark.parametrize(
    "strategy,expect",
    [
        ("top1", [[1, 0, 0], [0, 0, 1]]),
        ("topk", [[0.6 / 0.9, 0.3 / 0.9, 0], [0.2 / 0.8, 0, 0.6 / 0.8]]),
        ("full", [[0.6, 0.3, 0.1], [0.2, 0.2, 0.6]]),
        ("oracle", [[0, 1, 0], [0, 0, 1]]),
    ],
)
def test_combined_velocity_matches_hand_computation(strategy, expect):
    s = make(3, class_to_expert=[1] * 5 + [2] * 5)
    s.submit(JobRequest(job_id="c", digits=[2, 8], steps=3, strategy=strategy, top_k=2, seed=0), 0.0)
    b = s.schedule(0.0)
    b.route(np.array([[0.6, 0.3, 0.1], [0.2, 0.2, 0.6]]))
    consts = [1.0, 10.0, 100.0]
    for k, idx in b.requests().items():
        b.record(k, idx, np.full((len(idx),) + SHAPE, consts[k], np.float32))
    u = b.combined()
    np.testing.assert_allclose(u[:, 0, 0, 0], np.array(expect) @ consts, rtol=1e-6)
    assert b.requests() == {}


def test_fallback_when_expert_has_no_responders_is_noted():
    s = make()
    s.submit(JobRequest(job_id="f", digits=[6, 1], steps=3, seed=3), 0.0)
    ev = run_all(s, class_router, V2, down={1})
    d = done_of(ev, "f")
    np.testing.assert_array_equal(d.usage, [[1, 0], [1, 0]])
    frame = [e for e in ev if isinstance(e, FrameEvent)][0]
    assert frame.notes == ["row 0: expert 1 has no responders, fell back to 0"]
    assert frame.experts == [0, 0]
    np.testing.assert_allclose(frame.weights[0], [0.2, 0.8])
    assert any("fell back to 0" in n for n in d.notes)


def test_job_fails_when_no_expert_can_serve():
    s = make()
    s.submit(JobRequest(job_id="x", digits=[1], steps=3), 0.0)
    ev = run_all(s, class_router, V2, down={0, 1})
    (f,) = ev
    assert isinstance(f, FailedEvent) and f.code == ErrorCode.UNAVAILABLE and "no expert" in f.reason
    assert s.active_rows == 0


def test_admission_limits_and_fifo_queue():
    s = make(max_rows=4, max_queued_jobs=2)
    with pytest.raises(Rejected) as err:
        s.submit(JobRequest(digits=[1] * 5), 0.0)
    assert err.value.code == ErrorCode.TOO_LARGE
    assert s.submit(JobRequest(job_id="a", digits=[1] * 3, steps=2), 0.0).queue_position == 0  # starts at once
    assert s.submit(JobRequest(job_id="b", digits=[1] * 2, steps=2), 0.0).queue_position == 1  # 3 + 2 > 4
    assert s.submit(JobRequest(job_id="c", digits=[1], steps=2), 0.0).queue_position == 2  # fits, but b was first
    with pytest.raises(Rejected) as err:
        s.submit(JobRequest(job_id="d", digits=[1]), 0.0)
    assert err.value.code == ErrorCode.OVERLOADED
    with pytest.raises(Rejected, match="already in use"):
        s.submit(JobRequest(job_id="a", digits=[1]), 0.0)
    with pytest.raises(Rejected, match="already in use"):
        s.submit(JobRequest(job_id="b", digits=[1]), 0.0)
    assert tick(s, prefer(0), V2).job_ids == ["a"] * 3  # b waits (FIFO), so c waits behind it
    assert s.active_job_ids() == ["a"] and s.active_jobs == 1 and s.queued_jobs == 2 and s.active_rows == 3
    tick(s, prefer(0), V2)  # a finishes
    assert s.schedule(0.0).job_ids == ["b", "b", "c"]
    assert s.stats.jobs_rejected == 4


def test_oracle_without_manifest_is_rejected():
    with pytest.raises(Rejected, match="partition manifest"):
        make().submit(JobRequest(digits=[1], strategy="oracle"), 0.0)


def test_cancel_frees_rows_at_once_even_mid_tick():
    s = make()
    s.submit(JobRequest(job_id="a", digits=[1, 2], steps=5), 0.0)
    s.submit(JobRequest(job_id="b", digits=[3], steps=5), 0.0)
    tick(s, prefer(0), V2)
    s.pop_events()
    b = s.schedule(0.0)
    b.route(prefer(0)(b.x, b.t, b.y))
    assert s.cancel("a", 0.0) is True
    assert s.active_rows == 1
    for k, idx in b.requests().items():
        b.record(k, idx, V2[k](b.x[idx], b.t[idx], b.y[idx]))
    s.update(b, 0.0)  # the in-flight batch skips the cancelled rows
    ev = s.pop_events()
    assert isinstance(ev[0], FailedEvent) and ev[0].code == ErrorCode.CANCELLED
    assert all(e.job_id == "b" for e in ev[1:])
    assert s.schedule(0.0).job_ids == ["b"]
    assert s.cancel("a", 0.0) is False
    assert s.cancel("nope", 0.0) is False


def test_cancel_queued_job():
    s = make(max_rows=1)
    s.submit(JobRequest(job_id="a", digits=[1]), 0.0)
    s.submit(JobRequest(job_id="b", digits=[1]), 0.0)
    s.schedule(0.0)
    assert s.cancel("b", 0.0) and s.queued_jobs == 0


def test_deadline_expires_queued_and_running_jobs():
    s = make(max_rows=1)
    s.submit(JobRequest(job_id="a", digits=[1], steps=50, deadline_s=5), 0.0)
    s.submit(JobRequest(job_id="b", digits=[1], steps=50, deadline_s=2), 0.0)
    tick(s, prefer(0), V2, now=1.0)
    tick(s, prefer(0), V2, now=3.0)  # b expires while queued
    s.schedule(6.0)  # a expires while running
    failed = [e for e in s.pop_events() if isinstance(e, FailedEvent)]
    assert [(f.job_id, f.code) for f in failed] == [
        ("b", ErrorCode.DEADLINE_EXCEEDED),
        ("a", ErrorCode.DEADLINE_EXCEEDED),
    ]
    assert s.active_rows == 0 and s.queued_jobs == 0


def test_seeded_job_is_identical_alone_and_batched_with_100_others():
    req = dict(job_id="me", digits=[0, 5, 9, 3], steps=6, seed=1234, solver="heun", strategy="topk")
    alone = make()
    alone.submit(JobRequest(**req), 0.0)
    img_alone = done_of(run_all(alone, class_router, V2), "me").images

    crowd = make(max_rows=1000)
    rng = np.random.default_rng(0)
    for i in range(60):  # some before ...
        crowd.submit(
            JobRequest(
                job_id=f"o{i}",
                count=int(rng.integers(1, 5)),
                steps=int(rng.integers(1, 10)),
                strategy=["top1", "full", "topk"][i % 3],
                solver=["euler", "heun"][i % 2],
            ),
            0.0,
        )
    tick(crowd, class_router, V2)
    crowd.submit(JobRequest(**req), 0.0)
    for i in range(40):  # ... and some after
        crowd.submit(JobRequest(job_id=f"p{i}", count=3, steps=8, seed=i), 0.0)
    ev = run_all(crowd, class_router, V2)
    np.testing.assert_array_equal(done_of(ev, "me").images, img_alone)
    assert sum(isinstance(e, DoneEvent) for e in ev) == 101


def test_count_jobs_draw_digits_from_seed():
    s = make()
    a = s.submit(JobRequest(count=6, seed=9), 0.0)
    b = s.submit(JobRequest(count=6, seed=9), 0.0)
    assert a.digits == b.digits and a.seed == 9 and all(0 <= d <= 9 for d in a.digits)
    c = s.submit(JobRequest(count=6), 0.0)
    assert c.seed >= 0 and c.job_id != a.job_id


def test_bad_router_weights_are_refused():
    s = make()
    s.submit(JobRequest(digits=[1, 2]), 0.0)
    b = s.schedule(0.0)
    with pytest.raises(ValueError, match=r"\[R, K\]"):
        b.route(np.ones((3, 2)))
    with pytest.raises(ValueError, match="NaN"):
        b.route(np.full((2, 2), np.nan))


def test_config_errors_say_how_to_fix():
    with pytest.raises(ValueError, match="num_experts"):
        SchedulerConfig(num_experts=0)
    with pytest.raises(ValueError, match="max_queued_jobs"):
        SchedulerConfig(num_experts=2, max_queued_jobs=0)
    with pytest.raises(ValueError, match="class_to_expert"):
        SchedulerConfig(num_experts=2, class_to_expert=[0, 1, 2])


@pytest.mark.parametrize("method", ["euler", "heun"])
def test_scheduled_job_ends_where_sample_ends(method):
    """A job stepped by the scheduler (one stage per tick, top1) ends bit for bit where
    flow.solver.sample ends with the same velocity."""
    s = make()
    s.submit(JobRequest(job_id="r", digits=[2, 3, 4], steps=5, solver=method, seed=11), 0.0)
    v = fake_velocity(0)
    img = done_of(run_all(s, prefer(0), [v, fake_velocity(1)]), "r").images
    x0 = np.stack([initial_noise(11, i, SHAPE) for i in range(3)])
    np.testing.assert_array_equal(img, np.clip(sample(v, x0, np.array([2, 3, 4]), 5, method=method), -1, 1))


def test_diverging_job_fails_alone_with_non_finite():
    s = make()
    s.submit(JobRequest(job_id="boom", digits=[1], steps=2, solver="heun"), 0.0)
    s.submit(JobRequest(job_id="fine", digits=[6], steps=2), 0.0)
    # finite velocities (as the wire allows), but heun's v0 + v1 overflows float32
    huge = [lambda x, t, y: np.full(x.shape, 3.4e38, np.float32), fake_velocity(1)]
    ev = run_all(s, class_router, huge)
    (f,) = [e for e in ev if isinstance(e, FailedEvent)]
    assert f.job_id == "boom" and f.code == ErrorCode.NON_FINITE
    assert done_of(ev, "fine").images.shape == (1, 1, 4, 4)


def test_job_progress_and_counts_through_public_methods():
    s = make(max_rows=2)
    a = s.submit(JobRequest(job_id="a", digits=[1, 2], steps=3), 0.0)
    b = s.submit(JobRequest(job_id="b", digits=[3], steps=4), 0.0)
    assert (a.queue_position, b.queue_position) == (0, 1) and not hasattr(a, "events_subject")
    assert s.job_progress("a") == dict(state="running", step=0, steps=3, queue_position=0)
    assert s.job_progress("b") == dict(state="queued", step=0, steps=4, queue_position=1)
    assert s.job_progress("nope") is None and s.knows("b") and not s.knows("nope")
    tick(s, prefer(0), V2)
    assert s.job_progress("a")["step"] == 1
    batch = s.schedule(0.0)
    s.fail_batch(batch, ErrorCode.INTERNAL, "tick broke")
    assert [(e.job_id, e.code) for e in s.pop_events() if isinstance(e, FailedEvent)] == [("a", ErrorCode.INTERNAL)]
    assert s.active_jobs == 0 and s.job_progress("a") is None
    assert s.schedule(0.0).job_ids == ["b"] and s.active_job_ids() == ["b"]


def test_scheduler_names_no_subjects():
    import coordinator.scheduler as mod

    assert "subjects" not in vars(mod)
    assert "schemas.subjects" not in open(mod.__file__).read() and "subjects." not in open(mod.__file__).read()


def test_rows_left_by_a_garbage_answering_expert_fail_with_its_code():
    """Hand-made replies: expert 1 marked failed with bad_reply, expert 0 unavailable."""
    s = make()
    s.submit(JobRequest(job_id="g", digits=[7], steps=2), 0.0)
    s.submit(JobRequest(job_id="u", digits=[8], steps=2), 0.0)
    b = s.schedule(0.0)
    b.route(class_router(b.x, b.t, b.y))
    b.mark_failed(1, "replied with NaN/Inf velocities", ErrorCode.BAD_REPLY)
    b.mark_failed(0, "has no responders")
    assert b.requests() == {}
    s.update(b, 0.0)
    failed = {e.job_id: e for e in s.pop_events()}
    assert failed["g"].code == ErrorCode.BAD_REPLY and "NaN/Inf" in failed["g"].reason
    assert s.stats.row_fallbacks == 2  # both rows lost their experts

    s = make()  # the same without bad replies: unavailable, with the fallback note
    s.submit(JobRequest(job_id="u", digits=[8], steps=2), 0.0)
    b = s.schedule(0.0)
    b.route(class_router(b.x, b.t, b.y))
    b.mark_failed(1, "has no responders")
    b.mark_failed(0, "timed out")
    s.update(b, 0.0)
    (f,) = s.pop_events()
    assert f.code == ErrorCode.UNAVAILABLE and f.reason.startswith("no expert could serve a step (row 0: expert 1")


def test_sampled_job_is_identical_alone_and_amid_other_jobs():
    """strategy sample draws each row's expert from (seed, row, evaluation): the same images (and
    the same experts, in `usage`) alone and batched with other jobs, of every strategy, in any order."""
    req = dict(job_id="me", digits=[-1, -1, 3, -1, 7, -1, -1, -1], steps=7, seed=99, strategy="sample")
    router = prefer(1)  # 0.7 on expert 1, 0.3 on expert 0
    alone = make()
    alone.submit(JobRequest(**req), 0.0)
    done_alone = done_of(run_all(alone, router, V2), "me")

    crowd = make(max_rows=64)
    for i in range(30):
        crowd.submit(
            JobRequest(
                job_id=f"o{i}",
                count=1 + i % 4,
                steps=2 + i % 9,
                seed=i,
                strategy=["sample", "top1", "full", "topk"][i % 4],
                solver=["euler", "heun"][i % 2],
            ),
            0.0,
        )
    tick(crowd, router, V2)
    tick(crowd, router, V2)
    crowd.submit(JobRequest(**req), 0.0)  # joins mid-way, at another offset in the batch
    ev = run_all(crowd, router, V2)
    done_crowd = done_of(ev, "me")
    np.testing.assert_array_equal(done_crowd.images, done_alone.images)
    np.testing.assert_array_equal(done_crowd.usage, done_alone.usage)
    # it did draw: both experts served; under a router whose weights never move, each row keeps the
    # expert of its first draw (one quantile per row for the whole job)
    assert set(np.unique(done_alone.usage)) == {0.0, 1.0}
    assert 0 < done_alone.usage[:, 0].sum() < len(done_alone.usage)
    assert done_alone.strategy == "sample"


def test_sampled_job_draws_from_its_seed():
    """Two seeds, other draws; the same seed, the same draws (the noise alone would differ too, so the
    usage, which only the draws set, is what is compared)."""
    used = []
    for seed in (5, 5, 6):
        s = make()
        s.submit(JobRequest(job_id="j", digits=[-1] * 8, steps=10, seed=seed, strategy="sample"), 0.0)
        used.append(done_of(run_all(s, prefer(0), V2), "j").usage)
    np.testing.assert_array_equal(used[0], used[1])
    assert not np.array_equal(used[0], used[2])
