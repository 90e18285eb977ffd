"""evaluation/stats.py: McNemar, Wilson, chi-square, class distributions and the FID bootstrap.

Pure units on hand-computed cases and synthetic features (no judges): fast.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest

from evaluation.fid import fid_from_features
from evaluation.stats import (
    FidReference,
    bootstrap_fid,
    bootstrap_tv_uniform,
    bootstrap_weights,
    chi2_sf,
    class_distribution,
    mcnemar,
    paired_difference,
    recentred_interval,
    single_threaded_blas,
    wilson_interval,
)


def pairs(only_a: int, only_b: int, both: int = 0, neither: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Correctness vectors with the given counts of each (A right?, B right?) combination."""
    a = [True] * only_a + [False] * only_b + [True] * both + [False] * neither
    b = [False] * only_a + [True] * only_b + [True] * both + [False] * neither
    return np.array(a), np.array(b)


def exact_two_sided(k: int, n: int) -> float:
    """Hand formula in exact rationals: 2 * sum_{i <= min(k, n-k)} C(n, i) / 2^n, capped at 1."""
    m = min(k, n - k)
    return float(min(Fraction(1), 2 * Fraction(sum(math.comb(n, i) for i in range(m + 1)), 2**n)))


def test_mcnemar_exact_p_matches_hand_computed_cases():
    # RESULTS.md's 1000-image table: 19 images only the DDM gets right, 10 only the monolith: p = 0.136
    m = mcnemar(*pairs(19, 10, both=950, neither=21))
    assert (m.n, m.only_a, m.only_b, m.discordant) == (1000, 19, 10, 29)
    assert m.p_exact == pytest.approx(exact_two_sided(10, 29), rel=1e-12) and round(m.p, 3) == 0.136
    assert m.method == "exact binomial" and m.p == m.p_exact
    assert m.accuracy_a == pytest.approx(0.969) and m.accuracy_b == pytest.approx(0.96)
    # 0 vs 5: p = 2 / 32; symmetric in A and B
    assert mcnemar(*pairs(0, 5, both=3)).p == pytest.approx(0.0625)
    assert mcnemar(*pairs(5, 0, both=3)).p == pytest.approx(0.0625)
    # balanced discordance, or none at all: no evidence
    assert mcnemar(*pairs(3, 3, both=10)).p == 1.0 and mcnemar(*pairs(0, 0, both=4, neither=2)).p == 1.0
    # large counts: exact in log space still matches the rational formula
    assert mcnemar(*pairs(300, 240)).p_exact == pytest.approx(exact_two_sided(240, 540), rel=1e-9)


def test_mcnemar_normal_approximation_is_continuity_corrected():
    m = mcnemar(*pairs(30, 10))
    z = (abs(30 - 10) - 1) / math.sqrt(40)  # 3.004
    assert m.p_normal == pytest.approx(math.erfc(z / math.sqrt(2)), rel=1e-12)
    assert m.p_normal == pytest.approx(0.00266, abs=2e-5)
    # close to the exact p at this size, and never used while the exact one is affordable
    assert m.p_normal == pytest.approx(m.p_exact, rel=0.25) and m.p == m.p_exact
    with pytest.raises(ValueError, match="equal-length"):
        mcnemar(np.ones(3, bool), np.ones(4, bool))


def test_wilson_interval_textbook_values():
    assert wilson_interval(0, 10) == pytest.approx((0.0, 0.2775), abs=1e-4)
    assert wilson_interval(5, 10) == pytest.approx((0.2366, 0.7634), abs=1e-4)
    lo, hi = wilson_interval(979, 1000)
    assert lo < 0.979 < hi and (lo, hi) == pytest.approx((0.9681, 0.9862), abs=1e-4)
    assert wilson_interval(10, 10)[1] == 1.0 and wilson_interval(10, 10)[0] == pytest.approx(0.7225, abs=1e-4)
    assert all(math.isnan(v) for v in wilson_interval(0, 0))
    with pytest.raises(ValueError):
        wilson_interval(11, 10)


def test_chi2_survival_function_closed_forms_and_table_values():
    for x in (0.5, 3.0, 12.0):
        assert chi2_sf(x, 2) == pytest.approx(math.exp(-x / 2))
        assert chi2_sf(x, 1) == pytest.approx(math.erfc(math.sqrt(x / 2)))
    # 5% critical values from the chi-square table: df 9 -> 16.919, df 10 -> 18.307, df 3 -> 7.815
    assert chi2_sf(16.919, 9) == pytest.approx(0.05, abs=1e-4)
    assert chi2_sf(18.307, 10) == pytest.approx(0.05, abs=1e-4)
    assert chi2_sf(7.815, 3) == pytest.approx(0.05, abs=1e-4)
    assert chi2_sf(0.0, 9) == 1.0 and chi2_sf(500.0, 9) < 1e-90


