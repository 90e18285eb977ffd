"""A diffusers AutoencoderKL as the latent codec (`--vae DIR`): a tiny randomly initialised VAE is saved
with `save_pretrained` and loaded back through our own loading code (models/codec.py ->
models/vae_diffusers.py -> `AutoencoderKL.from_pretrained(DIR, local_files_only=True)`), then used by
`data encode`, by `ddm-fleet decoder --vae DIR` on a real nats-server, and by `up`'s decoder check.

Needs the pretrained extra (`make test` installs it); without diffusers this module is skipped."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest

# `make test` installs the extra: without it these tests fail loudly, never skip. Looked for, not imported
# here: collecting the suite stays light.
if importlib.util.find_spec("diffusers") is None:
    pytest.fail("the pretrained extra is missing: pip install 'ddm-fleet[pretrained]' (make test does)", pytrace=False)

from dataset.prepared import load_prepared, read_manifest, to_model_range  # noqa: E402
from infra.cli import main  # noqa: E402
from models.autoencoder import AutoencoderError, content_hash_of, decoder_name  # noqa: E402
from models.codec import codec_info, load_codec  # noqa: E402
from tests.infra.test_cmd_up import tiny_fleet_dir  # noqa: E402, F401
from tests.training.test_latent import _prepare  # noqa: E402  (a tiny 3x16x16 prepared dataset)
from training.datasets import load_split  # noqa: E402

SCALE, SHIFT = 0.5, 0.2


def _save_vae(path, seed: int = 0, **config):
    """A tiny random AutoencoderKL (widths 8, 16: downsampling 2, 4 latent channels) saved with save_pretrained."""
    import torch
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    kw = dict(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        block_out_channels=(8, 16),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=4,
        sample_size=16,
        scaling_factor=SCALE,
        shift_factor=SHIFT,
    )
    AutoencoderKL(**{**kw, **config}).save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def vae(tmp_path_factory):
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    d = tmp_path_factory.mktemp("vae")
    yield _save_vae(d / "vae"), d
    torch.set_num_threads(threads)


def test_vae_loads_through_our_code_and_encodes_scaled_latents(vae):
    import torch

    path, _ = vae
    codec = load_codec(path, image_shape=(3, 16, 16))
    assert codec.info.backend == "diffusers" and type(codec.model).__name__ == "AutoencoderKL"
    assert codec.image_shape == (3, 16, 16) and codec.latent_shape == (4, 8, 8)
    assert (codec.info.scale_factor, codec.info.shift_factor) == (SCALE, SHIFT)  # from the config
    x = np.random.default_rng(0).uniform(-1, 1, (5, 3, 16, 16)).astype(np.float32)
    z = codec.encode(x)
    assert z.shape == (5, 4, 8, 8) and z.dtype == np.float32 and np.isfinite(z).all()
    np.testing.assert_array_equal(z, codec.encode(x))  # the posterior mean: deterministic
    with torch.no_grad():
        mean = codec.model.encode(torch.from_numpy(x)).latent_dist.mean.numpy()
        raw = codec.model.decode(torch.from_numpy(z / SCALE + SHIFT)).sample.clamp(-1, 1).numpy()
    np.testing.assert_allclose(z, (mean - SHIFT) * SCALE, rtol=1e-5, atol=1e-6)  # the scaling is applied
    out = codec.decode(z)
    assert out.shape == x.shape and out.dtype == np.float32 and np.isfinite(out).all()
    np.testing.assert_allclose(out, raw, rtol=1e-5, atol=1e-6)  # decode undoes the scaling first
    assert codec.decode(z * 1e3).max() <= 1.0 and codec.decode(z * 1e3).min() >= -1.0
    # a convolutional VAE takes other sizes its downsampling divides
    assert codec.encode(x[:, :, :8, :8]).shape == (5, 4, 4, 4)
    assert codec.latent_shape_error((4, 3, 5)) is None and codec.latent_shape_error((3, 8, 8)) is not None
    # latents larger than those of its sample size (16 px: 8x8) are refused: a request cannot take its memory
    assert "h, w <= 8" in codec.latent_shape_error((4, 9, 8))
    with pytest.raises(AutoencoderError, match="multiples of 2"):
        codec.encode(x[:, :, :15, :15])
    with pytest.raises(AutoencoderError, match=r"latents must be \[N, 4, h, w\] with h, w <= 8"):
        codec.decode(np.zeros((1, 3, 8, 8), np.float32))
    with pytest.raises(AutoencoderError, match="non-finite"):
        codec.decode(np.full((1, 4, 8, 8), np.nan, np.float32))
    with pytest.raises(AutoencoderError, match="must be float"):
        codec.encode(np.zeros((1, 3, 16, 16), np.uint8))


def test_content_hash_names_weights_and_config(vae, tmp_path):
    path, _ = vae
    info = codec_info(path)
    assert len(info.content_hash) == 64 and info.path == str(path)
    spec = info.spec()
    assert spec["backend"] == "diffusers" and spec["latent_shape"] == [4, 8, 8] and spec["downsample"] == 2
    assert (spec["scale_factor"], spec["shift_factor"], spec["image_shape"]) == (SCALE, SHIFT, [3, 16, 16])
    again = _save_vae(tmp_path / "same", seed=0)  # the same weights and config, saved again
    assert codec_info(again).content_hash == info.content_hash
    assert codec_info(_save_vae(tmp_path / "other", seed=1)).content_hash != info.content_hash
    cfg = json.loads((again / "config.json").read_text())
    (again / "config.json").write_text(json.dumps({**cfg, "scaling_factor": 0.25}))  # another latent space
    assert codec_info(again).content_hash != info.content_hash
    (again / "config.json").write_text(json.dumps({**cfg, "_diffusers_version": "0.0.1"}))  # who saved it: no
    assert codec_info(again).content_hash == info.content_hash
    # a pipeline directory holding vae/ is taken as its VAE
    pipe = tmp_path / "pipeline"
    shutil.copytree(path, pipe / "vae")
    (pipe / "model_index.json").write_text("{}")
    assert codec_info(pipe).content_hash == info.content_hash and codec_info(pipe).path == str(pipe / "vae")
    # not a VAE: a clear error naming what is expected
    with pytest.raises(AutoencoderError, match="not a diffusers AutoencoderKL directory"):
        codec_info(tmp_path)
    weightless = tmp_path / "weightless"
    weightless.mkdir()
    shutil.copy(path / "config.json", weightless / "config.json")
    with pytest.raises(AutoencoderError, match="no weights file"):
        codec_info(weightless)


def test_data_encode_with_a_diffusers_vae(vae, capsys):
    path, d = vae
    data = _prepare(d / "ds")
    out = d / "ds-vae-latents"
    assert main(["data", "encode", "--vae", str(path), "--data", str(data), "--out", str(out), "--threads", "1"]) == 0
    m = read_manifest(out)
    info = codec_info(path)
    assert m["space"] == "latent" and m["channels"] == 4 and m["size"] == 8
    lat = m["latent"]
    assert lat["autoencoder_backend"] == "diffusers" and lat["autoencoder"] == str(path)
    assert lat["autoencoder_hash"] == info.content_hash and content_hash_of(lat["decoder"]) == info.content_hash
    assert (lat["scale_factor"], lat["shift_factor"]) == (SCALE, SHIFT)
    z, _, ref = load_split(out, "train")
    expect = load_codec(path).encode(to_model_range(load_prepared(data, "train")[0]))
    np.testing.assert_allclose(z, expect, rtol=2e-3, atol=2e-3)  # float16 in the cache
    assert ref.is_latent and ref.decoder == decoder_name(info.content_hash) and ref.sample_shape == [4, 8, 8]
    capsys.readouterr()
    assert main(["data", "encode", "--vae", str(path), "--data", str(data), "--out", str(out)]) == 0
    assert "up to date" in capsys.readouterr().out
    # a VAE that cannot take these images is refused with both shapes named, nothing written
    grey = _save_vae(d / "grey-vae", in_channels=1, out_channels=1)
    assert main(["data", "encode", "--vae", str(grey), "--data", str(data), "--out", str(d / "x")]) == 1
    err = capsys.readouterr().err
    assert "1-channel images" in err and "3x16x16" in err and not (d / "x").exists()


@pytest.mark.train
def test_a_latent_expert_on_a_vae_cache_names_the_vae(vae, tmp_path):
    """partition + train-expert on the VAE's latent cache: the expert's spec says latent and names the
    VAE's content hash as its decoder (what `up` and the coordinator find the decoder by)."""
    from models.checkpoint import load_checkpoint
    from models.spec import spec_of
    from tests.training.test_latent import DIT, QUICK

    path, d = vae
    data = _prepare(tmp_path / "ds", seed=3)
    cache = tmp_path / "ds-latents"
    assert main(["data", "encode", "--vae", str(path), "--data", str(data), "--out", str(cache)]) == 0
    part = tmp_path / "part.json"
    assert main(["partition", "--data", str(cache), "--method", "kmeans", "--experts", "2", "--out", str(part)]) == 0
    out = tmp_path / "expert0"
    args = ["train-expert", "--data", str(cache), "--partition", str(part), "--expert", "0", *DIT, *QUICK]
    assert main([*args, "--out", str(out), "--run-dir", str(tmp_path / "run")]) == 0
    meta, _ = load_checkpoint(out.with_suffix(".safetensors"))
    spec = spec_of(meta)
    assert spec.space == "latent" and list(spec.sample_shape) == [4, 8, 8]
    assert content_hash_of(spec.decoder) == codec_info(path).content_hash


