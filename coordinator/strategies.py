"""Routing strategies: router weights -> combination weights over experts.

Every function is pure numpy. Input `router_w` is [R, K] (softmax rows from the router),
output `w` is [R, K] with w >= 0 and each row summing to 1 (or all zeros when no expert is
available); the combined velocity of row r is  u_r = sum_k w[r, k] * v_k(x_r, t_r).

* top1:   one-hot at the argmax of the router among available experts (paper's best).
* topk:   the k largest router weights among available experts, renormalised.
* full:   every available expert, router weighted (renormalised over the available ones).
* oracle: one-hot at the partition owning the row's class; if that expert is unavailable,
          the router's best available expert instead.
* sample: one-hot at an expert DRAWN from the router's probabilities (among available experts,
          renormalised) by inverse CDF at the row's own quantile u, fixed for the whole job by
          (job seed, row index) (`draw_uniforms(seed, row)`). At the first evaluation that is a draw
          with the router's probabilities; the row then keeps its quantile, so it keeps its expert
          unless the router's weights move an interval boundary past u, and follows the router's
          choice once it is confident (a one-hot router leaves one interval). A seeded job gets the
          same draws whatever batch its rows ride in. For unconditional rows (label unknown) top1
          commits every row to the router's likeliest expert while x is still near noise, which skews
          the class mix; drawing gives each expert about the router's share of rows (docs/RESULTS.md,
          "Unconditional sampling that keeps the mix"; a fresh draw at every evaluation was measured
          there too, and was worse). One expert per row per evaluation, as top1.

`available` is a [K] bool mask; unavailable experts never get weight, which is how the
engine falls back when an expert has no responders.
"""

from __future__ import annotations

import numpy as np

STRATEGIES = ("top1", "topk", "full", "oracle", "sample")

#: Strategies that need `draw_uniforms` (one uniform per row: `draw_uniforms(seed, row)`).
DRAWN = ("sample",)


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


_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def _splitmix64(z: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser on uint64 [R] (wrapping arithmetic): a well-mixed 64-bit hash."""
    z = z + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def draw_uniforms(seed: int | np.ndarray, row: np.ndarray, draw: int | np.ndarray = 0) -> np.ndarray:
    """[R] float64 uniforms in [0, 1), one per (job seed, row index in its job, draw number).

    A counter-based hash (SplitMix64 chained over the three integers), so each value depends only on
    its own triple, never on which rows share the batch, their order or the batch size; vectorised
    (no generator object per row). `seed` and `draw` broadcast against `row` [R]. Strategy sample
    uses draw 0 at every evaluation (one quantile per row for the whole job)."""
    row = np.asarray(row, dtype=np.int64)
    seed = np.broadcast_to(np.asarray(seed, dtype=np.int64), row.shape)
    ev = np.broadcast_to(np.asarray(draw, dtype=np.int64), row.shape)
    with np.errstate(over="ignore"):
        h = _splitmix64(seed.astype(np.uint64) ^ np.uint64(0x5AD0_D1CE))  # domain tag: routing draws
        h = _splitmix64(h ^ row.astype(np.uint64))
        h = _splitmix64(h ^ ev.astype(np.uint64))
    return (h >> np.uint64(11)).astype(np.float64) * (1.0 / 9007199254740992.0)  # top 53 bits / 2**53


def sample(router_w: np.ndarray, available: np.ndarray, u: np.ndarray) -> np.ndarray:
    """[R, K] router weights + u [R] uniforms in [0, 1) -> one-hot [R, K] at the expert whose interval
    of the cumulative (available, renormalised) router weights holds u (inverse-CDF draw: expert k
    with probability w_k / sum of available w). Rows whose available weights sum to 0 draw uniformly
    among the available experts; unavailable experts are never drawn (zeros if none is available)."""
    r, k = router_w.shape
    w = np.zeros((r, k), np.float64)
    if not available.any() or r == 0:
        return w
    u = np.asarray(u, dtype=np.float64)
    if u.shape != (r,):
        raise ValueError(f"sample needs one uniform per row: u must be [{r}], got {list(u.shape)}")
    p = np.where(available[None, :], np.clip(router_w, 0.0, None), 0.0)
    s = p.sum(axis=1, keepdims=True)
    p = np.where(s > 0, p / np.where(s > 0, s, 1.0), available[None, :] / available.sum())
    cdf = np.cumsum(p, axis=1)
    pick = (u[:, None] >= cdf).sum(axis=1)  # first k with u < cdf[k]
    # rounding can leave cdf[-1] a hair under 1 (u beyond it) or land on an expert of weight 0:
    # take the last available expert with weight at or before the pick
    pick = np.minimum(pick, k - 1)
    ok = p[np.arange(r), pick] > 0
    if not ok.all():
        last = np.where(p > 0, np.arange(k)[None, :], -1)  # [R, K]
        before = np.where(np.arange(k)[None, :] <= pick[:, None], last, -1).max(axis=1)
        first = np.argmax(p > 0, axis=1)
        pick = np.where(ok, pick, np.where(before >= 0, before, first))
    w[np.arange(r), pick] = 1.0
    return w


def select(
    strategy: str,
    router_w: np.ndarray,
    available: np.ndarray,
    *,
    top_k: int | np.ndarray = 2,
    owner: np.ndarray | None = None,
    u: np.ndarray | None = None,
) -> np.ndarray:
    """Dispatch on `strategy` (one of STRATEGIES) for a group of rows sharing it. Returns [R, K].

    `u` [R]: the rows' `draw_uniforms`, needed by the drawn strategies (`DRAWN`)."""
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
    if strategy == "sample":
        if u is None:
            raise ValueError("sample strategy needs one uniform per row (draw_uniforms(seed, row))")
        return sample(router_w, available, u)
    raise ValueError(f"unknown strategy {strategy!r}; use one of {', '.join(STRATEGIES)}")
