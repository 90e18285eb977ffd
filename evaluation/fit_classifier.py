"""The training loop of the judges' CNN, shared by judge 1 (MNIST, `classifier.py`) and the data judge
(a prepared dataset, `data_judge.py`).

Both judges are the same network trained the same way: AdamW (lr 2e-3, weight decay 1e-4) under a
one-cycle schedule peaking at 3e-3, cross-entropy with label smoothing 0.05, a fresh shuffle each
epoch, the last partial batch dropped. Only how a batch of indices becomes images differs (MNIST
floats shifted with zero fill; prepared uint8 images scaled, shifted with repeated edges and fitted
to the network's input), so the caller passes that as `batch`: one loop, so a change to how judges
are trained reaches both and the two stay comparable.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np


def fit_classifier(
    model,
    n: int,
    batch: Callable,
    *,
    epochs: int,
    batch_size: int,
    rng: np.random.Generator,
    desc: str,
    progress: bool,
) -> None:
    """Train `model` in place on `n` examples for `epochs` epochs (at least one step each).
    `batch(indices)` -> (images tensor, labels int64 tensor) of those examples; it may draw from
    `rng`, which also shuffles (the same draws, in the same order, as each judge made on its own)."""
    import torch
    from tqdm import tqdm

    steps_per_epoch = max(1, n // batch_size)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=epochs * steps_per_epoch)
    bar = tqdm(total=epochs * steps_per_epoch, desc=desc, disable=not progress, unit="step")
    model.train()
    for _ in range(epochs):
        order = rng.permutation(n)
        for s in range(steps_per_epoch):
            xb, yb = batch(order[s * batch_size : (s + 1) * batch_size])
            loss = torch.nn.functional.cross_entropy(model(xb), yb, label_smoothing=0.05)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            bar.update(1)
            bar.set_postfix(loss=f"{loss.item():.3f}")
    bar.close()
