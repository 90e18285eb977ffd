"""`ddm-fleet eval --rescore` for the quality study: uint8 files, unconditional files (labels -1),
intervals and paired comparisons, scored by the real judges (the shipped ones, loaded offline)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dataset.images import to_uint8
from dataset.mnist import load_mnist
from evaluation.rescore import (
    CONDITIONAL,
    UNCONDITIONAL,
    RowStatistics,
    SavedImagesError,
    comparisons,
    default_pairs,
    format_rescore_table,
    load_saved,
    rescore_saved,
    saved_configurations,
)

SCRIPT = Path(sys.executable).with_name("ddm-fleet")
ROOT = Path(__file__).resolve().parents[2]


def eval_cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """`ddm-fleet eval ARGS` in a process of its own, as a user runs it (one thread, warnings off)."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [str(SCRIPT), "eval", *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT
    )


def test_uint8_images_round_trip_to_the_float_convention(tmp_path):
    x, y = load_mnist("val", limit=64)
    np.savez(tmp_path / "u8.npz", images=to_uint8(x), labels=y)
    back = load_saved(tmp_path / "u8.npz")
    assert back.images.dtype == np.float32 and back.images.min() == -1.0 and back.images.max() == 1.0
    # MNIST pixels are k/255, so the uint8 copy is exact up to float rounding; any image within half a step
    np.testing.assert_allclose(back.images, x, atol=1e-6)
    noisy = np.clip(x + np.random.default_rng(0).uniform(-0.3, 0.3, x.shape).astype(np.float32), -1, 1)
    np.savez(tmp_path / "noisy.npz", images=to_uint8(noisy), labels=y)
    assert np.abs(load_saved(tmp_path / "noisy.npz").images - noisy).max() <= 0.5 / 127.5 + 1e-6
    np.savez(tmp_path / "int16.npz", images=to_uint8(x).astype(np.int16), labels=y)
    with pytest.raises(SavedImagesError, match="uint8 0..255"):
        load_saved(tmp_path / "int16.npz")


def test_labels_minus_one_make_an_unconditional_file_and_mixed_files_are_refused(tmp_path):
    x, y = load_mnist("val", limit=20)
    np.savez(tmp_path / "uncond-a.npz", images=x, labels=np.full(20, -1))
    mixed = y.copy()
    mixed[:5] = -1
    np.savez(tmp_path / "mixed.npz", images=x, labels=mixed)
    np.savez(tmp_path / "minus-two.npz", images=x, labels=np.full(20, -2))
    np.savez(tmp_path / "cond.npz", images=x, labels=y)
    assert load_saved(tmp_path / "uncond-a.npz").kind == UNCONDITIONAL
    assert load_saved(tmp_path / "cond.npz").kind == CONDITIONAL
    with pytest.raises(SavedImagesError, match="5 of 20 labels are -1"):
        load_saved(tmp_path / "mixed.npz")
    with pytest.raises(SavedImagesError, match="or -1"):
        load_saved(tmp_path / "minus-two.npz")


def test_study_file_names_order_and_default_pairs(tmp_path):
    names = [
        "uncond-distilled",
        "distilled",
        "ddm-oracle",
        "uncond-ddm-top1",
        "ddm-top1",
        "monolith",
        "uncond-monolith",
        "ddm-full",
        "ddm-top2",
        "uncond-ddm-full",
        "uncond-ddm-top2",
        "extra",
    ]
    for n in names:
        (tmp_path / f"{n}.npz").write_bytes(b"")
    assert [p.stem for p in saved_configurations(tmp_path)] == [
        "monolith",
        "ddm-top1",
        "ddm-top2",
        "ddm-full",
        "ddm-oracle",
        "distilled",
        "extra",
        "uncond-monolith",
        "uncond-ddm-top1",
        "uncond-ddm-top2",
        "uncond-ddm-full",
        "uncond-distilled",
    ]
    order = [p.stem for p in saved_configurations(tmp_path)]
    pairs = default_pairs(order)
    assert pairs[:5] == [
        ("ddm-top1", "monolith"),
        ("ddm-top2", "monolith"),
        ("ddm-full", "monolith"),
        ("ddm-oracle", "monolith"),
        ("distilled", "monolith"),
    ]
    assert ("ddm-top1", "distilled") in pairs and ("uncond-ddm-top1", "uncond-monolith") in pairs
    assert ("uncond-distilled", "uncond-monolith") in pairs and ("uncond-ddm-full", "uncond-distilled") in pairs
    assert not any("extra" in p for pair in pairs for p in pair)  # other names only by --compare
    assert not any((a.startswith("uncond-")) != (b.startswith("uncond-")) for a, b in pairs)  # never across kinds
    assert len(pairs) == 9 + 7
    assert default_pairs(["ddm-top1", "ddm-top2"]) == []  # nothing to compare against


