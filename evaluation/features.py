"""Features of a pretrained network for the `features` partition (a stand-in for DINOv2).

The DDM paper clusters its training set in the feature space of a network trained for another
purpose (DINOv2). On MNIST the stand-in is judge 2 (`classifier_jax.py`, the JAX residual CNN
trained to classify digits): its penultimate layer `embed` (dense 1536 -> 128 after GELU, the same
128-d vector judge 2's FID uses). The judge is loaded from `checkpoints/judges/` (shipped) or the
data dir's cache; only when neither exists is it trained once (about 5 minutes on 2 CPU cores) and
cached. Extracting the 50k train images' features then takes seconds on a CPU.

Caveat: judge 2 learned its features from the digit labels, so its clusters follow the classes
more closely than a self-supervised network's would; the partition report's class histograms
show how much.

dataset/ may not import evaluation/, so `ddm-fleet partition --method features` (infra) calls
:func:`partition_features` and hands the matrix to `dataset.partition.make_partition`.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

LAYER = "embed"  # judge 2's penultimate layer: dense 1536 -> 128, GELU


def extractor_name(weights: Path | None) -> str:
    """`judge2-jax/<cache name>/embed[sha256 prefix]`: recorded in the manifest so the same
    extractor can be asked for again (assigning val images, training the router)."""
    from .classifier_jax import CACHE_NAME

    digest = hashlib.sha256(weights.read_bytes()).hexdigest()[:12] if weights is not None else "untracked"
    return f"judge2-jax/{CACHE_NAME}/{LAYER}@{digest}"


def partition_features(
    images: np.ndarray, data_dir: str | Path | None = None, *, progress: bool = True
) -> tuple[np.ndarray, str]:
    """images float32 [N, 1, 32, 32] in [-1, 1] -> (features float32 [N, 128], extractor name).

    Loads judge 2 (shipped or cached; trains and caches it once if neither is there).
    """
    from tqdm.auto import tqdm

    from .classifier import find_judge
    from .classifier_jax import CACHE_NAME, JaxClassifier

    judge = JaxClassifier.load_or_train(data_dir, progress=progress)
    x = np.asarray(images, dtype=np.float32)
    chunk = 5000  # a multiple of the judge's compiled batch, so only the last chunk pads
    parts = [
        judge.features(x[i : i + chunk])
        for i in tqdm(range(0, len(x), chunk), desc="judge 2 features", unit="chunk", disable=not progress)
    ]
    feats = np.concatenate(parts) if parts else np.zeros((0, judge.feature_dim), np.float32)
    return np.ascontiguousarray(feats, dtype=np.float32), extractor_name(find_judge(CACHE_NAME, data_dir))
