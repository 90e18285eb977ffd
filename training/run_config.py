"""The settings every torch-style training run shares: the expert trainers (`train_torch.TrainConfig`,
also the jax backend's) and distillation (`distill.DistillConfig`).

Both runs are the same kind of loop (AdamW with warmup + cosine learning rate,
grad-norm clip, EMA of the weights, a checkpoint and resume file every `save_every` steps, a
loss_history entry every `log_every`), so their schedule, save and data settings are declared and
checked once here, with the schedules over them (`lr_at`, `ema_decay_at`): a default, a check or a
schedule changed for one run changes for both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar


@dataclass(kw_only=True)
class RunConfig:
    """The shared fields (stored, with the run's own, in the checkpoint JSON under `training.config`)."""

    #: the exception a bad value raises (a run may narrow it, e.g. `DistillError`)
    error: ClassVar[type[ValueError]] = ValueError

    steps: int = 2000
    batch_size: int = 128
    lr: float = 1e-3
    warmup: int = 100
    min_lr_ratio: float = 0.05
    weight_decay: float = 0.01
    ema_decay: float = 0.999
    grad_clip: float = 1.0
    label_dropout: float = 0.0  # > 0: labels -> -1 with this probability, the model gets a null label
    seed: int = 0
    save_every: int = 250
    log_every: int = 50  # steps per loss_history entry
    save_dtype: str = "float16"
    device: str = "cpu"
    threads: int = 0
    data_dir: str | None = None  # the data directory (`--data-dir`)
    limit: int | None = None  # use only the first N images (tests, smoke runs)

    def __post_init__(self) -> None:
        """`error` naming the flag of the first bad shared setting."""
        for name in ("steps", "batch_size", "save_every", "log_every"):
            if getattr(self, name) <= 0:
                raise self.error(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        if not 0.0 <= self.ema_decay < 1.0:
            raise self.error(f"--ema-decay must be in [0, 1), got {self.ema_decay}")
        if self.lr <= 0:
            raise self.error(f"--lr must be positive, got {self.lr}")
        if not 0.0 <= self.label_dropout < 1.0:
            raise self.error(f"--label-dropout must be in [0, 1), got {self.label_dropout}")
        if self.save_dtype not in ("float16", "float32"):
            raise self.error(f"--save-dtype must be float16 or float32, got {self.save_dtype!r}")


def lr_at(step: int, cfg: RunConfig) -> float:
    """Linear warmup over cfg.warmup steps, then cosine decay to min_lr_ratio * lr at cfg.steps."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    frac = min(1.0, (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


def ema_decay_at(step: int, decay: float) -> float:
    """EMA decay with a warm start, so short runs are not dominated by the random init."""
    return min(decay, (1 + step) / (10 + step))
