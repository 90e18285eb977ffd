"""Latent space: the KL autoencoder (checkpoint, numpy codec, train-autoencoder with resume), the latent
cache (`data encode`: cached once, another autoencoder's cache refused), and partition / train-expert /
train-router on a cache, whose checkpoints' spec says `space: latent` and names the autoencoder."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dataset.partition import PartitionError, load_manifest
from dataset.prepared import inputs_key, load_prepared, read_manifest, to_model_range, write_prepared
from infra.cli import main
from models.autoencoder import (
    AutoencoderConfig,
    AutoencoderError,
    content_hash_of,
    load_autoencoder_meta,
    make_spec,
    save_autoencoder,
)
from models.checkpoint import load_checkpoint
from models.router import load_router_meta
from models.spec import spec_of
from training.datasets import load_split
from training.encode_latents import LatentCacheError, check_autoencoder, encode_dataset

SIZE = 16
AE = AutoencoderConfig(in_channels=3, image_size=SIZE, latent_channels=4, widths=(8, 16))  # 16 -> 8
DIT = ["--arch", "dit", "--patch-size", "2", "--hidden-size", "32", "--depth", "2", "--heads", "2"]
QUICK = ["--steps", "3", "--batch-size", "8", "--threads", "1", "--no-progress"]


def _prepare(out, seed: int = 0, n_train: int = 48, n_val: int = 16):
    """A tiny RGB prepared dataset: blocky colour images (3x16x16 uint8, 4x4 blocks), 3 classes."""
    rng = np.random.default_rng(seed)

    def split(n):
        blocks = rng.integers(0, 256, (n, 3, 4, 4)).astype(np.uint8)
        images = blocks.repeat(4, axis=2).repeat(4, axis=3)
        return {"images": images, "labels": rng.integers(0, 3, n).astype(np.int64)}

    write_prepared(
        out,
        {"train": split(n_train), "val": split(n_val)},
        name="tiny-blocks",
        source={"test": seed},
        class_names=["a", "b", "c"],
        made={"seed": seed},
        key=inputs_key({"seed": seed, "blocks": True}),
    )
    return out


def _random_autoencoder(path, seed: int, scale: float = 2.0, shift: float = 0.1):
    """A random-init autoencoder checkpoint (real network, untrained) with the given latent scaling."""
    import torch

    from models.autoencoder_torch import Autoencoder
    from models.checkpoint import torch_state_to_numpy

    torch.manual_seed(seed)
    state = torch_state_to_numpy(Autoencoder(AE).state_dict())
    meta = {"config": AE.to_dict(), "spec": make_spec(AE, scale_factor=scale, shift_factor=shift, latent_range=4.0)}
    return save_autoencoder(path, state, meta)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(dataset dir, autoencoder A, autoencoder B, latent cache of A) on a tiny blocky RGB dataset."""
    d = tmp_path_factory.mktemp("latent")
    data = _prepare(d / "ds")
    ae_a = _random_autoencoder(d / "ae_a", seed=1)
    ae_b = _random_autoencoder(d / "ae_b", seed=2)
    cache = d / "ds-latents"
    assert main(["data", "encode", "--autoencoder", str(ae_a), "--data", str(data), "--threads", "1"]) == 0
    return data, ae_a, ae_b, cache


# --------------------------------------------------------------------------- autoencoder + codec


def test_codec_encodes_scaled_latents_and_decodes_to_the_value_range(setup, tmp_path):
    from models.autoencoder_torch import LatentCodec

    data, ae_a, _, _ = setup
    codec = LatentCodec.load(ae_a)
    assert codec.latent_shape == (4, 8, 8) and codec.image_shape == (3, SIZE, SIZE)
    x = to_model_range(load_prepared(data, "val")[0])
    z = codec.encode(x)
    assert z.shape == (16, 4, 8, 8) and z.dtype == np.float32
    # the scaling is applied: z = (posterior mean - shift) * scale
    import torch

    with torch.no_grad():
        mean = codec.model.posterior(torch.from_numpy(x))[0].numpy()
    np.testing.assert_allclose(z, (mean - 0.1) * 2.0, rtol=1e-5, atol=1e-5)
    out = codec.decode(z * 100.0)  # far outside the data: still clipped into the images' range
    assert out.shape == (16, 3, SIZE, SIZE) and out.dtype == np.float32
    assert out.min() >= -1.0 and out.max() <= 1.0
    with pytest.raises(AutoencoderError, match=r"latents must be \[N, 4, 8, 8\]"):
        codec.decode(np.zeros((2, 4, 4, 4), np.float32))
    with pytest.raises(AutoencoderError, match="must be float"):
        codec.decode(np.zeros((2, 4, 8, 8), np.int64))
    with pytest.raises(AutoencoderError, match="non-finite"):
        codec.decode(np.full((2, 4, 8, 8), np.nan, np.float32))


