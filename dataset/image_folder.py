"""An image folder -> a prepared dataset (`ddm-fleet data prepare --images DIR --size S`).

Layout of DIR, decided by what it holds:

* **labelled**: one subfolder per class (``DIR/cat/*.jpg``, ``DIR/dog/**/*.png``); class names are
  the subfolder names, sorted; files directly in DIR are skipped (reported) in this layout;
* **unlabelled**: images directly in DIR (no subfolders); labels are -1 and conditioning is none.

Hidden files and folders (a leading dot) are ignored. Every other file is opened with Pillow and
fully decoded; one that is not an image or is corrupt is skipped with its reason, never a crash.
Also skipped, each named in the report: anything that is not a regular file or a folder (a FIFO, a
socket, a device: never opened), a link whose target lies outside DIR (file or folder: what DIR
holds is what is prepared), a link to a folder inside DIR (its images are already there or it
loops), and an image larger than MAX_IMAGE_PIXELS by its header (refused before it is decoded: a
small file can claim 13000 x 13000 16-bit pixels, gigabytes once decoded with several workers).
Each image: EXIF orientation applied; 16-bit grey scaled to 8 bits; palette images expanded;
transparency (RGBA, LA, palette with a transparent colour) composited on a ``background``
(white by default, or black); converted to grey (``L``, ITU-R 601 luma) or RGB; then its centred
square (side = the shorter side) resized to S x S (Lanczos when shrinking, bicubic when growing)
-- the same as resizing the shorter side to S and centre-cropping.

The train/val split is deterministic: within each class (or the whole unlabelled set) the
images, sorted by path, are permuted by ``np.random.default_rng(seed)`` and the first
``round(n * val_fraction)`` go to val. Files are fingerprinted by relative path, size and
mtime: a second prepare with the same files and options does nothing.
"""

from __future__ import annotations

import os
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from dataset.mnist import resolve_data_dir
from dataset.prepared import PreparedDataError, PrepareResult, inputs_key, up_to_date, write_prepared

BACKGROUNDS = {"white": (255, 255, 255), "black": (0, 0, 0)}
#: Largest image accepted (width x height, read from its header before decoding): 64 megapixels, e.g.
#: 8000 x 8000, about 0.5 GB decoded as 16-bit grey into float32 (`_to_mode`), per worker thread.
MAX_IMAGE_PIXELS = 64_000_000


class ImageError(ValueError):
    """One file could not be used as an image (the message is the reason shown in the skip report)."""


def _hidden(rel: Path) -> bool:
    return any(part.startswith(".") for part in rel.parts)


def scan_folder(root: str | os.PathLike) -> tuple[list[str], list[tuple[str, int]], list[tuple[str, str]]]:
    """List DIR: ``(class_names, [(relative path, label)], [(relative path, reason) skipped])``.

    Labelled when DIR has (non-hidden) subfolders: each is a class (searched recursively) and loose
    files in DIR are skipped; otherwise the files in DIR are one unlabelled set (label -1).
    Paths are POSIX-style relative to DIR, sorted, so the order is the same on every machine.
    """
    root = Path(root)
    if not root.is_dir():
        raise PreparedDataError(
            f"{root}: no such directory (give --images a folder of images, or of one subfolder per class)"
        )
    real_root = root.resolve()
    stray: list[tuple[str, str]] = []

    def kind(p: Path) -> str | None:
        """ "file", "dir", or None (skipped, with its reason in `stray`) for an entry of DIR."""
        rel = p.relative_to(root).as_posix()
        if p.is_symlink():
            try:
                target = p.resolve(strict=True)
            except (OSError, RuntimeError):
                stray.append((rel, "a broken link"))
                return None
            if not target.is_relative_to(real_root):
                stray.append((rel, "a link to outside the folder"))
                return None
            if target.is_dir():
                stray.append((rel, "a link to a folder (not followed)"))
                return None
        if p.is_dir():
            return "dir"
        if p.is_file():
            return "file"
        stray.append((rel, "not a regular file"))
        return None

    entries = sorted(p for p in root.iterdir() if not p.name.startswith("."))
    kinds = {p: kind(p) for p in entries}
    class_dirs = [p for p in entries if kinds[p] == "dir"]
    files: list[tuple[str, int]] = []
    if class_dirs:
        class_names = [p.name for p in class_dirs]
        for label, cdir in enumerate(class_dirs):
            for folder, dirs, names in os.walk(cdir):  # links to folders are not followed (reported above)
                dirs[:] = sorted(d for d in dirs if not d.startswith("."))
                here = Path(folder)
                for d in list(dirs):
                    if kind(here / d) is None:
                        dirs.remove(d)
                for n in sorted(names):
                    if not n.startswith(".") and kind(here / n) == "file":
                        files.append(((here / n).relative_to(root).as_posix(), label))
        stray += [(p.name, "not in a class subfolder") for p in entries if kinds[p] == "file"]
    else:
        class_names = []
        files = [(p.name, -1) for p in entries if kinds[p] == "file"]
    files.sort(key=lambda f: Path(f[0]).parts)  # the order of sorted(Path.rglob): splits stay as they were
    stray.sort()
    return class_names, files, stray


