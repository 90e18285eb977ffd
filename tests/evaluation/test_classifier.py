"""The judge classifier really trains and reads real digits; scoring uses it."""

from __future__ import annotations

import numpy as np
import pytest

from dataset.mnist import load_mnist
from evaluation.classifier import CACHE_NAME, Classifier, shipped_judge
from evaluation.score import score_images


@pytest.fixture(scope="module")
def small_classifier():
    # One short epoch on a 4k slice (62 steps; 0.95 on 2k test digits here): far below the shipped judge, but a
    # real run (checked on 2k test digits)
    return Classifier.train(epochs=1, limit=4000, batch_size=64, progress=False, min_accuracy=0.9, test_limit=2000)


@pytest.mark.slow  # needs small_classifier (~15 CPU-s of training); the end-to-end run ~25 s more
def test_classifier_trains_and_reads_test_digits(small_classifier):
    x, y = load_mnist("test")
    acc = float((small_classifier.predict(x[2000:4000]) == y[2000:4000]).mean())  # digits its check never saw
    assert acc > 0.9
    assert small_classifier.meta["test_accuracy"] > 0.9 and small_classifier.meta["test_images"] == 2000


@pytest.mark.slow  # needs small_classifier (~15 CPU-s of training); the end-to-end run ~25 s more
def test_classifier_refuses_wrong_shape(small_classifier):
    with pytest.raises(ValueError, match=r"\[N, 1, 32, 32\]"):
        small_classifier.predict(np.zeros((3, 28, 28), np.float32))


@pytest.mark.slow  # needs small_classifier (~15 CPU-s of training); the end-to-end run ~25 s more
def test_score_real_vs_wrong_labels_and_noise(small_classifier):
    x, y = load_mnist("val")
    ref = small_classifier.features(x[:1000])
    good = score_images(small_classifier, x[1000:1500], y[1000:1500], ref)
    wrong = score_images(small_classifier, x[1000:1500], (y[1000:1500] + 1) % 10, ref)
    noise = score_images(
        small_classifier,
        np.random.default_rng(0).uniform(-1, 1, (500, 1, 32, 32)).astype(np.float32),
        y[1000:1500],
        ref,
    )
    assert good.accuracy > 0.9 and wrong.accuracy < 0.1
    assert sum(good.predicted_counts) == 500
    assert good.fid < noise.fid / 5  # real digits are far closer to real digits than noise is


# ------------------------------------------------------------------ the whole comparison, end to end


@pytest.fixture(scope="module")
def eval_dirs(tmp_path_factory):
    """A checkpoints dir (tiny real experts, router, monolith, shipped partition) and a data dir
    holding the MNIST cache and judge 2, with judge 1 the shipped one: `evaluate` trains nothing, and
    both judges' readings of the 10k test digits come from the suite's judge cache (a judge trained
    here would read them anew: 16 CPU-s)."""
    import os
    import shutil

    from dataset.mnist import cache_path
    from evaluation.judge_cache import SUBDIR
    from tests.coordinator.helpers import JITTER, TINY_WIDTHS, make_tiny_expert, make_tiny_experts, make_tiny_router

    ck = tmp_path_factory.mktemp("ck")
    make_tiny_experts(ck, 2)
    make_tiny_router(ck / "router", 2)
    shutil.copy("checkpoints/partition.json", ck / "partition.json")
    # the "monolith" is expert 1's tiny net (its seed, 101) saved as a single expert 0 over all classes
    make_tiny_expert(
        ck / "monolith", expert_id=0, seed=101, widths=TINY_WIDTHS, jitter=JITTER, groups=8, classes=range(10)
    )
    data = tmp_path_factory.mktemp("data")
    os.symlink(cache_path().resolve(), data / cache_path().name)
    from evaluation.classifier_jax import JaxClassifier

    JaxClassifier.load_or_train()  # judge 2 must pass its 99% bar to be loaded at all
    for path in JaxClassifier.cache_paths():
        os.symlink(path.resolve(), data / path.name)
    # the judges' readings of the 10k test digits (evaluation.judge_cache): the suite's, kept where every
    # test finds them (keyed by the judges' weights)
    shared = cache_path().resolve().parent / SUBDIR
    shared.mkdir(exist_ok=True)
    os.symlink(shared, data / SUBDIR)
    return ck, data