def test_autoencoder_checkpoint_edited_json_is_refused(setup, tmp_path):
    _, ae_a, _, _ = setup
    meta = load_autoencoder_meta(ae_a)
    assert len(meta["content_hash"]) == 64 and meta["spec"]["downsample"] == 2
    bad = tmp_path / "ae.json"
    meta["spec"]["scale_factor"] = 3.0  # a different latent space under the same name
    bad.write_text(json.dumps(meta))
    with pytest.raises(AutoencoderError, match="content_hash does not match"):
        load_autoencoder_meta(bad)
    with pytest.raises(AutoencoderError, match="not found"):
        load_autoencoder_meta(tmp_path / "none")


@pytest.mark.train
def test_train_autoencoder_few_steps_then_resume(tmp_path, capsys):
    from models.autoencoder_torch import LatentCodec

    data = _prepare(tmp_path / "ds")
    out = tmp_path / "run" / "ae"
    args = ["train-autoencoder", "--data", str(data), "--widths", "8,16", "--batch-size", "8", "--threads", "1"]
    args += ["--out", str(out), "--run-dir", str(tmp_path / "run"), "--no-progress", "--save-every", "2"]
    assert main([*args, "--steps", "4"]) == 0
    meta = load_autoencoder_meta(out)
    spec, stats = meta["spec"], meta["training"]
    assert spec["image_shape"] == [3, SIZE, SIZE] and spec["latent_shape"] == [4, 8, 8] and spec["downsample"] == 2
    assert stats["steps"] == 4 and stats["complete"] and stats["val_images"] == 16
    assert meta["dataset"]["content_hash"] == read_manifest(data)["content_hash"]
    assert "content hash: " + meta["content_hash"] in capsys.readouterr().out

    # the scale and shift bring the train latents to mean 0, variance 1 (measured on all 48 images here)
    codec = LatentCodec.load(out)
    z = codec.encode(to_model_range(load_prepared(data, "train")[0]))
    assert abs(float(z.mean())) < 1e-3 and abs(float(z.std()) - 1.0) < 1e-3
    assert spec["latent_range"][1] >= float(np.abs(z).max())
    # the PSNR written is the codec's reconstruction of the val split
    xv = to_model_range(load_prepared(data, "val")[0])
    mse = float(np.mean((codec.decode(codec.encode(xv)).astype(np.float64) - xv) ** 2))
    assert stats["val_psnr_db"] == pytest.approx(10 * np.log10(4.0 / mse), abs=0.01)

    # --resume continues up to --steps from the saved step; another size is refused
    first = out.with_suffix(".safetensors").read_bytes()
    assert main([*args, "--steps", "6", "--resume"]) == 0
    meta2 = load_autoencoder_meta(out)
    assert meta2["training"]["steps"] == 6 and meta2["content_hash"] != meta["content_hash"]
    assert out.with_suffix(".safetensors").read_bytes() != first
    assert [h["step"] for h in meta2["training"]["loss_history"]][-1] == 6
    capsys.readouterr()
    assert main([*args[:4], "8,16,16", *args[5:], "--steps", "8", "--resume"]) == 2
    assert "keep --widths" in capsys.readouterr().err


@pytest.mark.train
def test_train_autoencoder_with_a_patch_fold(tmp_path):
    """--patch P folds PxP pixel blocks into channels first: 16px images, patch 4, one level -> 4x4x4 latents."""
    from models.autoencoder_torch import LatentCodec

    data = _prepare(tmp_path / "ds")
    out = tmp_path / "ae"
    args = ["train-autoencoder", "--data", str(data), "--patch", "4", "--widths", "16", "--batch-size", "8"]
    args += ["--threads", "1", "--steps", "2", "--out", str(out), "--run-dir", str(tmp_path / "run"), "--no-progress"]
    assert main(args) == 0
    meta = load_autoencoder_meta(out)
    assert meta["config"]["patch"] == 4 and meta["spec"]["downsample"] == 4
    assert meta["spec"]["latent_shape"] == [4, 4, 4]
    codec = LatentCodec.load(out)
    x = to_model_range(load_prepared(data, "val")[0])
    z = codec.encode(x)
    assert z.shape == (16, 4, 4, 4) and codec.decode(z).shape == x.shape
    # patch 1 is not written, so an autoencoder made before the option keeps its config and content hash
    assert "patch" not in AE.to_dict() and AutoencoderConfig.from_dict(AE.to_dict()) == AE
    with pytest.raises(AutoencoderError, match="patch 8 and 1 widths downsample by 8"):
        AutoencoderConfig(image_size=20, widths=(8,), patch=8)