DECODER_CMD = [sys.executable, "-m", "infra.cli", "decoder", "--threads", "1", "--vae"]


@pytest.mark.procs
async def test_decoder_command_serves_a_diffusers_vae(vae, nats_url, nc):
    from schemas import DecodeReply, DecodeRequest, DecodeResult, ErrorCode, pack, subjects, unpack

    path, _ = vae
    codec = load_codec(path)
    h = codec.content_hash
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.getcwd())
    proc = subprocess.Popen([*DECODER_CMD, str(path), "--nats", nats_url], stdout=subprocess.PIPE, env=env)
    try:
        line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 120)
        assert line.startswith(b"ready: decoder on " + subjects.decoder_decode(h).encode()), line

        async def ask(z):
            msg = await nc.request(subjects.decoder_decode(h), pack(DecodeRequest(decoder=h, latents=z)), timeout=30)
            return unpack(msg.data, DecodeResult)

        z = np.random.default_rng(1).standard_normal((3, 4, 8, 8)).astype(np.float32)
        reply = await ask(z)
        assert isinstance(reply, DecodeReply) and reply.decoder == h
        assert reply.images.shape == (3, 3, 16, 16)
        np.testing.assert_allclose(reply.images, codec.decode(z), atol=1e-5)
        bad = await ask(np.zeros((1, 3, 8, 8), np.float32))  # wrong channel count: an error, still serving
        assert bad.kind == "error" and bad.code == ErrorCode.BAD_SHAPE and "[B, 4, h, w]" in bad.message
        assert isinstance(await ask(z[:1]), DecodeReply)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    assert proc.returncode == 0


