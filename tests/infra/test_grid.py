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
    with pytest.raises(ValueError, match="single-channel"):
        make_grid(np.zeros((2, 3, 8, 8)), nrow=2)
