"""The backend protocol every expert runtime implements, and the parts they share.

A backend owns one expert model on one device:

    be = get_backend("torch", device="cpu", dtype="auto")  # or "float32" / "bfloat16" (models.precision)
    be.load("checkpoints/expert0.safetensors")     # same file for torch, xla and jax
    be.warmup([1, 2, 4, 8])                         # compile / autotune every bucket shape
    v = be.forward(x, t, y)                         # x float32 [B, C, H, W], t float32 [B], y int64 [B]
                                                    # -> v float32 [B, C, H, W] (numpy, C-contiguous)

`forward` is blocking and is called from ONE worker thread at a time (the batcher's executor);
`load` and `warmup` are called once, before serving.

Batch invariance (`make_batch_invariant`, the worker's `--batch-invariant`): a CPU's kernels pick their
blocking by the batch, so a row's velocity can move in its last bits with the number of rows beside it
(oneDNN's convolutions and GEMMs: measured on the shipped UNets, float32 and bfloat16). Computed at a
multiple of 16 rows that the forward's threads split evenly (a multiple of lcm(16, threads): 16 for 1, 2 or
4 threads, 48 for 3) they did not, nor with the rows' order or content beside them, and not with the thread
count either (48 and 96 rows came out the same on 1 to 4 threads). So in that mode every forward is padded
up to a multiple of `batch_quantum` rows, the torch backend keeps the thread count it was checked with,
and a row's result no longer depends on what else is in its batch, at the price of the padding (one row
costs what 16 do). The switch checks that this host's kernels keep that promise before it returns.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Iterable
from typing import Any, Protocol, runtime_checkable

import numpy as np

log = logging.getLogger(__name__)


@runtime_checkable
class Backend(Protocol):
    """What the worker service needs from a model runtime (see module docstring)."""

    name: str  # "torch" | "xla" | "jax"
    device: str  # human-readable device, e.g. "cpu", "cuda:0", "xla:CPU", "jax:cpu:0"

    def load(self, checkpoint_path: str | os.PathLike) -> None: ...

    def forward(self, x: np.ndarray, t: np.ndarray, y: np.ndarray) -> np.ndarray: ...

    def warmup(self, buckets: Iterable[int]) -> None: ...


class BackendError(RuntimeError):
    """A backend cannot be created or loaded (missing library, bad device, bad checkpoint)."""


#: Rows per forward in batch-invariant mode (`BackendBase.make_batch_invariant`): the multiple at which
#: the shipped models' rows came out the same on this project's CPUs (one AVX-512 vector of float32).
DEFAULT_BATCH_QUANTUM = 16
MAX_BATCH_QUANTUM = 256


def pad_rows_to(x: np.ndarray, t: np.ndarray, y: np.ndarray, n: int):
    """(x, t, y) with rows appended up to n, copies of the first row (valid input, whatever the model)."""
    extra = n - len(x)
    return (
        np.concatenate([x, np.repeat(x[:1], extra, axis=0)]),
        np.concatenate([np.asarray(t), np.repeat(np.asarray(t)[:1], extra)]),
        np.concatenate([np.asarray(y), np.repeat(np.asarray(y)[:1], extra)]),
    )


class BackendBase:
    """Shared plumbing: checkpoint reading, config, input shape, warm-up loop.

    Subclasses set `name`, implement `_build(cfg, state)` (state: torch state_dict names ->
    float32 numpy arrays) and `_forward(x, t, y)`.
    """

    name = "base"
    #: Does a forward need one of the bucket shapes (compiled or captured per shape: XLA, jax.jit,
    #: the sim's GPU-like model)? False lets the worker's batcher run exactly the rows it has.
    pads_to_buckets = True

    def __init__(self, device: str | None = None, dtype: str = "auto", bf16: bool | None = None):
        """dtype: "auto" | "float32" | "bfloat16" (`models.precision`; auto resolved here for this device).
        bf16: the older spelling (True = "bfloat16", False = "float32"); it wins when given."""
        from models.precision import resolve_dtype

        self.requested_device = device
        self.device = device or "cpu"
        if bf16 is not None:
            dtype = "bfloat16" if bf16 else "float32"
        self.dtype = resolve_dtype(dtype, backend=self.name, device=device)
        self.meta: dict[str, Any] = {}
        self.config = None  # models.config.UNetConfig or DiTConfig once loaded (`models.arch`)
        self.checkpoint_path: str | None = None
        self.warmup_s: dict[int, float] = {}
        #: > 1: every forward computes a multiple of this many rows (`make_batch_invariant`); 0: off
        self.batch_quantum = 0

    # ---------------------------------------------------------------- info

    @property
    def loaded(self) -> bool:
        return self.config is not None

    @property
    def input_shape(self) -> tuple[int, int, int]:
        """(C, H, W) the model takes."""
        self._need_loaded()
        c = self.config
        return (c.in_channels, c.image_size, c.image_size)

    @property
    def num_classes(self) -> int:
        self._need_loaded()
        return self.config.num_classes

    @property
    def null_label(self) -> bool:
        """The model has a null label (`train-expert --label-dropout > 0`): y = -1 ("label unknown",
        an unconditional row) selects it. Without one the worker refuses y = -1 (`bad_request`)."""
        self._need_loaded()
        return bool(getattr(self.config, "null_label", False))

    @property
    def spec(self):
        """The loaded model's spec (`schemas.spec.ModelSpec`): the one stored in its checkpoint, or the
        one its config implies for checkpoints made before specs (`models.spec.spec_of`)."""
        from models.spec import spec_of

        self._need_loaded()
        if "spec" in self.meta:
            return spec_of(self.meta, where=self.checkpoint_path or "checkpoint")
        return spec_of({"config": self.config.to_dict(), "arch": self.meta.get("arch", "unet")})

    @property
    def expert(self) -> int | None:
        """Expert id recorded in the checkpoint, if any."""
        value = self.meta.get("expert", self.meta.get("expert_id"))
        if isinstance(value, dict):
            value = value.get("id")
        return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None

    @property
    def bf16(self) -> bool:
        """Does the forward compute in bfloat16?"""
        return self.dtype == "bfloat16"

    @property
    def precision(self) -> str:
        """The dtype the forward computes in: "float32" or "bfloat16" (same as `dtype`)."""
        return self.dtype

    def describe(self) -> dict[str, str]:
        """String metadata for service discovery (`dtype`; `precision` is its older name, kept for readers;
        `batch_quantum` when batch-invariant)."""
        d = {"backend": self.name, "device": self.device, "dtype": self.dtype, "precision": self.dtype}
        if self.batch_quantum:
            d["batch_quantum"] = str(self.batch_quantum)
        return d

    def _need_loaded(self) -> None:
        if self.config is None:
            raise BackendError(f"{self.name} backend: call load(checkpoint) first")

    # ---------------------------------------------------------------- load / run

    def load(self, checkpoint_path: str | os.PathLike) -> None:
        from models.arch import config_from_meta
        from models.checkpoint import load_checkpoint

        path = os.fspath(checkpoint_path)
        if not os.path.exists(path):
            raise BackendError(f"checkpoint {path!r} does not exist (give the .safetensors file)")
        try:
            meta, state = load_checkpoint(path)
        except Exception as err:
            raise BackendError(f"cannot read checkpoint {path!r}: {err}") from err
        if not isinstance(meta.get("config"), dict):
            raise BackendError(f"checkpoint {path!r} has no model config in its JSON (keys: {sorted(meta)})")
        try:
            cfg = config_from_meta(meta)  # "arch": "unet" (default) or "dit"
        except (TypeError, ValueError) as err:
            raise BackendError(f"checkpoint {path!r}: bad model config: {err}") from err
        self.meta = meta
        self.checkpoint_path = path
        try:
            self._build(cfg, state)
        except BackendError:
            raise
        except Exception as err:
            raise BackendError(f"{self.name} backend: cannot build the model from {path!r}: {err}") from err
        self.config = cfg

    def forward(self, x: np.ndarray, t: np.ndarray, y: np.ndarray) -> np.ndarray:
        """x float32 [B, C, H, W], t float32 [B], y int64 [B] -> float32 [B, C, H, W]."""
        self._need_loaded()
        rows, q = len(x), self.batch_quantum
        if q > 1 and rows % q:
            x, t, y = pad_rows_to(x, t, y, rows + q - rows % q)
        out = self._forward(x, t, y)
        return np.ascontiguousarray(out[:rows] if len(out) != rows else out, dtype=np.float32)

    def make_batch_invariant(self, quantum: int = DEFAULT_BATCH_QUANTUM) -> None:
        """From now on compute every forward at a multiple of `quantum` rows, rounded up to a multiple of the
        forward's threads too (see the module docstring), after checking on probe rows that this host's
        kernels give each row the same bits at several multiples, in another order and beside other rows;
        BackendError (saying which sizes differed) if not, and the backend is left as it was. quantum 0 or 1
        turns the mode off."""
        self._need_loaded()
        quantum = int(quantum)
        if quantum < 0 or quantum > MAX_BATCH_QUANTUM:
            raise BackendError(f"batch quantum must be 0 (off) to {MAX_BATCH_QUANTUM} rows, got {quantum}")
        if quantum > 1:
            quantum = math.lcm(quantum, self._pin_threads())
        before, self.batch_quantum = self.batch_quantum, quantum if quantum > 1 else 0
        if not self.batch_quantum:
            return
        try:
            differ = self._batch_variance(quantum)
        except BaseException:
            self.batch_quantum = before
            raise
        if differ:
            self.batch_quantum = before
            raise BackendError(
                f"{self.name} backend on {self.device} ({self.dtype}): a row's velocity changes with its batch "
                f"even at multiples of {quantum} rows ({'; '.join(differ)}), so it cannot serve batch-invariant "
                f"here; try a larger quantum (a multiple of {quantum})"
            )
        log.info("%s backend batch-invariant: every forward padded to a multiple of %d rows", self.name, quantum)

    def _pin_threads(self) -> int:
        """The threads a forward runs on from now on (a backend whose kernels split rows over threads keeps
        the count it has now, whatever thread later calls it); 1 for one that does not say."""
        return 1

    def _batch_variance(self, q: int) -> list[str]:
        """What differs among probe rows computed at q, 2q and 4q rows, in reverse order and beside other
        rows (each a short description), with padding on (`batch_quantum` set); [] if nothing."""
        c, h, w = self.input_shape
        rng = np.random.default_rng(20261129)
        n = 4 * q
        x = rng.standard_normal((n, c, h, w)).astype(np.float32)
        t = rng.random(n).astype(np.float32)
        low = -1 if self.null_label else 0
        y = rng.integers(low, self.num_classes, n).astype(np.int64)
        full = self.forward(x, t, y)
        differ = []
        for rows in (1, q - 1, q, 2 * q + 1):
            if rows >= 1 and not np.array_equal(self.forward(x[:rows], t[:rows], y[:rows]), full[:rows]):
                differ.append(f"{rows} rows alone vs the same rows among {n}")
        back = self.forward(x[::-1].copy(), t[::-1].copy(), y[::-1].copy())[::-1]
        if not np.array_equal(back, full):
            differ.append(f"{n} rows in reverse order")
        other = x.copy()
        other[q:] = rng.standard_normal(other[q:].shape).astype(np.float32)
        if not np.array_equal(self.forward(other, t, y)[:q], full[:q]):
            differ.append(f"{q} rows beside {n - q} other rows")
        return differ

    def warmup(self, buckets: Iterable[int]) -> None:
        """Run every bucket shape twice: the first pass pays the one-off costs (compiling, autotuning,
        allocating), the second is timed into `warmup_s` {bucket: seconds}, the forward's steady cost
        that the batcher's merge decisions start from (`workers.batcher.Batcher(forward_s=...)`)."""
        from tqdm import tqdm

        self._need_loaded()
        c, h, w = self.input_shape
        buckets = sorted(set(int(b) for b in buckets))
        for b in tqdm(buckets, desc=f"warm-up {self.name}", unit="bucket", disable=None, leave=False):
            x = np.zeros((b, c, h, w), np.float32)
            t = np.full((b,), 0.5, np.float32)
            y = np.zeros((b,), np.int64)
            self.forward(x, t, y)
            start = time.perf_counter()
            self.forward(x, t, y)
            self.warmup_s[b] = self._steady_s(b, time.perf_counter() - start)
        log.info(
            "%s backend warm: %s", self.name, ", ".join(f"{b}: {s * 1000:.0f} ms" for b, s in self.warmup_s.items())
        )

    # ---------------------------------------------------------------- subclass hooks

    def _steady_s(self, rows: int, measured_s: float) -> float:
        """The steady cost of a forward of `rows` rows that `warmup` records, from the timed pass: that time."""
        return measured_s

    def _build(self, cfg, state: dict[str, np.ndarray]) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def _forward(self, x: np.ndarray, t: np.ndarray, y: np.ndarray) -> np.ndarray:  # pragma: no cover
        raise NotImplementedError
