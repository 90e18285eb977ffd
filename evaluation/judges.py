"""Two independent judges scoring the same images side by side.

Judge 1 is the torch CNN (`classifier.py`), judge 2 the JAX/Flax residual CNN (`classifier_jax.py`).
Both see exactly the same input (`score.prepare_images`: float32 [N,1,32,32] clipped to [-1,1], the
generator's and `load_mnist`'s convention), and each judge's FID is measured in its own penultimate
features against its own features of the 10k test images.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .score import Score, agreement, prepare_images, score_images


@dataclass
class DualScore:
    judge1: Score
    judge2: Score
    agreement: float  # fraction of images both judges read as the same digit

    def as_dict(self) -> dict:
        s1, s2 = self.judge1, self.judge2
        return {
            "n": s1.n,
            "accuracy": s1.accuracy,
            "fid": s1.fid,
            "accuracy_judge2": s2.accuracy,
            "fid_judge2": s2.fid,
            "agreement": self.agreement,
            "per_class_accuracy": s1.per_class_accuracy,
            "per_class_accuracy_judge2": s2.per_class_accuracy,
            "predicted_counts": s1.predicted_counts,
            "predicted_counts_judge2": s2.predicted_counts,
        }


@dataclass
class Judges:
    judge1: object  # classifier.Classifier
    judge2: object  # classifier_jax.JaxClassifier
    reference1: np.ndarray  # judge 1 features of the test split [M, 256]
    reference2: np.ndarray  # judge 2 features of the test split [M, 128]
    test_accuracy1: float  # measured now on the test split, not read from the cache's JSON
    test_accuracy2: float
    test_agreement: float  # the judges agree on this fraction of real test digits

    @classmethod
    def load(
        cls, data_dir: str | Path | None = None, *, progress: bool = True, min_accuracy: float | None = None
    ) -> Judges:
        """Load (or train once and cache) both judges; compute their test-set features and accuracy, and
        refuse (ValueError) a judge that reads fewer than `min_accuracy` (default 0.99) of the test digits."""
        from dataset.mnist import load_mnist

        from .classifier import MIN_TEST_ACCURACY, Classifier
        from .classifier_jax import JaxClassifier

        floor = MIN_TEST_ACCURACY if min_accuracy is None else min_accuracy
        j1 = Classifier.load_or_train(data_dir, progress=progress)
        j2 = JaxClassifier.load_or_train(data_dir, progress=progress)
        judges = cls.from_judges(j1, j2, *load_mnist("test", data_dir))
        for name, acc in (("judge 1", judges.test_accuracy1), ("judge 2", judges.test_accuracy2)):
            if acc < floor:  # measured now, whatever a cached JSON says
                raise ValueError(
                    f"{name} reads only {acc:.4f} of the 10k test digits correctly (< {floor}); "
                    "delete its cached files to retrain it"
                )
        return judges

    @classmethod
    def from_judges(cls, j1, j2, x_ref: np.ndarray, y_ref: np.ndarray) -> Judges:
        x_ref = prepare_images(x_ref)
        logits1, ref1 = j1.logits_and_features(x_ref)
        logits2, ref2 = j2.logits_and_features(x_ref)
        p1, p2 = logits1.argmax(1), logits2.argmax(1)
        return cls(
            j1, j2, ref1, ref2, float((p1 == y_ref).mean()), float((p2 == y_ref).mean()), float((p1 == p2).mean())
        )

    def score(self, images: np.ndarray, digits: np.ndarray) -> DualScore:
        images = prepare_images(images)
        s1 = score_images(self.judge1, images, digits, self.reference1)
        s2 = score_images(self.judge2, images, digits, self.reference2)
        return DualScore(s1, s2, agreement(s1, s2))

    def score_real(self, digits: np.ndarray, data_dir: str | Path | None = None) -> DualScore:
        """The same scores for real digits: for each requested digit the next validation image of
        that class (deterministic). Gives each judge's accuracy and the FID floor at this sample size,
        so generated rows can be read against real data scored the same way."""
        from dataset.mnist import load_mnist

        x, y = load_mnist("val", data_dir)
        digits = np.asarray(digits, np.int64)
        pick = np.empty(len(digits), np.int64)
        for c in range(10):
            where = np.flatnonzero(digits == c)
            pool = np.flatnonzero(y == c)
            if len(where) > len(pool):
                raise ValueError(f"{len(where)} images of digit {c} requested, the validation split has {len(pool)}")
            pick[where] = pool[: len(where)]
        return self.score(x[pick], digits)

    def describe(self) -> str:
        return (
            f"judge 1: torch 5-conv CNN, {self.test_accuracy1:.2%} test accuracy; judge 2: jax/flax residual "
            f"CNN, {self.test_accuracy2:.2%} test accuracy; they agree on {self.test_agreement:.2%} of the "
            f"10k real test digits. FID: each judge's penultimate features vs its features of those digits "
            f"(the two FID scales differ: compare rows within a column)."
        )
