"""The progress of an expert training run, the same for the torch and the jax backend: the bar, the
checks and the loss history.

Each step's loss is checked finite and folded into a smoothed value the bar shows (with images/s
and the learning rate, every 10 steps); every `log_every` steps and at the last one the window's mean
loss and images/s join `history` (the checkpoint's `loss_history`), and a log line is written when
there is no bar, or every fifth entry. The backends read losses back differently (torch in batches,
to keep the device busy; jax one step behind), so they hand the losses in (`add`) and say when a
step's losses are all in (`report`); both then write the same history and show the same bar.
"""

from __future__ import annotations

import logging
import math
import time

from training.run_config import lr_at

log = logging.getLogger(__name__)


class TrainProgress:
    """The bar and loss bookkeeping of one run from `step` (0, or where a resumed run left off)."""

    def __init__(self, cfg, history: list, *, step: int, desc: str, progress: bool, main: bool, hint: str):
        """`cfg`: the run's `TrainConfig`; `history`: its loss_history (appended to); `main`: this
        process reports (rank 0 of a data-parallel run); `hint`: what to try when the loss diverges."""
        from tqdm import tqdm

        self.cfg, self.history, self.progress, self.main, self.hint = cfg, history, progress, main, hint
        self.bar = tqdm(
            total=cfg.steps,
            initial=step,
            disable=not (progress and main),
            desc=desc,
            unit="step",
            dynamic_ncols=True,
            mininterval=2.0,
        )
        self.smooth: float | None = None
        self.window_loss, self.window_n, self.window_t = 0.0, 0, time.time()

    def advance(self) -> None:
        """One more step done (the bar moves before its loss is read back)."""
        self.bar.update(1)

    def add(self, loss: float, step: int) -> None:
        """One step's loss, read back by `step`; FloatingPointError when it is not finite."""
        if not math.isfinite(loss):
            raise FloatingPointError(f"loss became {loss} by step {step}; {self.hint}")
        self.smooth = loss if self.smooth is None else 0.98 * self.smooth + 0.02 * loss
        self.window_loss, self.window_n = self.window_loss + loss, self.window_n + 1

    def images_per_s(self) -> float:
        return self.window_n * self.cfg.batch_size / max(1e-6, time.time() - self.window_t)

    def report(self, step: int) -> None:
        """The losses up to `step` are in: the bar's figures, and a history entry when one is due."""
        cfg = self.cfg
        if step % 10 == 0 and self.smooth is not None:
            self.bar.set_postfix(
                loss=f"{self.smooth:.4f}", img_s=f"{self.images_per_s():.0f}", lr=f"{lr_at(step, cfg):.1e}"
            )
        if step % cfg.log_every == 0 or step == cfg.steps:
            ips, mean = self.images_per_s(), self.window_loss / self.window_n
            self.history.append({"step": step, "loss": round(mean, 5), "img_s": round(ips, 1)})
            if self.main and (not self.progress or step % (5 * cfg.log_every) == 0):
                log.info("expert%d step %d loss %.4f %.0f img/s", cfg.expert, step, mean, ips)
            self.window_loss, self.window_n, self.window_t = 0.0, 0, time.time()

    def close(self) -> None:
        self.bar.close()
