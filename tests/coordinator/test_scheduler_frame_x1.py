"""The predicted clean image on frames (`JobRequest.frame_x1` -> `FrameEvent.x1`), pure scheduler units.

x1 = x_t + (1 - t) * u, with u the last combined velocity and t the time after the step: for a
constant velocity c, every frame's x1 is x0 + c (the exact end point), whatever the step.
"""

from __future__ import annotations

import numpy as np

from coordinator.rows import RowGroup, initial_noise
from coordinator.scheduler import Scheduler, SchedulerConfig
from schemas import FrameEvent, JobEvent, JobRequest, pack, unpack
from schemas.wire import loads

SHAPE = (1, 4, 4)


def _frames(request: JobRequest, velocity, weights=(0.7, 0.3)) -> list[FrameEvent]:
    """Run one job to the end with a fixed router and one velocity function for every expert."""
    s = Scheduler(SchedulerConfig(num_experts=2, image_shape=SHAPE))
    s.submit(request, 0.0)
    events = []
    for i in range(10_000):
        batch = s.schedule(float(i))
        if batch is None:
            break
        batch.route(np.tile(np.asarray(weights, np.float64), (len(batch.y), 1)))
        while reqs := batch.requests():
            for k, idx in reqs.items():
                batch.record(k, idx, velocity(batch.x[idx], batch.t[idx]))
        s.update(batch, float(i))
        events += s.pop_events()
    return [e for e in events if isinstance(e, FrameEvent)]


def test_x1_with_a_constant_velocity_is_the_exact_end_point_on_every_frame():
    c = np.float32(0.375)
    frames = _frames(
        JobRequest(job_id="a", digits=[3, 8], steps=5, seed=11, frame_x1=True),
        lambda x, t: np.full(x.shape, c, np.float32),
    )
    assert [f.step for f in frames] == [1, 2, 3, 4, 5]
    x0 = np.stack([initial_noise(11, i, SHAPE) for i in range(2)])
    for f in frames:
        assert f.x1 is not None and f.x1.dtype == np.float16 and f.x1.shape == f.x.shape
        np.testing.assert_allclose(f.x1.astype(np.float32), (x0 + c).astype(np.float16).astype(np.float32), atol=2e-3)
    # the state itself moves: x_t = x0 + t c, so x and x1 differ before the last step and meet at t = 1
    assert not np.allclose(frames[0].x.astype(np.float32), frames[0].x1.astype(np.float32), atol=0.05)
    np.testing.assert_array_equal(frames[-1].x, frames[-1].x1)


def test_x1_uses_the_last_velocity_and_the_time_after_the_step():
    """A velocity that depends on t: x1 = x_after + (1 - t_after) * v(t_before) for Euler."""
    frames = _frames(
        JobRequest(job_id="b", digits=[1], steps=4, seed=2, frame_x1=True, frame_every=2),
        lambda x, t: (1.0 + t[:, None, None, None] * np.ones_like(x)).astype(np.float32),
    )
    assert [f.step for f in frames] == [2, 4]
    x0 = initial_noise(2, 0, SHAPE)
    x2 = x0 + 0.25 * (1.0 + 0.0) + 0.25 * (1.0 + 0.25)  # after steps 1 and 2
    expect = x2 + (1 - 0.5) * (1.0 + 0.25)
    np.testing.assert_allclose(frames[0].x1[0].astype(np.float32), expect, atol=2e-3)


def test_x1_absent_unless_asked_and_off_the_wire():
    frames = _frames(JobRequest(job_id="c", digits=[4], steps=3, seed=1), lambda x, t: np.zeros(x.shape, np.float32))
    assert frames and all(f.x1 is None for f in frames)
    assert "x1" not in loads(pack(frames[0]))  # an older client (no unknown keys) still reads it
    assert "frame_x1" not in loads(pack(JobRequest(digits=[4])))  # an older coordinator still takes it
    asked = _frames(
        JobRequest(job_id="d", digits=[4], steps=3, seed=1, frame_x1=True), lambda x, t: np.zeros(x.shape, np.float32)
    )
    back = unpack(pack(asked[0]), JobEvent)
    assert isinstance(back, FrameEvent) and back.x1 is not None
    np.testing.assert_array_equal(back.x1, asked[0].x1)


def test_row_group_keeps_the_last_combined_velocity():
    r = RowGroup(job_id="j", y=[0], x=np.zeros((1,) + SHAPE, np.float32), steps=2, solver="heun")
    assert r.last_u is None
    r.advance(np.full((1,) + SHAPE, 2.0, np.float32))
    np.testing.assert_array_equal(r.last_u, 2.0)
    r.advance(np.full((1,) + SHAPE, 4.0, np.float32))  # heun corrector: the velocity at t[n+1]
    np.testing.assert_array_equal(r.last_u, 4.0)
