"""The digit view and colour check on real colour MNIST (a --limit slice), the data judge trained on it,
and `ddm-fleet eval --rescore --data` scoring saved colour images with every judge."""

import json

import numpy as np
import pytest

from dataset import builtin as B
from dataset import mnist as D
from dataset.prepared import load_prepared, load_prepared_extra, read_manifest, to_model_range
from evaluation.views import colour_check, digit_view, palette_arrays


@pytest.fixture(scope="module")
def colour_dir(tmp_path_factory):
    D.prepare_mnist(progress=False)
    out = tmp_path_factory.mktemp("colour") / "colour-mnist"
    B.prepare_builtin("colour-mnist", out, seed=0, limit=2000, progress=False)
    return out


def test_digit_view_of_grey_is_the_image_and_colour_reads_as_mnist(colour_dir):
    grey = np.random.default_rng(0).uniform(-1, 1, (4, 1, 32, 32)).astype(np.float32)
    assert np.array_equal(digit_view(grey), grey)
    x_u8, _, _ = load_prepared(colour_dir, "test", limit=300)
    view = digit_view(to_model_range(x_u8))
    mnist, _ = D.load_mnist("test", limit=300)
    assert view.shape == (300, 1, 32, 32)
    # the palette is gone: the view is MNIST's digit up to the colour LUT's rounding
    assert np.abs(view - mnist).mean() < 0.03
    with pytest.raises(ValueError, match="digit view"):
        digit_view(np.zeros((2, 3, 16, 16), np.float32))


def test_colour_check_reads_real_palettes_and_refuses_wrong_colours(colour_dir):
    x_u8, _, manifest = load_prepared(colour_dir, "test")
    x = to_model_range(x_u8)
    fg, bg = palette_arrays(manifest)
    r = colour_check(x, fg, bg)
    assert r.correct.mean() > 0.99
    assert (r.palette_index == load_prepared_extra(colour_dir, "test", "palette")).mean() > 0.99
    inverted = -x  # 255 - p: bright backgrounds, dark digits, none in the palette
    assert colour_check(inverted, fg, bg).correct.sum() == 0
    noise = np.random.default_rng(0).uniform(-1, 1, (50, 3, 32, 32)).astype(np.float32)
    assert colour_check(noise, fg, bg).correct.sum() == 0


@pytest.fixture(scope="module")
def data_judge(colour_dir):
    """A small data judge trained on the slice (2 epochs: 0.94 on its test split here; 3 gave 0.95 for 50% more
    CPU) and cached next to it, as `eval --data` would find it."""
    from evaluation import data_judge as J

    judge = J.train_data_judge(colour_dir, epochs=2, batch_size=32, progress=False, min_accuracy=0.6)
    judge.save(colour_dir / f"{J.CACHE_NAME}.safetensors")
    return judge


@pytest.mark.train
def test_data_judge_trains_caches_and_refuses_other_data(colour_dir, data_judge):
    from evaluation import data_judge as J

    judge = J.load_or_train_data_judge(colour_dir, progress=False)  # the cached one: no training here
    assert judge.meta == data_judge.meta and judge.meta["test_accuracy"] >= 0.6
    assert judge.input_shape == (3, 32, 32) and judge.num_classes == 10
    assert judge.meta["dataset_hash"] == read_manifest(colour_dir)["content_hash"]
    cached = colour_dir / f"{J.CACHE_NAME}.safetensors"
    assert cached.exists()
    assert J.find_data_judge(colour_dir, read_manifest(colour_dir)) == cached
    other = dict(read_manifest(colour_dir), content_hash="0" * 64, name="other")
    assert J.find_data_judge(colour_dir, other) is None  # trained on other data: never used
    with pytest.raises(ValueError, match="reads images"):
        judge.predict(np.zeros((2, 1, 32, 32), np.float32))


@pytest.mark.train
def test_eval_rescore_with_data_scores_every_judge_and_colour(colour_dir, data_judge, tmp_path, capsys):
    """`ddm-fleet eval --rescore --data` (run in this process, `infra.cli.main`: the command's own process
    would import and compile every judge again) scores the digit judges, the data judge and the colours."""
    from infra.cli import main

    x_u8, y, _ = load_prepared(colour_dir, "test", limit=400)
    saved = tmp_path / "saved"
    saved.mkdir()
    np.savez_compressed(saved / "monolith.npz", images=x_u8, labels=y)
    np.savez_compressed(saved / "ddm-top1.npz", images=255 - x_u8, labels=y)  # colours out of the palette
    big = x_u8[:60].repeat(8, axis=2).repeat(8, axis=3)  # the same digits at 256px: read after an 8x8 area mean
    np.savez_compressed(saved / "ddm-full.npz", images=big, labels=y[:60])
    capsys.readouterr()
    rc = main(
        ["eval", "--rescore", str(saved), "--data", str(colour_dir), "--bootstrap", "50", "--json", "--no-progress"]
    )
    r = capsys.readouterr()
    assert rc == 0, r.err[-3000:]
    out = json.loads(r.out)
    rows = {row["config"]: row for row in out["rows"]}
    real, swapped = rows["monolith"], rows["ddm-top1"]
    assert real["accuracy"] > 0.95 and real["accuracy_judge2"] > 0.95  # judges 1 and 2 on the digit view
    assert real["accuracy_data"] > 0.6 and real["colour_correct"] > 0.98
    assert swapped["colour_correct"] == 0.0
    assert rows["ddm-full"]["accuracy"] > 0.9 and rows["ddm-full"]["colour_correct"] > 0.98
    assert len(real["fid_data_interval"]) == 2
    (cmp,) = out["comparisons"]
    assert cmp["mcnemar_colour"]["only_b_right"] > cmp["mcnemar_colour"]["only_a_right"]
    assert out["judges"]["dataset"] == str(colour_dir)
