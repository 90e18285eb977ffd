"""workers.batcher: coalescing, bucket padding, chunking, deadlines, failures, loop stays free.

The model here is a plain numpy function (a fake is fine for this pure unit): v = 2x + t + y,
so every output row proves which input row it came from.
"""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.waiting import wait_until
from workers.batcher import (
    Batcher,
    BatcherClosed,
    DeadlineExceeded,
    ModelError,
    bucket_for,
    pad_rows,
    parse_buckets,
    plan_buckets,
)


class RecordingModel:
    """v = 2 x + t + y per row; records the batch sizes it saw; optional delay and failure."""

    def __init__(self, delay: float = 0.0):
        self.calls: list[int] = []
        self.delay = delay
        self.fail_next = False
        self.gate: threading.Event | None = None
        self.entered = threading.Event()  # set when a forward pass has started (before the gate)

    def __call__(self, x, t, y):
        self.entered.set()
        if self.gate is not None:
            self.gate.wait(5)
        if self.delay:
            time.sleep(self.delay)
        self.calls.append(x.shape[0])
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("boom")
        return 2 * x + t[:, None, None, None] + y[:, None, None, None].astype(np.float32)


def rows(n: int, start: float = 0.0):
    x = (np.arange(n, dtype=np.float32)[:, None, None, None] + start) * np.ones((1, 1, 2, 2), np.float32)
    return x, np.full(n, 0.5, np.float32), np.arange(n, dtype=np.int64) % 10


def expected(x, t, y):
    return 2 * x + t[:, None, None, None] + y[:, None, None, None]


def test_parse_and_plan_buckets():
    assert parse_buckets("8, 1,2,2,4") == (1, 2, 4, 8)
    with pytest.raises(ValueError, match="comma-separated"):
        parse_buckets("1,two")
    with pytest.raises(ValueError, match="positive"):
        parse_buckets([0, 4])
    assert plan_buckets((1, 2, 4, 8, 16), 6) == ((1, 2, 4, 8), 6)
    assert plan_buckets((1, 2, 4), None) == ((1, 2, 4), 4)
    with pytest.raises(ValueError, match="larger than the largest bucket"):
        plan_buckets((1, 2, 4), 5)
    assert bucket_for(3, (1, 2, 4, 8)) == 4 and bucket_for(8, (1, 2, 4, 8)) == 8
    a = np.ones((3, 2), np.float32)
    p = pad_rows(a, 4)
    assert p.shape == (4, 2) and (p[3] == 0).all() and pad_rows(a, 3) is a


async def test_single_request_padded_to_bucket_and_unpadded_back():
    model = RecordingModel()
    b = Batcher(model, buckets=(1, 2, 4, 8))
    await b.start()
    x, t, y = rows(3)
    result = await b.submit(x, t, y)
    await b.close()
    assert model.calls == [4]
    assert result.velocity.shape == (3, 1, 2, 2)
    np.testing.assert_array_equal(result.velocity, expected(x, t, y))
    assert result.info.rows == 3 and result.info.bucket == 4


async def test_requests_arriving_while_busy_are_coalesced_into_one_pass():
    model = RecordingModel()
    model.gate = threading.Event()  # hold the first pass until the others are queued
    b = Batcher(model, buckets=(1, 2, 4, 8, 16), max_batch=16)
    await b.start()
    first = b.submit(*rows(1))
    await wait_until(model.entered.is_set, what="the first pass to block in the executor")
    parts = [rows(n, start=10 * i) for i, n in enumerate((2, 3, 4))]
    futs = [b.submit(*p) for p in parts]
    model.gate.set()
    results = await asyncio.gather(first, *futs)
    await b.close()
    assert model.calls == [1, 16]  # 2+3+4 = 9 rows -> one pass padded to 16
    for p, r in zip(parts, results[1:]):
        np.testing.assert_array_equal(r.velocity, expected(*p))
        assert r.info.rows == 9 and r.info.bucket == 16


