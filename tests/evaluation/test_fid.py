"""FID's matrix square root against closed forms."""

from __future__ import annotations

import numpy as np
import pytest

from evaluation.fid import fid_from_features, frechet_distance, trace_sqrt_product


def test_trace_sqrt_matches_closed_form_for_commuting_matrices():
    a = np.diag([1.0, 4.0, 9.0])
    b = np.diag([4.0, 1.0, 16.0])
    # sqrt(a b) = diag(2, 2, 12)
    assert trace_sqrt_product(a, b) == pytest.approx(16.0, rel=1e-10)


def test_trace_sqrt_non_commuting_against_eigen_reference():
    rng = np.random.default_rng(0)
    m = rng.standard_normal((6, 6))
    a = m @ m.T + 0.1 * np.eye(6)
    n = rng.standard_normal((6, 6))
    b = n @ n.T + 0.1 * np.eye(6)
    # Reference: eigenvalues of a@b are real, non-negative; Tr sqrt = sum sqrt(eig).
    ref = np.sqrt(np.clip(np.linalg.eigvals(a @ b).real, 0, None)).sum()
    assert trace_sqrt_product(a, b) == pytest.approx(ref, rel=1e-8)


def test_gaussian_fid_closed_form():
    d = 4
    # N(0, I) vs N(m, 4I): |m|^2 + d * (1 + 4 - 2*2) = |m|^2 + d
    m = np.array([1.0, 0.0, 2.0, 0.0])
    assert frechet_distance(np.zeros(d), np.eye(d), m, 4 * np.eye(d)) == pytest.approx(5.0 + d)


def test_fid_of_samples_is_small_for_same_distribution_and_large_for_shifted():
    rng = np.random.default_rng(1)
    a = rng.standard_normal((4000, 8))
    b = rng.standard_normal((4000, 8))
    c = rng.standard_normal((4000, 8)) + 3.0
    assert fid_from_features(a, b) < 0.05
    assert fid_from_features(a, c) == pytest.approx(72.0, rel=0.05)


def test_fid_refuses_too_few_samples():
    with pytest.raises(ValueError):
        fid_from_features(np.zeros((1, 3)), np.zeros((5, 3)))