def test_class_distribution_uniform_against_a_single_digit():
    uniform = class_distribution(np.repeat(np.arange(10), 50))
    assert uniform.counts == [50] * 10 and uniform.tv_uniform == pytest.approx(0.0)
    assert uniform.entropy_bits == pytest.approx(math.log2(10)) and uniform.chi2_p == pytest.approx(1.0)
    one = class_distribution(np.full(500, 7))
    assert one.tv_uniform == pytest.approx(0.9) and one.entropy_bits == pytest.approx(0.0) and one.chi2_p < 1e-300
    half = class_distribution(np.array([0] * 250 + [1] * 250))
    assert half.tv_uniform == pytest.approx(0.8) and half.entropy_bits == pytest.approx(1.0)
    assert half.fractions[:2] == [0.5, 0.5] and half.n == 500
    with pytest.raises(ValueError, match=r"\[0, 10\)"):
        class_distribution(np.array([0, 10]))


def test_bootstrap_weights_are_deterministic_resamples():
    w = bootstrap_weights(50, 30, seed=3)
    assert w.shape == (30, 50) and (w.sum(axis=1) == 50).all() and (w >= 0).all()
    assert np.array_equal(w, bootstrap_weights(50, 30, seed=3))  # paired rows get the same draws
    assert not np.array_equal(w, bootstrap_weights(50, 30, seed=4))
    # about 1 - 1/e of the rows appear in a resample
    assert 0.55 < float((w > 0).mean()) < 0.72


def gaussian_features(n: int, shift: float = 0.0, seed: int = 0, d: int = 16) -> np.ndarray:
    rng = np.random.default_rng(seed)
    scale = np.linspace(0.5, 2.0, d)
    return (rng.standard_normal((n, d)) * scale + shift).astype(np.float32)


def test_bootstrap_fid_matches_fid_with_unit_weights_and_its_interval_holds_the_estimate_and_narrows():
    ref_feats = gaussian_features(4000, seed=1)
    ref = FidReference.from_features(ref_feats)
    small, large = gaussian_features(400, shift=0.3, seed=2), gaussian_features(3200, shift=0.3, seed=3)
    # all weights 1: exactly the ordinary FID
    assert bootstrap_fid(small, ref, np.ones((1, 400)))[0] == pytest.approx(
        fid_from_features(small, ref_feats), rel=1e-9
    )
    widths = []
    for feats in (small, large):
        point = fid_from_features(feats, ref_feats)
        samples = bootstrap_fid(feats, ref, bootstrap_weights(len(feats), 100))
        assert samples.shape == (100,) and np.isfinite(samples).all() and samples.std() > 0
        lo, hi = recentred_interval(point, samples)
        assert lo < point < hi
        widths.append(hi - lo)
    # 8x the images: the interval shrinks by about sqrt(8) ~ 2.8
    assert widths[1] < widths[0] / 2


def test_paired_difference_separates_a_shift_from_no_change():
    ref_feats = gaussian_features(4000, seed=1)
    ref = FidReference.from_features(ref_feats)
    w = bootstrap_weights(1000, 100)
    same = gaussian_features(1000, seed=5)
    fid_same = bootstrap_fid(same, ref, w)
    point = fid_from_features(same, ref_feats)
    nothing = paired_difference(point, fid_same, point, fid_same)
    assert nothing.estimate == 0 and nothing.p == 1.0 and nothing.low == nothing.high == 0
    shifted = same + 0.5  # the same rows, every feature moved: a paired, clearly worse configuration
    diff = paired_difference(fid_from_features(shifted, ref_feats), bootstrap_fid(shifted, ref, w), point, fid_same)
    assert diff.estimate > 0 and diff.low > 0 and diff.at_floor and diff.p == pytest.approx(1 / 101)
    # TV of the predicted classes, resampled with the same weights
    pred = np.repeat(np.arange(10), 100)
    tv = bootstrap_tv_uniform(pred, w)
    assert tv.shape == (100,) and (tv >= 0).all() and tv.mean() > 0  # a resample is rarely exactly uniform
    assert bootstrap_tv_uniform(pred, np.ones((1, 1000)))[0] == pytest.approx(0.0)


def test_single_threaded_blas_restores_the_thread_count():
    from evaluation.stats import _loaded_openblas

    libs = _loaded_openblas()
    before = [int(get()) for get, _ in libs]
    with single_threaded_blas():
        assert all(int(get()) == 1 for get, _ in libs)
        np.linalg.eigvalsh(np.eye(8))  # still computes
    assert [int(get()) for get, _ in libs] == before
