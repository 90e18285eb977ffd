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
