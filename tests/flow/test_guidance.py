"""flow.guidance: the classifier-free guidance formula and the doubled forward batch, on hand-made arrays."""

from __future__ import annotations

import numpy as np
import pytest

from flow.guidance import add_null_twins, fold_twins, guide, guided_rows


def _rows(*values: float) -> np.ndarray:
    """[len(values), 1, 1, 1] float32, one value per row."""
    return np.array(values, np.float32).reshape(-1, 1, 1, 1)


def test_guide_by_hand():
    v_c, v_n = _rows(3.0, 1.0, -2.0), _rows(1.0, 1.0, 2.0)
    got = guide(v_c, v_n, np.array([2.0, 5.0, 0.0], np.float32))
    np.testing.assert_array_equal(got[:, 0, 0, 0], [5.0, 1.0, 2.0])  # 1 + 2 * 2; equal pair; s = 0: the null one
    assert got.dtype == np.float32 and got.shape == (3, 1, 1, 1)
    np.testing.assert_array_equal(guide(v_c, v_n, 3.0)[:, 0, 0, 0], [7.0, 1.0, -10.0])  # a scalar scale
    # float32 throughout: the same bits as the formula written out in float32
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((2, 4, 3, 5, 5)).astype(np.float32)
    s = np.array([1.5, 2.0, 7.25, 0.5], np.float32)
    np.testing.assert_array_equal(guide(a, b, s), b + s[:, None, None, None] * (a - b))
    with pytest.raises(ValueError, match="one value per row"):
        guide(a, b, np.ones(3, np.float32))
    with pytest.raises(ValueError, match="one shape"):
        guide(a, b[:3], 2.0)


def test_guided_rows_skip_scale_one_and_unknown_labels():
    y = np.array([3, -1, 0, 7, 2], np.int64)
    s = np.array([2.0, 2.0, 1.0, 4.0, 0.0], np.float32)
    np.testing.assert_array_equal(guided_rows(y, s), [0, 3, 4])  # row 1: y = -1; row 2: s = 1
    assert guided_rows(y, 1.0).size == 0 and guided_rows(y, 1.0).dtype == np.int64
    np.testing.assert_array_equal(guided_rows(y, 3.0), [0, 2, 3, 4])


def test_twins_follow_their_rows_and_fold_back():
    x = _rows(10.0, 20.0, 30.0)
    t = np.array([0.1, 0.2, 0.3], np.float32)
    y = np.array([4, -1, 6], np.int64)
    s = np.array([3.0, 3.0, 1.0], np.float32)
    rows = guided_rows(y, s)
    np.testing.assert_array_equal(rows, [0])
    x2, t2, y2 = add_null_twins(x, t, y, rows)
    np.testing.assert_array_equal(x2[:, 0, 0, 0], [10.0, 20.0, 30.0, 10.0])
    np.testing.assert_array_equal(t2, np.array([0.1, 0.2, 0.3, 0.1], np.float32))
    np.testing.assert_array_equal(y2, [4, -1, 6, -1])
    # a "model" whose conditional velocity is y + x and null velocity 1: row 0 guided, rows 1, 2 as given
    v2 = np.where(y2[:, None, None, None] >= 0, x2 + y2[:, None, None, None], np.float32(1.0)).astype(np.float32)
    v2[1] = 0.1  # the unconditional row's own velocity passes through untouched
    v2[2] = np.float32(0.1) + np.float32(0.2)  # an s = 1 row keeps its bits exactly
    got = fold_twins(v2, rows, s)
    assert got.shape == (3, 1, 1, 1) and got.dtype == np.float32
    np.testing.assert_array_equal(got[:, 0, 0, 0], [1.0 + 3.0 * 13.0, np.float32(0.1), v2[2, 0, 0, 0]])


def test_no_guided_rows_is_the_plain_batch():
    x, t, y = _rows(1.0, 2.0), np.zeros(2, np.float32), np.array([1, 2], np.int64)
    x2, t2, y2 = add_null_twins(x, t, y, np.zeros(0, np.int64))
    assert x2 is x and t2 is t and y2.tolist() == [1, 2]
    v = _rows(5.0, 6.0)
    np.testing.assert_array_equal(fold_twins(v, np.zeros(0, np.int64), 1.0), v)
    with pytest.raises(ValueError, match="cannot hold"):
        fold_twins(_rows(1.0), np.array([0, 1, 2]), 2.0)


def test_scale_one_is_not_the_identity_in_float32():
    """Why rows with s = 1 never go through the formula: v_n + 1 * (v_c - v_n) can differ from v_c."""
    v_c, v_n = _rows(0.1), _rows(1e8)
    assert guide(v_c, v_n, 1.0)[0, 0, 0, 0] != v_c[0, 0, 0, 0]
    y, s = np.array([0], np.int64), np.ones(1, np.float32)
    assert guided_rows(y, s).size == 0  # so a job at s = 1 computes exactly what it did unguided
