"""Partitions: disjoint, covering, classes respected, k-means deterministic and non-degenerate."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dataset.mnist import load_mnist
from dataset.partition import (
    Manifest,
    PartitionError,
    load_manifest,
    make_partition,
    parse_class_groups,
    save_manifest,
)

N = 3000


@pytest.fixture(scope="module")
def mnist_slice():
    return load_mnist("train", limit=N)


def _check_disjoint_cover(m: Manifest, n: int) -> None:
    idx = np.concatenate([np.asarray(e.indices) for e in m.experts])
    assert len(idx) == n and len(np.unique(idx)) == n and idx.min() == 0 and idx.max() == n - 1
    owner = m.expert_of_index()
    assert (owner >= 0).all()


def test_classes_default_split(mnist_slice):
    x, y = mnist_slice
    m = make_partition("classes", y, None, 2)
    _check_disjoint_cover(m, N)
    assert m.experts[0].classes == [0, 1, 2, 3, 4] and m.experts[1].classes == [5, 6, 7, 8, 9]
    for e in m.experts:
        assert set(y[e.indices].tolist()) <= set(e.classes)
        assert sum(e.class_counts) == e.num_images
    assert [m.class_to_expert(c) for c in range(10)] == [0] * 5 + [1] * 5


def test_classes_custom_groups_and_errors(mnist_slice):
    _, y = mnist_slice
    groups = parse_class_groups("0-2+7,3-6,8+9")
    assert groups == [[0, 1, 2, 7], [3, 4, 5, 6], [8, 9]]
    m = make_partition("classes", y, None, 3, classes=groups)
    _check_disjoint_cover(m, N)
    assert m.class_to_expert(7) == 0 and m.class_to_expert(9) == 2
    with pytest.raises(PartitionError, match="more than one expert"):
        make_partition("classes", y, None, 2, classes=[[0, 1, 2, 3, 4], [4, 5, 6, 7, 8, 9]])
    with pytest.raises(PartitionError, match="belong to no expert"):
        make_partition("classes", y, None, 2, classes=[[0, 1], [5, 6, 7, 8, 9]])
    with pytest.raises(PartitionError, match="class groups given"):
        make_partition("classes", y, None, 3, classes=[[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]])
    with pytest.raises(PartitionError, match="parse"):
        parse_class_groups("0-4,five")
    with pytest.raises(PartitionError, match="unknown partition method"):
        make_partition("spectral", y, None, 2)


def test_random_balanced_and_seeded(mnist_slice):
    _, y = mnist_slice
    m = make_partition("random", y, None, 3, seed=1)
    _check_disjoint_cover(m, N)
    assert sorted(e.num_images for e in m.experts) == [1000, 1000, 1000]
    assert m == make_partition("random", y, None, 3, seed=1)
    assert m != make_partition("random", y, None, 3, seed=2)


def test_kmeans_deterministic_nondegenerate(mnist_slice):
    x, y = mnist_slice
    m = make_partition("kmeans", y, x, 2, seed=0)
    _check_disjoint_cover(m, N)
    assert m == make_partition("kmeans", y, x, 2, seed=0)
    sizes = [e.num_images for e in m.experts]
    assert min(sizes) > 0.15 * N, sizes
    # clusters follow image content: the class mix differs clearly between experts
    frac = np.array([e.class_counts for e in m.experts], dtype=float)
    frac /= frac.sum(0, keepdims=True)
    assert np.abs(frac[0] - frac[1]).max() > 0.5
    # the stored assigner reproduces the training assignment, so unseen images get the same rule
    np.testing.assert_array_equal(m.assign(x, y), m.expert_of_index())
    m4 = make_partition("kmeans", y, x, 4, seed=0)
    assert min(e.num_images for e in m4.experts) > 0.05 * N


def test_manifest_roundtrip_and_bad_files(tmp_path, mnist_slice):
    x, y = mnist_slice
    m = make_partition("kmeans", y[:800], x[:800], 2, seed=3)
    p = save_manifest(m, tmp_path / "p.json")
    doc = json.loads(p.read_text())
    assert "class_to_expert" in doc and len(doc["experts"]) == 2
    assert load_manifest(p) == m
    with pytest.raises(PartitionError, match="no partition manifest"):
        load_manifest(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(PartitionError, match="bad.json is not valid JSON"):
        load_manifest(tmp_path / "bad.json")
    doc["experts"][1]["indices"].append(doc["experts"][0]["indices"][0])
    (tmp_path / "overlap.json").write_text(json.dumps(doc))
    with pytest.raises(PartitionError, match="overlap"):
        load_manifest(tmp_path / "overlap.json")
    assert "class_to_expert" in m.summary()


def test_partition_cli(tmp_path, capsys):
    from infra.cli import main

    out = tmp_path / "p.json"
    assert (
        main(
            [
                "partition",
                "--method",
                "classes",
                "--experts",
                "3",
                "--classes",
                "0-2+7,3-6,8+9",
                "--limit",
                "500",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "class_to_expert" in printed and "wrote" in printed
    m = load_manifest(out)
    assert m.num_images == 500 and m.experts[2].classes == [8, 9]
    # mistakes give a clear message and exit code 2, not a traceback
    assert main(["partition", "--method", "random", "--classes", "0-4,5-9", "--out", str(out)]) == 2
    assert (
        main(
            [
                "partition",
                "--method",
                "classes",
                "--experts",
                "2",
                "--classes",
                "0-3,5-9",
                "--limit",
                "50",
                "--out",
                str(out),
            ]
        )
        == 2
    )
    assert "belong to no expert" in capsys.readouterr().err


def test_image_features_of_any_shape_and_default_pool():
    from dataset.partition import default_pool, image_features

    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 1, 32, 32)).astype(np.float32)
    want = x[:, 0].reshape(4, 8, 4, 8, 4).mean(axis=(2, 4)).reshape(4, -1)  # MNIST's features, as before
    assert np.allclose(image_features(x, 4), want) and default_pool(32) == 4
    rgb = rng.standard_normal((2, 3, 16, 16)).astype(np.float32)
    f = image_features(rgb, default_pool(16))
    assert f.shape == (2, 3 * 8 * 8) and np.allclose(f[:, :64], image_features(rgb[:, :1], 2))
    assert default_pool(64) == 8 and default_pool(28) == 2 and default_pool(48) == 6


def test_partition_of_a_dataset_with_other_classes():
    from dataset.partition import DatasetRef, Manifest

    ref = DatasetRef(name="d", path="/x", content_hash="ab" * 32, sample_shape=[3, 8, 8], num_classes=4)
    labels = np.array([0, 1, 2, 3, 3, 2, 1, 0], np.int64)
    m = make_partition("classes", labels, None, 2, dataset=ref)
    assert m.class_owner == [0, 0, 1, 1] and m.num_classes == 4 and m.experts[1].class_counts == [0, 0, 2, 2]
    again = Manifest.model_validate(json.loads(m.model_dump_json(by_alias=True, exclude_none=True)))
    assert again.dataset == ref and again.class_to_expert(3) == 1
    with pytest.raises(PartitionError, match="labels must lie in 0..3"):
        make_partition("random", labels + 1, None, 2, dataset=ref)
