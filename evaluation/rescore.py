"""Re-score saved images (`ddm-fleet eval --save-images DIR` output) with the judges, with statistics.

Every `<configuration>.npz` in DIR holds `images` [N,C,H,W] (MNIST: [N,1,32,32]), float32 in [-1,1] or
uint8 0..255 (read as x / 127.5 - 1), `labels` int [N] (the requested classes, or -1 on every row for an
unconditional file) and optionally `usage` [N,K]. Nothing is generated: the same images are read back
and scored by every judge of `Judges` side by side (judge 1 and judge 2; on a prepared dataset also
the data judge, and the colour check where the dataset has a palette), with how often judges 1 and 2 agree.

* Conditional files: accuracy (95% Wilson interval) and FID (95% bootstrap interval) per judge.
* Unconditional files (labels all -1): accuracy is undefined; each judge's predicted class
  distribution instead (histogram, total variation distance to uniform with a bootstrap interval,
  entropy, chi-square p against uniform) and FID.
* Paired comparisons (`compare`): configurations that generated the same digits with the same seeds
  row for row. Conditional: McNemar on per-image correctness, accuracy and FID differences with paired
  bootstrap intervals. Unconditional: TV and FID differences, paired bootstrap. By default every DDM
  row (and `distilled`) against `monolith`, and every DDM row against `distilled`, within each kind.

File names the quality study uses: monolith, ddm-top1, ddm-top2, ddm-full, ddm-oracle, distilled
(conditional) and the same with an `uncond-` prefix (unconditional; no oracle there).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .judges import JUDGE_LABELS, DualScore, Judges
from .stats import (
    DEFAULT_RESAMPLES,
    DEFAULT_SEED,
    ClassDistribution,
    Difference,
    FidReference,
    McNemar,
    bootstrap_fid,
    bootstrap_tv_uniform,
    bootstrap_weights,
    class_distribution,
    mcnemar,
    paired_difference,
    recentred_interval,
    wilson_interval,
)

# the order `ddm-fleet eval` writes them in, then the distilled student; unconditional files after the
# conditional ones in the same order; anything else follows alphabetically within its kind
CANONICAL_ORDER = ("monolith", "ddm-top1", "ddm-top2", "ddm-full", "ddm-oracle", "distilled")
UNCONDITIONAL_PREFIX = "uncond-"
BASELINE_NAMES = ("monolith", "distilled")  # what the default comparisons test the DDM rows against
CONDITIONAL, UNCONDITIONAL = "conditional", "unconditional"


class SavedImagesError(ValueError):
    """A saved configuration is missing, unreadable or not in the generator's image convention."""


@dataclass
class Saved:
    name: str
    images: np.ndarray  # float32 [N,C,H,W] in [-1,1]
    labels: np.ndarray  # int64 [N]: classes >= 0, or -1 on every row (unconditional)
    usage: np.ndarray | None  # [N,K] expert weights per image, if saved

    @property
    def kind(self) -> str:
        return UNCONDITIONAL if self.labels[0] < 0 else CONDITIONAL