# --------------------------------------------------------------------------- the latent cache


def test_encode_cache_once_and_its_contents(setup, capsys):
    from models.autoencoder_torch import LatentCodec

    data, ae_a, _, cache = setup
    m = read_manifest(cache)
    ae_meta = load_autoencoder_meta(ae_a)
    assert m["space"] == "latent" and m["channels"] == 4 and m["size"] == 8
    assert m["latent"]["autoencoder_hash"] == ae_meta["content_hash"]
    assert content_hash_of(m["latent"]["decoder"]) == ae_meta["content_hash"]
    assert m["latent"]["source"]["content_hash"] == read_manifest(data)["content_hash"]
    assert m["class_names"] == ["a", "b", "c"] and set(m["splits"]) == {"train", "val"}

    # training reads float latents as they are (float16 in the cache), not uint8 pixels
    z, y, ref = load_split(cache, "train")
    assert z.dtype == np.float32 and z.shape == (48, 4, 8, 8)
    expect = LatentCodec.load(ae_a).encode(to_model_range(load_prepared(data, "train")[0]))
    np.testing.assert_allclose(z, expect, rtol=2e-3, atol=2e-3)
    np.testing.assert_array_equal(y, load_prepared(data, "train")[1])
    assert ref.is_latent and ref.decoder == m["latent"]["decoder"] and ref.sample_shape == [4, 8, 8]
    assert ref.source_hash == read_manifest(data)["content_hash"]

    # a second run does nothing
    stamp = (cache / "train-images.npy").stat().st_mtime_ns
    capsys.readouterr()
    assert main(["data", "encode", "--autoencoder", str(ae_a), "--data", str(data)]) == 0
    assert "up to date" in capsys.readouterr().out
    assert (cache / "train-images.npy").stat().st_mtime_ns == stamp
    assert main(["data", "info", str(cache)]) == 0
    assert "latents: 4x8x8 float16 of tiny-blocks" in capsys.readouterr().out


def test_encode_refuses_another_autoencoders_cache(setup, tmp_path, capsys):
    data, ae_a, ae_b, cache = setup
    hash_a = load_autoencoder_meta(ae_a)["content_hash"]
    hash_b = load_autoencoder_meta(ae_b)["content_hash"]
    before = (cache / "manifest.json").read_text()
    capsys.readouterr()
    assert main(["data", "encode", "--autoencoder", str(ae_b), "--data", str(data)]) == 1
    err = capsys.readouterr().err
    assert hash_a[:16] in err and hash_b[:16] in err and "another --out" in err
    assert (cache / "manifest.json").read_text() == before  # nothing lost
    with pytest.raises(LatentCacheError, match="do not mix"):
        check_autoencoder(cache, hash_b)
    assert check_autoencoder(cache, hash_a)["latent"]["autoencoder_hash"] == hash_a
    with pytest.raises(LatentCacheError, match="source dataset itself"):
        encode_dataset(ae_a, data, out=data, progress=False)
    other = _prepare(tmp_path / "other", seed=5)
    with pytest.raises(LatentCacheError, match="is an image dataset"):
        encode_dataset(ae_a, data, out=other, progress=False, force=True)
    assert read_manifest(other).get("space") is None  # never overwritten
    with pytest.raises(LatentCacheError, match="latent cache already"):
        encode_dataset(ae_a, cache, out=tmp_path / "x", progress=False)
    # --force replaces it (into a copy here, so the module's cache stays A's)
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(cache, copy)
    result = encode_dataset(ae_b, data, out=copy, force=True, progress=False)
    assert result.built and read_manifest(copy)["latent"]["autoencoder_hash"] == hash_b


# --------------------------------------------------------------------------- experts + router on latents


