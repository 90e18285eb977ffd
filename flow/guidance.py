"""Classifier-free guidance (Ho & Salimans): one model that knows the null label predicts both
v(x, y) and v(x, null), and sampling follows

    v = v(x, null) + s * (v(x, y) - v(x, null))          s = 1: off (v(x, y) itself)

In a DDM the ensemble is linear, so each routed expert guides its own pair and the router's weights
combine the guided velocities: u = sum_k w_k [v_k(x, null) + s (v_k(x, y) - v_k(x, null))].

The one implementation, shared by the expert worker (which forwards a row and its null twin in one
pass), the coordinator's in-process transport and the in-process sampler, so their images agree bit
for bit. A row is guided only when its scale is not 1 and its label is known (y >= 0): a row with
s = 1 never goes through the formula (v_n + 1 * (v_c - v_n) is not always v_c in float32), and an
unconditional row (y = -1) already is the null prediction, so it is never doubled.

    rows = guided_rows(y, scale)                       # [G] rows that get a null twin
    x2, t2, y2 = add_null_twins(x, t, y, rows)         # [B + G]: the rows, then their twins (y = -1)
    v = fold_twins(model(x2, t2, y2), rows, scale)     # [B]: guided where asked, as computed elsewhere
    v = guided_velocity(model, x, t, y, scale)         # the three lines above in one

Arrays: x, v [B, C, H, W] float32; t [B] float32; y [B] int; scale [B] float32 (one per row).
"""

from __future__ import annotations

import numpy as np

#: The null label a twin carries (schemas.UNCONDITIONAL, repeated here: flow sits below schemas' users).
NULL_LABEL = -1


def _scale_rows(scale, n: int) -> np.ndarray:
    """scale (a scalar or [n]) -> [n] float32; ValueError naming the shape otherwise."""
    s = np.asarray(scale, dtype=np.float32)
    if s.ndim == 0:
        return np.full(n, s, np.float32)
    if s.shape != (n,):
        raise ValueError(f"guidance scale must be a scalar or one value per row [{n}], got shape {list(s.shape)}")
    return s


def guide(v_cond: np.ndarray, v_null: np.ndarray, scale) -> np.ndarray:
    """v_null + s * (v_cond - v_null) in float32: v_cond, v_null [G, C, H, W], scale a scalar or [G]
    (one per row, broadcast over C, H, W) -> [G, C, H, W] float32. Applies the formula to every row,
    s = 1 included: callers leave rows with s = 1 out (`guided_rows`)."""
    v_cond = np.asarray(v_cond, dtype=np.float32)
    v_null = np.asarray(v_null, dtype=np.float32)
    if v_cond.shape != v_null.shape:
        raise ValueError(f"v_cond {list(v_cond.shape)} and v_null {list(v_null.shape)} must have one shape")
    s = _scale_rows(scale, v_cond.shape[0]).reshape((v_cond.shape[0],) + (1,) * (v_cond.ndim - 1))
    with np.errstate(over="ignore", invalid="ignore"):  # overflow gives Inf, which the callers check
        return (v_null + s * (v_cond - v_null)).astype(np.float32, copy=False)


def guided_rows(y: np.ndarray, scale) -> np.ndarray:
    """[G] int64, ascending: the rows that are guided, i.e. whose scale is not 1 and whose label is
    known (y >= 0). y [B] int, scale a scalar or [B]."""
    y = np.asarray(y)
    s = _scale_rows(scale, y.shape[0])
    return np.nonzero((s != np.float32(1.0)) & (y >= 0))[0].astype(np.int64)


def add_null_twins(
    x: np.ndarray, t: np.ndarray, y: np.ndarray, rows: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The forward batch of a guided request: x [B, C, H, W], t [B], y [B] followed by a twin of each
    row in `rows` ([G], from `guided_rows`) at the same x and t with y = -1 (the null label)
    -> (x [B + G, C, H, W], t [B + G], y [B + G] int64). No copy when G = 0."""
    y = np.asarray(y, dtype=np.int64)
    if len(rows) == 0:
        return x, t, y
    x2 = np.concatenate([x, x[rows]])
    t2 = np.concatenate([t, t[rows]])
    y2 = np.concatenate([y, np.full(len(rows), NULL_LABEL, np.int64)])
    return x2, t2, y2


def fold_twins(v: np.ndarray, rows: np.ndarray, scale) -> np.ndarray:
    """The velocities of a batch made by `add_null_twins`, v [B + G, C, H, W], back to [B, C, H, W]
    float32: row r in `rows` gets guide(v[r], v[its twin], scale[r]); every other row is v[r] as the
    model gave it (bit for bit). scale: a scalar or [B]."""
    g = len(rows)
    n = v.shape[0] - g
    if n < 0:
        raise ValueError(f"{v.shape[0]} velocity rows cannot hold {g} null twins")
    if g == 0:
        return np.asarray(v, dtype=np.float32)
    out = np.array(v[:n], dtype=np.float32)  # a copy: the guided rows are written below
    out[rows] = guide(out[rows], v[n:], _scale_rows(scale, n)[rows])
    return out


def guided_velocity(forward, x: np.ndarray, t: np.ndarray, y: np.ndarray, scale) -> np.ndarray:
    """forward(x, t, y) -> v [B, C, H, W] with classifier-free guidance at `scale` (a scalar or [B]; 1: the
    forward itself, untouched): the guided rows and their null twins go through `forward` in one call, the
    rows first, then the twins, as an expert worker forwards them."""
    s = _scale_rows(scale, len(y))
    if not (s != np.float32(1.0)).any():
        return forward(x, t, y)
    rows = guided_rows(y, s)
    return fold_twins(forward(*add_null_twins(x, t, y, rows)), rows, s)
