"""`--features dinov2:DIR`: a tiny randomly initialised transformers DINOv2, saved with `save_pretrained`
and loaded back through our own code (evaluation/features.py -> evaluation/features_dinov2.py ->
`Dinov2Model.from_pretrained(DIR, local_files_only=True)`), as the features of `partition --method
features`, and asked again by `train-router` for its val targets.

Needs the pretrained extra (`make test` installs it); without transformers this module is skipped."""

from __future__ import annotations

import importlib.util
import json
import shutil

import numpy as np
import pytest

# `make test` installs the extra: without it these tests fail loudly, never skip. Looked for, not imported
# here: collecting the suite stays light.
if importlib.util.find_spec("transformers") is None:
    pytest.fail("the pretrained extra is missing: pip install 'ddm-fleet[pretrained]' (make test does)", pytrace=False)

from evaluation.features import ExtractorError, choice_of, extractor_for, load_extractor  # noqa: E402
from evaluation.features_dinov2 import IMAGENET_MEAN, preprocessing  # noqa: E402
from infra.cli import main  # noqa: E402
from tests.training.test_latent import _prepare  # noqa: E402  (a tiny 3x16x16 prepared dataset, 3 classes)

HIDDEN = 32


def _save_dinov2(path, seed: int = 0):
    """A tiny random DINOv2 (2 layers, 2 heads, 28x28 input in 4x4 patches) saved with save_pretrained."""
    import torch
    from transformers import Dinov2Config, Dinov2Model

    torch.manual_seed(seed)
    layers = dict(hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
    cfg = Dinov2Config(**layers, image_size=28, patch_size=4)
    Dinov2Model(cfg).save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def dino(tmp_path_factory):
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield _save_dinov2(tmp_path_factory.mktemp("dinov2") / "dinov2")
    torch.set_num_threads(threads)


def test_cls_features_of_grey_and_rgb_images(dino):
    import torch
    import torch.nn.functional as F
    from transformers import Dinov2Model

    ex = load_extractor(f"dinov2:{dino}")
    assert ex.name.startswith(f"dinov2-cls:{dino}@") and len(ex.name.rsplit("@", 1)[1]) == 12
    assert choice_of(ex.name) == f"dinov2:{dino}"
    rgb = np.random.default_rng(0).uniform(-1, 1, (6, 3, 16, 16)).astype(np.float32)
    f = ex.features(rgb, progress=False)
    assert f.shape == (6, HIDDEN) and f.dtype == np.float32 and np.isfinite(f).all()
    np.testing.assert_array_equal(f, ex.features(rgb, progress=False))  # deterministic
    # the CLS token after the final layer norm, of the images resized to 28x28 and ImageNet-normalised
    model = Dinov2Model.from_pretrained(str(dino), local_files_only=True).eval()
    mean = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)
    std = torch.tensor((0.229, 0.224, 0.225)).view(1, 3, 1, 1)
    x = F.interpolate(torch.from_numpy(rgb), size=(28, 28), mode="bilinear", align_corners=False)
    with torch.no_grad():
        out = model(pixel_values=((x + 1) / 2 - mean) / std)
    np.testing.assert_allclose(f, out.last_hidden_state[:, 0].numpy(), rtol=1e-4, atol=1e-5)
    # grey images are read as three equal channels
    grey = rgb[:, :1]
    np.testing.assert_allclose(
        ex.features(grey, progress=False), ex.features(np.repeat(grey, 3, axis=1), progress=False), atol=1e-6
    )
    with pytest.raises(ExtractorError, match="3-channel images"):
        ex.features(rgb[:, :2], progress=False)


def test_preprocessor_config_sets_size_and_normalisation_and_the_hash(dino, tmp_path):
    config = json.loads((dino / "config.json").read_text())
    assert preprocessing(config, None) == (28, IMAGENET_MEAN, (0.229, 0.224, 0.225))
    pre = {"crop_size": {"height": 17, "width": 17}, "image_mean": [0.5] * 3, "image_std": [0.5] * 3}
    assert preprocessing(config, pre) == (16, (0.5,) * 3, (0.5,) * 3)  # 17 rounded to the 4-pixel patches
    copy = tmp_path / "with-preprocessor"
    shutil.copytree(dino, copy)
    (copy / "preprocessor_config.json").write_text(json.dumps(pre))
    a, b = load_extractor(f"dinov2:{dino}"), load_extractor(f"dinov2:{copy}")
    assert a.name.rsplit("@", 1)[1] != b.name.rsplit("@", 1)[1]  # another preprocessing: other features
    x = np.random.default_rng(1).uniform(-1, 1, (3, 3, 16, 16)).astype(np.float32)
    assert not np.allclose(a.features(x, progress=False), b.features(x, progress=False))


def test_not_a_dinov2_directory_is_refused_clearly(tmp_path, capsys):
    with pytest.raises(ExtractorError, match="not a transformers DINOv2 directory"):
        load_extractor(f"dinov2:{tmp_path}")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "dinov2"}))
    with pytest.raises(ExtractorError, match="no weights file"):
        load_extractor(f"dinov2:{tmp_path}")
    data = _prepare(tmp_path / "ds")
    argv = ["partition", "--data", str(data), "--method", "features", "--features", f"dinov2:{tmp_path / 'none'}"]
    assert main([*argv, "--experts", "2", "--out", str(tmp_path / "p.json")]) == 2
    assert "not a transformers DINOv2 directory" in capsys.readouterr().err
    assert not (tmp_path / "p.json").exists()


@pytest.mark.train
def test_partition_on_dinov2_features_then_router_asks_again(dino, tmp_path, capsys):
    data = _prepare(tmp_path / "ds")
    out = tmp_path / "partition.json"
    argv = ["partition", "--data", str(data), "--method", "features", "--features", f"dinov2:{dino}"]
    assert main([*argv, "--experts", "2", "--out", str(out)]) == 0
    m = json.loads(out.read_text())
    assert m["method"] == "features" and m["features"]["dim"] == HIDDEN
    assert m["features"]["extractor"] == load_extractor(f"dinov2:{dino}").name  # dinov2-cls:<DIR>@<sha>
    assert sorted(np.concatenate([e["indices"] for e in m["experts"]]).tolist()) == list(range(48))

    router = ["train-router", "--partition", str(out), "--data", str(data), "--steps", "2", "--val-limit", "16"]
    router += ["--bins", "2", "--threads", "1", "--run-dir", str(tmp_path / "run")]
    assert main([*router, "--out", str(tmp_path / "router")]) == 0
    # the same model moved elsewhere is accepted; other weights are refused (val targets would not match)
    moved = tmp_path / "moved"
    shutil.copytree(dino, moved)
    assert extractor_for(m["features"]["extractor"], choice=f"dinov2:{moved}").name.startswith("dinov2-cls:")
    assert main([*router, "--features", f"dinov2:{moved}", "--out", str(tmp_path / "router2")]) == 0
    _save_dinov2(moved, seed=5)
    capsys.readouterr()
    assert main([*router, "--features", f"dinov2:{moved}", "--out", str(tmp_path / "router3")]) == 2
    assert "same weights needed" in capsys.readouterr().err
