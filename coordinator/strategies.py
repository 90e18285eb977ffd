"""Routing strategies: router weights -> combination weights over experts.

Every function is pure numpy. Input `router_w` is [R, K] (softmax rows from the router),
output `w` is [R, K] with w >= 0 and each row summing to 1 (or all zeros when no expert is
available); the combined velocity of row r is  u_r = sum_k w[r, k] * v_k(x_r, t_r).

* top1:   one-hot at the argmax of the router among available experts (paper's best).
* topk:   the k largest router weights among available experts, renormalised.
* full:   every available expert, router weighted (renormalised over the available ones).
* oracle: one-hot at the partition owning the row's class; if that expert is unavailable,
          the router's best available expert instead.

`available` is a [K] bool mask; unavailable experts never get weight, which is how the
engine falls back when an expert has no responders.
"""

from __future__ import annotations

import numpy as np

STRATEGIES = ("top1", "topk", "full", "oracle")


def _masked(router_w: np.ndarray, available: np.ndarray) -> np.ndarray:
    """Router weights with unavailable experts set to -inf (for ranking)."""
    return np.where(available[None, :], router_w, -np.inf)


def top1(router_w: np.ndarray, available: np.ndarray) -> np.ndarray:
    """[R, K] -> one-hot [R, K] at the best available expert (zeros if none available)."""
    r, k = router_w.shape
    w = np.zeros((r, k), np.float64)
    if not available.any() or r == 0:
        return w
    best = np.argmax(_masked(router_w, available), axis=1)
    w[np.arange(r), best] = 1.0
    return w


def topk(router_w: np.ndarray, available: np.ndarray, k: int | np.ndarray) -> np.ndarray:
    """[R, K] -> the k largest available weights per row, renormalised to sum 1.

    `k` is an int or an [R] int array (per-row k); clamped to the available experts.
    Ties break towards the lower expert id. If the chosen weights sum to 0, they are uniform."""
    r, kk = router_w.shape
    w = np.zeros((r, kk), np.float64)
    n_avail = int(available.sum())
    if n_avail == 0 or r == 0:
        return w
    ks = np.broadcast_to(np.asarray(k, dtype=np.int64), (r,))
    ks = np.clip(ks, 1, n_avail)
    order = np.argsort(-_masked(router_w, available), axis=1, kind="stable")  # best first
    rank = np.empty_like(order)
    np.put_along_axis(rank, order, np.arange(kk)[None, :].repeat(r, 0), axis=1)
    chosen = rank < ks[:, None]
    w = np.where(chosen, np.clip(router_w, 0.0, None), 0.0)
    s = w.sum(axis=1, keepdims=True)
    uniform = chosen / chosen.sum(axis=1, keepdims=True)
    return np.where(s > 0, w / np.where(s > 0, s, 1.0), uniform)


def full(router_w: np.ndarray, available: np.ndarray) -> np.ndarray:
    """[R, K] -> router weights over all available experts, renormalised."""
    return topk(router_w, available, int(router_w.shape[1]))


def oracle(router_w: np.ndarray, available: np.ndarray, owner: np.ndarray) -> np.ndarray:
    """[R, K] + owner [R] (expert owning each row's class) -> one-hot [R, K].

    Rows whose owner is unavailable (or unknown, -1) take the router's best available expert."""
    r, k = router_w.shape
    owner = np.asarray(owner, dtype=np.int64)
    w = top1(router_w, available)
    ok = (owner >= 0) & (owner < k)
    ok[ok] = available[owner[ok]]
    w[ok] = 0.0
    w[np.nonzero(ok)[0], owner[ok]] = 1.0
    return w


def select(
    strategy: str,
    router_w: np.ndarray,
    available: np.ndarray,
    *,
    top_k: int | np.ndarray = 2,
    owner: np.ndarray | None = None,
) -> np.ndarray:
    """Dispatch on `strategy` (one of STRATEGIES) for a group of rows sharing it. Returns [R, K]."""
    router_w = np.asarray(router_w, dtype=np.float64)
    available = np.asarray(available, dtype=bool)
    if router_w.ndim != 2 or available.shape != (router_w.shape[1],):
        raise ValueError(f"router_w must be [R, K] and available [K]; got {router_w.shape} and {available.shape}")
    if strategy == "top1":
        return top1(router_w, available)
    if strategy == "topk":
        return topk(router_w, available, top_k)
    if strategy == "full":
        return full(router_w, available)
    if strategy == "oracle":
        if owner is None:
            raise ValueError("oracle strategy needs the owner expert of each row's class")
        return oracle(router_w, available, owner)
    raise ValueError(f"unknown strategy {strategy!r}; use one of {', '.join(STRATEGIES)}")
