"""Feature extractors for the `features` partition: the DDM paper clusters its data in the feature space
of a pretrained network trained for another purpose (DINOv2). Pick one with `--features CHOICE`:

* ``judge2`` (default): judge 2 (`classifier_jax.py`, the JAX residual CNN trained to classify MNIST
  digits), its penultimate layer ``embed`` (128-d, the vector judge 2's FID uses). It reads grey
  1x32x32 digits; RGB 3x32x32 images are read through their digit view (`views.digit_view`), so on
  colour MNIST it clusters by shape, not colour. Loaded from `checkpoints/judges/` or the data dir's
  cache, else trained once (about 5 minutes on 2 CPU cores).
* ``data-judge:DIR``: the data judge of the prepared dataset DIR (`data_judge.py`, a CNN trained on
  that dataset's own classes), its 256-d penultimate layer; any shape and channel count.
* ``torch:PATH``: your own network, a TorchScript file (``torch.jit.save``) mapping float32
  [N, C, H, W] in [-1, 1] to [N, D] features (or anything that flattens to that); run on the CPU.
* ``dinov2:DIR``: a transformers DINOv2 model saved with ``save_pretrained`` (the paper's feature
  space; the `pretrained` extra): its CLS token after the final layer norm (``pooler_output``), images
  resized and normalised as its preprocessor expects (``features_dinov2.py``).

The partition manifest records the extractor's name with a hash of its weights (``judge2-jax/...@<sha>``,
``data-judge:<DIR>@<sha>``, ``torch:<PATH>@<sha>``, ``dinov2-cls:<DIR>@<sha>``), so `train-router` asks the
same extractor again for its val targets and refuses one whose weights changed. (The `kmeans` method is
the pixel-PCA choice: it clusters PCA'd pooled pixels and needs no network.)

dataset/ may not import evaluation/, so `ddm-fleet partition` (infra) calls :func:`load_extractor` and
hands the matrix to `dataset.partition.make_partition`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

LAYER = "embed"  # judge 2's penultimate layer: dense 1536 -> 128, GELU
CHOICES = ("judge2", "data-judge:DIR", "torch:PATH", "dinov2:DIR")


class ExtractorError(ValueError):
    """An extractor that cannot be built, or one that does not fit the images."""


def _digest(path: Path | None) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:12] if path is not None else "untracked"


def extractor_name(weights: Path | None) -> str:
    """Judge 2's recorded name: `judge2-jax/<cache name>/embed@<sha256 prefix>`."""
    from .classifier_jax import CACHE_NAME

    return f"judge2-jax/{CACHE_NAME}/{LAYER}@{_digest(weights)}"


@dataclass
class Extractor:
    """`name` goes in the partition manifest; `run(x [n, C, H, W]) -> [n, D]` on one chunk."""

    name: str
    run: Callable[[np.ndarray], np.ndarray]
    chunk: int = 2000

    def features(self, images: np.ndarray, *, progress: bool = True) -> np.ndarray:
        """images float32 [N, C, H, W] in [-1, 1] -> float32 [N, D], in chunks with a progress bar."""
        from tqdm.auto import tqdm

        x = np.asarray(images, np.float32)
        starts = range(0, len(x), self.chunk)
        bar = tqdm(starts, desc="features", unit="chunk", disable=not progress)
        parts = [self.run(x[i : i + self.chunk]) for i in bar]
        if not parts:
            raise ExtractorError("no images to extract features from")
        feats = np.concatenate([np.asarray(p, np.float32).reshape(len(p), -1) for p in parts])
        if not np.isfinite(feats).all():
            raise ExtractorError(f"{self.name} gave non-finite features")
        return np.ascontiguousarray(feats)


def _judge2(data_dir, progress: bool) -> Extractor:
    from .classifier import find_judge
    from .classifier_jax import CACHE_NAME, JaxClassifier
    from .views import digit_view, has_digit_view

    judge = JaxClassifier.load_or_train(data_dir, progress=progress)

    def run(x: np.ndarray) -> np.ndarray:
        if not has_digit_view(x.shape[1:]):
            raise ExtractorError(
                f"--features judge2 reads 1x32x32 digits (or 3x32x32 through their digit view); these images are "
                f"{'x'.join(map(str, x.shape[1:]))}: use --features data-judge:DIR or torch:PATH, or --method kmeans"
            )
        return judge.features(digit_view(x))

    return Extractor(extractor_name(find_judge(CACHE_NAME, data_dir)), run, chunk=5000)