async def test_max_batch_limits_coalescing():
    model = RecordingModel()
    model.gate = threading.Event()
    b = Batcher(model, buckets=(1, 2, 4, 8), max_batch=4)
    await b.start()
    first = b.submit(*rows(1))
    await wait_until(model.entered.is_set, what="the first pass to block in the executor")
    futs = [b.submit(*rows(3)), b.submit(*rows(2)), b.submit(*rows(2))]
    model.gate.set()
    await asyncio.gather(first, *futs)
    await b.close()
    assert model.calls == [1, 4, 4]  # 3 | 2+2 (never 7 in one pass)


async def test_request_larger_than_max_batch_is_split_into_chunks():
    model = RecordingModel()
    b = Batcher(model, buckets=(1, 2, 4, 8))
    await b.start()
    x, t, y = rows(19)
    result = await b.submit(x, t, y)
    await b.close()
    assert model.calls == [8, 8, 4]  # 8 + 8 + 3 (padded to 4)
    np.testing.assert_array_equal(result.velocity, expected(x, t, y))


async def test_expired_requests_are_not_computed():
    model = RecordingModel()
    model.gate = threading.Event()
    b = Batcher(model, buckets=(1, 2, 4, 8))
    await b.start()
    first = b.submit(*rows(1))
    await wait_until(model.entered.is_set, what="the first pass to block in the executor")
    late = b.submit(*rows(2), deadline=time.time() + 0.01)
    fine = b.submit(*rows(3), deadline=time.time() + 60)
    await asyncio.sleep(0.05)  # the thing under test: the first deadline expires while the model is busy
    model.gate.set()
    with pytest.raises(DeadlineExceeded):
        await late
    assert (await fine).velocity.shape[0] == 3
    await first
    await b.close()
    assert model.calls == [1, 4]  # the expired 2 rows never reached the model


async def test_model_failure_fails_that_batch_only():
    model = RecordingModel()
    b = Batcher(model, buckets=(1, 2, 4))
    await b.start()
    model.fail_next = True
    with pytest.raises(ModelError, match="boom"):
        await b.submit(*rows(2))
    ok = await b.submit(*rows(2))
    await b.close()
    assert ok.velocity.shape[0] == 2


async def test_close_finishes_queued_work_then_refuses_new():
    model = RecordingModel(delay=0.05)
    b = Batcher(model, buckets=(1, 2), max_batch=2)
    await b.start()
    futs = [b.submit(*rows(2)) for _ in range(4)]
    await b.close()
    assert all(f.done() and not f.exception() for f in futs)
    with pytest.raises(BatcherClosed):
        b.submit(*rows(1))


async def test_event_loop_keeps_running_during_a_forward_pass():
    model = RecordingModel(delay=0.4)
    b = Batcher(model, buckets=(1,))
    await b.start()
    fut = b.submit(*rows(1))
    ticks = 0
    while not fut.done():
        await asyncio.sleep(0.01)  # the thing under test: the loop keeps ticking during the pass
        ticks += 1
    await b.close()
    assert ticks >= 10  # the loop ran ~40 times while the model slept in its thread


async def test_observer_sees_rows_and_bucket():
    seen = []
    b = Batcher(RecordingModel(), buckets=(1, 2, 4), observer=lambda r, k, s: seen.append((r, k)))
    await b.start()
    await b.submit(*rows(3))
    await b.close()
    assert seen == [(3, 4)]


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(st.integers(min_value=1, max_value=40), min_size=1, max_size=12),
    buckets=st.sets(st.sampled_from([1, 2, 3, 4, 8, 16]), min_size=1, max_size=6),
    stagger=st.booleans(),
)
def test_any_mix_of_requests_gets_exactly_its_own_rows_back(sizes, buckets, stagger):
    """Property: whatever the sizes and arrival pattern, each request gets model(its rows) and
    every forward pass has a bucket's size."""
    model = RecordingModel()

    async def scenario():
        b = Batcher(model, buckets=sorted(buckets))
        await b.start()
        inputs, futs = [], []
        for i, n in enumerate(sizes):
            p = rows(n, start=100 * i)
            inputs.append(p)
            futs.append(b.submit(*p))
            if stagger and i % 3 == 0:
                await asyncio.sleep(0)
        results = await asyncio.gather(*futs)
        await b.close()
        return inputs, results

    loop = asyncio.new_event_loop()  # a private loop: leaves pytest-asyncio's session loop alone
    try:
        inputs, results = loop.run_until_complete(scenario())
    finally:
        loop.close()
    for p, r in zip(inputs, results):
        np.testing.assert_array_equal(r.velocity, expected(*p))
    assert set(model.calls) <= set(buckets)
    assert sum(model.calls) >= sum(sizes)


