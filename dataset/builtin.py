"""The built-in prepared datasets, made from the MNIST cache (`dataset/mnist.py`): mnist and colour-mnist.

* ``mnist``: grey 1x32x32, the 28x28 digits zero-padded by 2 (as `load_mnist` pads them), labels the
  digit; ``to_model_range`` of it equals `load_mnist`'s images bit for bit.
* ``colour-mnist``: RGB 3x32x32. Each digit is drawn with a foreground colour on a background colour:
  pixel = bg + (fg - bg) * p / 255 (p the MNIST intensity, padding p = 0, so the whole border is
  background), rounded to uint8. The (fg, bg) pair, its *palette index*, is drawn uniformly from
  :data:`COMBINATIONS` (4 foregrounds x 3 backgrounds = 12) by ``np.random.default_rng([seed, s])``
  (s = 0, 1, 2 for train, val, test) for every image of the full split, independently of the digit,
  so a good partition splits by colour and shape, not by label. Labels stay the digit (classes
  "0".."9"); each split also stores ``palette`` int64 [N] (index into ``manifest["palette"]
  ["combinations"]``) for checking colour correctness. Every foreground is brighter than every
  background (luma difference >= 99 of 255), so the digit reads on luminance too.

Both keep MNIST's splits (train 50k, val 10k, test 10k). ``limit`` keeps the first N images of each
split (for tests); the same seed and limit give the same content hash.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np

from dataset.mnist import PAD, SPLITS, prepare_mnist, resolve_data_dir
from dataset.prepared import PrepareResult, inputs_key, up_to_date, write_prepared

BUILTIN = ("mnist", "colour-mnist")

#: foreground colours (bright), RGB
FOREGROUNDS: dict[str, tuple[int, int, int]] = {
    "yellow": (255, 230, 40),
    "cyan": (40, 220, 255),
    "green": (60, 235, 60),
    "magenta": (255, 70, 255),
}
#: background colours (dark), RGB
BACKGROUNDS: dict[str, tuple[int, int, int]] = {
    "black": (0, 0, 0),
    "navy": (20, 30, 120),
    "maroon": (110, 20, 20),
}
#: palette index -> (foreground name, background name); index = fg_index * len(BACKGROUNDS) + bg_index
COMBINATIONS: list[tuple[str, str]] = [(f, b) for f in FOREGROUNDS for b in BACKGROUNDS]


def luma(rgb) -> float:
    """ITU-R 601 luma of an RGB triple (0..255), the weights Pillow's "L" conversion uses."""
    r, g, b = rgb
    return 0.299 * r + 0.587 * g + 0.114 * b


def palette_table() -> dict:
    """The palette as recorded in colour MNIST's manifest (``manifest["palette"]``)."""
    return {
        "foreground": {k: list(v) for k, v in FOREGROUNDS.items()},
        "background": {k: list(v) for k, v in BACKGROUNDS.items()},
        "combinations": [
            {"index": i, "foreground": f, "background": b, "name": f"{f} on {b}"}
            for i, (f, b) in enumerate(COMBINATIONS)
        ],
        "assignment": "uniform over combinations, np.random.default_rng([seed, split index]).integers "
        "over the full split, independent of the digit",
        "per_image_array": "palette",
    }


def pad28(images_u8: np.ndarray) -> np.ndarray:
    """uint8 [N, 28, 28] -> uint8 [N, 1, 32, 32], zero border of PAD (as `load_mnist` pads)."""
    out = np.zeros((len(images_u8), 1, 28 + 2 * PAD, 28 + 2 * PAD), dtype=np.uint8)
    out[:, 0, PAD : PAD + 28, PAD : PAD + 28] = images_u8
    return out


def colour_lut() -> np.ndarray:
    """uint8 [len(COMBINATIONS), 3, 256]: channel value of intensity p for each palette index,
    rint(bg + (fg - bg) * (p / 255)) computed in float32."""
    fg = np.array([FOREGROUNDS[f] for f, _ in COMBINATIONS], dtype=np.float32)[:, :, None]
    bg = np.array([BACKGROUNDS[b] for _, b in COMBINATIONS], dtype=np.float32)[:, :, None]
    a = np.arange(256, dtype=np.float32)[None, None, :] / np.float32(255.0)
    return np.clip(np.rint(bg + (fg - bg) * a), 0, 255).astype(np.uint8)