@dataclass
class Rescored:
    name: str
    score: DualScore
    experts_per_step: float | None  # from the saved usage (None when the file has none)
    kind: str = CONDITIONAL
    labels: np.ndarray | None = field(default=None, repr=False)  # [N] the saved labels (pairing checks)
    # filled by `RowStatistics.attach`; keys: the judges' JSON suffixes ("" judge 1, "_judge2", "_data")
    accuracy_interval: dict = field(default_factory=dict)  # suffix -> (low, high), Wilson (conditional)
    fid_interval: dict = field(default_factory=dict)  # suffix -> (low, high), bootstrap
    classes: dict = field(default_factory=dict)  # suffix -> ClassDistribution (unconditional)
    tv_interval: dict = field(default_factory=dict)  # suffix -> (low, high), bootstrap (unconditional)
    samples: dict = field(default_factory=dict, repr=False)  # "fid" / "accuracy" / "tv" + suffix -> [B]
    colour_interval: tuple | None = None  # Wilson interval of the colour-correct fraction

    def as_dict(self) -> dict:
        d = {"config": self.name, "kind": self.kind, **self.score.as_dict(), "experts_per_step": self.experts_per_step}
        suffixes = [sfx for _, sfx, _ in self.score.panel()]
        if self.kind == UNCONDITIONAL:  # no class was requested: accuracy is undefined, not 0
            for sfx in suffixes:
                d[f"accuracy{sfx}"] = d[f"per_class_accuracy{sfx}"] = None
        if self.colour_interval is not None:
            d["colour_correct_interval"] = list(self.colour_interval)
        for sfx in suffixes:
            if sfx in self.accuracy_interval:
                d[f"accuracy{sfx}_interval"] = list(self.accuracy_interval[sfx])
            if sfx in self.fid_interval:
                d[f"fid{sfx}_interval"] = list(self.fid_interval[sfx])
            if sfx in self.classes:
                d[f"class_distribution{sfx}"] = self.classes[sfx].as_dict()
                d[f"tv_uniform{sfx}"] = self.classes[sfx].tv_uniform
            if sfx in self.tv_interval:
                d[f"tv_uniform{sfx}_interval"] = list(self.tv_interval[sfx])
        return d


def load_saved(path: str | Path) -> Saved:
    """Read and check one `<configuration>.npz` (images float in [-1, 1] or uint8 0..255; labels >= 0 or all -1).
    The shape and class count are checked against the judges when they score it."""
    path = Path(path)
    try:
        with np.load(path, allow_pickle=False) as z:
            if "images" not in z or "labels" not in z:
                raise SavedImagesError(f"{path}: needs arrays 'images' and 'labels', has {sorted(z.files)}")
            images, labels = z["images"], z["labels"]
            usage = z["usage"] if "usage" in z else None
    except (OSError, ValueError) as e:
        if isinstance(e, SavedImagesError):
            raise
        raise SavedImagesError(f"{path}: unreadable ({e})") from e
    if images.ndim != 4 or images.shape[1] not in (1, 2, 3, 4):
        raise SavedImagesError(
            f"{path}: images must be [N, C, H, W] (MNIST: [N, 1, 32, 32], 28x28 digits padded by 2, as "
            f"load_mnist does), got {list(images.shape)}"
        )
    if images.dtype == np.uint8:  # 0..255 -> [-1, 1], the inverse of (x + 1) * 127.5
        images = images.astype(np.float32) / 127.5 - 1.0
    elif not np.issubdtype(images.dtype, np.floating):
        raise SavedImagesError(f"{path}: images must be floats in [-1, 1] or uint8 0..255, got dtype {images.dtype}")
    if len(images) < 2 or len(labels) != len(images):
        raise SavedImagesError(f"{path}: {len(images)} images and {len(labels)} labels (need equal, >= 2)")
    labels = np.asarray(labels)
    if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer) or labels.min() < -1:
        raise SavedImagesError(f"{path}: labels must be integer classes >= 0 (digits 0-9), or -1 (unconditional)")
    if (labels < 0).any() and not (labels < 0).all():
        raise SavedImagesError(
            f"{path}: {int((labels < 0).sum())} of {len(labels)} labels are -1; a file is either "
            "conditional (digits 0-9) or unconditional (all -1): save the two kinds apart"
        )
    lo, hi = float(images.min()), float(images.max())
    # The judges were trained on [-1, 1] with background -1; a [0, 1] or [0, 255] float file would be
    # read as grey or saturated digits and scored wrongly without any error, so refuse it.
    # (Colour images may have no black pixel: there only a non-negative minimum is refused.)
    if (lo > -0.5 if images.shape[1] == 1 else lo >= 0.0) or hi > 1.5 or not np.isfinite(images).all():
        raise SavedImagesError(
            f"{path}: image values span [{lo:.3g}, {hi:.3g}]; expected the generator's [-1, 1] "
            "with background -1 (convert [0, 1] images with x * 2 - 1, or save uint8 0..255)"
        )
    return Saved(path.stem, images.astype(np.float32), labels.astype(np.int64), usage)