def _to_mode(im, channels: int, background: tuple[int, int, int]):
    """Any Pillow image -> mode "L" (channels 1) or "RGB" (channels 3), transparency on `background`."""
    from PIL import Image

    if im.mode in ("I;16", "I;16L", "I;16B", "I;16N", "I") or im.mode == "F":
        a = np.asarray(im, dtype=np.float32)
        if im.mode == "F":
            a = a * 255.0 if a.size and float(np.nanmax(a)) <= 1.0 else a
        elif im.mode != "I" or (a.size and float(a.max()) > 255):
            a = a / 257.0  # 16-bit range -> 8 bits
        im = Image.fromarray(np.clip(np.rint(np.nan_to_num(a)), 0, 255).astype(np.uint8), "L")
    if im.mode == "1":
        im = im.convert("L")
    if im.mode in ("P", "PA"):
        im = im.convert("RGBA" if (im.mode == "PA" or "transparency" in im.info) else "RGB")
    if (im.mode == "L" and "transparency" in im.info) or im.mode in ("LA", "La", "RGBa"):
        im = im.convert("RGBA")
    if im.mode == "RGBA":
        base = Image.new("RGBA", im.size, (*background, 255))
        im = Image.alpha_composite(base, im).convert("RGB")
    target = "L" if channels == 1 else "RGB"
    if im.mode != target:
        im = im.convert("RGB").convert(target) if im.mode not in ("L", "RGB") else im.convert(target)
    return im


def load_image(path: str | os.PathLike, size: int, channels: int, background: str = "white") -> np.ndarray:
    """One image file -> uint8 [channels, size, size] (see the module doc); ImageError if unusable."""
    from PIL import Image, ImageOps, UnidentifiedImageError

    try:
        with warnings.catch_warnings():  # Pillow warns of sizes past its own bound; ours is lower, checked below
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            im = Image.open(path)
        with im:
            w, h = im.size  # from the header: nothing decoded yet
            if w * h > MAX_IMAGE_PIXELS:
                raise ImageError(f"too large: {w} x {h} pixels (limit {MAX_IMAGE_PIXELS / 1e6:g} megapixels)")
            im.load()  # decode all of it now: a truncated file fails here, not later
            im = ImageOps.exif_transpose(im)
            im = _to_mode(im, channels, BACKGROUNDS[background])
            w, h = im.size
            if w < 1 or h < 1:
                raise ImageError("empty image")
            m = min(w, h)
            box = ((w - m) / 2, (h - m) / 2, (w + m) / 2, (h + m) / 2)
            resample = Image.Resampling.LANCZOS if m > size else Image.Resampling.BICUBIC
            im = im.resize((size, size), resample, box=box)
            arr = np.asarray(im, dtype=np.uint8)
    except UnidentifiedImageError:
        known = Path(path).suffix.lower() in Image.registered_extensions()
        raise ImageError("corrupt (unreadable image data)" if known else "not an image") from None
    except ImageError:
        raise
    except Exception as exc:  # noqa: BLE001 - truncated, corrupt, bomb, odd mode: skip the file, never crash
        raise ImageError(f"corrupt or unreadable ({type(exc).__name__}: {exc})"[:200]) from None
    return arr[None] if channels == 1 else np.ascontiguousarray(arr.transpose(2, 0, 1))


