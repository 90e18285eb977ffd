"""evaluation.judge_cache: a judge's reading of the reference set is kept between runs, and only ever
reused for the same weights and the same images."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from evaluation.judge_cache import SUBDIR, logits_and_features, weights_digest


class CountingJudge:
    """A torch judge in miniature: logits and features from a linear map, counting its passes."""

    def __init__(self, seed: int):
        torch.manual_seed(seed)
        self.model = torch.nn.Linear(16, 3)
        self.passes = 0

    def logits_and_features(self, images):
        self.passes += 1
        with torch.no_grad():
            feats = self.model(torch.from_numpy(images.reshape(len(images), -1)))
        return feats.numpy() * 2, feats.numpy()


def _images(seed: int = 0, n: int = 5):
    return np.random.default_rng(seed).standard_normal((n, 1, 4, 4)).astype(np.float32)


def test_second_reading_comes_from_the_cache_and_equals_the_first(tmp_path):
    judge, x = CountingJudge(0), _images()
    first = logits_and_features(judge, x, tmp_path)
    again = logits_and_features(judge, x, tmp_path)
    assert judge.passes == 1 and len(list((tmp_path / SUBDIR).glob("*.npz"))) == 1
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a, b)
    assert not list((tmp_path / SUBDIR).glob(".*"))  # no temporary file left behind


def test_other_weights_or_other_images_are_read_again(tmp_path):
    judge, x = CountingJudge(0), _images()
    logits_and_features(judge, x, tmp_path)
    other = CountingJudge(1)
    assert weights_digest(other) != weights_digest(judge)
    logits, _ = logits_and_features(other, x, tmp_path)
    assert other.passes == 1
    np.testing.assert_array_equal(logits, other.logits_and_features(x)[0])  # its own reading, not judge's
    with torch.no_grad():
        judge.model.bias[0] += 1e-6  # one weight retrained by a hair
    logits_and_features(judge, x, tmp_path)
    y = x.copy()
    y[0, 0, 0, 0] = np.nextafter(y[0, 0, 0, 0], np.float32(9))  # one pixel, one ulp
    logits_and_features(judge, y, tmp_path)
    assert judge.passes == 3 and len(list((tmp_path / SUBDIR).glob("*.npz"))) == 4


def test_an_unreadable_file_is_computed_again_and_replaced(tmp_path, caplog):
    judge, x = CountingJudge(0), _images()
    want = logits_and_features(judge, x, tmp_path)
    (kept,) = (tmp_path / SUBDIR).glob("*.npz")
    kept.write_bytes(b"not a zip")
    got = logits_and_features(judge, x, tmp_path)
    assert judge.passes == 2 and "unreadable" in caplog.text
    np.testing.assert_array_equal(got[1], want[1])
    logits_and_features(judge, x, tmp_path)
    assert judge.passes == 2  # the replaced file is good


def test_a_directory_that_cannot_be_written_only_costs_the_reading(tmp_path):
    blocked = tmp_path / "a-file"
    blocked.write_text("in the way")  # the cache directory cannot be made under it (root or not)
    judge = CountingJudge(0)
    first = logits_and_features(judge, _images(), blocked)
    again = logits_and_features(judge, _images(), blocked)
    assert judge.passes == 2 and blocked.read_text() == "in the way"
    np.testing.assert_array_equal(first[0], again[0])


def test_no_cache_dir_reads_every_time():
    judge = CountingJudge(0)
    logits_and_features(judge, _images(), None)
    logits_and_features(judge, _images(), None)
    assert judge.passes == 2


def test_the_jax_judge_has_a_digest_of_its_own_weights():
    import jax.numpy as jnp

    class J:
        def __init__(self, v):
            self.params = {"dense": {"kernel": jnp.full((2, 2), v), "bias": jnp.zeros(2)}}

    assert weights_digest(J(1.0)) == weights_digest(J(1.0)) != weights_digest(J(2.0))
    with pytest.raises(TypeError, match="no weights"):
        weights_digest(object())


def test_a_judge_without_weights_to_fingerprint_is_read_and_nothing_kept(tmp_path):
    class Opaque:
        passes = 0

        def logits_and_features(self, images):
            self.passes += 1
            return np.zeros((len(images), 3), np.float32), np.ones((len(images), 2), np.float32)

    judge = Opaque()
    logits_and_features(judge, _images(), tmp_path)
    logits_and_features(judge, _images(), tmp_path)
    assert judge.passes == 2 and not (tmp_path / SUBDIR).exists()


def test_only_the_most_recently_used_readings_are_kept(tmp_path, monkeypatch):
    import os
    import time

    import evaluation.judge_cache as judge_cache

    monkeypatch.setattr(judge_cache, "MAX_KEPT", 2)
    judge = CountingJudge(0)
    first, second, third = _images(1), _images(2), _images(3)
    logits_and_features(judge, first, tmp_path)
    logits_and_features(judge, second, tmp_path)
    for f in (tmp_path / SUBDIR).glob("*.npz"):  # both an hour old, the first read again just now
        os.utime(f, (time.time() - 3600, time.time() - 3600))
    logits_and_features(judge, first, tmp_path)
    assert judge.passes == 2
    logits_and_features(judge, third, tmp_path)  # a third reading: the least recently used (second) goes
    assert judge.passes == 3 and len(list((tmp_path / SUBDIR).glob("*.npz"))) == 2
    logits_and_features(judge, first, tmp_path)
    logits_and_features(judge, third, tmp_path)
    assert judge.passes == 3
    logits_and_features(judge, second, tmp_path)
    assert judge.passes == 4


def test_readers_side_by_side_compute_the_reading_once(tmp_path):
    """Evaluations started together (several processes, here threads: each opens the lock file itself) wait
    for the first one's reading instead of each computing it."""
    import threading
    import time

    class SlowJudge(CountingJudge):
        def logits_and_features(self, images):
            time.sleep(0.3)  # long enough for every reader to arrive while the first computes
            return super().logits_and_features(images)

    judge, x = SlowJudge(0), _images()
    got = []
    readers = [threading.Thread(target=lambda: got.append(logits_and_features(judge, x, tmp_path))) for _ in range(3)]
    for r in readers:
        r.start()
    for r in readers:
        r.join(timeout=30)
    assert len(got) == 3 and judge.passes == 1
    for logits, feats in got[1:]:
        np.testing.assert_array_equal(logits, got[0][0])
        np.testing.assert_array_equal(feats, got[0][1])
