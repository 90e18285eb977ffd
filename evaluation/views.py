"""What each judge sees of an image, and the colour check of colour MNIST.

The project's two MNIST judges read grey digits: float32 [N, 1, 32, 32] in [-1, 1], background -1.
A dataset drawn from MNIST in another form (colour MNIST: RGB, a bright foreground on a dark
background) is judged on its *digit view*: the luminance, with each image's own background (the
median of its border ring) mapped to -1 and its brightest pixels (99.5th percentile) to 1. That
removes the palette and keeps the shape, so "digit accuracy on luminance" reads the same way on
colour and grey images. `digit_view` of a grey 1x32x32 image is the image itself.

`colour_check` reads each image's background (border median) and foreground (the mean colour of the
pixels furthest from the background) and names the nearest palette entry of each: an image is
colour-correct when both lie within `tolerance` of a palette colour (RGB distance in 0..255 units).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

LUMA = np.array([0.299, 0.587, 0.114], np.float32)  # ITU-R 601, as Pillow's "L" conversion
DIGIT_SHAPE = (1, 32, 32)


def border_ring(images: np.ndarray, width: int = 2) -> np.ndarray:
    """[N, C, H, W] -> [N, C, P] the pixels of each image's outer ring of `width` pixels."""
    x = np.asarray(images)
    n, c, h, w = x.shape
    mask = np.zeros((h, w), bool)
    mask[:width, :] = mask[-width:, :] = True
    mask[:, :width] = mask[:, -width:] = True
    return x[:, :, mask]


def area_downsample(images: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Images [N, C, H, W] -> [N, C, h, w] = `shape` by the mean of each (H/h)x(W/w) block, when H and W
    are the same whole multiple of h and w (a 256px colour digit for the 32px judges); images already of
    `shape` come back unchanged. ValueError for any other shape."""
    x = np.asarray(images)
    c, h, w = (int(v) for v in shape)
    if x.ndim != 4 or x.shape[1] != c:
        raise ValueError(f"images must be [N, {c}, H, W], got {list(x.shape)}")
    big_h, big_w = x.shape[2:]
    if (big_h, big_w) == (h, w):
        return x
    f = big_h // h
    if f < 2 or big_h != f * h or big_w != f * w:
        raise ValueError(f"images of {big_h}x{big_w} are not a whole multiple of {h}x{w}")
    return x.reshape(len(x), c, h, f, w, f).mean(axis=(3, 5), dtype=np.float32)


def has_digit_view(shape: tuple[int, ...]) -> bool:
    """Whether images of `shape` [C, H, W] have a digit view the MNIST judges can read."""
    return tuple(shape) in ((1, 32, 32), (3, 32, 32))


def digit_view(images: np.ndarray) -> np.ndarray:
    """Images float [N, C, 32, 32] in [-1, 1] (C = 1 or 3) -> grey digits float32 [N, 1, 32, 32] in [-1, 1].

    Grey images pass through unchanged (clipped to [-1, 1]). RGB images become their luminance,
    rescaled per image from its background (border median) to its 99.5th-percentile brightness.
    """
    x = np.clip(np.asarray(images, np.float32), -1.0, 1.0)
    if x.ndim != 4 or not has_digit_view(x.shape[1:]):
        raise ValueError(f"the digit view needs images [N, 1 or 3, 32, 32], got {list(x.shape)}")
    if x.shape[1] == 1:
        return x
    lum = np.einsum("nchw,c->nhw", x, LUMA)
    bg = np.median(border_ring(lum[:, None]), axis=(1, 2))
    top = np.percentile(lum.reshape(len(lum), -1), 99.5, axis=1)
    span = np.maximum(top - bg, 1e-3)  # a blank image stays at the background
    grey = np.clip((lum - bg[:, None, None]) / span[:, None, None], 0.0, 1.0)
    return (grey * 2.0 - 1.0)[:, None].astype(np.float32)


@dataclass
class ColourReading:
    correct: np.ndarray  # bool [N]: both colours within tolerance of a palette colour
    foreground: np.ndarray  # int [N]: nearest foreground index
    background: np.ndarray  # int [N]: nearest background index
    foreground_error: np.ndarray  # float [N]: RGB distance (0..255 units) to that foreground
    background_error: np.ndarray  # float [N]
    n_backgrounds: int

    @property
    def palette_index(self) -> np.ndarray:
        """The combination index (fg * n_backgrounds + bg, colour MNIST's convention)."""
        return self.foreground * self.n_backgrounds + self.background


def colour_check(
    images: np.ndarray, foregrounds: np.ndarray, backgrounds: np.ndarray, *, tolerance: float = 40.0
) -> ColourReading:
    """images float [N, 3, H, W] in [-1, 1]; foregrounds [F, 3] and backgrounds [B, 3] RGB 0..255.

    Background = the border median; foreground = the mean of the 1% of pixels furthest from the
    background (at least 4): the digit's strokes at full intensity, where MNIST's anti-aliasing blends least.
    """
    x = (np.clip(np.asarray(images, np.float32), -1.0, 1.0) + 1.0) * 127.5
    if x.ndim != 4 or x.shape[1] != 3:
        raise ValueError(f"the colour check needs RGB images [N, 3, H, W], got {list(x.shape)}")
    fg_pal = np.asarray(foregrounds, np.float32)
    bg_pal = np.asarray(backgrounds, np.float32)
    n, _, h, w = x.shape
    bg = np.median(border_ring(x), axis=2)  # [N, 3]
    flat = x.reshape(n, 3, h * w)
    dist = np.linalg.norm(flat - bg[:, :, None], axis=1)  # [N, HW]
    k = max(4, int(round(0.01 * h * w)))
    far = np.argpartition(-dist, k - 1, axis=1)[:, :k]  # [N, k]
    fg = np.take_along_axis(flat, far[:, None, :], axis=2).mean(axis=2)  # [N, 3]
    d_fg = np.linalg.norm(fg[:, None, :] - fg_pal[None], axis=2)  # [N, F]
    d_bg = np.linalg.norm(bg[:, None, :] - bg_pal[None], axis=2)
    fi, bi = d_fg.argmin(1), d_bg.argmin(1)
    fe, be = d_fg[np.arange(n), fi], d_bg[np.arange(n), bi]
    return ColourReading((fe <= tolerance) & (be <= tolerance), fi, bi, fe, be, len(bg_pal))


def palette_arrays(manifest: dict) -> tuple[np.ndarray, np.ndarray] | None:
    """(foregrounds [F, 3], backgrounds [B, 3]) from a prepared dataset's manifest, None when it has no palette."""
    pal = (manifest.get("extra") or {}).get("palette") or manifest.get("palette")
    if not pal or "foreground" not in pal or "background" not in pal:
        return None
    fg = np.array(list(pal["foreground"].values()), np.float32)
    bg = np.array(list(pal["background"].values()), np.float32)
    return fg, bg