@pytest.fixture(scope="module")
def judges():
    from evaluation.judges import Judges

    return Judges.load(progress=False)


@pytest.mark.slow  # ~15-30 s: loads both judges and scores 1,500 images
def test_unconditional_class_distribution_real_digits_near_uniform_one_digit_far(judges, tmp_path):
    x, y = load_mnist("test")
    rng = np.random.default_rng(0)
    real = x[rng.permutation(len(x))[:500]]
    threes = x[y == 3][:500]
    np.savez(tmp_path / "uncond-real.npz", images=to_uint8(real), labels=np.full(500, -1))
    np.savez(tmp_path / "uncond-threes.npz", images=threes, labels=np.full(500, -1))
    stats = RowStatistics(judges, resamples=50)
    real_row = rescore_saved(load_saved(tmp_path / "uncond-real.npz"), judges, stats)
    threes_row = rescore_saved(load_saved(tmp_path / "uncond-threes.npz"), judges, stats)
    for sfx in ("", "_judge2"):
        near, far = real_row.classes[sfx], threes_row.classes[sfx]
        assert near.n == far.n == 500
        assert near.tv_uniform < 0.08 and near.entropy_bits > 3.25  # log2(10) = 3.32
        assert far.tv_uniform > 0.85 and far.counts[3] > 490 and far.entropy_bits < 0.2 and far.chi2_p < 1e-100
        lo, hi = real_row.tv_interval[sfx]
        assert lo <= near.tv_uniform <= hi < far.tv_uniform
        lo, hi = real_row.fid_interval[sfx]
        assert lo < getattr(real_row.score, "judge1" if not sfx else "judge2").fid < hi
    d = real_row.as_dict()
    assert d["kind"] == UNCONDITIONAL and d["accuracy"] is None and d["accuracy_judge2"] is None
    assert d["class_distribution"]["counts"] == real_row.classes[""].counts and len(d["tv_uniform_interval"]) == 2
    # the two are paired by seed only in the study; here they are merely the same size, which is all
    # an unconditional pair needs: the one-digit file is far worse on TV and FID, firmly
    (c,), notes = comparisons([threes_row, real_row], [("uncond-threes", "uncond-real")])
    assert notes == [] and c.kind == UNCONDITIONAL and c.mcnemar == {}
    assert c.tv[""].estimate > 0.7 and c.tv[""].low > 0.6 and c.fid["_judge2"].low > 0 and c.fid[""].at_floor
    table = format_rescore_table([real_row, threes_row], judges, tmp_path, comparisons=[c], resamples=50)
    assert "TV to uniform judge 1 | TV to uniform judge 2" in table and "cond. acc." not in table
    assert "| uncond-threes vs uncond-real | judge 2 |" in table and "< 0.02" in table