def _order_key(name: str) -> tuple:
    uncond = name.startswith(UNCONDITIONAL_PREFIX)
    base = name[len(UNCONDITIONAL_PREFIX) :] if uncond else name
    rank = {n: i for i, n in enumerate(CANONICAL_ORDER)}
    return (uncond, rank.get(base, len(rank)), name)


def saved_configurations(directory: str | Path) -> list[Path]:
    """The `*.npz` files of DIR in table order: canonical names first, `uncond-` files after the others."""
    d = Path(directory)
    if not d.is_dir():
        raise SavedImagesError(f"{d} is not a directory (write one with `ddm-fleet eval --save-images {d}`)")
    files = sorted(f for f in d.glob("*.npz") if not f.name.endswith(".partial.npz"))  # a sampler's unfinished file
    if not files:
        raise SavedImagesError(f"{d} holds no <configuration>.npz files")
    return sorted(files, key=lambda p: _order_key(p.stem))


class RowStatistics:
    """Intervals for one row at a time, with the judges' reference statistics computed once and the same
    bootstrap resamples for every row of the same size (so equal-size rows form a paired bootstrap).
    `resamples` = 0 gives Wilson intervals and class distributions only."""

    def __init__(self, judges: Judges, resamples: int = DEFAULT_RESAMPLES, seed: int = DEFAULT_SEED):
        if resamples < 0:
            raise ValueError(f"bootstrap resamples must be >= 0, got {resamples}")
        self.resamples, self.seed = resamples, seed
        self.references = {sfx: FidReference.from_features(ref) for sfx, ref in judges.references().items()}
        self._weights: dict[int, np.ndarray] = {}

    def weights(self, n: int) -> np.ndarray:
        if n not in self._weights:
            self._weights[n] = bootstrap_weights(n, self.resamples, self.seed)
        return self._weights[n]

    def attach(self, row: Rescored) -> Rescored:
        labels = row.labels
        colour = row.score.colour
        if colour is not None:
            row.colour_interval = wilson_interval(int(colour.correct.sum()), len(colour.correct))
        for _, sfx, s in row.score.panel():
            if row.kind == CONDITIONAL:
                correct = s.predictions == labels
                row.accuracy_interval[sfx] = wilson_interval(int(correct.sum()), len(correct))
            else:
                row.classes[sfx] = class_distribution(s.predictions, len(s.predicted_counts))
            if self.resamples == 0:
                continue
            w = self.weights(s.n)
            fid = bootstrap_fid(s.features, self.references[sfx], w)
            row.samples[f"fid{sfx}"] = fid
            row.fid_interval[sfx] = recentred_interval(s.fid, fid)
            if row.kind == CONDITIONAL:
                row.samples[f"accuracy{sfx}"] = w @ (s.predictions == labels).astype(np.float64) / s.n
            else:
                tv = bootstrap_tv_uniform(s.predictions, w, len(s.predicted_counts))
                row.samples[f"tv{sfx}"] = tv
                row.tv_interval[sfx] = recentred_interval(row.classes[sfx].tv_uniform, tv)
        return row


def rescore_saved(saved: Saved, judges: Judges, stats: RowStatistics | None = None) -> Rescored:
    eps = float(saved.usage.sum(axis=1).mean()) if saved.usage is not None and saved.usage.ndim == 2 else None
    row = Rescored(saved.name, judges.score(saved.images, saved.labels), eps, saved.kind, saved.labels)
    return stats.attach(row) if stats is not None else row


def load_dir(directory: str | Path) -> list[Saved]:
    """Read and check every saved configuration of DIR (table order); the first bad file raises."""
    return [load_saved(p) for p in saved_configurations(directory)]


