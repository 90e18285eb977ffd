"""Fréchet distance between two sets of feature vectors (FID with any feature extractor).

    FD = |mu_a - mu_b|^2 + Tr(S_a + S_b - 2 (S_a^1/2 S_b S_a^1/2)^1/2)

The trace term uses the symmetric form (S_a^1/2 S_b S_a^1/2 is symmetric PSD), computed
with eigendecompositions, so it is exact up to float64 round-off and never returns the
complex garbage a naive `sqrtm(S_a @ S_b)` can.
"""

from __future__ import annotations

import numpy as np


def _psd_sqrt(m: np.ndarray) -> np.ndarray:
    """Square root of a symmetric positive semi-definite matrix [D, D]."""
    w, v = np.linalg.eigh((m + m.T) / 2)
    w = np.clip(w, 0.0, None)
    return (v * np.sqrt(w)) @ v.T


def trace_sqrt_product(s_a: np.ndarray, s_b: np.ndarray) -> float:
    """Tr((S_a S_b)^1/2) for PSD S_a, S_b, via Tr((S_a^1/2 S_b S_a^1/2)^1/2)."""
    ra = _psd_sqrt(s_a)
    inner = ra @ s_b @ ra
    w = np.linalg.eigvalsh((inner + inner.T) / 2)
    return float(np.sqrt(np.clip(w, 0.0, None)).sum())


def gaussian_stats(features: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """features [N, D] -> (mean [D], covariance [D, D]) in float64."""
    f = np.asarray(features, dtype=np.float64)
    if f.ndim != 2 or f.shape[0] < 2:
        raise ValueError(f"need features [N>=2, D], got shape {f.shape}")
    return f.mean(axis=0), np.cov(f, rowvar=False)


def frechet_distance(mu_a, cov_a, mu_b, cov_b) -> float:
    diff = np.asarray(mu_a, np.float64) - np.asarray(mu_b, np.float64)
    tr = np.trace(cov_a) + np.trace(cov_b) - 2.0 * trace_sqrt_product(cov_a, cov_b)
    return float(diff @ diff + max(tr, 0.0))


def fid_from_features(feats_a: np.ndarray, feats_b: np.ndarray) -> float:
    """FID between two feature sets [N_a, D] and [N_b, D]."""
    return frechet_distance(*gaussian_stats(feats_a), *gaussian_stats(feats_b))