@pytest.mark.slow  # ~20-45 s: one CLI run loading both judges
@pytest.mark.procs
def test_rescore_cli_mixed_directory_prints_both_kinds_and_paired_tests(tmp_path):
    x, y = load_mnist("test", limit=400)
    saved = tmp_path / "saved"
    saved.mkdir()
    blanked = x.copy()
    blanked[:40] = -1.0  # 40 empty canvases: the "DDM" misses 10% of the requests the "monolith" gets right
    np.savez_compressed(saved / "monolith.npz", images=x, labels=y, usage=np.ones((400, 1), np.float32))
    np.savez_compressed(
        saved / "ddm-top1.npz",
        images=to_uint8(blanked),
        labels=y,
        usage=np.tile([[1.0, 0.0]], (400, 1)).astype(np.float32),
    )
    np.savez_compressed(saved / "uncond-monolith.npz", images=to_uint8(x), labels=np.full(400, -1))
    np.savez_compressed(saved / "uncond-ddm-top1.npz", images=np.resize(x[y == 1], x.shape), labels=np.full(400, -1))
    kept = tmp_path / "out" / "scores.json"
    # one run (each loads both judges): the table on stdout, the same results as JSON in --json-out;
    # --compare replaces the default pairs (ddm-top1 vs monolith would be the default: here it is reversed)
    out = eval_cli(
        *("--rescore", str(saved), "--no-progress", "--bootstrap", "50", "--json-out", str(kept)),
        *("--compare", "monolith,ddm-top1", "--compare", "uncond-ddm-top1,uncond-monolith"),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    table = out.stdout
    assert "(2 conditional, 2 unconditional)" in table
    assert "cond. acc. judge 1 | cond. acc. judge 2 | FID judge 1 | FID judge 2 | judges agree" in table
    assert "TV to uniform judge 1 | TV to uniform judge 2 | FID judge 1 | FID judge 2" in table
    assert "| monolith | 400 | " in table and "| ddm-top1 | 400 | 0.9" in table and "| real-val | 400 |" in table
    assert "| uncond-monolith | 400 | 0.0" in table and "| real-val (unconditional) | 400 |" in table
    assert "| uncond-ddm-top1 | judge 1 | 0.0 | 100.0 | 0.0 |" in table  # its class histogram: all ones
    assert "| 0.000 | 0.0e+00 |" in table  # entropy 0 bits, chi-square p ~ 0
    assert (
        "| monolith vs ddm-top1 | judge 1 | " in table and "| uncond-ddm-top1 vs uncond-monolith | judge 2 |" in table
    )
    assert "| ddm-top1 vs monolith |" not in table

    data = json.loads(kept.read_text())
    assert data["bootstrap"] == {"resamples": 50, "seed": 0}
    rows = {r["config"]: r for r in data["rows"]}
    assert [r["kind"] for r in data["rows"]] == ["conditional", "conditional", "unconditional", "unconditional"]
    mono, ddm = rows["monolith"], rows["ddm-top1"]
    assert mono["accuracy"] > 0.98 and ddm["accuracy"] < mono["accuracy"] - 0.08
    lo, hi = mono["accuracy_interval"]
    assert lo < mono["accuracy"] <= hi and mono["fid_interval"][0] < mono["fid"] < mono["fid_interval"][1]
    assert ddm["experts_per_step"] == pytest.approx(1.0)
    u = rows["uncond-ddm-top1"]
    assert u["accuracy"] is None and u["tv_uniform"] == pytest.approx(0.9, abs=0.01)
    assert u["class_distribution_judge2"]["counts"][1] >= 396
    assert data["real_baseline"]["config"] == "real-val"
    assert data["real_baseline_unconditional"]["tv_uniform"] < 0.1
    cmp, ucmp = data["comparisons"]  # the pairs asked for, in that order
    assert (cmp["a"], cmp["b"], cmp["kind"]) == ("monolith", "ddm-top1", "conditional")
    assert (ucmp["a"], ucmp["b"], ucmp["kind"]) == ("uncond-ddm-top1", "uncond-monolith", "unconditional")
    m = cmp["mcnemar"]
    # blanked images the monolith reads right, the DDM wrong; nothing the other way round
    assert m["only_a_right"] >= 30 and m["only_b_right"] == 0 and m["p"] < 1e-9 and m["method"] == "exact binomial"
    assert cmp["accuracy_difference"]["interval"][0] > 0 and cmp["fid_difference_judge2"]["estimate"] < 0

    bad = eval_cli("--rescore", str(saved), "--compare", "ddm-top1,nope", timeout=120)
    assert bad.returncode != 0 and "--compare names nope" in bad.stderr and "Traceback" not in bad.stderr
    # a --json-out that cannot be written fails before any judge is loaded
    bad = eval_cli("--rescore", str(saved), "--json-out", str(saved), timeout=120)
    assert bad.returncode != 0 and "--json-out" in bad.stderr and "Traceback" not in bad.stderr
