"""evaluation.sample_inprocess: the study's batch sampler keeps the fleet's conventions, image for image."""

import json
import shutil

import numpy as np
import pytest


@pytest.fixture(scope="module")
def tiny_ddm(tmp_path_factory):
    from models.tiny import make_tiny_expert, make_tiny_experts, make_tiny_router
    from tests.coordinator.helpers import JITTER, TINY_WIDTHS

    ck = tmp_path_factory.mktemp("ck")  # experts with a null label, so unconditional rows (y = -1) run
    make_tiny_experts(ck, 2, widths=TINY_WIDTHS, jitter=JITTER, groups=8, null_label=True)
    make_tiny_router(ck / "router", 2)
    shutil.copy("checkpoints/partition.json", ck / "partition.json")
    make_tiny_expert(
        ck / "monolith",
        expert_id=0,
        seed=101,
        widths=TINY_WIDTHS,
        jitter=JITTER,
        groups=8,
        classes=range(10),
        null_label=True,
    )
    return ck


async def _fleet_images(ck, strategy: str, digits, steps: int, job_size: int, monolith: bool = False):
    from coordinator.local_fleet import LabelRouter, LocalFleet
    from evaluation.run import Config, EvalSpec, generate_through_fleet

    if monolith:
        fleet = LocalFleet(
            [str(ck / "monolith.safetensors")],
            LabelRouter([0] * 10, 1),
            num_experts=1,
            class_to_expert=[0] * 10,
            dtype="float32",
        )
        cfg = Config("monolith", "monolith")
    else:
        fleet = LocalFleet.from_dir(ck, dtype="float32")
        cfg = Config.parse(strategy)
    spec = EvalSpec(configs=[cfg], checkpoints=str(ck), per_class=2, steps=steps, job_size=job_size, progress=False)
    async with fleet:
        return await generate_through_fleet(fleet.nc, digits, cfg, spec)


@pytest.mark.parametrize("strategy", ["top1", "oracle", "full", "sample", "monolith"])
@pytest.mark.bus
async def test_same_images_as_the_fleet(tiny_ddm, strategy):
    """Same digits, seeds (jobs of job_size seeded seed + j) and solver as `ddm-fleet eval`: the images
    match the fleet's to float rounding (the fleet's experts see other batch sizes, which can move the
    last bits of a convolution)."""
    from evaluation.run import requested_digits
    from evaluation.sample_inprocess import SampleConfig, generate, initial_batch

    digits = requested_digits(2)
    steps, job_size = 3, 8
    mono = strategy == "monolith"
    want, want_usage = await _fleet_images(tiny_ddm, strategy, digits, steps, job_size, monolith=mono)
    cfg = (
        SampleConfig("monolith", str(tiny_ddm / "monolith.safetensors"))
        if mono
        else SampleConfig(f"ddm-{strategy}", "ddm", strategy)
    )
    got, usage = generate(
        cfg,
        digits=digits,
        noise=initial_batch(len(digits), job_size, 0),
        steps=steps,
        solver="euler",
        device="cpu",
        checkpoints=str(tiny_ddm),
        seed=0,
        job_size=job_size,  # sample: the draws follow each row's job seed and index in it, as the fleet's
        dtype="float32",  # as the fleet's workers above: images compared to the last bits
    )
    assert got.shape == (20, 1, 32, 32) and usage.shape == want_usage.shape
    np.testing.assert_allclose(got, want, atol=1e-5)
    assert np.abs(got).max() <= 1.0 and np.abs(got - want).max() < 1e-5
    np.testing.assert_allclose(usage, want_usage, atol=1e-6)


def _top1_images(ddm, strategy: str = "top1", digits=None, job_size: int = 5, **opts) -> np.ndarray:
    """One image per digit (default 0-9) from the tiny DDM, top1, 3 Euler steps, jobs of 5 (`opts`:
    dtype, compile)."""
    from evaluation.run import requested_digits
    from evaluation.sample_inprocess import SampleConfig, generate, initial_batch

    digits = requested_digits(1) if digits is None else np.asarray(digits, np.int64)
    images, _ = generate(
        SampleConfig(f"ddm-{strategy}", "ddm", strategy),
        digits=digits,
        noise=initial_batch(len(digits), job_size, 0),
        steps=3,
        solver="euler",
        device="cpu",
        checkpoints=str(ddm),
        job_size=job_size,
        **opts,
    )
    return images