def _data_judge(directory: str, progress: bool) -> Extractor:
    from dataset.prepared import read_manifest

    from .data_judge import find_data_judge, load_or_train_data_judge

    judge = load_or_train_data_judge(directory, progress=progress)
    weights = find_data_judge(directory, read_manifest(directory))
    return Extractor(f"data-judge:{directory}@{_digest(weights)}", judge.features)


def _torch_module(path: str) -> Extractor:
    import torch

    p = Path(path)
    if not p.is_file():
        raise ExtractorError(f"--features torch:{path}: no such file (a TorchScript module, torch.jit.save)")
    try:
        module = torch.jit.load(str(p), map_location="cpu").eval()
    except (RuntimeError, ValueError) as e:
        raise ExtractorError(f"--features torch:{path}: not a TorchScript module ({e})") from e

    def run(x: np.ndarray) -> np.ndarray:
        with torch.inference_mode():
            try:
                out = module(torch.from_numpy(np.ascontiguousarray(x)))
            except Exception as e:  # the user's module: any failure is reported, with the input shape
                raise ExtractorError(f"--features torch:{path} failed on images {list(x.shape)}: {e}") from e
        if not isinstance(out, torch.Tensor) or out.ndim < 1 or out.shape[0] != len(x):
            raise ExtractorError(f"--features torch:{path} must return a tensor [N, D]; got {type(out).__name__}")
        return out.float().reshape(len(x), -1).numpy()

    return Extractor(f"torch:{path}@{_digest(p)}", run, chunk=512)


def _dinov2(directory: str) -> Extractor:
    from .features_dinov2 import Dinov2Error, load

    try:
        name, run = load(directory)
    except Dinov2Error as e:
        raise ExtractorError(str(e)) from None

    def checked(x: np.ndarray) -> np.ndarray:
        try:
            return run(x)
        except Dinov2Error as e:
            raise ExtractorError(str(e)) from None

    return Extractor(name, checked, chunk=256)


def load_extractor(choice: str = "judge2", data_dir=None, *, progress: bool = True) -> Extractor:
    """Build the extractor `choice` names (see the module doc); ExtractorError for an unknown choice."""
    kind, _, arg = choice.partition(":")
    if kind == "judge2" and not arg:
        return _judge2(data_dir, progress)
    if kind == "data-judge" and arg:
        return _data_judge(arg, progress)
    if kind == "torch" and arg:
        return _torch_module(arg)
    if kind == "dinov2" and arg:
        return _dinov2(arg)
    raise ExtractorError(f"unknown feature extractor {choice!r}: use one of {', '.join(CHOICES)}")


def choice_of(recorded: str) -> str:
    """The `--features` choice that made a manifest's recorded extractor name."""
    if recorded.startswith("judge2-jax/"):
        return "judge2"
    kind, _, rest = recorded.partition(":")
    if kind in ("data-judge", "torch") and "@" in rest:
        return f"{kind}:{rest.rsplit('@', 1)[0]}"
    if kind == "dinov2-cls" and "@" in rest:  # DINOv2's CLS token (features_dinov2.py)
        return f"dinov2:{rest.rsplit('@', 1)[0]}"
    raise ExtractorError(f"the partition names an extractor this version does not know: {recorded!r}")


def extractor_for(recorded: str, data_dir=None, *, choice: str | None = None, progress: bool = True) -> Extractor:
    """The extractor a partition was clustered with (or `choice`, e.g. a moved torch file), checked: its
    name, weights hash included, must be the recorded one."""
    ex = load_extractor(choice or choice_of(recorded), data_dir, progress=progress)
    same = ex.name == recorded or (choice is not None and ex.name.rsplit("@", 1)[-1] == recorded.rsplit("@", 1)[-1])
    if not same:
        raise ExtractorError(
            f"the partition was clustered with {recorded} but the extractor found now is {ex.name}; "
            "targets would not match (same weights needed)"
        )
    return ex


def partition_features(
    images: np.ndarray, data_dir: str | Path | None = None, *, progress: bool = True, choice: str = "judge2"
) -> tuple[np.ndarray, str]:
    """images float32 [N, C, H, W] in [-1, 1] -> (features float32 [N, D], extractor name)."""
    ex = load_extractor(choice, data_dir, progress=progress)
    return ex.features(images, progress=progress), ex.name
