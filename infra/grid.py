"""Write a PNG grid of generated images.

`write_grid(path, images [N, C, H, W] in [-1, 1], nrow=..., row_labels=...)`: images fill the grid row by
row, grey for C = 1 (or [N, H, W]), RGB for C = 3; optional text labels are drawn in a left margin, one per
row. Pixels: `dataset.images.to_uint8`.
Pure numpy + Pillow.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from dataset.images import to_uint8


def _channels_last(images: np.ndarray) -> np.ndarray:
    """[N, 1, H, W] or [N, H, W] -> [N, H, W]; [N, 3, H, W] -> [N, H, W, 3]; other shapes are a ValueError."""
    a = np.asarray(images)
    if a.ndim == 4:
        if a.shape[1] == 1:
            return a[:, 0]
        if a.shape[1] == 3:
            return a.transpose(0, 2, 3, 1)
        raise ValueError(
            f"a grid shows grey [N, 1, H, W] or RGB [N, 3, H, W] images, got {a.shape} (save them as .npz instead)"
        )
    if a.ndim != 3:
        raise ValueError(f"expected images [N, C, H, W] (C = 1 or 3) or [N, H, W], got shape {a.shape}")
    return a


def make_grid(images: np.ndarray, nrow: int, pad: int = 2, scale: int = 1) -> np.ndarray:
    """Tile images into a uint8 [rows*(H+pad)+pad, nrow*(W+pad)+pad] array (grey), with a trailing axis of
    3 for RGB images [N, 3, H, W]; `nrow` images per row, pad pixels of grey 40 around each."""
    imgs = to_uint8(_channels_last(images))
    if nrow < 1:
        raise ValueError(f"nrow must be >= 1, got {nrow}")
    if scale > 1:
        imgs = imgs.repeat(scale, axis=1).repeat(scale, axis=2)
    n, h, w = imgs.shape[:3]
    rows = max(1, -(-n // nrow))
    canvas = np.full((rows * (h + pad) + pad, nrow * (w + pad) + pad, *imgs.shape[3:]), 40, dtype=np.uint8)
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
    """Write images [N, 1, H, W] (grey) or [N, 3, H, W] (RGB) in [-1, 1] as one PNG; returns the path.

    row_labels: optional text per grid row, drawn in a left margin.
    scale: integer upscaling (nearest) so 32x32 digits are visible.
    """
    from PIL import Image, ImageDraw

    canvas = make_grid(images, nrow, pad=pad, scale=scale)
    mode = "RGB" if canvas.ndim == 3 else "L"
    img = Image.fromarray(canvas)  # uint8 [H, W] -> "L", [H, W, 3] -> "RGB"
    white, black = (255, 0) if mode == "L" else ((255,) * 3, (0,) * 3)
    if row_labels:
        rows = max(1, -(-len(images) // nrow))
        if len(row_labels) != rows:
            raise ValueError(f"{len(row_labels)} row labels for {rows} grid rows")
        h = np.asarray(images).shape[-2] * scale
        margin = 8 + 7 * max(len(s) for s in row_labels)
        out = Image.new(mode, (canvas.shape[1] + margin, canvas.shape[0]), white)
        out.paste(img, (margin, 0))
        draw = ImageDraw.Draw(out)
        for r, label in enumerate(row_labels):
            draw.text((4, pad + r * (h + pad) + h // 2 - 5), str(label), fill=black)
        img = out
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    img.save(path)
    return path
