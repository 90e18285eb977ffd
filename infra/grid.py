"""Write a PNG grid of generated images.

`write_grid(path, images [N, 1, H, W] in [-1, 1], nrow=..., row_labels=...)`: images fill the grid row by
row; optional text labels are drawn in a left margin, one per row. Pixels: `dataset.images.to_uint8`.
Pure numpy + Pillow.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from dataset.images import to_uint8


def _single_channel(images: np.ndarray) -> np.ndarray:
    """[N, 1, H, W] or [N, H, W] -> [N, H, W] (a view); other shapes are a ValueError."""
    a = np.asarray(images)
    if a.ndim == 4:
        if a.shape[1] != 1:
            raise ValueError(f"expected single-channel images [N, 1, H, W], got {a.shape}")
        a = a[:, 0]
    if a.ndim != 3:
        raise ValueError(f"expected images [N, 1, H, W] or [N, H, W], got shape {a.shape}")
    return a


def make_grid(images: np.ndarray, nrow: int, pad: int = 2, scale: int = 1) -> np.ndarray:
    """Tile images into a uint8 [rows*(H+pad)+pad, nrow*(W+pad)+pad] array, `nrow` images per row."""
    imgs = to_uint8(_single_channel(images))
    if nrow < 1:
        raise ValueError(f"nrow must be >= 1, got {nrow}")
    if scale > 1:
        imgs = imgs.repeat(scale, axis=1).repeat(scale, axis=2)
    n, h, w = imgs.shape
    rows = max(1, -(-n // nrow))
    canvas = np.full((rows * (h + pad) + pad, nrow * (w + pad) + pad), 40, dtype=np.uint8)
    for i in range(n):
        r, c = divmod(i, nrow)
        canvas[pad + r * (h + pad) : pad + r * (h + pad) + h, pad + c * (w + pad) : pad + c * (w + pad) + w] = imgs[i]
    return canvas


def write_grid(
    path: str | Path,
    images: np.ndarray,
    nrow: int = 8,
    row_labels: list[str] | None = None,
    pad: int = 2,
    scale: int = 2,
) -> Path:
    """Write images [N, 1, H, W] in [-1, 1] as one PNG; returns the path.

    row_labels: optional text per grid row, drawn in a left margin.
    scale: integer upscaling (nearest) so 32x32 digits are visible.
    """
    from PIL import Image, ImageDraw

    canvas = make_grid(images, nrow, pad=pad, scale=scale)
    img = Image.fromarray(canvas, mode="L")
    if row_labels:
        rows = max(1, -(-len(images) // nrow))
        if len(row_labels) != rows:
            raise ValueError(f"{len(row_labels)} row labels for {rows} grid rows")
        h = np.asarray(images).shape[-2] * scale
        margin = 8 + 7 * max(len(s) for s in row_labels)
        out = Image.new("L", (canvas.shape[1] + margin, canvas.shape[0]), 255)
        out.paste(img, (margin, 0))
        draw = ImageDraw.Draw(out)
        for r, label in enumerate(row_labels):
            draw.text((4, pad + r * (h + pad) + h // 2 - 5), str(label), fill=0)
        img = out
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    img.save(path)
    return path
