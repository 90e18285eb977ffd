"""Simulated expert: a latency model plus a closed-form velocity, no neural network (numpy only).

It lets a fleet of dozens of "GPU" workers run on one CPU box while everything around the model stays
real: the worker still decodes, validates and encodes every message, batches and pads to buckets,
and the checkpoint (`--checkpoint`, e.g. a tiny one from `models.tiny`) still sets the image shape,
the number of classes and the expert id, so shape / label / expert checks refuse bad input as usual.
The weights in the checkpoint are read (as every backend does) and then ignored.

    be = get_backend("sim", preset="h200-torch")          # or batch_ms=..., row_ms=...
    be.load("checkpoints/expert0.safetensors")
    v = be.forward(x, t, y)    # x float32 [B, C, H, W], t float32 [B], y int64 [B] -> float32 [B, C, H, W]

Velocity (deterministic, row by row, so a row's output never depends on the rest of its batch):

    v(x, t, y) = (T[k, y] - x) / max(1 - t, 1e-3)

where T[k, c] (float32 [C, H, W], values in [-1, 1]) is a fixed template for expert k and class c: a bright
disc of radius 0.22*min(H, W) on a -1 background, centred on a circle of radius 0.25*min(H, W) around the
image centre at angle 2*pi*c/num_classes + 0.5*k, edges smoothed with tanh. This is the exact
flow-matching velocity toward the data point T under the convention x_t = (1 - t) * noise + t * data
(t=0 noise, t=1 data), so an Euler integration from t=0 to t=1 lands on T: a job served by sim workers
"converges" to one blob per digit, different per expert (exactly for Euler; Heun's last corrector sees
v(T, 1) = 0 and stops short of T on its final step). Labels outside [0, num_classes) (only padded
rows can carry them: the worker refuses such requests) are clipped for the lookup.

Label unknown (y = -1, an unconditional row): the sim always serves it (`null_label` is True whatever
the checkpoint says), with the exact flow-matching velocity of the uniform mixture of expert k's
templates: v = (E[T | x_t] - x) / max(1 - t, 1e-3), the posterior over the classes c having logits
-|x - t T[k, c]|^2 / (2 max(1 - t, 1e-3)^2); an Euler integration lands near one template.

Latency: each `forward` lasts `batch_ms + row_ms * B` milliseconds, B = rows as given (the batcher has
already padded to the bucket), spent in the calling thread (the batcher's executor, like a real
forward pass): the velocity is computed, then the thread sleeps for what is left.

Presets (`--sim-preset`), fitted to the H200 in-process rows/s in docs/DEPLOYMENT.md (buckets 1, 8, 64,
256): per-batch time = bucket / (rows/s), then a least-squares line ms = batch_ms + row_ms * bucket:

    h200-torch  batch_ms 3.33  row_ms 0.00575   (measured 3.40 / 3.45 / 3.53 / 4.85 ms; fit 3.34 / 3.38 / 3.70 / 4.81)
    h200-jax    batch_ms 2.20  row_ms 0.0165    (measured 2.19 / 2.39 / 3.22 / 6.44 ms; fit 2.22 / 2.33 / 3.26 / 6.43)
    instant     batch_ms 0     row_ms 0

`batch_ms` / `row_ms` (`--sim-batch-ms` / `--sim-row-ms`) override the preset's values. `dtype` (or
the older `bf16`) is accepted and only reported (`auto` is float32 here: nothing is computed); the
velocity is float32 either way.
"""

from __future__ import annotations

import math
import time

import numpy as np

from schemas import UNCONDITIONAL

from .base import BackendBase, BackendError

#: preset name -> (batch_ms, row_ms); see the module docstring for how they were fitted.
PRESETS: dict[str, tuple[float, float]] = {
    "h200-torch": (3.33, 0.00575),
    "h200-jax": (2.20, 0.0165),
    "instant": (0.0, 0.0),
}
DEFAULT_PRESET = "h200-torch"
MIN_ONE_MINUS_T = 1e-3


def sim_template(expert: int, label: int, num_classes: int, shape: tuple[int, int, int]) -> np.ndarray:
    """The fixed target image T[expert, label]: float32 [C, H, W] in [-1, 1] (see module docstring)."""
    c, h, w = shape
    size = min(h, w)
    angle = 2.0 * math.pi * label / max(num_classes, 1) + 0.5 * expert
    cy = (h - 1) / 2.0 + 0.25 * size * math.sin(angle)
    cx = (w - 1) / 2.0 + 0.25 * size * math.cos(angle)
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float64)
    dist = np.sqrt((yy - cy) ** 2 + (xx - cx) ** 2)
    disc = np.tanh((0.22 * size - dist) / 1.5)  # +1 inside, -1 outside, soft edge
    return np.broadcast_to(disc.astype(np.float32), (c, h, w)).copy()


