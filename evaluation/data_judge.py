"""The data judge: a classifier trained on the evaluated dataset itself, for FID in that data's own features.

The MNIST judges (judge 1 and judge 2) read grey digits; a prepared dataset of another kind (RGB,
another size, other classes) needs a feature space of its own. The data judge is judge 1's CNN
(`classifier.py`) with the dataset's channel count and class count, trained on its train split
(random shifts of up to 2 px, edges repeated), refused below `min_accuracy` on its test split, and
cached next to the dataset as `judge-cnn-v1.safetensors` (+ JSON naming the dataset's content hash,
so a judge of other data is never used). A copy shipped in `checkpoints/judges/<name>-<hash12>-cnn-v1`
is found first, so the figures in docs/RESULTS.md can be reproduced without retraining it.

Its FID reads generated images against its features of the test split; its accuracy is the fraction
of images it reads as the requested class. For an unlabelled dataset there is no data judge.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np

from .classifier import Classifier, _build, _random_shift, fit_input

log = logging.getLogger(__name__)

CACHE_NAME = "judge-cnn-v1"
SHIPPED = Path("checkpoints") / "judges"
MIN_ACCURACY = 0.97


def shipped_name(manifest: dict) -> str:
    return f"{manifest['name']}-{manifest['content_hash'][:12]}-cnn-v1"


def find_data_judge(data: str | Path, manifest: dict) -> Path | None:
    """The cached (next to the dataset) or shipped data judge of exactly this dataset, else None."""
    repo = Path(__file__).resolve().parents[1]
    candidates = [Path(data) / f"{CACHE_NAME}.safetensors"]
    candidates += [base / SHIPPED / f"{shipped_name(manifest)}.safetensors" for base in (Path.cwd(), repo)]
    for w in candidates:
        if w.exists() and w.with_suffix(".json").exists():
            judge = Classifier.load(w)
            if judge.meta.get("dataset_hash") == manifest["content_hash"]:
                return w
            log.warning("ignoring %s: it was trained on other data (dataset hash differs)", w)
    return None


def train_data_judge(
    data: str | Path,
    *,
    epochs: int = 3,
    batch_size: int = 128,
    seed: int = 0,
    limit: int | None = None,
    progress: bool = True,
    min_accuracy: float = MIN_ACCURACY,
) -> Classifier:
    """Train the data judge on a prepared dataset's train split; ValueError below `min_accuracy` on test."""
    import torch

    from dataset.prepared import load_prepared, to_model_range

    from .fit_classifier import fit_classifier

    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    x_u8, y, manifest = load_prepared(data, "train", limit=limit)
    xt_u8, yt, _ = load_prepared(data, "test")
    if (y < 0).any():
        raise ValueError(f"{data}: the data judge needs labels; this dataset has unlabelled images")
    classes = len(manifest.get("class_names") or []) or int(y.max()) + 1
    model = _build(int(manifest["channels"]), classes)
    t0 = time.time()

    def batch(idx):
        idx = np.sort(idx)  # ascending, as the data judge has always drawn a batch (same weights)
        xb = torch.from_numpy(_random_shift(to_model_range(x_u8[idx]), rng, edge=True))
        return fit_input(xb), torch.from_numpy(y[idx])

    fit_classifier(
        model, len(x_u8), batch, epochs=epochs, batch_size=batch_size, rng=rng, desc="data judge", progress=progress
    )
    c, h, w = int(manifest["channels"]), int(manifest["size"]), int(manifest["size"])
    judge = Classifier(model, {"input_shape": [c, h, w], "num_classes": classes})
    acc = float((judge.predict(to_model_range(xt_u8)) == yt).mean())
    judge.meta.update(
        {
            "test_accuracy": acc,
            "dataset": manifest["name"],
            "dataset_hash": manifest["content_hash"],
            "epochs": epochs,
            "train_images": int(len(x_u8)),
            "seconds": round(time.time() - t0, 1),
            "seed": seed,
        }
    )
    seconds = time.time() - t0
    log.info("data judge of %s: test accuracy %.4f after %d epochs (%.0fs)", manifest["name"], acc, epochs, seconds)
    if acc < min_accuracy:
        raise ValueError(f"the data judge reached only {acc:.4f} test accuracy (< {min_accuracy}); train longer")
    return judge


def load_or_train_data_judge(
    data: str | Path, *, progress: bool = True, min_accuracy: float | None = None, epochs: int = 3
) -> Classifier:
    """The data judge of a prepared dataset: cached or shipped, else trained once (`epochs`, refused below
    `min_accuracy`, default MIN_ACCURACY, on the test split) and cached next to the data."""
    from dataset.prepared import read_manifest

    manifest = read_manifest(data)
    found = find_data_judge(data, manifest)
    if found is not None:
        return Classifier.load(found)
    floor = MIN_ACCURACY if min_accuracy is None else min_accuracy
    judge = train_data_judge(data, progress=progress, min_accuracy=floor, epochs=epochs)
    judge.save(Path(data) / f"{CACHE_NAME}.safetensors")
    return judge