@pytest.mark.slow  # the end-to-end run: ~15 s with the judges' readings cached
@pytest.mark.bus
async def test_evaluate_every_configuration_through_the_fleet(eval_dirs, tmp_path):
    from evaluation.run import Config, EvalSpec, evaluate, format_table

    ck, data = eval_dirs
    names = ["monolith", "top1", "top2", "full", "oracle"]
    spec = EvalSpec(
        configs=[Config.parse(n) for n in names],
        checkpoints=str(ck),
        per_class=2,
        steps=3,
        job_size=8,
        data_dir=str(data),
        save_dir=str(tmp_path),
        progress=False,
    )
    from evaluation.judges import Judges
    from evaluation.rescore import rescore_dir

    # a judge reading fewer of the test digits than the floor is refused (no judge reads more than all of them)
    with pytest.raises(ValueError, match=r"judge 1 reads only 0\.99\d* of the 10k test digits correctly \(< 1\.01\)"):
        Judges.load(str(data), progress=False, min_accuracy=1.01)
    judges = Judges.load(str(data), progress=False)  # what `ddm-fleet eval` does
    assert judges.judge1.meta == Classifier.load(shipped_judge(CACHE_NAME)).meta
    assert judges.test_accuracy1 >= 0.99 and judges.test_accuracy2 >= 0.99
    rows = {r.config.name: r for r in await evaluate(spec, judges)}
    assert list(rows) == ["monolith", "ddm-top1", "ddm-top2", "ddm-full", "ddm-oracle"]
    for r in rows.values():
        assert r.n == 20 and 0.0 <= r.accuracy <= 1.0 and np.isfinite(r.fid) and sum(r.predicted_counts) == 20
        # judge 2 scored the same images
        assert 0.0 <= r.accuracy2 <= 1.0 and np.isfinite(r.fid2) and sum(r.predicted_counts2) == 20
        assert 0.0 <= r.agreement <= 1.0 and r.as_dict()["fid_judge2"] == r.fid2
    # experts per step are measured from the jobs' usage, not assumed
    assert rows["monolith"].experts_per_step == pytest.approx(1.0)
    assert rows["ddm-top1"].experts_per_step == pytest.approx(1.0)
    assert rows["ddm-oracle"].experts_per_step == pytest.approx(1.0)
    assert rows["ddm-top2"].experts_per_step == pytest.approx(2.0)
    assert rows["ddm-full"].experts_per_step == pytest.approx(2.0)
    f = {k: r.flops_per_image for k, r in rows.items()}
    assert f["ddm-top2"] > 1.9 * f["ddm-oracle"] and f["ddm-top1"] > f["ddm-oracle"] > 0
    saved = np.load(tmp_path / "ddm-top1.npz")
    assert saved["images"].shape == (20, 1, 32, 32) and saved["labels"].tolist() == list(range(10)) * 2
    assert saved["usage"].shape == (20, 2)
    # same seeds and digits, different models: the monolith's images are not the DDM's
    mono = np.load(tmp_path / "monolith.npz")["images"]
    assert not np.allclose(mono, saved["images"])
    from evaluation.run import baseline_row

    base = baseline_row(judges, spec)  # real val digits, the same 20 requested digits
    assert base.n == 20 and base.accuracy2 >= 0.9 and base.as_dict()["experts_per_step"] is None
    table = format_table([*rows.values(), base], spec, judges)
    assert table.count("\n| ") == 7 and "ddm-top2" in table and "| real-val |" in table and "| - | - | - |" in table
    assert "judge 2: jax/flax residual CNN" in table
    assert "cond. acc. judge 1 | cond. acc. judge 2 | FID judge 1 | FID judge 2 | judges agree" in table
    # the saved images re-score to the very numbers the run printed
    again = {r.name: r for r in rescore_dir(tmp_path, judges)}
    assert sorted(again) == sorted(rows)
    for name, r in rows.items():
        d = again[name].score
        assert d.judge1.accuracy == r.accuracy and d.judge2.accuracy == r.accuracy2 and d.agreement == r.agreement
        assert d.judge1.fid == pytest.approx(r.fid, rel=1e-6) and d.judge2.fid == pytest.approx(r.fid2, rel=1e-6)
        assert again[name].experts_per_step == pytest.approx(r.experts_per_step)


def test_eval_config_parsing():
    from evaluation.run import Config

    assert Config.parse("top3") == Config("ddm-top3", "ddm", "topk", 3)
    with pytest.raises(ValueError, match="unknown configuration"):
        Config.parse("top1x")
    with pytest.raises(ValueError):
        Config.parse("top1 ".replace("1", "0"))