def colourize(images_u8: np.ndarray, palette: np.ndarray, chunk: int = 8192) -> np.ndarray:
    """Grey digits uint8 [N, 1, S, S] + palette indices [N] -> RGB uint8 [N, 3, S, S] (see colour_lut)."""
    lut = colour_lut()
    out = np.empty((len(images_u8), 3, *images_u8.shape[2:]), dtype=np.uint8)
    channel = np.arange(3)[None, :, None, None]
    for i in range(0, len(images_u8), chunk):
        pal = np.asarray(palette[i : i + chunk])[:, None, None, None]
        out[i : i + chunk] = lut[pal, channel, images_u8[i : i + chunk]]
    return out


def draw_palette(seed: int, split: str, n: int) -> np.ndarray:
    """Palette indices int64 [n] for a full split: uniform over COMBINATIONS, by (seed, split) only."""
    rng = np.random.default_rng([seed, SPLITS.index(split)])
    return rng.integers(0, len(COMBINATIONS), size=n).astype(np.int64)


def default_out(dataset: str, data_dir=None, limit: int | None = None) -> Path:
    """``<data dir>/<dataset>`` (``-limit<N>`` appended when limited, so a test never replaces the full set)."""
    base = resolve_data_dir(data_dir)
    return base / (dataset + (f"-limit{limit}" if limit is not None else ""))


def prepare_builtin(
    dataset: str,
    out: str | os.PathLike | None = None,
    *,
    seed: int = 0,
    limit: int | None = None,
    data_dir: str | os.PathLike | None = None,
    force: bool = False,
    progress: bool = True,
) -> PrepareResult:
    """Build (or find up to date) ``mnist`` or ``colour-mnist`` from the MNIST cache (prepared first if
    missing). ``seed`` only matters for colour-mnist; ``limit`` keeps the first N images per split."""
    from tqdm.auto import tqdm

    if dataset not in BUILTIN:
        raise ValueError(f"unknown built-in dataset {dataset!r}; choose one of {', '.join(BUILTIN)}")
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    cache = prepare_mnist(data_dir, progress=progress)
    with np.load(cache, allow_pickle=False) as z:
        source = {split: (z[f"{split}_images"], z[f"{split}_labels"].astype(np.int64)) for split in SPLITS}
        origin = str(z["source"])
    digest = hashlib.sha256()
    for split in SPLITS:
        x, y = source[split]
        digest.update(x.tobytes())
        digest.update(y.tobytes())
    out = Path(out) if out is not None else default_out(dataset, data_dir, limit)
    colour = dataset == "colour-mnist"
    key = inputs_key(
        {
            "kind": dataset,
            "mnist_sha256": digest.hexdigest(),
            "limit": limit,
            **({"seed": seed, "palette": palette_table()} if colour else {}),
        }
    )
    if not force and (manifest := up_to_date(out, key)) is not None:
        return PrepareResult(out, manifest, built=False)
    splits: dict[str, dict[str, np.ndarray]] = {}
    for split in tqdm(SPLITS, desc=dataset, unit="split", disable=not progress):
        x, y = source[split]
        n = len(x) if limit is None else min(limit, len(x))
        grey = pad28(x[:n])
        if colour:
            palette = draw_palette(seed, split, len(x))[:n]
            splits[split] = {"images": colourize(grey, palette), "labels": y[:n].copy(), "palette": palette}
        else:
            splits[split] = {"images": grey, "labels": y[:n].copy()}
    manifest = write_prepared(
        out,
        splits,
        name=dataset,
        source={
            "kind": dataset,
            "from": "mnist",
            "mnist_cache": str(cache),
            "mnist_origin": origin,
            "mnist_sha256": digest.hexdigest(),
        },
        class_names=[str(d) for d in range(10)],
        made={"seed": seed if colour else None, "options": {"limit": limit, "pad": PAD}},
        key=key,
        extra={"palette": palette_table()} if colour else None,
    )
    return PrepareResult(out, manifest, built=True)
