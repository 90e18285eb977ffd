"""Train the router to predict each clean sample's partition from its noisy version.

Per step: draw a batch of train images x [B, 1, 32, 32] with expert targets k [B] from the manifest,
t ~ U[0, 1], noise ~ N(0, I), x_t = (1 - t) noise + t x (the experts' own noising), drop the class
label to "unknown" with probability ``label_dropout``, and minimise cross-entropy(r(x_t, t, y), k).

Evaluation (:func:`accuracy_vs_t`): on held-out images whose expert comes from
``Manifest.assign`` (classes: by label; kmeans: nearest stored centroid; features: nearest stored
centroid of the caller's features of those images), top-1 accuracy in
``bins`` equal-width t bins, with the label given and with the label unknown.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from dataset.partition import Manifest
from models.router import RouterConfig, RouterError


@dataclass
class RouterTrainConfig:
    steps: int = 1500
    batch_size: int = 128
    lr: float = 2e-3
    weight_decay: float = 1e-4
    label_dropout: float = 0.5  # fraction of samples trained with y = unknown
    seed: int = 0
    width: int = 16
    emb_dim: int = 64

    def __post_init__(self) -> None:
        if self.steps < 1 or self.batch_size < 1:
            raise RouterError(f"steps and batch_size must be >= 1 (got {self.steps}, {self.batch_size})")
        if not 0.0 <= self.label_dropout <= 1.0:
            raise RouterError(f"label_dropout must lie in [0, 1], got {self.label_dropout}")
        if self.lr <= 0:
            raise RouterError(f"lr must be > 0, got {self.lr}")


def train_targets(manifest: Manifest, num_images: int) -> tuple[np.ndarray, np.ndarray]:
    """(indices int64 [M], expert ids int64 [M]) of every train image some expert holds."""
    if manifest.num_images != num_images:
        raise RouterError(
            f"manifest indexes a split of {manifest.num_images} images but {num_images} were loaded; "
            "load the same split (and --limit) the partition was made from")
    owner = manifest.expert_of_index()
    idx = np.flatnonzero(owner >= 0)
    return idx, owner[idx]


def train_router(manifest: Manifest, images: np.ndarray, labels: np.ndarray, cfg: RouterTrainConfig,
                 progress: bool = True, log_every: int = 25):
    """Train a RouterNet. images float32 [N, 1, 32, 32] (the split the manifest indexes), labels int64 [N].

    Returns (net in eval mode, stats dict with steps, wall time, final loss / accuracy over the last 100 steps).
    """
    import torch
    from torch.nn import functional as F
    from tqdm.auto import tqdm

    from models.router import RouterNet

    idx, targets = train_targets(manifest, len(images))
    torch.manual_seed(cfg.seed)
    rng = np.random.default_rng(cfg.seed)
    net = RouterNet(cfg=RouterConfig(num_experts=manifest.num_experts, width=cfg.width, emb_dim=cfg.emb_dim))
    opt = torch.optim.AdamW(net.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    warmup = max(1, min(100, cfg.steps // 10))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / cfg.steps))))
    x_all = torch.from_numpy(np.ascontiguousarray(images, dtype=np.float32))
    y_all = torch.from_numpy(np.asarray(labels, dtype=np.int64))
    k_all = torch.from_numpy(targets)
    idx_t = torch.from_numpy(idx)
    losses, accs = [], []
    t0 = time.perf_counter()
    net.train()
    bar = tqdm(range(cfg.steps), desc="router", unit="step", disable=not progress)
    for step in bar:
        pick = torch.from_numpy(rng.integers(0, len(idx), size=cfg.batch_size))
        rows = idx_t[pick]
        x, y, k = x_all[rows], y_all[rows].clone(), k_all[pick]
        t = torch.rand(cfg.batch_size)
        noise = torch.randn_like(x)
        x_t = (1 - t)[:, None, None, None] * noise + t[:, None, None, None] * x
        y[torch.rand(cfg.batch_size) < cfg.label_dropout] = -1
        logits = net(x_t, t, y)
        loss = F.cross_entropy(logits, k)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
        accs.append(float((logits.argmax(1) == k).float().mean()))
        if step % log_every == 0 or step == cfg.steps - 1:
            bar.set_postfix(loss=f"{np.mean(losses[-100:]):.3f}", acc=f"{np.mean(accs[-100:]):.3f}")
    bar.close()
    net.eval()
    stats = {
        "steps": cfg.steps, "batch_size": cfg.batch_size, "wall_s": round(time.perf_counter() - t0, 1),
        "final_loss": round(float(np.mean(losses[-100:])), 4), "final_train_acc": round(float(np.mean(accs[-100:])), 4),
        "config": asdict(cfg),
    }
    return net, stats


def accuracy_vs_t(net, manifest: Manifest, images: np.ndarray, labels: np.ndarray, bins: int = 10,
                  seed: int = 1234, batch_size: int = 500, progress: bool = False,
                  features: np.ndarray | None = None) -> dict[str, Any]:
    """Top-1 router accuracy per t bin on held-out images (float32 [N, 1, 32, 32], labels int64 [N]).

    ``features`` float32 [N, D]: the held-out images' features, needed for a ``features`` partition
    (made by the extractor its manifest names; the caller computes them).

    Each image is noised once per bin at a t drawn uniformly inside the bin (seeded). Returns
    {"bins": [[lo, hi], ...], "acc_label": [...], "acc_no_label": [...], "chance": majority-class rate, "n": N}.
    """
    import torch
    from tqdm.auto import tqdm

    targets = manifest.assign(images, labels, seed=seed, features=features)
    rng = np.random.default_rng(seed)
    edges = np.linspace(0.0, 1.0, bins + 1)
    acc_label, acc_none = [], []
    with torch.no_grad():
        for b in tqdm(range(bins), desc="eval t-bins", disable=not progress):
            hits_l = hits_n = 0
            for s in range(0, len(images), batch_size):
                x = images[s:s + batch_size]
                n = len(x)
                t = rng.uniform(edges[b], edges[b + 1], size=n).astype(np.float32)
                noise = rng.standard_normal(x.shape).astype(np.float32)
                x_t = torch.from_numpy((1 - t)[:, None, None, None] * noise + t[:, None, None, None] * x)
                tt, k = torch.from_numpy(t), targets[s:s + n]
                y = torch.from_numpy(np.asarray(labels[s:s + n], dtype=np.int64))
                hits_l += int((net(x_t, tt, y).argmax(1).numpy() == k).sum())
                hits_n += int((net(x_t, tt, torch.full_like(y, -1)).argmax(1).numpy() == k).sum())
            acc_label.append(round(hits_l / len(images), 4))
            acc_none.append(round(hits_n / len(images), 4))
    chance = float(np.bincount(targets, minlength=manifest.num_experts).max() / max(1, len(targets)))
    return {"bins": [[round(float(edges[i]), 3), round(float(edges[i + 1]), 3)] for i in range(bins)],
            "acc_label": acc_label, "acc_no_label": acc_none, "chance": round(chance, 4), "n": int(len(images))}


def format_accuracy_table(acc: dict[str, Any]) -> str:
    """Markdown table of accuracy vs t (as written to checkpoints/README.md)."""
    lines = ["| t bin | acc (label given) | acc (label unknown) |", "|---|---|---|"]
    for (lo, hi), a, b in zip(acc["bins"], acc["acc_label"], acc["acc_no_label"]):
        lines.append(f"| {lo:.1f}-{hi:.1f} | {a:.3f} | {b:.3f} |")
    lines.append(f"\nchance (majority expert) = {acc['chance']:.3f}, n = {acc['n']} held-out images per bin")
    return "\n".join(lines)
