"""A judge's logits and features of a reference set (the real test split), kept on disk between runs.

Every `Judges.load` reads the 10k real test images through each judge (their features are FID's
reference; their logits give the judge's accuracy, measured, never read from the judge's JSON): about
20 s of CPU for judges 1 and 2 on a 2-core box, the same numbers every time. `logits_and_features`
keeps them in `<data dir>/judge-references/<key>.npz`, where the key is a SHA-256 of the judge's weights
(every tensor, bit for bit) and of the images themselves: another judge, retrained weights or other
reference images give another key, so a kept file is only ever the same computation's result. A file
that cannot be read is computed again; a directory that cannot be written is skipped (computed each time);
the 8 most recently used readings are kept (10-15 MB each for the 10k MNIST test digits). Processes that
need the same reading at once compute it once: the others wait on a lock file beside it, then read it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

SUBDIR = "judge-references"
#: Readings kept per directory, the least recently used dropped first (a judge retrained, another test set).
MAX_KEPT = 8
#: Bumped when what is kept (or how a judge computes it) changes meaning.
FORMAT = b"judge-reference-v1"


def weights_digest(judge) -> str:
    """SHA-256 of a judge's weights: the torch judges' state dict (`.model`), the JAX judge's params."""
    h = hashlib.sha256(FORMAT)
    h.update(type(judge).__name__.encode())
    h.update(json.dumps(getattr(judge, "meta", None), sort_keys=True, default=str).encode())  # its input shape...
    if hasattr(judge, "model"):
        named = [(k, v.detach().cpu().float().contiguous().numpy()) for k, v in judge.model.state_dict().items()]
    elif hasattr(judge, "params"):
        import jax

        named = [(str(k), np.asarray(v)) for k, v in jax.tree_util.tree_leaves_with_path(judge.params)]
    else:
        raise TypeError(f"no weights to fingerprint on {type(judge).__name__}")
    for name, array in sorted(named, key=lambda kv: kv[0]):
        h.update(f"{name}:{array.dtype}:{array.shape}".encode())
        h.update(np.ascontiguousarray(array).tobytes())
    return h.hexdigest()


def cache_key(judge, images: np.ndarray) -> str:
    x = np.ascontiguousarray(images, np.float32)
    h = hashlib.sha256(weights_digest(judge).encode())
    h.update(repr(x.shape).encode())
    h.update(x.tobytes())
    return h.hexdigest()[:32]


def logits_and_features(
    judge, images: np.ndarray, cache_dir: str | os.PathLike | None
) -> tuple[np.ndarray, np.ndarray]:
    """`judge.logits_and_features(images)`, from `cache_dir` when this judge read these images before
    (None: no cache)."""
    if cache_dir is None:
        return judge.logits_and_features(images)
    try:
        path = Path(cache_dir) / SUBDIR / f"{cache_key(judge, images)}.npz"
    except Exception as err:  # a judge this module cannot fingerprint: read, keep nothing
        log.info("judge reference not kept (%r)", err)
        return judge.logits_and_features(images)
    kept = _read(path, len(images))
    if kept is not None:
        return kept
    with _computing(path):  # another process reading the same images waits for this one's file
        kept = _read(path, len(images), quiet=True)  # ... or this one for another's
        if kept is not None:
            return kept
        logits, feats = judge.logits_and_features(images)
        _keep(path, logits, feats)
    return logits, feats


def _read(path: Path, n: int, quiet: bool = False) -> tuple[np.ndarray, np.ndarray] | None:
    """The kept reading of `n` images at `path`, or None (missing, or unreadable: computed again)."""
    try:
        with np.load(path) as kept:
            logits, feats = kept["logits"], kept["features"]
        if len(logits) == len(feats) == n:
            _touch(path)
            return logits, feats
        if not quiet:
            log.warning("judge reference %s does not match its images: computing it again", path)
    except FileNotFoundError:
        pass
    except Exception as err:  # a truncated or foreign file: compute again, overwrite
        if not quiet:
            log.warning("judge reference %s unreadable (%r): computing it again", path, err)
    return None


@contextlib.contextmanager
def _computing(path: Path):
    """Hold an exclusive lock on `<path>.lock` while computing the reading for `path`, so that evaluations
    started side by side compute it once; where no lock can be taken (a read-only directory, no fcntl),
    each computes its own."""
    try:
        import fcntl

        path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(path.with_suffix(".lock"), "a+b")
    except (ImportError, OSError):
        yield
        return
    try:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX)
        except OSError:
            pass
        yield
    finally:
        handle.close()  # closing releases the lock


def _keep(path: Path, logits: np.ndarray, feats: np.ndarray) -> None:
    """Write whole or not at all (a reader never sees half a file; two writers each rename their own)."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".npz")
        with os.fdopen(fd, "wb") as f:
            np.savez(f, logits=logits, features=feats)
        os.replace(tmp, path)
        tmp = None
        _prune(path.parent)
    except Exception as err:  # a full disk, a read-only data dir: the reading is only not kept
        log.info("judge reference not kept (%s): %r", path.parent, err)
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass


def _touch(path: Path) -> None:
    try:
        os.utime(path)  # its age is its last use: `_prune` drops the least recently used
    except OSError:
        pass


def _prune(directory: Path) -> None:
    """Keep the MAX_KEPT most recently used readings."""
    try:
        kept = sorted(directory.glob("*.npz"), key=lambda p: p.stat().st_mtime, reverse=True)
        for old in kept[MAX_KEPT:]:
            old.unlink()
            old.with_suffix(".lock").unlink(missing_ok=True)
            log.info("judge reference %s dropped (least recently used of more than %d)", old.name, MAX_KEPT)
    except OSError:  # another process pruned it first, or no right to: not ours to fail on
        pass
