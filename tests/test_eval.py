"""The judge classifier really trains and reads real digits; scoring uses it."""

from __future__ import annotations

import numpy as np
import pytest

from coordinator.data import load_mnist
from coordinator.evaluation.classifier import Classifier
from coordinator.evaluation.score import score_images


@pytest.fixture(scope="module")
def small_classifier():
    # One short epoch on a 6k slice: far below the shipped judge, but a real run.
    return Classifier.train(epochs=1, limit=6000, batch_size=64, progress=False, min_accuracy=0.9)


def test_classifier_trains_and_reads_test_digits(small_classifier):
    x, y = load_mnist("test")
    acc = float((small_classifier.predict(x[:2000]) == y[:2000]).mean())
    assert acc > 0.9
    assert small_classifier.meta["test_accuracy"] > 0.9


def test_classifier_refuses_wrong_shape(small_classifier):
    with pytest.raises(ValueError, match=r"\[N, 1, 32, 32\]"):
        small_classifier.predict(np.zeros((3, 28, 28), np.float32))


def test_score_real_vs_wrong_labels_and_noise(small_classifier):
    x, y = load_mnist("val")
    ref = small_classifier.features(x[:1000])
    good = score_images(small_classifier, x[1000:1500], y[1000:1500], ref)
    wrong = score_images(small_classifier, x[1000:1500], (y[1000:1500] + 1) % 10, ref)
    noise = score_images(small_classifier, np.random.default_rng(0).uniform(-1, 1, (500, 1, 32, 32)).astype(np.float32),
                         y[1000:1500], ref)
    assert good.accuracy > 0.9 and wrong.accuracy < 0.1
    assert sum(good.predicted_counts) == 500
    assert good.fid < noise.fid / 5  # real digits are far closer to real digits than noise is