def rescore_dir(
    directory: str | Path,
    judges: Judges,
    *,
    resamples: int = DEFAULT_RESAMPLES,
    seed: int = DEFAULT_SEED,
    progress: bool = False,
    saved: Sequence[Saved] | None = None,
) -> list[Rescored]:
    """Score every saved configuration of DIR (or the already loaded `saved`) with both judges, with
    intervals (B = `resamples` bootstrap resamples)."""
    stats = RowStatistics(judges, resamples, seed)
    items = list(saved) if saved is not None else load_dir(directory)
    if progress:
        from tqdm import tqdm

        items = tqdm(items, desc="re-scoring", unit="file")
    return [rescore_saved(s, judges, stats) for s in items]


REAL_ROW = "real-val"  # reference row: real validation digits, same requested digits
REAL_ROW_UNCONDITIONAL = "real-val (unconditional)"


def real_baseline(
    directory: str | Path,
    judges: Judges,
    data_dir=None,
    *,
    resamples: int = DEFAULT_RESAMPLES,
    seed: int = DEFAULT_SEED,
) -> Rescored | None:
    """Real validation digits with the first conditional file's labels, scored the same way (None when DIR
    holds no conditional file)."""
    for path in saved_configurations(directory):
        saved = load_saved(path)
        if saved.kind == CONDITIONAL:
            row = Rescored(REAL_ROW, judges.score_real(saved.labels, data_dir), None, CONDITIONAL, saved.labels)
            return RowStatistics(judges, resamples, seed).attach(row)
    return None


def real_baseline_unconditional(
    n: int, judges: Judges, data_dir=None, *, resamples: int = DEFAULT_RESAMPLES, seed: int = DEFAULT_SEED
) -> Rescored:
    """n real validation images drawn without replacement (fixed seed 0) and scored as unconditional
    images: the class-distribution and FID floor of real data at this sample size. ValueError when n
    exceeds the validation split."""
    x, _ = judges.real_images("val", data_dir)
    if n > len(x):
        raise ValueError(f"an unconditional baseline of {n} images needs more than the {len(x)} validation digits")
    pick = np.sort(np.random.default_rng(0).permutation(len(x))[:n])
    labels = np.full(n, -1, np.int64)
    row = Rescored(REAL_ROW_UNCONDITIONAL, judges.score(x[pick], labels), None, UNCONDITIONAL, labels)
    return RowStatistics(judges, resamples, seed).attach(row)


# ------------------------------------------------------------------ paired comparisons


@dataclass
class Comparison:
    """A against B (differences are A - B) on the same requests, per judge (keys: the judges' suffixes)."""

    a: str
    b: str
    kind: str
    mcnemar: dict = field(default_factory=dict)  # suffix -> McNemar (conditional)
    accuracy: dict = field(default_factory=dict)  # suffix -> Difference (conditional, needs the bootstrap)
    tv: dict = field(default_factory=dict)  # suffix -> Difference (unconditional, needs the bootstrap)
    fid: dict = field(default_factory=dict)  # suffix -> Difference (needs the bootstrap)
    colour: McNemar | None = None  # colour correctness, paired (datasets with a palette)

    def as_dict(self) -> dict:
        d: dict = {"a": self.a, "b": self.b, "kind": self.kind}
        if self.colour is not None:
            d["mcnemar_colour"] = self.colour.as_dict()
        for sfx in JUDGE_LABELS:
            if sfx in self.mcnemar:
                d[f"mcnemar{sfx}"] = self.mcnemar[sfx].as_dict()
            for name, table in (
                ("accuracy_difference", self.accuracy),
                ("tv_uniform_difference", self.tv),
                ("fid_difference", self.fid),
            ):
                if sfx in table:
                    d[f"{name}{sfx}"] = table[sfx].as_dict()
        return d


