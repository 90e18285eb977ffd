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

``size`` (a multiple of 32, default 32) draws them larger: the padded grey digit is upscaled by bicubic
interpolation (Keys, a = -0.5; separable, each output pixel centre mapped back onto the 32x32 grid) and
rounded to uint8, then coloured as above, so a 256px colour digit keeps its palette's two colours and the
ramp between them. ``colour-mnist`` at 256px is the seeds' image size (3x256x256); 32px judges read it
after an 8x8 area mean (evaluation: ``downsample_to``).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np

from dataset.mnist import PAD, SPLITS, prepare_mnist, resolve_data_dir
from dataset.prepared import PrepareResult, inputs_key, up_to_date, write_prepared

BUILTIN = ("mnist", "colour-mnist")
NATIVE_SIZE = 28 + 2 * PAD  # the padded digits' side

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


def colourize(
    images_u8: np.ndarray, palette: np.ndarray, chunk: int = 8192, out: np.ndarray | None = None
) -> np.ndarray:
    """Grey digits uint8 [N, 1, S, S] + palette indices [N] -> RGB uint8 [N, 3, S, S] (see colour_lut);
    ``out`` may be a preallocated (e.g. memory-mapped) array."""
    lut = colour_lut()
    if out is None:
        out = np.empty((len(images_u8), 3, *images_u8.shape[2:]), dtype=np.uint8)
    chunk = max(1, min(chunk, (64 << 20) // max(1, images_u8[0].nbytes * 3)))
    channel = np.arange(3)[None, :, None, None]
    for i in range(0, len(images_u8), chunk):
        pal = np.asarray(palette[i : i + chunk])[:, None, None, None]
        out[i : i + chunk] = lut[pal, channel, images_u8[i : i + chunk]]
    return out


def bicubic_matrix(src: int, dst: int) -> np.ndarray:
    """float64 [dst, src]: row i weighs the source pixels for output pixel i (Keys cubic, a = -0.5,
    half-pixel centres, edges clamped); rows sum to 1."""
    a = -0.5

    def w(d: np.ndarray) -> np.ndarray:
        d = np.abs(d)
        return np.where(
            d <= 1,
            (a + 2) * d**3 - (a + 3) * d**2 + 1,
            np.where(d < 2, a * d**3 - 5 * a * d**2 + 8 * a * d - 4 * a, 0.0),
        )

    m = np.zeros((dst, src))
    centres = (np.arange(dst) + 0.5) * src / dst - 0.5
    for i, c in enumerate(centres):
        base = int(np.floor(c))
        for j in range(base - 1, base + 3):
            m[i, min(max(j, 0), src - 1)] += w(c - j)
    return m / m.sum(axis=1, keepdims=True)


def upscale(images_u8: np.ndarray, size: int, out: np.ndarray | None = None, chunk: int = 1024) -> np.ndarray:
    """uint8 [N, C, S, S] -> uint8 [N, C, size, size] by separable bicubic interpolation (rounded, clipped);
    ``out`` may be a preallocated (e.g. memory-mapped) array."""
    n, c, s, _ = images_u8.shape
    m = bicubic_matrix(s, size).astype(np.float32)
    out = np.empty((n, c, size, size), np.uint8) if out is None else out
    for i in range(0, n, chunk):
        x = images_u8[i : i + chunk].astype(np.float32)
        y = np.matmul(np.matmul(m, x), m.T)
        out[i : i + chunk] = np.clip(np.rint(y), 0, 255).astype(np.uint8)
    return out


def draw_palette(seed: int, split: str, n: int) -> np.ndarray:
    """Palette indices int64 [n] for a full split: uniform over COMBINATIONS, by (seed, split) only."""
    rng = np.random.default_rng([seed, SPLITS.index(split)])
    return rng.integers(0, len(COMBINATIONS), size=n).astype(np.int64)


def default_out(dataset: str, data_dir=None, limit: int | None = None, size: int = NATIVE_SIZE) -> Path:
    """``<data dir>/<dataset>`` (``-<S>px`` for another size, ``-limit<N>`` when limited, so a test never
    replaces the full set)."""
    base = resolve_data_dir(data_dir)
    sized = f"-{size}px" if size != NATIVE_SIZE else ""
    return base / (dataset + sized + (f"-limit{limit}" if limit is not None else ""))


def prepare_builtin(
    dataset: str,
    out: str | os.PathLike | None = None,
    *,
    seed: int = 0,
    limit: int | None = None,
    data_dir: str | os.PathLike | None = None,
    force: bool = False,
    progress: bool = True,
    size: int = NATIVE_SIZE,
) -> PrepareResult:
    """Build (or find up to date) ``mnist`` or ``colour-mnist`` from the MNIST cache (prepared first if
    missing). ``seed`` only matters for colour-mnist; ``limit`` keeps the first N images per split;
    ``size`` upscales (a multiple of 32; large splits are built in memory-mapped files beside ``out``)."""

    if dataset not in BUILTIN:
        raise ValueError(f"unknown built-in dataset {dataset!r}; choose one of {', '.join(BUILTIN)}")
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    if not isinstance(size, int) or size < NATIVE_SIZE or size % NATIVE_SIZE or size > 512:
        raise ValueError(f"size must be a multiple of {NATIVE_SIZE} from {NATIVE_SIZE} to 512, got {size!r}")
    cache = prepare_mnist(data_dir, progress=progress)
    with np.load(cache, allow_pickle=False) as z:
        source = {split: (z[f"{split}_images"], z[f"{split}_labels"].astype(np.int64)) for split in SPLITS}
        origin = str(z["source"])
    digest = hashlib.sha256()
    for split in SPLITS:
        x, y = source[split]
        digest.update(x.tobytes())
        digest.update(y.tobytes())
    out = Path(out) if out is not None else default_out(dataset, data_dir, limit, size)
    colour = dataset == "colour-mnist"
    sized = {"size": size, "upscale": "bicubic"} if size != NATIVE_SIZE else {}
    key = inputs_key(
        {
            "kind": dataset,
            "mnist_sha256": digest.hexdigest(),
            "limit": limit,
            **({"seed": seed, "palette": palette_table()} if colour else {}),
            **sized,
        }
    )
    if not force and (manifest := up_to_date(out, key)) is not None:
        return PrepareResult(out, manifest, built=False)
    scratch = out.parent / f".{out.name}.scratch-{os.getpid()}"
    try:
        splits = _build_splits(dataset, source, seed, limit, size, scratch, progress)
        manifest = _write(out, dataset, splits, cache, origin, digest.hexdigest(), seed, limit, size, key)
    finally:
        import shutil

        shutil.rmtree(scratch, ignore_errors=True)
    return PrepareResult(out, manifest, built=True)


def _build_splits(dataset, source, seed, limit, size, scratch: Path, progress: bool) -> dict:
    from tqdm.auto import tqdm

    colour = dataset == "colour-mnist"
    splits: dict[str, dict[str, np.ndarray]] = {}
    for split in tqdm(SPLITS, desc=dataset, unit="split", disable=not progress):
        x, y = source[split]
        n = len(x) if limit is None else min(limit, len(x))
        grey = pad28(x[:n])
        if size != NATIVE_SIZE:
            grey = upscale(grey, size)
        channels = 3 if colour else 1
        images = grey
        if colour:
            palette = draw_palette(seed, split, len(x))[:n]
            target = None
            if grey.nbytes * 3 > 1 << 30:  # over 1 GiB of RGB: build it on disk, not in memory
                scratch.mkdir(parents=True, exist_ok=True)
                target = np.lib.format.open_memmap(
                    scratch / f"{split}.npy", mode="w+", dtype=np.uint8, shape=(n, channels, size, size)
                )
            images = colourize(grey, palette, out=target)
            splits[split] = {"images": images, "labels": y[:n].copy(), "palette": palette}
        else:
            splits[split] = {"images": images, "labels": y[:n].copy()}
    return splits


def _write(out, dataset, splits, cache, origin, mnist_sha256, seed, limit, size, key) -> dict:
    colour = dataset == "colour-mnist"
    return write_prepared(
        out,
        splits,
        name=dataset,
        source={
            "kind": dataset,
            "from": "mnist",
            "mnist_cache": str(cache),
            "mnist_origin": origin,
            "mnist_sha256": mnist_sha256,
        },
        class_names=[str(d) for d in range(10)],
        made={
            "seed": seed if colour else None,
            "options": {
                "limit": limit,
                "pad": PAD,
                **({"size": size, "upscale": "bicubic"} if size != NATIVE_SIZE else {}),
            },
        },
        key=key,
        extra={"palette": palette_table()} if colour else None,
    )
