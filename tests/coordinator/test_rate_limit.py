"""The per-client token buckets of coordinator.rate_limit, on a hand-driven clock."""

from __future__ import annotations

import pytest

from coordinator.rate_limit import TokenBuckets


def test_a_client_gets_its_burst_then_the_rate_and_others_are_not_touched():
    b = TokenBuckets(rate=2.0, burst=3)
    assert [b.take("a", 0.0) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert b.take("a", 0.0) == pytest.approx(0.5)  # refused: the next token in 0.5 s
    assert b.take("b", 0.0) == 0.0  # another client has its own bucket
    assert b.take("a", 0.25) > 0 and b.take("a", 0.5) == 0.0  # refusals take nothing; 0.5 s brings one
    assert b.take("a", 100.0) == 0.0 and [b.take("a", 100.0) for _ in range(3)][-1] > 0  # refills to burst only
    assert b.refused == 3


def test_buckets_are_bounded_and_checked():
    b = TokenBuckets(rate=1.0, burst=1, max_clients=2)
    for c in "abc":
        b.take(c, 0.0)
    assert len(b._buckets) == 2 and b.take("a", 0.0) == 0.0  # "a" was forgotten: full again
    with pytest.raises(ValueError):
        TokenBuckets(rate=0, burst=1)