async def _passes(model, b, sizes):
    """Hold a first 1-row pass, queue requests of `sizes` behind it, release; the results."""
    model.gate = threading.Event()
    b.inline_max_s = 0  # the first pass is held in the model thread, not on the loop
    await b.start()
    first = b.submit(*rows(1))
    await wait_until(model.entered.is_set, what="the first pass to block in the executor")
    parts = [rows(n, start=10 * i) for i, n in enumerate(sizes)]
    futs = [b.submit(*p) for p in parts]
    model.gate.set()
    results = await asyncio.gather(first, *futs)
    await b.close()
    for p, r in zip(parts, results[1:]):
        np.testing.assert_array_equal(r.velocity, expected(*p))
    return results[1:]


async def test_auto_merge_declines_where_the_forward_cost_grows_with_the_rows():
    # A CPU-like cost (linear in the rows): one pass of 4 costs as much as two of 2, so the two
    # queued requests run one after another and the first one's answer is not held back.
    model = RecordingModel()
    b = Batcher(model, buckets=(1, 2, 4, 8), forward_s={1: 0.01, 2: 0.02, 4: 0.04, 8: 0.08})
    results = await _passes(model, b, (2, 2))
    assert model.calls == [1, 2, 2]
    assert [r.info.rows for r in results] == [2, 2] and b.merges_declined == 1


async def test_auto_merge_merges_where_the_forward_cost_is_mostly_fixed():
    model = RecordingModel()  # a GPU-like cost: 4 rows cost barely more than 2
    b = Batcher(model, buckets=(1, 2, 4, 8), forward_s={1: 0.010, 2: 0.0102, 4: 0.0105, 8: 0.011})
    results = await _passes(model, b, (2, 2))
    assert model.calls == [1, 4] and [r.info.rows for r in results] == [4, 4]
    assert b.merges_declined == 0


async def test_auto_merge_always_fills_the_padding_of_the_bucket_it_needs_anyway():
    model = RecordingModel()  # linear costs, but 3 + 1 rows fit the 4-row bucket the 3 pad to
    b = Batcher(model, buckets=(1, 2, 4, 8), forward_s={1: 0.01, 2: 0.02, 4: 0.04, 8: 0.08})
    await _passes(model, b, (3, 1))
    assert model.calls == [1, 4]


async def test_first_fit_lets_a_small_request_ride_past_one_that_does_not_fit():
    model = RecordingModel()
    b = Batcher(model, buckets=(1, 2, 4), max_batch=4, merge="always")
    results = await _passes(model, b, (3, 3, 1))
    assert model.calls == [1, 4, 4]
    assert [r.info.rows for r in results] == [4, 3, 4]  # 3 + 1 together, then the second 3


async def test_cost_estimates_follow_the_passes_and_bad_merge_mode_is_refused():
    model = RecordingModel(delay=0.02)
    b = Batcher(model, buckets=(1, 2, 4), forward_s={4: 1.0, 16: 1.0})
    assert b.cost_s == {4: 1.0}  # buckets this batcher never runs are ignored
    await b.start()
    await b.submit(*rows(3))
    await b.close()
    assert 0.8 < b.cost_s[4] < 1.0  # moved towards the measured ~0.02 s by COST_EWMA
    with pytest.raises(ValueError, match="merge must be one of auto, always"):
        Batcher(model, buckets=(1, 2), merge="sometimes")