def split_indices(labels: np.ndarray, val_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Deterministic stratified split: ``(train indices, val indices)``, each sorted ascending.

    For each label in ascending order, its indices are permuted by one ``default_rng(seed)`` and
    the first ``round(n * val_fraction)`` go to val.
    """
    rng = np.random.default_rng(seed)
    val: list[np.ndarray] = []
    for label in np.unique(labels):
        idx = np.flatnonzero(labels == label)
        n_val = int(round(len(idx) * val_fraction))
        val.append(idx[rng.permutation(len(idx))[:n_val]])
    val_idx = np.sort(np.concatenate(val)) if val else np.zeros(0, dtype=np.int64)
    train_mask = np.ones(len(labels), dtype=bool)
    train_mask[val_idx] = False
    return np.flatnonzero(train_mask), val_idx


def _fingerprint(root: Path, files: list[tuple[str, int]], stray: list[tuple[str, str]]) -> str:
    import hashlib

    digest = hashlib.sha256()
    for rel, label in files:
        st = (root / rel).stat()
        digest.update(f"{rel}\0{label}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    for rel, _ in stray:
        digest.update(f"stray {rel}\n".encode())
    return digest.hexdigest()


def describe_skipped(skipped: list[tuple[str, str]], total: int, first: int = 5) -> str:
    """'skipped 3 of 12 files: a.txt (not an image), ...' with the first `first` names, or ''."""
    if not skipped:
        return ""
    shown = ", ".join(f"{name} ({reason})" for name, reason in skipped[:first])
    more = f", and {len(skipped) - first} more" if len(skipped) > first else ""
    return f"skipped {len(skipped)} of {total} files: {shown}{more}"


def default_out(images_dir: str | os.PathLike, size: int, channels: int, data_dir=None) -> Path:
    """``<data dir>/<folder name>-<S>px-<grey|rgb>``."""
    base = resolve_data_dir(data_dir)
    return base / f"{Path(images_dir).resolve().name}-{size}px-{'grey' if channels == 1 else 'rgb'}"


def prepare_image_folder(
    images_dir: str | os.PathLike,
    out: str | os.PathLike | None = None,
    *,
    size: int,
    channels: int = 3,
    val_fraction: float = 0.1,
    seed: int = 0,
    background: str = "white",
    name: str | None = None,
    data_dir: str | os.PathLike | None = None,
    force: bool = False,
    progress: bool = True,
    workers: int | None = None,
) -> PrepareResult:
    """Build (or find up to date) the prepared dataset of an image folder; see the module doc.

    ``out`` defaults to :func:`default_out`. Splits: ``train`` and ``val`` (val may be empty when
    ``val_fraction`` is 0). Raises PreparedDataError when DIR has no usable image.
    """
    from tqdm.auto import tqdm

    if size < 1:
        raise ValueError(f"size must be >= 1, got {size}")
    if channels not in (1, 3):
        raise ValueError(f"channels must be 1 or 3, got {channels}")
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    if background not in BACKGROUNDS:
        raise ValueError(f"background must be one of {', '.join(BACKGROUNDS)}, got {background!r}")
    root = Path(images_dir)
    class_names, files, stray = scan_folder(root)
    out = Path(out) if out is not None else default_out(root, size, channels, data_dir)
    options = {
        "size": size,
        "channels": channels,
        "val_fraction": val_fraction,
        "background": background,
        "crop": "centre square",
        "resample": "lanczos (shrink) / bicubic (grow)",
    }
    key = inputs_key(
        {
            "kind": "images",
            "root": str(root.resolve()),
            "options": options,
            "seed": seed,
            "name": name,
            "files": _fingerprint(root, files, stray),
        }
    )
    if not force and (manifest := up_to_date(out, key)) is not None:
        return PrepareResult(out, manifest, built=False, skipped=[tuple(s) for s in manifest.get("skipped", [])])
    if not files:
        raise PreparedDataError(
            f"{root}: no files to prepare ({'empty class folders' if class_names else 'empty folder'})"
        )

    images = np.empty((len(files), channels, size, size), dtype=np.uint8)
    ok = np.zeros(len(files), dtype=bool)
    skipped = list(stray)

    def work(i: int) -> tuple[int, str | None]:
        try:
            images[i] = load_image(root / files[i][0], size, channels, background)
            return i, None
        except ImageError as exc:
            return i, str(exc)

    n_workers = workers or min(4, os.cpu_count() or 1)
    with (
        ThreadPoolExecutor(max_workers=n_workers) as pool,
        tqdm(total=len(files), desc=f"prepare {root.name}", unit="img", disable=not progress) as bar,
    ):
        for i, reason in pool.map(work, range(len(files))):
            if reason is None:
                ok[i] = True
            else:
                skipped.append((files[i][0], reason))
            bar.update(1)
    skipped.sort(key=lambda s: s[0])
    if not ok.any():
        raise PreparedDataError(f"{root}: no readable image; {describe_skipped(skipped, len(files) + len(stray))}")
    labels_all = np.array([label for _, label in files], dtype=np.int64)[ok]
    images = images[ok]
    train_idx, val_idx = split_indices(labels_all, val_fraction, seed)
    empty = [c for i, c in enumerate(class_names) if not (labels_all == i).any()]
    manifest = write_prepared(
        out,
        {
            "train": {"images": images[train_idx], "labels": labels_all[train_idx]},
            "val": {"images": images[val_idx], "labels": labels_all[val_idx]},
        },
        name=name or root.resolve().name,
        source={
            "kind": "images",
            "path": str(root.resolve()),
            "layout": "class subfolders" if class_names else "unlabelled",
            "files": len(files) + len(stray),
            "used": int(ok.sum()),
            "skipped": len(skipped),
            **({"empty_classes": empty} if empty else {}),
        },
        class_names=class_names or None,
        made={"seed": seed, "options": options},
        key=key,
        extra={"skipped": [list(s) for s in skipped[:100]]},
    )
    return PrepareResult(out, manifest, built=True, skipped=skipped)