class SimBackend(BackendBase):
    """A simulated expert (see module docstring). device is a label only, default "sim:<preset>"."""

    name = "sim"

    def __init__(
        self,
        device: str | None = None,
        dtype: str = "float32",
        bf16: bool | None = None,
        preset: str | None = None,
        batch_ms: float | None = None,
        row_ms: float | None = None,
    ):
        super().__init__(device=device, dtype=dtype, bf16=bf16)
        preset = preset or DEFAULT_PRESET
        if preset not in PRESETS:
            raise BackendError(f"sim backend: unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
        base_batch, base_row = PRESETS[preset]
        self.preset = preset
        self.batch_ms = float(base_batch if batch_ms is None else batch_ms)
        self.row_ms = float(base_row if row_ms is None else row_ms)
        for label, value in (("batch_ms", self.batch_ms), ("row_ms", self.row_ms)):
            if not math.isfinite(value) or value < 0:
                raise BackendError(f"sim backend: {label} must be a finite number >= 0, got {value}")
        self.device = device or f"sim:{preset}"
        self._templates: np.ndarray | None = None  # float32 [num_classes, C, H, W]
        self._sleeps = True  # off during warm-up only

    def latency_s(self, rows: int) -> float:
        """Seconds one forward pass of `rows` rows takes: (batch_ms + row_ms * rows) / 1000."""
        return (self.batch_ms + self.row_ms * rows) / 1000.0

    def warmup(self, buckets) -> None:
        """`BackendBase.warmup` without the simulated wait: a sim has no one-off costs to pay, and its steady
        cost is its latency model (`_steady_s`), so a worker with a slow sim (`--sim-batch-ms 1500`) is ready
        at once, not after 2 x buckets x 1.5 s."""
        self._sleeps = False
        try:
            super().warmup(buckets)
        finally:
            self._sleeps = True

    def _steady_s(self, rows: int, measured_s: float) -> float:
        """The latency model's time for `rows` rows (or the velocity's own compute time, if longer)."""
        return max(self.latency_s(rows), measured_s)

    def describe(self) -> dict[str, str]:
        out = super().describe()
        out["sim"] = f"{self.preset} batch_ms={self.batch_ms:g} row_ms={self.row_ms:g}"
        return out

    @property
    def null_label(self) -> bool:
        """Always True: y = -1 (label unknown) gets the templates' mixture velocity (module docstring)."""
        self._need_loaded()
        return True

    def _posterior_targets(self, x: np.ndarray, t: np.ndarray) -> np.ndarray:
        """x [r, C, H, W] float32, t [r] -> E[T | x_t] [r, C, H, W] over the uniform mixture of templates."""
        r = x.shape[0]
        temps = self._templates.reshape(len(self._templates), -1).astype(np.float64)  # [classes, D]
        flat = x.reshape(r, -1).astype(np.float64)
        tt = t.astype(np.float64)[:, None]
        s2 = np.maximum(1.0 - tt, MIN_ONE_MINUS_T) ** 2
        # elementwise, no BLAS: a row's result never depends on the batch it rode in
        dist2 = ((flat[:, None, :] - tt[:, :, None] * temps[None]) ** 2).sum(axis=2)  # [r, classes]
        logits = -dist2 / (2.0 * s2)
        p = np.exp(logits - logits.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        return (p[:, :, None] * temps[None]).sum(axis=1).astype(np.float32).reshape(x.shape)

    def _build(self, cfg, state: dict[str, np.ndarray]) -> None:
        shape = (cfg.in_channels, cfg.image_size, cfg.image_size)
        expert = self.expert if self.expert is not None else 0
        self._templates = np.stack([sim_template(expert, c, cfg.num_classes, shape) for c in range(cfg.num_classes)])

    def _forward(self, x: np.ndarray, t: np.ndarray, y: np.ndarray) -> np.ndarray:
        start = time.perf_counter()
        x = np.asarray(x, np.float32)
        if x.ndim != 4 or x.shape[1:] != self._templates.shape[1:]:
            raise BackendError(
                f"sim backend: x must be [B, {', '.join(map(str, self._templates.shape[1:]))}], got {list(x.shape)}"
            )
        rows = x.shape[0]
        t = np.asarray(t, np.float32).reshape(rows)
        y = np.asarray(y).reshape(rows).astype(np.int64)
        targets = self._templates[np.clip(y, 0, len(self._templates) - 1)]  # a copy: [rows, C, H, W]
        unknown = y == UNCONDITIONAL
        if unknown.any():
            targets[unknown] = self._posterior_targets(x[unknown], t[unknown])
        denom = np.maximum(np.float32(1.0) - t, np.float32(MIN_ONE_MINUS_T)).reshape(rows, 1, 1, 1)
        v = (targets - x) / denom
        left = self.latency_s(rows) - (time.perf_counter() - start)
        if left > 0 and self._sleeps:
            time.sleep(left)
        return v
