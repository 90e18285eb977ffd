"""Re-score saved images (`ddm-fleet eval --save-images DIR` output) with both judges.

Every `<configuration>.npz` in DIR holds `images` float32 [N,1,32,32] in [-1,1], `labels` int [N]
(the requested digits) and optionally `usage` [N,K]. Nothing is generated: the same images are read
back and scored by judge 1 and judge 2 side by side, with how often the two judges agree.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from .judges import DualScore, Judges

# the order `ddm-fleet eval` writes them in; anything else follows alphabetically
CANONICAL_ORDER = ("monolith", "ddm-top1", "ddm-top2", "ddm-full", "ddm-oracle")


class SavedImagesError(ValueError):
    """A saved configuration is missing, unreadable or not in the generator's image convention."""


@dataclass
class Saved:
    name: str
    images: np.ndarray  # float32 [N,1,32,32] in [-1,1]
    labels: np.ndarray  # int64 [N]
    usage: np.ndarray | None  # [N,K] expert weights per image, if saved


@dataclass
class Rescored:
    name: str
    score: DualScore
    experts_per_step: float | None  # from the saved usage (None when the file has none)

    def as_dict(self) -> dict:
        return {"config": self.name, **self.score.as_dict(), "experts_per_step": self.experts_per_step}


def load_saved(path: str | Path) -> Saved:
    """Read and check one `<configuration>.npz`."""
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
    if images.ndim != 4 or images.shape[1:] != (1, 32, 32):
        raise SavedImagesError(f"{path}: images must be [N, 1, 32, 32] (28x28 digits padded by 2, as load_mnist "
                               f"does), got {list(images.shape)}")
    if not np.issubdtype(images.dtype, np.floating):
        raise SavedImagesError(f"{path}: images must be floats in [-1, 1], got dtype {images.dtype}")
    if len(images) < 2 or len(labels) != len(images):
        raise SavedImagesError(f"{path}: {len(images)} images and {len(labels)} labels (need equal, >= 2)")
    labels = np.asarray(labels)
    if not np.issubdtype(labels.dtype, np.integer) or labels.min() < 0 or labels.max() > 9:
        raise SavedImagesError(f"{path}: labels must be integer digits 0-9")
    lo, hi = float(images.min()), float(images.max())
    # The judges were trained on [-1, 1] with background -1; a [0, 1] or [0, 255] file would be read
    # as grey or saturated digits and scored wrongly without any error, so refuse it.
    if lo > -0.5 or hi > 1.5 or not np.isfinite(images).all():
        raise SavedImagesError(f"{path}: image values span [{lo:.3g}, {hi:.3g}]; expected the generator's [-1, 1] "
                               "with background -1 (convert [0, 1] images with x * 2 - 1)")
    return Saved(path.stem, images.astype(np.float32), labels.astype(np.int64), usage)


def saved_configurations(directory: str | Path) -> list[Path]:
    d = Path(directory)
    if not d.is_dir():
        raise SavedImagesError(f"{d} is not a directory (write one with `ddm-fleet eval --save-images {d}`)")
    files = sorted(d.glob("*.npz"))
    if not files:
        raise SavedImagesError(f"{d} holds no <configuration>.npz files")
    rank = {name: i for i, name in enumerate(CANONICAL_ORDER)}
    return sorted(files, key=lambda p: (rank.get(p.stem, len(rank)), p.stem))


def rescore_dir(directory: str | Path, judges: Judges) -> list[Rescored]:
    rows = []
    for path in saved_configurations(directory):
        saved = load_saved(path)
        eps = float(saved.usage.sum(axis=1).mean()) if saved.usage is not None and saved.usage.ndim == 2 else None
        rows.append(Rescored(saved.name, judges.score(saved.images, saved.labels), eps))
    return rows


def real_baseline(directory: str | Path, judges: Judges, data_dir=None) -> Rescored:
    """Real validation digits with the first saved file's labels, scored the same way."""
    labels = load_saved(saved_configurations(directory)[0]).labels
    return Rescored(REAL_ROW, judges.score_real(labels, data_dir), None)


REAL_ROW = "real-val"  # reference row: real validation digits, same requested digits


def format_rescore_table(rows: Sequence[Rescored], judges: Judges, directory: str | Path,
                         baseline: Rescored | None = None) -> str:
    """Markdown table: both judges' accuracy and FID side by side, and their agreement; `baseline`
    (real digits scored the same way) as a last row."""
    lines = [
        f"re-scored {len(rows)} saved configurations from {directory}",
        judges.describe(),
        "",
        "| configuration | images | cond. acc. judge 1 | cond. acc. judge 2 | FID judge 1 | FID judge 2 "
        "| judges agree | experts/step |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in [*rows, *([baseline] if baseline is not None else [])]:
        s1, s2 = r.score.judge1, r.score.judge2
        eps = "-" if r.experts_per_step is None else f"{r.experts_per_step:.2f}"
        lines.append(f"| {r.name} | {s1.n} | {s1.accuracy:.4f} | {s2.accuracy:.4f} | {s1.fid:.3f} | {s2.fid:.3f} | "
                     f"{r.score.agreement:.4f} | {eps} |")
    return "\n".join(lines)
