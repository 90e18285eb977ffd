"""A judge's logits and features of a reference set (the real test split), kept on disk between runs.

Every `Judges.load` reads the 10k real test images through each judge (their features are FID's
reference; their logits give the judge's accuracy, measured, never read from the judge's JSON): about
20 s of CPU for judges 1 and 2 on a 2-core box, the same numbers every time. `logits_and_features`
keeps them in `<data dir>/judge-references/<key>.npz`, where the key is a SHA-256 of the judge's weights
(every tensor, bit for bit) and of the images themselves: another judge, retrained weights or other
reference images give another key, so a kept file is only ever the same computation's result. A file
that cannot be read is computed again; a directory that cannot be written is skipped (computed each time).
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

SUBDIR = "judge-references"
#: Bumped when what is kept (or how a judge computes it) changes meaning.
FORMAT = b"judge-reference-v1"


def weights_digest(judge) -> str:
    """SHA-256 of a judge's weights: the torch judges' state dict (`.model`), the JAX judge's params."""
    h = hashlib.sha256(FORMAT)
    h.update(type(judge).__name__.encode())
    if hasattr(judge, "model"):
        for name, tensor in sorted(judge.model.state_dict().items()):
            h.update(name.encode())
            h.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    elif hasattr(judge, "params"):
        import jax

        for path, leaf in sorted(jax.tree_util.tree_leaves_with_path(judge.params), key=lambda kv: str(kv[0])):
            h.update(str(path).encode())
            h.update(np.asarray(leaf).tobytes())
    else:
        raise TypeError(f"no weights to fingerprint on {type(judge).__name__}")
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
    path = Path(cache_dir) / SUBDIR / f"{cache_key(judge, images)}.npz"
    try:
        with np.load(path) as kept:
            logits, feats = kept["logits"], kept["features"]
        if len(logits) == len(feats) == len(images):
            return logits, feats
        log.warning("judge reference %s does not match its images: computing it again", path)
    except FileNotFoundError:
        pass
    except Exception as err:  # a truncated or foreign file: compute again, overwrite
        log.warning("judge reference %s unreadable (%r): computing it again", path, err)
    logits, feats = judge.logits_and_features(images)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.stem}.{os.getpid()}.npz")
        np.savez(tmp, logits=logits, features=feats)
        os.replace(tmp, path)  # whole or absent: a reader never sees half a file
    except OSError as err:
        log.info("judge reference not kept (%s): %r", path.parent, err)
    return logits, feats
