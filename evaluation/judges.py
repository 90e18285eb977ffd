"""Independent judges scoring the same images side by side.

Judge 1 is the torch CNN (`classifier.py`), judge 2 the JAX/Flax residual CNN (`classifier_jax.py`),
both trained on MNIST. Both see exactly the same input: float32 [N,1,32,32] clipped to [-1,1], the
generator's and `load_mnist`'s convention; for a prepared dataset drawn from MNIST in another form
(colour MNIST) they read its digit view (`views.digit_view`: luminance, background to -1). Each
judge's FID is measured in its own penultimate features against its own features of the test split
(of the evaluated dataset, through the same view).

For a prepared dataset (`Judges.load(dataset=DIR)`) a third judge joins: the data judge
(`data_judge.py`), trained on that dataset itself, whose FID reads the images as they are (RGB,
any size). For an image folder that is not digits, the data judge is the only one. When the
dataset records a palette (colour MNIST), every image's colours are checked too (`views.colour_check`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dataset.mnist import resolve_data_dir

from .judge_cache import logits_and_features
from .score import Score, agreement, prepare_images, score_images
from .views import ColourReading, area_downsample, colour_check, digit_view, has_digit_view, palette_arrays

JUDGE_LABELS = {"": "judge 1", "_judge2": "judge 2", "_data": "data judge"}  # JSON suffix -> label


@dataclass
class DualScore:
    judge1: Score | None
    judge2: Score | None
    agreement: float  # fraction of images judges 1 and 2 read as the same digit (nan without them)
    data: Score | None = None  # the data judge's (prepared datasets)
    colour: ColourReading | None = None  # the palette check (datasets that record a palette)

    def panel(self) -> list[tuple[str, str, Score]]:
        """(label, JSON suffix, score) of every judge that scored these images, judge 1 first."""
        present = (("", self.judge1), ("_judge2", self.judge2), ("_data", self.data))
        return [(JUDGE_LABELS[sfx], sfx, s) for sfx, s in present if s is not None]

    @property
    def n(self) -> int:
        return self.panel()[0][2].n

    def as_dict(self) -> dict:
        d: dict = {"n": self.n, "agreement": self.agreement}
        for _, sfx, s in self.panel():
            d[f"accuracy{sfx}"] = s.accuracy
            d[f"fid{sfx}"] = s.fid
            d[f"per_class_accuracy{sfx}"] = s.per_class_accuracy
            d[f"predicted_counts{sfx}"] = s.predicted_counts
        if self.colour is not None:
            d["colour_correct"] = float(self.colour.correct.mean()) if len(self.colour.correct) else float("nan")
        return d


def _digit_classes(manifest: dict) -> bool:
    """Whether a prepared dataset's classes are the digits 0-9 in order (MNIST drawn another way)."""
    return list(manifest.get("class_names") or []) == [str(c) for c in range(10)]


