"""dataset.images.to_uint8: the one model-range -> pixel conversion (web tiles, PNG grids, saved eval images)."""

from __future__ import annotations

import numpy as np

from dataset.images import to_uint8
from dataset.mnist import to_model_range


def test_model_range_maps_onto_0_255_clipped_and_non_finite_values_do_not_break_it():
    x = np.array([-1.0, 0.0, 1.0, 5.0, np.nan, np.inf, -np.inf, -3.0], np.float32)
    out = to_uint8(x)
    assert out.dtype == np.uint8 and out.tolist() == [0, 128, 255, 255, 0, 255, 0, 0]


def test_the_shape_is_kept_and_float64_is_rounded_as_float32():
    x = np.linspace(-1, 1, 2 * 1 * 3 * 4).reshape(2, 1, 3, 4)
    assert to_uint8(x).shape == (2, 1, 3, 4)
    np.testing.assert_array_equal(to_uint8(x), to_uint8(x.astype(np.float32)))


def test_halves_round_to_even():
    """(x + 1) * 127.5 landing exactly on k + 0.5 goes to the even neighbour (np.rint), the rounding the saved
    evaluation images have always had (`evaluation.sample_inprocess`); infra.grid's old floor(v + 0.5) went up."""
    x = np.array([0.0, -0.4, -0.4941176474094391], np.float32)
    assert ((x + np.float32(1.0)) * np.float32(127.5)).tolist() == [127.5, 76.5, 64.5]  # exact halves in float32
    assert to_uint8(x).tolist() == [128, 76, 64]


def test_every_pixel_survives_the_round_trip_through_the_model_range():
    """uint8 -> model range (dataset.mnist.to_model_range, evaluation.rescore's p / 127.5 - 1) -> uint8: the
    identity."""
    p = np.arange(256, dtype=np.uint8)
    assert to_uint8(p.astype(np.float32) / 127.5 - 1.0).tolist() == p.tolist()
    digits = np.resize(p, (1, 28, 28))
    assert (to_uint8(to_model_range(digits))[0, 0, 2:30, 2:30] == digits[0]).all()