def compare(a: Rescored, b: Rescored) -> Comparison:
    """Paired tests of row A against row B; SavedImagesError when they are not paired (kind, size, digits)."""
    if a.kind != b.kind:
        raise SavedImagesError(f"cannot pair {a.name} ({a.kind}) with {b.name} ({b.kind})")
    if a.score.n != b.score.n:
        raise SavedImagesError(
            f"cannot pair {a.name} ({a.score.n} images) with {b.name} "
            f"({b.score.n}): paired files share digits and seeds row for row"
        )
    if a.kind == CONDITIONAL and not np.array_equal(a.labels, b.labels):
        raise SavedImagesError(f"cannot pair {a.name} with {b.name}: their requested digits differ row for row")
    out = Comparison(a.name, b.name, a.kind)
    if a.score.colour is not None and b.score.colour is not None:
        out.colour = mcnemar(a.score.colour.correct, b.score.colour.correct)
    b_panel = {sfx: s for _, sfx, s in b.score.panel()}
    for _, sfx, sa in a.score.panel():
        sb = b_panel[sfx]
        if a.kind == CONDITIONAL:
            out.mcnemar[sfx] = mcnemar(sa.predictions == a.labels, sb.predictions == b.labels)
            if f"accuracy{sfx}" in a.samples and f"accuracy{sfx}" in b.samples:
                out.accuracy[sfx] = paired_difference(
                    sa.accuracy, a.samples[f"accuracy{sfx}"], sb.accuracy, b.samples[f"accuracy{sfx}"]
                )
        elif f"tv{sfx}" in a.samples and f"tv{sfx}" in b.samples:
            out.tv[sfx] = paired_difference(
                a.classes[sfx].tv_uniform, a.samples[f"tv{sfx}"], b.classes[sfx].tv_uniform, b.samples[f"tv{sfx}"]
            )
        if f"fid{sfx}" in a.samples and f"fid{sfx}" in b.samples:
            out.fid[sfx] = paired_difference(sa.fid, a.samples[f"fid{sfx}"], sb.fid, b.samples[f"fid{sfx}"])
    return out


def default_pairs(names: Sequence[str]) -> list[tuple[str, str]]:
    """Within each kind: every `ddm-*` row and `distilled` against `monolith`, and every `ddm-*` row against
    `distilled` (each only when present); unconditional names carry the `uncond-` prefix."""
    present = set(names)
    pairs = []
    for prefix in ("", UNCONDITIONAL_PREFIX):
        ddm = [n for n in names if n.startswith(prefix + "ddm-")]
        for base in BASELINE_NAMES:
            if prefix + base not in present:
                continue
            others = ddm + ([prefix + "distilled"] if base == "monolith" and prefix + "distilled" in present else [])
            pairs += [(n, prefix + base) for n in others]
    return pairs


def comparisons(
    rows: Sequence[Rescored], pairs: Sequence[tuple[str, str]] | None = None
) -> tuple[list[Comparison], list[str]]:
    """Run `compare` on the given (A, B) name pairs, or on `default_pairs`. Explicit pairs that name a
    missing row or are not paired raise SavedImagesError; default pairs that are not paired are skipped
    with a note (second return value)."""
    by_name = {r.name: r for r in rows}
    notes: list[str] = []
    if pairs is not None:
        for a, b in pairs:
            for n in (a, b):
                if n not in by_name:
                    raise SavedImagesError(f"--compare names {n!r}; the saved configurations are {sorted(by_name)}")
        return [compare(by_name[a], by_name[b]) for a, b in pairs], notes
    out = []
    for a, b in default_pairs([r.name for r in rows]):
        try:
            out.append(compare(by_name[a], by_name[b]))
        except SavedImagesError as e:
            notes.append(f"not compared: {e}")
    return out, notes


# ------------------------------------------------------------------ tables


def _interval(value: float | None, iv: tuple[float, float] | None, digits: int) -> str:
    if value is None or not np.isfinite(value):
        return "-"
    text = f"{value:.{digits}f}"
    return text if iv is None else f"{text} [{iv[0]:.{digits}f}, {iv[1]:.{digits}f}]"


def _difference(d: Difference | None, digits: int) -> str:
    return "-" if d is None else f"{d.estimate:+.{digits}f} [{d.low:+.{digits}f}, {d.high:+.{digits}f}]"