@dataclass
class Judges:
    judge1: object | None  # classifier.Classifier (None: the dataset is not digits)
    judge2: object | None  # classifier_jax.JaxClassifier
    reference1: np.ndarray | None  # judge 1 features of the test split [M, 256]
    reference2: np.ndarray | None  # judge 2 features of the test split [M, 128]
    test_accuracy1: float | None  # measured now on the test split, not read from the cache's JSON
    test_accuracy2: float | None
    test_agreement: float | None  # the judges agree on this fraction of real test digits
    data_judge: object | None = None  # data_judge: trained on the evaluated prepared dataset
    reference_data: np.ndarray | None = None
    test_accuracy_data: float | None = None
    dataset: str | None = None  # the prepared dataset directory (None: MNIST from the cache)
    dataset_name: str = "MNIST"
    sample_shape: tuple = (1, 32, 32)
    num_classes: int = 10
    palette: tuple | None = None  # (foregrounds [F,3], backgrounds [B,3]) RGB 0..255

    @classmethod
    def load(
        cls,
        data_dir: str | Path | None = None,
        *,
        progress: bool = True,
        min_accuracy: float | None = None,
        dataset: str | Path | None = None,
    ) -> Judges:
        """Load (or train once and cache) both judges; compute their test-set features and accuracy, and
        refuse (ValueError) a judge that reads fewer than `min_accuracy` (default 0.99) of the test digits.

        `dataset`: a prepared dataset directory to evaluate instead of MNIST. Judges 1 and 2 join when
        its classes are the digits and its images have a digit view; the data judge always (it needs labels)."""
        from dataset.mnist import load_mnist

        from .classifier import MIN_TEST_ACCURACY, Classifier
        from .classifier_jax import JaxClassifier

        floor = MIN_TEST_ACCURACY if min_accuracy is None else min_accuracy
        if dataset is None:
            j1 = Classifier.load_or_train(data_dir, progress=progress)
            j2 = JaxClassifier.load_or_train(data_dir, progress=progress)
            judges = cls.from_judges(j1, j2, *load_mnist("test", data_dir), cache_dir=resolve_data_dir(data_dir))
        else:
            judges = cls._for_dataset(dataset, data_dir, progress, min_accuracy)
        for name, acc in (("judge 1", judges.test_accuracy1), ("judge 2", judges.test_accuracy2)):
            if acc is not None and acc < floor:  # measured now, whatever a cached JSON says
                raise ValueError(
                    f"{name} reads only {acc:.4f} of the 10k test digits correctly (< {floor}); "
                    "delete its cached files to retrain it"
                )
        return judges

    @classmethod
    def _for_dataset(cls, dataset: str | Path, data_dir, progress: bool, min_accuracy: float | None) -> Judges:
        from dataset.prepared import load_prepared, to_model_range

        from .classifier import Classifier
        from .classifier_jax import JaxClassifier
        from .data_judge import load_or_train_data_judge

        x_u8, y, manifest = load_prepared(dataset, "test")
        if (y < 0).any():
            raise ValueError(f"{dataset}: evaluation needs a labelled test split (the data judge learns the classes)")
        x = to_model_range(x_u8)
        shape = tuple(int(v) for v in x.shape[1:])
        if _digit_classes(manifest) and has_digit_view(shape):
            j1 = Classifier.load_or_train(data_dir, progress=progress)
            j2 = JaxClassifier.load_or_train(data_dir, progress=progress)
            judges = cls.from_judges(j1, j2, digit_view(x), y, cache_dir=resolve_data_dir(data_dir))
        else:
            judges = cls(None, None, None, None, None, None, None)
        dj = load_or_train_data_judge(dataset, progress=progress, min_accuracy=min_accuracy)
        logits, feats = logits_and_features(dj, x, resolve_data_dir(data_dir))
        judges.data_judge, judges.reference_data = dj, feats
        judges.test_accuracy_data = float((logits.argmax(1) == y).mean())
        judges.dataset, judges.dataset_name = str(dataset), str(manifest.get("name", dataset))
        judges.sample_shape, judges.num_classes = shape, dj.num_classes
        judges.palette = palette_arrays(manifest) if shape[0] == 3 else None
        return judges

    @classmethod
    def from_judges(cls, j1, j2, x_ref: np.ndarray, y_ref: np.ndarray, *, cache_dir=None) -> Judges:
        """Both judges' reading of the reference set (`x_ref`, `y_ref`); `cache_dir`: keep it there
        between runs (`judge_cache`: keyed by the judges' weights and the images)."""
        x_ref = prepare_images(x_ref)
        logits1, ref1 = logits_and_features(j1, x_ref, cache_dir)
        logits2, ref2 = logits_and_features(j2, x_ref, cache_dir)
        p1, p2 = logits1.argmax(1), logits2.argmax(1)
        return cls(
            j1, j2, ref1, ref2, float((p1 == y_ref).mean()), float((p2 == y_ref).mean()), float((p1 == p2).mean())
        )

    def panel(self) -> list[tuple[str, str]]:
        """(label, JSON suffix) of every judge this set scores with."""
        present = (("", self.judge1), ("_judge2", self.judge2), ("_data", self.data_judge))
        return [(JUDGE_LABELS[sfx], sfx) for sfx, j in present if j is not None]

    def references(self) -> dict[str, np.ndarray]:
        """JSON suffix -> that judge's features of the test split (FID's reference)."""
        refs = {"": self.reference1, "_judge2": self.reference2, "_data": self.reference_data}
        return {sfx: refs[sfx] for _, sfx in self.panel()}

    def score(self, images: np.ndarray, digits: np.ndarray) -> DualScore:
        """Scores of `images` [N, C, H, W] asked to be `digits`. Images larger than the judges' by a whole
        factor (colour MNIST drawn at 256px for 32px judges) are read after an area mean to their size."""
        images = np.clip(np.asarray(images, np.float32), -1.0, 1.0)
        if images.ndim == 4 and tuple(images.shape[1:]) != tuple(self.sample_shape):
            try:
                images = area_downsample(images, self.sample_shape)
            except ValueError:
                pass  # refused below, naming the shape these judges read
        if images.ndim != 4 or tuple(images.shape[1:]) != tuple(self.sample_shape):
            raise ValueError(
                f"these judges read {self.dataset_name} images [N, {', '.join(map(str, self.sample_shape))}], "
                f"got {list(images.shape)}"
            )
        s1 = s2 = s3 = colour = None
        if self.judge1 is not None:
            view = digit_view(images)
            s1 = score_images(self.judge1, view, digits, self.reference1)
            s2 = score_images(self.judge2, view, digits, self.reference2)
        if self.data_judge is not None:
            s3 = score_images(self.data_judge, images, digits, self.reference_data, self.num_classes)
        if self.palette is not None:
            colour = colour_check(images, *self.palette)
        agree = agreement(s1, s2) if s1 is not None else float("nan")
        return DualScore(s1, s2, agree, s3, colour)

    def real_images(self, split: str, data_dir: str | Path | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(images in the model's range, labels) of a split of the evaluated data."""
        if self.dataset is None:
            from dataset.mnist import load_mnist

            return load_mnist(split, data_dir)
        from dataset.prepared import load_prepared, to_model_range

        x, y, _ = load_prepared(self.dataset, split)
        return to_model_range(x), y

    def score_real(self, digits: np.ndarray, data_dir: str | Path | None = None) -> DualScore:
        """The same scores for real digits: for each requested digit the next validation image of
        that class (deterministic). Gives each judge's accuracy and the FID floor at this sample size,
        so generated rows can be read against real data scored the same way."""
        x, y = self.real_images("val", data_dir)
        digits = np.asarray(digits, np.int64)
        pick = np.empty(len(digits), np.int64)
        for c in range(self.num_classes):
            where = np.flatnonzero(digits == c)
            pool = np.flatnonzero(y == c)
            if len(where) > len(pool):
                raise ValueError(f"{len(where)} images of digit {c} requested, the validation split has {len(pool)}")
            pick[where] = pool[: len(where)]
        return self.score(x[pick], digits)

    def describe(self) -> str:
        parts = []
        if self.judge1 is not None:
            view = " (on the images' digit view: luminance, background -1)" if self.dataset is not None else ""
            parts.append(
                f"judge 1: torch 5-conv CNN, {self.test_accuracy1:.2%} test accuracy; judge 2: jax/flax residual "
                f"CNN, {self.test_accuracy2:.2%} test accuracy{view}; they agree on {self.test_agreement:.2%} of "
                f"the real test images"
            )
        if self.data_judge is not None:
            parts.append(
                f"data judge: torch CNN trained on {self.dataset_name} itself, {self.test_accuracy_data:.2%} "
                "test accuracy"
            )
        if self.palette is not None:
            parts.append("colour: background (border median) and foreground both within 40 of a palette colour")
        return (
            "; ".join(parts) + ". FID: each judge's penultimate features vs its features of the test split "
            "(the FID scales differ: compare rows within a column)."
        )
