"""Score generated digits: conditional accuracy, FID (classifier features), per-class counts."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .fid import fid_from_features


@dataclass
class Score:
    n: int
    accuracy: float  # fraction of images the classifier reads as the requested digit
    fid: float  # Fréchet distance to the reference set in classifier feature space
    predicted_counts: list[int] = field(default_factory=list)  # [10] how often each digit was seen
    per_class_accuracy: list[float] = field(default_factory=list)  # [10] accuracy per requested digit (nan if none)
    predictions: np.ndarray | None = field(default=None, repr=False)  # [N] the judge's digit per image
    features: np.ndarray | None = field(default=None, repr=False)  # [N, D] the judge's features (bootstrap FID)

    def as_dict(self) -> dict:
        return {
            "n": self.n,
            "accuracy": self.accuracy,
            "fid": self.fid,
            "predicted_counts": self.predicted_counts,
            "per_class_accuracy": self.per_class_accuracy,
        }


def prepare_images(images: np.ndarray) -> np.ndarray:
    """The one preprocessing every judge sees: float32 [N,1,32,32] clipped to [-1,1] (the generator's range)."""
    return np.clip(np.asarray(images, np.float32), -1.0, 1.0)


def judge_reads(classifier, images: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(predicted class [N] int64, features [N, D]) of prepared images: one pass through a judge that has
    `logits_and_features` (both shipped judges), else its `predict` and `features`."""
    both = getattr(classifier, "logits_and_features", None)
    if both is None:
        return np.asarray(classifier.predict(images), np.int64), classifier.features(images)
    logits, feats = both(images)
    return np.asarray(logits).argmax(axis=1).astype(np.int64), feats


def score_images(
    classifier, images: np.ndarray, digits: np.ndarray, reference_features: np.ndarray, num_classes: int = 10
) -> Score:
    """images [N,1,32,32] in [-1,1], digits [N] requested classes (-1: unconditional, no class asked
    for; accuracy counts only the rows with a digit, nan when there are none), reference_features [M,D]
    (the same judge's features of the reference set). Works with any judge that has predict/features
    (or logits_and_features: one pass instead of two)."""
    images = prepare_images(images)
    digits = np.asarray(digits, np.int64)
    if len(images) != len(digits):
        raise ValueError(f"{len(images)} images but {len(digits)} labels")
    pred, feats = judge_reads(classifier, images)
    asked = digits >= 0
    per_class = []
    for c in range(num_classes):
        mask = digits == c
        per_class.append(float((pred[mask] == c).mean()) if mask.any() else float("nan"))
    return Score(
        n=int(len(images)),
        accuracy=float((pred[asked] == digits[asked]).mean()) if asked.any() else float("nan"),
        fid=fid_from_features(feats, reference_features),
        predicted_counts=np.bincount(pred, minlength=num_classes).astype(int).tolist(),
        per_class_accuracy=per_class,
        predictions=np.asarray(pred, np.int64),
        features=np.asarray(feats, np.float32),
    )


def agreement(a: Score, b: Score) -> float:
    """Fraction of images two judges read as the same digit (whatever was requested)."""
    if a.predictions is None or b.predictions is None or len(a.predictions) != len(b.predictions):
        raise ValueError("agreement needs both scores' predictions on the same images")
    return float((a.predictions == b.predictions).mean()) if len(a.predictions) else float("nan")
