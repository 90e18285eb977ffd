"""Running ahead's pure parts (coordinator/run_ahead.py): which rows may run ahead and how far, and the
check that a streamed velocity is exactly the one a tick would ask for."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from coordinator.rows import RowGroup, step_dts
from coordinator.run_ahead import AheadEnded, AheadRun, AheadStream, plan_ahead
from flow.solver import euler_update, time_grid

SHAPE = (1, 4, 4)


def group(job="a", n=2, steps=10, **kw) -> RowGroup:
    return RowGroup.from_seed(job, 3, [1] * n, SHAPE, steps=steps, num_experts=2, **kw)


def test_the_plan_covers_the_next_steps_of_the_rows_time_grid():
    g = group(steps=10)
    g.step = g.evals = 2
    plan = plan_ahead([g, g], most=4)
    assert plan.steps == 4 and plan.t.shape == plan.dt.shape == (4, 2)
    np.testing.assert_array_equal(plan.t[:, 0], time_grid(10)[3:7].astype(np.float32))
    np.testing.assert_array_equal(plan.dt[:, 1], step_dts(10)[2:6])
    assert plan.t.dtype == plan.dt.dtype == np.float32


def test_no_further_step_than_any_job_has_left():
    a, b = group("a", steps=10), group("b", steps=4)
    b.step = b.evals = 1  # steps 2 and 3 are left after this one
    assert plan_ahead([a, a, b], most=8).steps == 2
    b.step = b.evals = 3  # this is its last step
    assert plan_ahead([a, b], most=8) is None
    assert plan_ahead([a], most=0) is None


@pytest.mark.parametrize(
    "kw, paused",
    [({"solver": "heun"}, False), ({"strategy": "topk"}, False), ({"strategy": "full"}, False), ({}, True)],
)
def test_rows_that_mix_experts_take_heun_steps_or_are_paused_do_not_run_ahead(kw, paused):
    g = group(**kw)
    if paused:
        g.ahead_paused_until = g.evals + 1
    assert plan_ahead([g], most=8) is None
    for strategy in ("top1", "oracle", "sample"):
        assert plan_ahead([group(strategy=strategy)], most=8) is not None


def _stream(steps=3):
    return AheadStream(
        steps, check=lambda data: (np.frombuffer(data, np.float32).reshape(2, *SHAPE), "w1", 1), close=lambda: None
    )


def test_a_run_fits_only_the_same_expert_jobs_position_and_bits():
    g = group()
    plan = plan_ahead([g, g], most=3)
    x = g.x.copy()
    v = np.random.default_rng(0).standard_normal(x.shape).astype(np.float32)
    run = AheadRun.start(0, _stream(), plan, [g, g], x, v)
    g.advance(v)  # the scheduler's own step with that velocity
    assert run.fits(0, [g, g], g.x, np.full(2, plan.t[0, 0]))
    assert not run.fits(1, [g, g], g.x, np.full(2, plan.t[0, 0]))  # the router chose another expert
    assert not run.fits(0, [g, group("b")], g.x, np.full(2, plan.t[0, 0]))  # other rows
    assert not run.fits(0, [g, g], g.x, np.full(2, plan.t[1, 0]))  # another time
    bumped = g.x.copy()
    bumped.view(np.uint32)[0, 0, 0, 0] ^= 1  # one bit off: a velocity mixed from several experts, say
    assert not run.fits(0, [g, g], bumped, np.full(2, plan.t[0, 0]))
    g.advance(v)  # a step the run did not give (e.g. another expert's): the job is one evaluation further
    assert not run.fits(0, [g, g], g.x, np.full(2, plan.t[0, 0]))


def test_taking_a_velocity_moves_the_expectation_one_step_on():
    g = group()
    plan = plan_ahead([g, g], most=2)
    rng = np.random.default_rng(1)
    v0, v1 = (rng.standard_normal(g.x.shape).astype(np.float32) for _ in range(2))
    run = AheadRun.start(0, _stream(2), plan, [g, g], g.x.copy(), v0)
    g.advance(v0)
    assert run.fits(0, [g, g], g.x, g.t * np.ones(2, np.float32)) and run.left == 2
    run.took(g.x.copy(), v1)
    g.advance(v1)
    np.testing.assert_array_equal(run.x_next, euler_update(euler_update(group().x, plan.dt[0], v0), plan.dt[1], v1))
    assert run.fits(0, [g, g], g.x, np.full(2, plan.t[1, 0])) and run.left == 1


async def test_a_stream_gives_its_legs_velocities_in_order_and_ends_on_anything_else():
    v = np.ones((2, *SHAPE), np.float32)

    def check(data: bytes):  # b"<worker>:<ahead_index>"
        worker, index = data.decode().split(":")
        return v, worker, int(index)

    stream = AheadStream(3, check=check, close=lambda: None)
    stream.token = "leg1"  # the leg whose first reply was taken
    for data, leg in ((b"w2:1", "leg2"), (b"w1:1", "leg1"), (b"w1:2", "leg1"), (b"w1:4", "leg1")):
        stream.put(data, leg)  # leg2: the hedged copy of the request, streaming too: skipped
    assert (await stream.next(1.0)).shape == v.shape
    assert stream.received == 1 and stream.dropped == 1
    await stream.next(1.0)
    with pytest.raises(AheadEnded, match="4 came where 3"):
        await stream.next(1.0)
    stalls = []
    quiet = AheadStream(2, check=lambda data: (v, "w", 1), close=lambda: None, on_stall=lambda: stalls.append(1))
    began = asyncio.get_running_loop().time()
    with pytest.raises(AheadEnded, match="no velocity"):
        await quiet.next(10.0)  # waits AHEAD_MIN_WAIT_S (the first reply took no time), not 10 s
    assert stalls == [1] and asyncio.get_running_loop().time() - began < 2
    failing = AheadStream(
        2, check=lambda data: (_ for _ in ()).throw(ValueError("error reply internal")), close=lambda: None
    )
    failing.put(b"x")
    with pytest.raises(AheadEnded, match="error reply internal"):
        await failing.next(1.0)
