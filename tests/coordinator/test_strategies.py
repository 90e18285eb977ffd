"""Routing strategies against hand computations."""

from __future__ import annotations

import numpy as np
import pytest

from coordinator import strategies

W = np.array([[0.6, 0.3, 0.1], [0.2, 0.2, 0.6], [0.1, 0.45, 0.45]])
ALL = np.ones(3, bool)


def test_top1_is_one_hot_argmax():
    np.testing.assert_array_equal(strategies.select("top1", W, ALL), [[1, 0, 0], [0, 0, 1], [0, 1, 0]])


def test_top1_falls_back_to_next_best_available():
    avail = np.array([False, True, True])
    np.testing.assert_array_equal(strategies.select("top1", W, avail), [[0, 1, 0], [0, 0, 1], [0, 1, 0]])


def test_topk_keeps_k_largest_and_renormalises():
    w = strategies.select("topk", W, ALL, top_k=2)
    np.testing.assert_allclose(w[0], [0.6 / 0.9, 0.3 / 0.9, 0])
    np.testing.assert_allclose(w[1], [0.2 / 0.8, 0, 0.6 / 0.8])  # tie 0.2/0.2 -> lower id
    np.testing.assert_allclose(w[2], [0, 0.5, 0.5])
    np.testing.assert_allclose(w.sum(1), 1.0)


def test_topk_per_row_k_and_clamped_to_available():
    w = strategies.select("topk", W, np.array([True, False, True]), top_k=np.array([1, 5, 2]))
    np.testing.assert_allclose(w[0], [1, 0, 0])
    np.testing.assert_allclose(w[1], [0.25, 0, 0.75])
    np.testing.assert_allclose(w[2], [0.1 / 0.55, 0, 0.45 / 0.55])


def test_full_is_router_weighted_over_available():
    np.testing.assert_allclose(strategies.select("full", W, ALL), W)
    w = strategies.select("full", W, np.array([True, True, False]))
    np.testing.assert_allclose(w[1], [0.5, 0.5, 0])


def test_oracle_follows_owner_then_router_when_owner_down():
    owner = np.array([2, 0, -1])
    np.testing.assert_array_equal(strategies.select("oracle", W, ALL, owner=owner), [[0, 0, 1], [1, 0, 0], [0, 1, 0]])
    w = strategies.select("oracle", W, np.array([True, True, False]), owner=owner)
    np.testing.assert_array_equal(w, [[1, 0, 0], [1, 0, 0], [0, 1, 0]])


def test_no_available_expert_gives_zero_weights():
    none = np.zeros(3, bool)
    for s in ("top1", "topk", "full"):
        assert not strategies.select(s, W, none).any()


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match="unknown strategy"):
        strategies.select("best", W, ALL)
    with pytest.raises(ValueError, match="owner"):
        strategies.select("oracle", W, ALL)
    with pytest.raises(ValueError, match=r"\[R, K\]"):
        strategies.select("top1", W, np.ones(2, bool))


# ------------------------------------------------------------ sample (drawn from the router's weights)


def test_draw_uniforms_depend_only_on_seed_row_and_evaluation():
    rows = np.arange(50)
    a = strategies.draw_uniforms(7, rows, 3)
    assert a.shape == (50,) and a.dtype == np.float64 and ((a >= 0) & (a < 1)).all()
    # the same triple gives the same value whatever else is drawn with it, in any order
    np.testing.assert_array_equal(strategies.draw_uniforms(7, rows[::-1], 3), a[::-1])
    np.testing.assert_array_equal(strategies.draw_uniforms(7, np.array([12]), 3), a[12:13])
    mixed = strategies.draw_uniforms(np.array([7, 8, 7]), np.array([12, 12, 5]), np.array([3, 3, 4]))
    assert mixed[0] == a[12] and mixed[1] != a[12] and mixed[2] != a[5]
    # another seed, another draw number: other values
    assert not np.isin(strategies.draw_uniforms(8, rows, 3), a).any()
    assert not np.isin(strategies.draw_uniforms(7, rows, 4), a).any()


def test_draw_uniforms_are_uniform():
    u = strategies.draw_uniforms(0, np.arange(20000), 0)
    counts = np.histogram(u, bins=10, range=(0, 1))[0]
    assert abs(u.mean() - 0.5) < 0.01 and counts.min() > 1800 and counts.max() < 2200


def test_sample_is_inverse_cdf_of_the_router_weights():
    u = np.array([0.0, 0.59, 0.61, 0.89, 0.91, 0.999])  # W[0] = 0.6, 0.3, 0.1
    w = strategies.select("sample", np.repeat(W[:1], 6, 0), ALL, u=u)
    np.testing.assert_array_equal(w.argmax(1), [0, 0, 1, 1, 2, 2])
    np.testing.assert_array_equal(w.sum(1), 1.0)
    assert set(np.unique(w)) == {0.0, 1.0}


def test_sample_frequencies_follow_the_router_probabilities():
    n = 40000
    p = np.array([0.5, 0.3, 0.15, 0.05])
    u = strategies.draw_uniforms(3, np.arange(n), 0)
    share = strategies.select("sample", np.tile(p, (n, 1)), np.ones(4, bool), u=u).mean(0)
    np.testing.assert_allclose(share, p, atol=0.01)
    # top1 on the same rows gives every row to expert 0: the collapse sample avoids
    assert strategies.select("top1", np.tile(p, (n, 1)), np.ones(4, bool)).mean(0)[0] == 1.0


def test_sample_never_draws_unavailable_experts_and_renormalises():
    n = 30000
    p = np.array([0.4, 0.4, 0.2])
    avail = np.array([True, False, True])
    u = strategies.draw_uniforms(11, np.arange(n), 5)
    w = strategies.select("sample", np.tile(p, (n, 1)), avail, u=u)
    assert (w[:, 1] == 0).all() and (w.sum(1) == 1).all()
    np.testing.assert_allclose(w.mean(0), [2 / 3, 0, 1 / 3], atol=0.012)
    # zero weight on every available expert: uniform among them; none available: no expert
    z = strategies.select("sample", np.tile([0.0, 1.0, 0.0], (n, 1)), avail, u=u)
    assert (z[:, 1] == 0).all()
    np.testing.assert_allclose(z.mean(0), [0.5, 0, 0.5], atol=0.012)
    assert not strategies.select("sample", np.tile(p, (3, 1)), np.zeros(3, bool), u=u[:3]).any()


def test_sample_never_draws_a_zero_weight_expert_even_at_the_edges():
    w = np.array([[0.0, 0.5, 0.0, 0.5, 0.0]] * 4)
    u = np.array([0.0, 0.5, 1 - 2**-53, np.nextafter(0.5, 0)])
    got = strategies.select("sample", w, np.ones(5, bool), u=u).argmax(1)
    np.testing.assert_array_equal(got, [1, 3, 3, 1])


def test_sample_needs_uniforms():
    with pytest.raises(ValueError, match="uniform"):
        strategies.select("sample", W, ALL)
    with pytest.raises(ValueError, match=r"u must be \[3\]"):
        strategies.select("sample", W, ALL, u=np.zeros(2))