async def test_unpadded_batcher_runs_exactly_the_rows_and_still_decides_merges_by_cost():
    model = RecordingModel()
    b = Batcher(model, buckets=(1, 2, 4, 8), pad=False, forward_s={1: 0.01, 2: 0.02, 4: 0.04, 8: 0.08})
    results = await _passes(model, b, (3, 1))  # linear costs: 3 + 1 is not free without padding
    assert model.calls == [1, 3, 1] and [r.info.bucket for r in results] == [3, 1]
    model2 = RecordingModel()
    b2 = Batcher(model2, buckets=(1, 2, 4, 8), pad=False, forward_s={1: 0.01, 2: 0.0101, 4: 0.0102, 8: 0.0104})
    results = await _passes(model2, b2, (3, 2))  # fixed costs: merged, and 5 rows run as 5
    assert model2.calls == [1, 5] and results[0].info.rows == 5 and results[0].info.bucket == 5
    b3 = Batcher(RecordingModel(delay=0.03), buckets=(1, 2, 4, 8), pad=False, forward_s={4: 0.001})
    await b3.start()
    await b3.submit(*rows(3))
    await b3.close()
    # a 3-row pass of >= 30 ms counts as >= 40 ms for the 4-row bucket: 0.8 * 1 ms + 0.2 * >= 40 ms
    assert b3.cost_s[4] >= 0.0008 + 0.2 * 0.04 * 0.99


def test_only_backends_with_fixed_shapes_pad():
    from workers.backends import get_backend

    assert get_backend("torch", device="cpu").pads_to_buckets is False
    assert get_backend("sim").pads_to_buckets is True  # it models a fixed-shape GPU forward


async def test_a_small_pass_with_nothing_behind_it_runs_on_the_loop_others_in_the_model_thread():
    """One client's steps (a pass of a few rows, its forward estimated under INLINE_MAX_S, nothing queued
    behind it) run on the event loop: the hand-off to the model thread and back would cost more. A large pass,
    a slow bucket, or a pass with requests queued behind it goes to the thread, so decoding them overlaps it."""
    from workers.batcher import INLINE_MAX_S, INLINE_ROWS

    class WhereModel(RecordingModel):
        def __init__(self):
            super().__init__()
            self.threads: list[tuple[int, threading.Thread]] = []

        def __call__(self, x, t, y):
            self.threads.append((x.shape[0], threading.current_thread()))
            return super().__call__(x, t, y)

    loop_thread = threading.current_thread()
    costs = {1: 0.003, 2: 0.004, 4: 0.006, 8: 2 * INLINE_MAX_S}
    model = WhereModel()
    b = Batcher(model, buckets=(1, 2, 4, 8), pad=False, forward_s=costs)
    await b.start()
    for n in (1, INLINE_ROWS, INLINE_ROWS + 1):  # one at a time: nothing queued behind any of them
        r = await b.submit(*rows(n))
        np.testing.assert_array_equal(r.velocity, expected(*rows(n)))
    assert [(n, th is loop_thread) for n, th in model.threads] == [
        (1, True),
        (INLINE_ROWS, True),
        (INLINE_ROWS + 1, False),
    ]
    await b.close()

    # linear costs (merging two 1-row requests does not pay): the first pass has the second request queued
    # behind it and goes to the thread; the second, with nothing behind it, runs on the loop
    queued = WhereModel()
    b1 = Batcher(queued, buckets=(1, 2, 4), pad=False, forward_s={1: 0.005, 2: 0.010, 4: 0.020})
    await b1.start()
    await asyncio.gather(b1.submit(*rows(1)), b1.submit(*rows(1, start=5)))
    await b1.close()
    assert [(n, th is loop_thread) for n, th in queued.threads] == [(1, False), (1, True)]

    slow = WhereModel()
    b2 = Batcher(slow, buckets=(1, 2), pad=False, forward_s={1: 2 * INLINE_MAX_S, 2: 4 * INLINE_MAX_S})
    await b2.start()
    await b2.submit(*rows(1))
    await b2.close()
    assert slow.threads[0][1] is not loop_thread  # a slow forward would block the loop: the thread
    off = WhereModel()
    b3 = Batcher(off, buckets=(1, 2), pad=False, forward_s={1: 0.001, 2: 0.002}, inline_max_s=0)
    await b3.start()
    await b3.submit(*rows(1))
    await b3.close()
    assert off.threads[0][1] is not loop_thread