@pytest.mark.train
def test_latent_expert_and_router_say_latent(setup, tmp_path, capsys):
    from workers.backends.torch_backend import TorchBackend

    data, ae_a, ae_b, cache = setup
    decoder = read_manifest(cache)["latent"]["decoder"]
    part = tmp_path / "part.json"
    assert main(["partition", "--data", str(cache), "--method", "kmeans", "--experts", "2", "--out", str(part)]) == 0
    assert load_manifest(part).dataset.is_latent

    out = tmp_path / "expert0"
    args = ["train-expert", "--data", str(cache), "--partition", str(part), "--expert", "0", *DIT, *QUICK]
    assert main([*args, "--out", str(out), "--run-dir", str(tmp_path / "run")]) == 0
    meta, _ = load_checkpoint(out.with_suffix(".safetensors"))
    spec = spec_of(meta)
    assert spec.space == "latent" and spec.decoder == decoder and list(spec.sample_shape) == [4, 8, 8]
    assert meta["config"]["in_channels"] == 4 and meta["config"]["image_size"] == 8
    lo, hi = spec.value_range
    assert lo == -hi and hi >= float(np.abs(load_split(cache, "train")[0]).max())
    backend = TorchBackend()
    backend.load(out.with_suffix(".safetensors"))
    assert backend.spec == spec and backend.input_shape == (4, 8, 8)

    # without --data the partition's own cache is used; the router's spec says latent too
    router = tmp_path / "router"
    assert (
        main(
            [
                "train-router",
                "--partition",
                str(part),
                *QUICK[:6],
                "--out",
                str(router),
                "--run-dir",
                str(tmp_path / "rr"),
            ]
        )
        == 0
    )
    rspec = spec_of(load_router_meta(router))
    assert rspec.space == "latent" and rspec.decoder == decoder and list(rspec.sample_shape) == [4, 8, 8]

    # another autoencoder's cache of the same images is refused for this partition, naming both
    cache_b = tmp_path / "latents-b"
    encode_dataset(ae_b, data, out=cache_b, progress=False)
    capsys.readouterr()
    assert main([*args, "--data", str(cache_b), "--out", str(tmp_path / "e_b")]) == 2
    assert "do not mix" in capsys.readouterr().err


@pytest.mark.train
def test_pixel_partition_trains_on_its_latents_and_resume_keeps_the_autoencoder(setup, tmp_path, capsys):
    from training.train_torch import TrainConfig, load_expert_data, train_expert

    data, _, ae_b, cache = setup
    part = tmp_path / "part.json"
    assert main(["partition", "--data", str(data), "--method", "kmeans", "--experts", "2", "--out", str(part)]) == 0
    out, run = tmp_path / "expert0", tmp_path / "run"
    args = ["train-expert", "--data", str(cache), "--partition", str(part), "--expert", "0", *DIT, *QUICK]
    assert main([*args, "--out", str(out), "--run-dir", str(run)]) == 0
    assert spec_of(load_checkpoint(out.with_suffix(".safetensors"))[0]).space == "latent"
    # the router on latents of a pixel partition: val targets come from the source images
    router = tmp_path / "router"
    assert (
        main(
            [
                "train-router",
                "--data",
                str(cache),
                "--partition",
                str(part),
                *QUICK[:6],
                "--out",
                str(router),
                "--run-dir",
                str(tmp_path / "rr"),
            ]
        )
        == 0
    )
    assert load_router_meta(router)["accuracy_vs_t"]["n"] == 16

    # the same pixel partition accepts either autoencoder's cache, but a run keeps its autoencoder on resume
    cache_b = tmp_path / "latents-b"
    encode_dataset(ae_b, data, out=cache_b, progress=False)
    cfg = TrainConfig(
        expert=0, partition=str(part), data=str(cache_b), arch="dit", patch_size=2, hidden_size=32, depth=2,
        heads=2, steps=6, batch_size=8, out=str(out), run_dir=str(run), threads=1,
    )  # fmt: skip
    images, labels, info = load_expert_data(cfg)
    assert images.shape[1:] == (4, 8, 8)
    with pytest.raises(ValueError, match="latents of two autoencoders do not mix"):
        train_expert(cfg, images, labels, info, resume=True, progress=False)
    # and a pixel expert cannot resume from the latent run either
    with pytest.raises((ValueError, PartitionError)):
        cfg_px = TrainConfig(
            expert=0, partition=str(part), data=str(data), arch="dit", patch_size=2, hidden_size=32, depth=2,
            heads=2, steps=6, batch_size=8, out=str(out), run_dir=str(run), threads=1,
        )  # fmt: skip
        train_expert(cfg_px, *load_expert_data(cfg_px), resume=True, progress=False)
