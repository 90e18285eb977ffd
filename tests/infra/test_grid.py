"""PNG grids of generated images (infra.grid)."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from infra.grid import make_grid, write_grid


def test_grid_png(tmp_path):
    imgs = np.linspace(-1, 1, 6 * 32 * 32, dtype=np.float32).reshape(6, 1, 32, 32)
    g = make_grid(imgs, nrow=3, pad=2)
    assert g[2, 2] == 0 and g[2 + 34 + 31, 2 + 2 * 34 + 31] == 255  # the first image's first, the last one's last pixel
    assert make_grid(np.full((1, 1, 2, 2), 5.0), nrow=1, pad=0).tolist() == [[255, 255], [255, 255]]  # clipped
    assert g.shape == (2 * 34 + 2, 3 * 34 + 2)
    path = write_grid(tmp_path / "g.png", imgs, nrow=3, row_labels=["a", "b"], scale=2)
    im = Image.open(path)
    assert im.mode == "L" and im.size[1] == 2 * 66 + 2 and im.size[0] > 3 * 66
    # plain grid (no labels) reproduces the pixels
    path = write_grid(tmp_path / "h.png", imgs, nrow=3, scale=1)
    np.testing.assert_array_equal(np.asarray(Image.open(path)), g)
    with pytest.raises(ValueError, match="row labels"):
        write_grid(tmp_path / "x.png", imgs, nrow=3, row_labels=["only one"])
    with pytest.raises(ValueError, match="grey .* or RGB"):
        make_grid(np.zeros((2, 4, 8, 8)), nrow=2)


def test_rgb_grid_holds_each_images_pixels_per_channel(tmp_path):
    """[N, 3, H, W] -> an RGB canvas: tile i at its row/column holds to_uint8 of image i, channels last;
    the padding is grey 40 in every channel; the PNG is RGB with those pixels (labels add a white margin)."""
    from dataset.images import to_uint8

    rng = np.random.default_rng(0)
    imgs = rng.uniform(-1, 1, (5, 3, 4, 6)).astype(np.float32)
    g = make_grid(imgs, nrow=3, pad=2)
    assert g.shape == (2 * 6 + 2, 3 * 8 + 2, 3) and g.dtype == np.uint8
    for i in range(5):
        r, c = divmod(i, 3)
        tile = g[2 + r * 6 : 2 + r * 6 + 4, 2 + c * 8 : 2 + c * 8 + 6]
        np.testing.assert_array_equal(tile, to_uint8(imgs[i]).transpose(1, 2, 0))
    assert (g[:2] == 40).all() and (g[8:, 2 + 2 * 8 :] == 40).all()  # top pad; the empty 6th slot
    path = write_grid(tmp_path / "rgb.png", imgs, nrow=3, scale=1)
    im = Image.open(path)
    assert im.mode == "RGB" and im.size == (3 * 8 + 2, 2 * 6 + 2)
    np.testing.assert_array_equal(np.asarray(im), g)
    big = Image.open(write_grid(tmp_path / "rgb2.png", imgs, nrow=3, scale=2, row_labels=["a", "b"]))
    assert big.mode == "RGB" and big.size[1] == 2 * 10 + 2 and tuple(big.getpixel((0, 0))) == (255, 255, 255)