def test_bfloat16_images_are_close_to_float32_and_reproducible(tiny_ddm):
    """--dtype bfloat16 computes the experts in bfloat16: other images than float32's (seeded
    reproducibility holds per dtype), close to them, and the same again for the same seed."""
    fp32 = _top1_images(tiny_ddm, dtype="float32")
    bf16 = _top1_images(tiny_ddm, dtype="bfloat16")
    again = _top1_images(tiny_ddm, dtype="bfloat16")
    np.testing.assert_array_equal(bf16, again)
    assert 0 < np.abs(bf16 - fp32).max() < 0.1


def test_compile_reaches_the_experts_the_sampler_runs(tmp_path):
    """--compile on: the in-process sampler's experts are the workers' compiled torch backend (what their
    compiled forward computes, against eager, is tests/workers/test_torch_compile.py's; compiling here again
    would cost the suite about 50 CPU-seconds for the same kernels); off: eager."""
    from evaluation.sample_inprocess import _Experts
    from models.tiny import make_tiny_expert
    from tests.workers.test_torch_compile import COMPILED_SEEDS, COMPILED_TINY

    paths = [
        str(make_tiny_expert(tmp_path / f"e{k}", expert_id=k, seed=COMPILED_SEEDS[k], **COMPILED_TINY)) for k in (0, 1)
    ]
    on = _Experts(paths, "cpu", dtype="float32", compile="on")
    off = _Experts(paths, "cpu", dtype="float32", compile="off")
    assert [b.describe()["compiled"] for b in on.backends] == ["true", "true"]
    assert [b.describe()["compiled"] for b in off.backends] == ["false", "false"]
    assert all(b.compile_reason == "asked for" for b in on.backends)