def _p(p: float | None) -> str:
    if p is None or not np.isfinite(p):
        return "-"
    return f"{p:.2g}" if p >= 1e-3 else f"{p:.1e}"


def _p_boot(d: Difference | None) -> str:
    """A bootstrap p; at its floor 1 / (B + 1) it reads '< floor' (no resample came near 'no difference')."""
    if d is None:
        return "-"
    return f"< {d.p:.2g}" if d.at_floor else _p(d.p)


def format_rescore_table(
    rows: Sequence[Rescored],
    judges: Judges,
    directory: str | Path,
    baseline: Rescored | None = None,
    *,
    unconditional_baseline: Rescored | None = None,
    comparisons: Sequence[Comparison] = (),
    notes: Sequence[str] = (),
    resamples: int = DEFAULT_RESAMPLES,
    seed: int = DEFAULT_SEED,
) -> str:
    """Markdown: a conditional table (accuracy and FID per judge, agreement, colour; `baseline` last), an
    unconditional table (TV distance of the predicted classes to uniform, FID; `unconditional_baseline`
    last) with each judge's class histogram, and the paired comparisons. Cells: value [95% interval]."""
    cond = [r for r in rows if r.kind == CONDITIONAL]
    uncond = [r for r in rows if r.kind == UNCONDITIONAL]
    panel = judges.panel()
    pair = judges.judge1 is not None  # judges 1 and 2: their agreement is a column
    colour = judges.palette is not None
    lines = [
        f"re-scored {len(rows)} saved configurations from {directory} ({len(cond)} conditional, "
        f"{len(uncond)} unconditional)",
        judges.describe(),
        (
            "[95% intervals]: Wilson for accuracy; for FID and TV a bootstrap over the generated images "
            f"(B = {resamples} resamples, seed {seed}, the reference set fixed), recentred on the estimate"
            if resamples
            else "[95% intervals]: Wilson for accuracy (bootstrap off: no FID/TV intervals)"
        ),
    ]

    def eps(r: Rescored) -> str:
        return "-" if r.experts_per_step is None else f"{r.experts_per_step:.2f}"

    def tail(r: Rescored) -> str:
        cells = [f"{r.score.agreement:.4f}"] if pair else []
        if colour:
            c = r.score.colour
            cells.append(_interval(float(c.correct.mean()), r.colour_interval, 4) if c is not None else "-")
        return " | ".join([*cells, eps(r)])

    tail_head = "".join([" | judges agree" if pair else "", " | colour correct" if colour else "", " | experts/step |"])
    tail_rule = "---:|" * (1 + pair + colour)

    def scores(r: Rescored) -> dict:
        return {sfx: s for _, sfx, s in r.score.panel()}

    if cond:
        lines += [
            "",
            "Conditional (the requested class):",
            "",
            "| configuration | images | "
            + " | ".join(f"cond. acc. {label}" for label, _ in panel)
            + " | "
            + " | ".join(f"FID {label}" for label, _ in panel)
            + tail_head,
            "|---|---:|" + "---:|" * (2 * len(panel)) + tail_rule,
        ]
        for r in [*cond, *([baseline] if baseline is not None else [])]:
            sc = scores(r)
            acc = [_interval(sc[sfx].accuracy, r.accuracy_interval.get(sfx), 4) for _, sfx in panel]
            fid = [_interval(sc[sfx].fid, r.fid_interval.get(sfx), 3) for _, sfx in panel]
            lines.append(f"| {r.name} | {r.score.n} | " + " | ".join([*acc, *fid]) + f" | {tail(r)} |")
    if uncond:
        shown = [*uncond, *([unconditional_baseline] if unconditional_baseline is not None else [])]
        lines += [
            "",
            "Unconditional (no class requested; TV = total variation distance of the judge's predicted "
            "class distribution to uniform, 0 = uniform, 0.9 = a single class of 10):",
            "",
            "| configuration | images | "
            + " | ".join(f"TV to uniform {label}" for label, _ in panel)
            + " | "
            + " | ".join(f"FID {label}" for label, _ in panel)
            + tail_head,
            "|---|---:|" + "---:|" * (2 * len(panel)) + tail_rule,
        ]
        for r in shown:
            sc = scores(r)
            tv = [_interval(r.classes[sfx].tv_uniform, r.tv_interval.get(sfx), 4) for _, sfx in panel]
            fid = [_interval(sc[sfx].fid, r.fid_interval.get(sfx), 3) for _, sfx in panel]
            lines.append(f"| {r.name} | {r.score.n} | " + " | ".join([*tv, *fid]) + f" | {tail(r)} |")
        n_classes = len(shown[0].classes[panel[0][1]].fractions)
        lines += [
            "",
            "Predicted class distribution of the unconditional rows (% of images per class):",
            "",
            "| configuration | judge | " + " | ".join(str(c) for c in range(n_classes)) + " | entropy bits | chi² p |",
            "|---|---|" + "---:|" * (n_classes + 2),
        ]
        for r in shown:
            for label, sfx in panel:
                cd: ClassDistribution = r.classes[sfx]
                cells = " | ".join(f"{100 * f:.1f}" for f in cd.fractions)
                lines.append(f"| {r.name} | {label} | {cells} | {cd.entropy_bits:.3f} | {_p(cd.chi2_p)} |")
    cmp_c = [c for c in comparisons if c.kind == CONDITIONAL]
    cmp_u = [c for c in comparisons if c.kind == UNCONDITIONAL]
    if cmp_c:
        lines += [
            "",
            "Paired comparisons, conditional (same classes and seeds row for row; differences are A - B; "
            "McNemar: exact binomial p on the images only one of the two gets right):",
            "",
            "| A vs B | judge | acc. A | acc. B | only A right | only B right | McNemar p | Δ acc. [95%] "
            "| Δ FID [95%] | Δ FID p |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for c in cmp_c:
            for label, sfx in panel:
                m: McNemar = c.mcnemar[sfx]
                f = c.fid.get(sfx)
                lines.append(
                    f"| {c.a} vs {c.b} | {label} | {m.accuracy_a:.4f} | {m.accuracy_b:.4f} | {m.only_a} | "
                    f"{m.only_b} | {_p(m.p)} | {_difference(c.accuracy.get(sfx), 4)} | "
                    f"{_difference(f, 3)} | {_p_boot(f)} |"
                )
    if cmp_u:
        lines += [
            "",
            "Paired comparisons, unconditional (same seeds row for row; differences are A - B, paired bootstrap):",
            "",
            "| A vs B | judge | TV A | TV B | Δ TV [95%] | Δ TV p | Δ FID [95%] | Δ FID p |",
            "|---|---|---:|---:|---:|---:|---:|---:|",
        ]
        by_name = {r.name: r for r in rows}
        for c in cmp_u:
            for label, sfx in panel:
                t, f = c.tv.get(sfx), c.fid.get(sfx)
                lines.append(
                    f"| {c.a} vs {c.b} | {label} | {by_name[c.a].classes[sfx].tv_uniform:.4f} | "
                    f"{by_name[c.b].classes[sfx].tv_uniform:.4f} | {_difference(t, 4)} | "
                    f"{_p_boot(t)} | {_difference(f, 3)} | {_p_boot(f)} |"
                )
    with_colour = [c for c in comparisons if c.colour is not None]
    if with_colour:
        lines += [
            "",
            "Paired comparisons, colour correctness (McNemar on the images only one of the two gets right):",
            "",
            "| A vs B | colour A | colour B | only A right | only B right | McNemar p |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for c in with_colour:
            m = c.colour
            lines.append(
                f"| {c.a} vs {c.b} | {m.accuracy_a:.4f} | {m.accuracy_b:.4f} | {m.only_a} | {m.only_b} | {_p(m.p)} |"
            )
    if notes:
        lines += ["", *notes]
    return "\n".join(lines)
