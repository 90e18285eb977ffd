"""`ddm-fleet sample`: classifier-free guidance (asked for, or the fleet's default beside the checkpoints),
refused without a null label; latent experts decoded by their autoencoder, and refused before the first
step when no grid could show what they make."""

from __future__ import annotations

import json

import numpy as np
import pytest

from infra.cli import main


def _grey_pair(tmp_path, null_label: bool):
    from models.tiny import make_tiny_expert

    return [
        str(make_tiny_expert(tmp_path / f"expert{k}", expert_id=k, classes=cls, jitter=0.05, null_label=null_label))
        for k, cls in enumerate(([0, 1, 2, 3, 4], [5, 6, 7, 8, 9]))
    ]


def _sample(ckpts, out, *extra) -> int:
    argv = ["sample", "--classes", "2,7", "--per-class", "2", "--steps", "2", "--dtype", "float32", "--out", str(out)]
    for c in ckpts:
        argv += ["--checkpoint", c]
    return main([*argv, *extra])


def test_guidance_changes_labelled_images_and_the_fleets_default_applies(tmp_path, capsys):
    from infra.cmd_sample import sample_oracle
    from models.fleet_guidance import set_default_guidance

    ckpts = _grey_pair(tmp_path, null_label=True)
    plain, y, _, _ = sample_oracle(ckpts, [2, 7], 2, 2, progress=False)
    guided, _, _, _ = sample_oracle(ckpts, [2, 7], 2, 2, progress=False, guidance=3.0)
    assert np.abs(guided - plain).max() > 1e-3  # (the velocity: flow.guidance.guided_velocity, the workers' own)
    out, npz = tmp_path / "g.png", tmp_path / "g.npz"
    assert _sample(ckpts, out, "--guidance", "3", "--npz", str(npz)) == 0
    assert "guidance 3" in capsys.readouterr().out
    np.testing.assert_array_equal(np.load(npz)["images"], guided)
    (tmp_path / "router.json").write_text(json.dumps({"format": "ddm-fleet-router/1"}))
    set_default_guidance(tmp_path / "router.json", 3.0)  # beside the checkpoints: their fleet's default
    assert _sample(ckpts, out, "--npz", str(npz)) == 0
    np.testing.assert_array_equal(np.load(npz)["images"], guided)
    assert _sample(ckpts, out, "--guidance", "1", "--npz", str(npz)) == 0  # 1 turns it off
    np.testing.assert_array_equal(np.load(npz)["images"], plain)


def test_guidance_without_a_null_label_is_refused_before_sampling(tmp_path, capsys):
    ckpts = _grey_pair(tmp_path, null_label=False)
    assert _sample(ckpts, tmp_path / "g.png", "--guidance", "2") == 2
    err = capsys.readouterr().err
    assert "null label" in err and "--label-dropout" in err and "sampling" not in err
    assert not (tmp_path / "g.png").exists()


def test_latent_experts_are_decoded_and_refused_early_without_their_autoencoder(tmp_path, capsys):
    from PIL import Image

    from models.tiny import make_tiny_latent_fleet

    fleet = make_tiny_latent_fleet(tmp_path / "latent")
    ckpts = [str(p) for p in fleet.experts]
    out, npz = tmp_path / "l.png", tmp_path / "l.npz"
    assert _sample(ckpts, out, "--npz", str(npz)) == 0, capsys.readouterr().err
    assert "decoded" in capsys.readouterr().out
    assert Image.open(out).mode == "RGB"
    data = np.load(npz)
    assert data["images"].shape == (4, 3, 16, 16) and data["latents"].shape == (4, 4, 8, 8)
    assert np.abs(data["images"]).max() <= 1.0 + 1e-6
    # the experts alone, without their autoencoder: refused before the first step, saying what is missing
    bare = tmp_path / "bare"
    bare.mkdir()
    moved = []
    for p in fleet.experts:
        for suffix in (".safetensors", ".json"):
            (bare / (p.stem + suffix)).write_bytes(p.with_suffix(suffix).read_bytes())
        moved.append(str(bare / (p.stem + ".safetensors")))
    assert _sample(moved, tmp_path / "x.png") == 2
    err = capsys.readouterr().err
    assert "autoencoder" in err and "sampling" not in err and not (tmp_path / "x.png").exists()
    # --autoencoder names it from anywhere
    assert _sample(moved, tmp_path / "x.png", "--autoencoder", str(fleet.autoencoder)) == 0
    # another autoencoder than the spec names is refused
    from models.tiny import make_tiny_autoencoder

    other = make_tiny_autoencoder(tmp_path / "other", seed=7)
    assert _sample(moved, tmp_path / "y.png", "--autoencoder", str(other)) == 2
    assert "spec names" in capsys.readouterr().err


@pytest.mark.parametrize("bad", ["-1", "21", "x"])
def test_a_bad_scale_is_an_argparse_error(tmp_path, bad, capsys):
    with pytest.raises(SystemExit) as err:
        _sample(_grey_pair(tmp_path, null_label=True), tmp_path / "g.png", "--guidance", bad)
    assert err.value.code == 2 and "guidance" in capsys.readouterr().err


def test_batch_invariant_sampling_gives_an_image_the_same_bits_however_many_share_its_class(tmp_path, capsys):
    """`sample --batch-invariant`: the first image of a class is the same bit for bit whether it is drawn
    alone or with 4 more (its noise is the first draw either way), as a batch-invariant worker computes it;
    the flag reaches the experts (the run prints it)."""
    from infra.cmd_sample import sample_oracle

    ckpts = _grey_pair(tmp_path, null_label=True)
    alone, _, _, _ = sample_oracle(ckpts, [3], 1, 2, progress=False, guidance=2.0, batch_quantum=16)
    among, _, _, _ = sample_oracle(ckpts, [3], 5, 2, progress=False, guidance=2.0, batch_quantum=16)
    np.testing.assert_array_equal(alone[0], among[0])
    npz = tmp_path / "b.npz"
    assert _sample(ckpts, tmp_path / "b.png", "--batch-invariant", "--npz", str(npz)) == 0
    assert "batch-invariant" in capsys.readouterr().out