@pytest.mark.slow
def test_cli_writes_files_rescore_reads(tiny_ddm, tmp_path):
    """The CLI writes <config>.npz (uint8 images by default), labels -1 for unconditional, no oracle there."""
    from evaluation.sample_inprocess import main, parse_configs

    out = tmp_path / "img"
    assert (
        main(
            [
                "--checkpoints",
                str(tiny_ddm),
                "--monolith",
                str(tiny_ddm / "monolith.safetensors"),
                "--configs",
                "monolith,top1,top2",
                "--per-class",
                "1",
                "--steps",
                "2",
                "--dtype",
                "float32",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    assert (
        main(
            [
                "--checkpoints",
                str(tiny_ddm),
                "--configs",
                "top1",
                "--unconditional",
                "--per-class",
                "1",
                "--steps",
                "2",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    assert sorted(p.name for p in out.iterdir()) == [
        "ddm-top1.npz",
        "ddm-top2.npz",
        "monolith.npz",
        "uncond-ddm-top1.npz",
    ]
    d = np.load(out / "ddm-top2.npz")
    assert d["images"].dtype == np.uint8 and d["images"].shape == (10, 1, 32, 32)
    assert d["labels"].tolist() == list(range(10)) and np.allclose(d["usage"].sum(1), 2.0)
    assert json.loads(str(d["meta"]))["steps"] == 2 and json.loads(str(d["meta"]))["dtype"] == "float32"
    u = np.load(out / "uncond-ddm-top1.npz")
    assert (u["labels"] == -1).all()
    # --skip-existing resumes: files already there are kept byte for byte, only missing ones are made
    (out / "ddm-top2.npz").unlink()
    before = (out / "ddm-top1.npz").stat().st_mtime_ns
    assert (
        main(
            [
                "--checkpoints",
                str(tiny_ddm),
                "--configs",
                "top1,top2",
                "--per-class",
                "1",
                "--steps",
                "2",
                "--skip-existing",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    assert (out / "ddm-top1.npz").stat().st_mtime_ns == before and (out / "ddm-top2.npz").exists()
    assert not list(out.glob("*.partial.npz"))
    with pytest.raises(ValueError, match="oracle"):
        from evaluation.sample_inprocess import SampleConfig, generate, initial_batch

        generate(
            SampleConfig("x", "ddm", "oracle", unconditional=True),
            digits=np.arange(2),
            noise=initial_batch(2, 8, 0),
            steps=1,
            solver="euler",
            device="cpu",
            checkpoints=str(tiny_ddm),
        )
    with pytest.raises(ValueError, match="unknown configuration"):
        parse_configs("top1,bogus", None, None, None, False)


def test_latent_checkpoints_are_decoded_by_the_autoencoder_their_spec_names(tmp_path):
    """A latent monolith's samples go through its autoencoder (found beside it) before they are saved, exactly
    as `LatentCodec.decode` computes them; another autoencoder is refused, naming it."""
    from dataset.images import to_uint8
    from evaluation.run import requested_digits
    from evaluation.sample_inprocess import SampleConfig, generate, initial_batch, main
    from models.autoencoder_torch import LatentCodec
    from models.tiny import make_tiny_autoencoder, make_tiny_latent_fleet

    ck = tmp_path / "latent"  # 3x16x16 images <-> 4x8x8 latents, a monolith of the ten classes beside them
    made = make_tiny_latent_fleet(ck, num_experts=0, monolith=True)
    codec, mono = LatentCodec.load(made.autoencoder), made.monolith

    out = tmp_path / "img"
    argv = ["--monolith", str(mono), "--configs", "monolith", "--per-class", "1", "--steps", "2"]
    argv += ["--images-per-job", "5", "--dtype", "float32", "--out", str(out)]
    assert main(argv) == 0
    got = np.load(out / "monolith.npz")
    assert got["images"].shape == (10, 3, 16, 16) and got["images"].dtype == np.uint8
    assert json.loads(str(got["meta"]))["decoded_by"] == codec.content_hash
    digits = requested_digits(1, 10)
    latents, _ = generate(
        SampleConfig("monolith", str(mono)),
        digits=digits,
        noise=initial_batch(10, 5, 0, (4, 8, 8)),
        steps=2,
        solver="euler",
        device="cpu",
        checkpoints=None,
        seed=0,
        job_size=5,
        dtype="float32",
        latent=True,
    )
    # latents are not images: they reach the decoder unclipped, as the fleet's scheduler hands them over
    assert np.abs(latents).max() > 1.0
    np.testing.assert_array_equal(got["images"], to_uint8(codec.decode(latents)))
    assert not np.array_equal(got["images"], to_uint8(codec.decode(np.clip(latents, -1.0, 1.0))))

    other = make_tiny_autoencoder(tmp_path / "other", seed=1)
    with pytest.raises(SystemExit, match="is autoencoder .* but the spec names"):
        main([*argv[:-2], "--autoencoder", str(other), "--out", str(tmp_path / "img2")])
    (ck / "autoencoder.safetensors").unlink()
    with pytest.raises(SystemExit, match="their autoencoder is needed as .*autoencoder.safetensors"):
        main([*argv[:-2], "--out", str(tmp_path / "img3")])


def test_guidance_names_the_files_and_refuses_bad_scales():
    """--guidance S guides every configuration (files <config>-cfgS); 1 leaves them as they were. The images
    themselves are checked against the fleet's, bit for bit, in tests/coordinator/test_service_guidance.py."""
    from evaluation.sample_inprocess import build_parser, parse_configs, with_guidance

    configs = parse_configs("top1,full", None, None, None, False)
    assert with_guidance(configs, 1.0) == configs
    guided = with_guidance(configs, 2.5)
    assert [c.name for c in guided] == ["ddm-top1-cfg2.5", "ddm-full-cfg2.5"]
    assert all(c.guidance == 2.5 and c.strategy == o.strategy for c, o in zip(guided, configs))
    for bad in (-1.0, 20.5, float("nan")):
        with pytest.raises(ValueError, match="--guidance"):
            with_guidance(configs, bad)
    assert build_parser().parse_args(["--out", "x", "--guidance", "3"]).guidance == (3.0,)
    assert build_parser().parse_args(["--out", "x", "--guidance", "1,1.5,2,1.5"]).guidance == (1.0, 1.5, 2.0)
    assert build_parser().parse_args(["--out", "x"]).guidance == (1.0,)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--out", "x", "--guidance", "2,x"])