def test_up_serves_the_vae_directory_of_a_latent_fleet(vae, tiny_fleet_dir, tmp_path):
    """A latent fleet whose DIR holds a diffusers VAE as vae/ (and no autoencoder.safetensors) starts
    `ddm-fleet decoder --checkpoint DIR/vae`; another VAE than the spec names is refused."""
    from infra import cli
    from infra.cmd_up import Probes, UpError, build_stages, check_checkpoints
    from models.spec import spec_of
    from schemas import subjects

    path, _ = vae
    digest = codec_info(path).content_hash
    d = tmp_path / "latent"
    shutil.copytree(tiny_fleet_dir, d)
    rj = d / "router.json"
    meta = json.loads(rj.read_text())
    rj.write_text(
        json.dumps({**meta, "spec": {**spec_of(meta).to_json(), "space": "latent", "decoder": decoder_name(digest)}})
    )
    _save_vae(d / "vae", seed=7)
    with pytest.raises(UpError, match="spec names"):
        check_checkpoints(d)
    shutil.rmtree(d / "vae")
    shutil.copytree(path, d / "vae")
    args = cli.build_parser().parse_args(["up", "--checkpoints", str(d), "--no-web"])
    _, rest = build_stages(args, check_checkpoints(d), "/bin/nats-server", Probes("nats://x:1"))
    dec = next(c for c in rest if c.name == "decoder-0")
    assert dec.argv[3:6] == ["decoder", "--checkpoint", str((d / "vae").resolve())]
    assert dec.where == subjects.decoder_decode(digest)


def test_sampled_latents_are_decoded_by_the_vae_beside_the_checkpoints(vae, tmp_path):
    """A latent monolith whose spec names the VAE, with the VAE saved as vae/ beside it: the in-process
    sampler decodes its samples with that VAE before saving them (and refuses another VAE)."""
    from evaluation.sample_inprocess import main as sample_main
    from models.tiny import make_tiny_expert
    from schemas.spec import ModelSpec, legacy_spec

    path, _ = vae
    ck = tmp_path / "latent"
    ck.mkdir()
    shutil.copytree(path, ck / "vae")
    digest = codec_info(path).content_hash
    spec = {**legacy_spec(in_channels=4, image_size=8).to_json(), "space": "latent", "decoder": decoder_name(digest)}
    mono = make_tiny_expert(ck / "monolith", expert_id=0, in_channels=4, image_size=8, jitter=0.05, classes=range(10))
    js = mono.with_suffix(".json")
    js.write_text(json.dumps({**json.loads(js.read_text()), "spec": ModelSpec.from_json(spec).to_json()}))
    argv = ["--monolith", str(mono), "--configs", "monolith", "--per-class", "1", "--steps", "2"]
    argv += ["--images-per-job", "5", "--dtype", "float32"]
    assert sample_main([*argv, "--out", str(tmp_path / "img")]) == 0
    got = np.load(tmp_path / "img" / "monolith.npz")
    assert got["images"].shape == (10, 3, 16, 16) and json.loads(str(got["meta"]))["decoded_by"] == digest
    other = _save_vae(tmp_path / "other", seed=9)
    with pytest.raises(SystemExit, match="but the spec names"):
        sample_main([*argv, "--vae", str(other), "--out", str(tmp_path / "img2")])
