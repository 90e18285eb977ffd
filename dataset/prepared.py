"""Prepared datasets: any image set as uint8 shards plus a manifest, checked on load.

A prepared dataset is a directory::

    manifest.json            format, name, source, size, channels, classes, counts, hashes, how it was made
    train-images.npy         uint8 [N, C, S, S]
    train-labels.npy         int64 [N]   (class index; -1 = unlabelled)
    train-<extra>.npy        optional per-image arrays [N] (colour MNIST: `palette`)
    val-images.npy ...       the same for each split in the manifest

`.npy` files are written by ``np.save`` (deterministic bytes, memory-mappable). The manifest records
each file's sha256 and byte count, and a ``content_hash`` over all of them: the same inputs and seed
give the same content hash on any machine. :func:`load_prepared` checks a split's files against the
manifest and raises :class:`PreparedDataError` (a :class:`dataset.mnist.DataError`) saying which file
is missing, corrupt or altered and how to rebuild it.

Builders (dataset/image_folder.py, dataset/builtin.py) call :func:`up_to_date` with a key of their
inputs (source fingerprint + options) and :func:`write_prepared` only when it changed, so preparing
twice does nothing the second time. The model sees :func:`to_model_range` of the uint8 images:
p -> p * 2/255 - 1 in float32, the mapping MNIST uses (`dataset.mnist.to_model_range`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dataset.mnist import DataError

FORMAT = "ddm-fleet-prepared"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
UNLABELLED = -1


class PreparedDataError(DataError):
    """A prepared dataset is missing, corrupt, altered or of another format; the message says what to do."""


@dataclass
class PrepareResult:
    """What a builder did: ``built`` False means the dataset was already up to date (nothing written)."""

    path: Path
    manifest: dict
    built: bool
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (file, reason) the builder skipped


# --------------------------------------------------------------------------- hashing


def inputs_key(inputs: dict) -> str:
    """sha256 of the canonical JSON of a builder's inputs (source fingerprint, options, format version)."""
    blob = json.dumps({"format_version": FORMAT_VERSION, **inputs}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def _content_hash(splits: dict) -> str:
    lines = sorted(
        f"{split}/{name}:{entry['sha256']}" for split, info in splits.items() for name, entry in info["files"].items()
    )
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


# --------------------------------------------------------------------------- write


def _tool_version() -> str:
    try:
        from importlib import metadata

        return metadata.version("ddm-fleet")
    except Exception:  # noqa: BLE001 - not installed (a bare checkout): still write a manifest
        return "unknown"


def _split_stats(labels: np.ndarray, num_classes: int) -> dict:
    labelled = labels[labels >= 0]
    return {
        "count": int(len(labels)),
        "class_counts": np.bincount(labelled, minlength=num_classes).astype(int).tolist() if num_classes else [],
        "unlabelled": int((labels == UNLABELLED).sum()),
    }


def _check_arrays(
    split: str, arrays: dict[str, np.ndarray], channels: int, size: int, num_classes: int, latent: bool = False
) -> None:
    images, labels = arrays.get("images"), arrays.get("labels")
    if images is None or labels is None:
        raise ValueError(f"split {split}: needs 'images' and 'labels' arrays")
    dtypes = (np.float16, np.float32) if latent else (np.uint8,)
    if images.dtype not in dtypes or images.ndim != 4 or images.shape[1:] != (channels, size, size):
        want = "float16 or float32 latents" if latent else "uint8 images"
        raise ValueError(
            f"split {split}: {want} must be [N, {channels}, {size}, {size}], got {images.dtype} {list(images.shape)}"
        )
    if latent and not bool(np.isfinite(images).all()):
        raise ValueError(f"split {split}: latents hold non-finite values")
    if labels.dtype != np.int64 or labels.shape != (len(images),):
        raise ValueError(
            f"split {split}: labels must be int64 [{len(images)}], got {labels.dtype} {list(labels.shape)}"
        )
    if len(labels) and bool(((labels < UNLABELLED) | (labels >= num_classes)).any()):
        raise ValueError(f"split {split}: labels outside -1..{num_classes - 1} (-1 = unlabelled)")
    for name, arr in arrays.items():
        if len(arr) != len(images):
            raise ValueError(f"split {split}: array {name!r} has {len(arr)} rows, images {len(images)}")
        if arr.dtype.hasobject:
            raise ValueError(f"split {split}: array {name!r} has object dtype")


def _ensure_replaceable(out: Path) -> None:
    """Refuse to replace a non-empty directory that is not a prepared dataset (a mistyped --out)."""
    if out.exists() and not (out / MANIFEST_NAME).is_file():
        if not out.is_dir() or any(out.iterdir()):
            raise PreparedDataError(
                f"{out} exists and is not a prepared dataset (no {MANIFEST_NAME}); choose another --out or remove it"
            )


def write_prepared(
    out: str | os.PathLike,
    splits: dict[str, dict[str, np.ndarray]],
    *,
    name: str,
    source: dict,
    class_names: list[str] | None,
    made: dict,
    key: str,
    extra: dict | None = None,
    latent: dict | None = None,
) -> dict:
    """Write a prepared dataset atomically (a temp dir swapped in) and return its manifest.

    ``splits``: split name -> {"images": uint8 [N, C, S, S], "labels": int64 [N], other [N] arrays}.
    ``class_names``: one per class (labels index it), or None for an unlabelled set (labels all -1).
    ``made``: how it was made (seed, options); ``key``: :func:`inputs_key` of the inputs, compared by
    :func:`up_to_date`; ``extra``: more manifest fields (e.g. colour MNIST's palette table).
    ``latent``: a latent cache (training/encode_latents.py): "images" are float16/float32 latents
    [N, c, h, w] used as they are, and this dict (autoencoder, decoder, scaling, source dataset,
    "value_range") is stored under "latent"; the manifest says "space": "latent".
    """
    out = Path(out)
    first = next(iter(splits.values()))["images"]
    channels, size = int(first.shape[1]), int(first.shape[2])
    num_classes = len(class_names or [])
    for split, arrays in splits.items():
        _check_arrays(split, arrays, channels, size, num_classes, latent=latent is not None)
    _ensure_replaceable(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        split_info: dict[str, dict] = {}
        for split, arrays in splits.items():
            files = {}
            for arr_name, arr in arrays.items():
                fname = f"{split}-{arr_name}.npy"
                np.save(tmp / fname, np.ascontiguousarray(arr), allow_pickle=False)
                files[arr_name] = {
                    "file": fname,
                    "dtype": str(arr.dtype),
                    "shape": list(arr.shape),
                    "bytes": (tmp / fname).stat().st_size,
                    "sha256": file_sha256(tmp / fname),
                }
            split_info[split] = {**_split_stats(arrays["labels"], num_classes), "files": files}
        manifest = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "name": name,
            "source": source,
            "size": size,
            "channels": channels,
            "sample_shape": [channels, size, size],
            "value_range": list(latent["value_range"]) if latent else [-1.0, 1.0],
            **(
                {"space": "latent", "pixel_to_model": "latents as stored (scaled to unit variance), as float32"}
                if latent
                else {"pixel_to_model": "x = p * 2/255 - 1 (uint8 p), float32"}
            ),
            "conditioning": {"kind": "class", "num_classes": num_classes} if class_names else {"kind": "none"},
            "class_names": list(class_names or []),
            "splits": split_info,
            "content_hash": _content_hash(split_info),
            "made": {
                **made,
                "tool": f"ddm-fleet {_tool_version()}",
                "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            },
            "inputs_key": key,
            **({"latent": latent} if latent else {}),
            **(extra or {}),
        }
        (tmp / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n")
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        if out.exists():
            os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


# --------------------------------------------------------------------------- read


def read_manifest(path: str | os.PathLike) -> dict:
    """The manifest of the prepared dataset in directory ``path``; PreparedDataError if absent or invalid."""
    d = Path(path)
    mpath = d / MANIFEST_NAME
    if not d.is_dir():
        raise PreparedDataError(
            f"{d}: no such directory; make it with `ddm-fleet data prepare` (--images DIR or --dataset)"
        )
    if not mpath.is_file():
        raise PreparedDataError(
            f"{d} is not a prepared dataset (no {MANIFEST_NAME}); make it with `ddm-fleet data prepare`"
        )
    try:
        manifest = json.loads(mpath.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PreparedDataError(
            f"{mpath} is unreadable ({exc}); rebuild with `ddm-fleet data prepare --force`"
        ) from exc
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise PreparedDataError(f"{mpath}: not a {FORMAT} manifest; rebuild with `ddm-fleet data prepare --force`")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise PreparedDataError(
            f"{mpath}: format version {manifest.get('format_version')} is not the supported "
            f"{FORMAT_VERSION}; rebuild with this version's `ddm-fleet data prepare --force`"
        )
    for key in ("name", "size", "channels", "class_names", "splits", "content_hash"):
        if key not in manifest:
            raise PreparedDataError(f"{mpath}: missing field {key!r}; rebuild with `ddm-fleet data prepare --force`")
    return manifest


def up_to_date(out: str | os.PathLike, key: str) -> dict | None:
    """The manifest at ``out`` if it was made from the same inputs (``key``) and every shard is
    present with its recorded size; else None (the builder must build). Does not hash the shards."""
    try:
        manifest = read_manifest(out)
    except PreparedDataError:
        return None
    if manifest.get("inputs_key") != key:
        return None
    for info in manifest["splits"].values():
        for entry in info.get("files", {}).values():
            p = Path(out) / entry["file"]
            if not p.is_file() or p.stat().st_size != entry.get("bytes"):
                return None
    return manifest


def _load_file(d: Path, split: str, name: str, entry: dict, verify: bool, mmap: bool) -> np.ndarray:
    path = d / entry["file"]
    rebuild = "rebuild with `ddm-fleet data prepare --force`"
    if not path.is_file():
        raise PreparedDataError(f"{path}: shard missing ({split} {name}); {rebuild}")
    if verify:
        digest = file_sha256(path)
        if digest != entry.get("sha256"):
            raise PreparedDataError(
                f"{path}: sha256 {digest[:16]}... does not match the manifest's "
                f"{str(entry.get('sha256'))[:16]}... (file altered or corrupt); {rebuild}"
            )
    try:
        arr = np.load(path, allow_pickle=False, mmap_mode="r" if mmap else None)
    except (OSError, ValueError, EOFError) as exc:
        raise PreparedDataError(f"{path}: unreadable shard ({exc}); {rebuild}") from exc
    if str(arr.dtype) != entry.get("dtype") or list(arr.shape) != entry.get("shape"):
        raise PreparedDataError(
            f"{path}: {arr.dtype} {list(arr.shape)} but the manifest says "
            f"{entry.get('dtype')} {entry.get('shape')}; {rebuild}"
        )
    return arr


def _split_entry(manifest: dict, d: Path, split: str, name: str) -> dict:
    splits = manifest["splits"]
    if split not in splits:
        raise PreparedDataError(f"{d}: no split {split!r}; it has {', '.join(splits) or 'none'}")
    files = splits[split].get("files", {})
    if name not in files:
        raise PreparedDataError(f"{d}: split {split!r} has no array {name!r}; it has {', '.join(files)}")
    return files[name]


def load_prepared(
    path: str | os.PathLike,
    split: str = "train",
    *,
    limit: int | None = None,
    verify: bool = True,
    mmap: bool = False,
) -> tuple[np.ndarray, np.ndarray, dict]:
    """Load one split: ``(images uint8 [N, C, S, S], labels int64 [N] (-1 = unlabelled), manifest)``.

    ``verify`` checks each file's sha256 against the manifest first (PreparedDataError on a
    mismatch); ``mmap`` memory-maps the shards read-only instead of reading them; ``limit`` keeps
    the first ``limit`` images (index i here is index i of the full split). Feed the images to a
    model through :func:`to_model_range`.
    """
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    d = Path(path)
    manifest = read_manifest(d)
    images = _load_file(d, split, "images", _split_entry(manifest, d, split, "images"), verify, mmap)
    labels = _load_file(d, split, "labels", _split_entry(manifest, d, split, "labels"), verify, mmap)
    c, s = manifest["channels"], manifest["size"]
    if images.ndim != 4 or images.shape[1:] != (c, s, s) or len(labels) != len(images):
        raise PreparedDataError(
            f"{d}: split {split!r} images {list(images.shape)} / labels {list(labels.shape)} "
            f"disagree with the manifest's [N, {c}, {s}, {s}]"
        )
    if limit is not None:
        images, labels = images[:limit], labels[:limit]
    return images, labels, manifest


def load_prepared_extra(
    path: str | os.PathLike, split: str, name: str, *, limit: int | None = None, verify: bool = True
) -> np.ndarray:
    """One extra per-image array of a split (colour MNIST: ``palette`` int64 [N]), checked like the images."""
    d = Path(path)
    manifest = read_manifest(d)
    arr = _load_file(d, split, name, _split_entry(manifest, d, split, name), verify, mmap=False)
    return arr[:limit] if limit is not None else arr


def verify_prepared(path: str | os.PathLike) -> dict:
    """Check every shard of every split against the manifest; return the manifest (PreparedDataError if not)."""
    d = Path(path)
    manifest = read_manifest(d)
    for split, info in manifest["splits"].items():
        for name, entry in info.get("files", {}).items():
            _load_file(d, split, name, entry, verify=True, mmap=True)
    if _content_hash(manifest["splits"]) != manifest["content_hash"]:
        raise PreparedDataError(
            f"{d / MANIFEST_NAME}: content_hash does not match its files' hashes; "
            "rebuild with `ddm-fleet data prepare --force`"
        )
    return manifest


# --------------------------------------------------------------------------- model range + summary

_LUT = np.arange(256, dtype=np.float32) * np.float32(2.0 / 255.0) - np.float32(1.0)


def to_model_range(images_u8: np.ndarray) -> np.ndarray:
    """uint8 [N, C, S, S] -> float32 [N, C, S, S] in [-1, 1]: p * 2/255 - 1 (0 -> -1, 255 -> 1).

    The same table as `dataset.mnist.to_model_range`, so prepared MNIST gives bit-identical inputs.
    """
    x = np.asarray(images_u8)
    if x.dtype != np.uint8 or x.ndim != 4:
        raise PreparedDataError(f"expected uint8 images [N, C, S, S], got {x.dtype} {list(x.shape)}")
    return _LUT[x]


def is_latent(manifest: dict) -> bool:
    """Whether a prepared manifest is a latent cache (float latents of an autoencoder, not uint8 images)."""
    return manifest.get("space") == "latent"


def _images_line(manifest: dict) -> str:
    c, s = manifest["channels"], manifest["size"]
    if not is_latent(manifest):
        return f"images:  {c}x{s}x{s} uint8 ({'RGB' if c == 3 else 'grey'}), model range [-1, 1]"
    lat = manifest.get("latent", {})
    src = lat.get("source", {})
    return (
        f"latents: {c}x{s}x{s} {lat.get('dtype', '?')} of {src.get('name', '?')} "
        f"({'x'.join(map(str, lat.get('image_shape', [])))} images), value range {manifest.get('value_range')}, "
        f"autoencoder {lat.get('autoencoder', '?')} (sha256 {str(lat.get('autoencoder_hash', '?'))[:16]}...)"
    )


def summary(manifest: dict, path: str | os.PathLike | None = None) -> str:
    """A few lines for `ddm-fleet data info DIR`: name, shape, classes, counts per split and class, hash."""
    names = manifest.get("class_names") or []
    lines = [
        f"dataset: {manifest['name']}" + (f"  ({path})" if path else ""),
        f"source:  {json.dumps(manifest.get('source', {}), sort_keys=True)}",
        _images_line(manifest),
        f"classes: {len(names)}: {', '.join(names)}" if names else "classes: none (unlabelled; conditioning none)",
        f"made:    {json.dumps({k: v for k, v in manifest.get('made', {}).items()}, sort_keys=True)}",
        f"content: sha256 {manifest['content_hash']}",
    ]
    width = max([5] + [len(n) for n in names]) if names else 5
    header = f"{'split':>6} {'images':>7}" + ("".join(f" {n[:width]:>{width}}" for n in names) if names else "")
    lines.append(
        header + (f" {'none':>{width}}" if any(i.get("unlabelled") for i in manifest["splits"].values()) else "")
    )
    for split, info in manifest["splits"].items():
        row = f"{split:>6} {info['count']:>7}" + "".join(f" {n:>{width}}" for n in info.get("class_counts", []))
        if info.get("unlabelled"):
            row += f" {info['unlabelled']:>{width}}"
        lines.append(row)
    return "\n".join(lines)
