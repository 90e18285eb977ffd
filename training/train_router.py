"""Train the router to predict each clean sample's partition from its noisy version.

Per step: draw a batch of train images x [B, C, S, S] with expert targets k [B] from the manifest,
t ~ U[0, 1], noise ~ N(0, I), x_t = (1 - t) noise + t x (the experts' own noising), drop the class
label to "unknown" with probability ``label_dropout``, and minimise cross-entropy(r(x_t, t, y), k).

Evaluation (:func:`accuracy_vs_t`): on held-out images whose expert comes from
``Manifest.assign`` (classes: by label; kmeans: nearest stored centroid; features: nearest stored
centroid of the caller's features of those images), top-1 accuracy in
``bins`` equal-width t bins, with the label given and with the label unknown.

Resume: with ``cfg.run_dir`` set, every ``cfg.save_every`` steps and at the end the loop writes
``<run_dir>/router_resume.pt`` (network, AdamW and LR-scheduler state, step, the numpy and torch RNG
states, the last 100 losses; via training/train_torch's ``save_resume_state``), and
``train_router(..., resume=True)`` continues from it up to ``cfg.steps`` on the same sample stream,
so an interrupted run resumed with the same flags ends with the same weights as an uninterrupted one.
It refuses a file made from another partition manifest or another network config.

The router's input shape and class count are the data's (`router_config`: MNIST 1x32x32 with 10
classes, or the prepared dataset the partition was made from; an unlabelled one has 0 classes, so
every label is the "unknown" row).
"""

from __future__ import annotations

import hashlib
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
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
    run_dir: str | None = None  # where router_resume.pt lives; None: no resume file (library default)
    save_every: int = 500  # steps between resume-file writes (with run_dir)

    def __post_init__(self) -> None:
        if self.steps < 1 or self.batch_size < 1:
            raise RouterError(f"steps and batch_size must be >= 1 (got {self.steps}, {self.batch_size})")
        if self.save_every < 1:
            raise RouterError(f"save_every must be >= 1, got {self.save_every}")
        if not 0.0 <= self.label_dropout <= 1.0:
            raise RouterError(f"label_dropout must lie in [0, 1], got {self.label_dropout}")
        if self.lr <= 0:
            raise RouterError(f"lr must be > 0, got {self.lr}")


def router_config(manifest: Manifest, images: np.ndarray, cfg: RouterTrainConfig) -> RouterConfig:
    """The RouterNet config for `images` [N, C, S, S] (S divisible by 8) and the manifest's experts
    and classes."""
    shape = tuple(int(v) for v in np.shape(images)[1:])
    if len(shape) != 3 or shape[1] != shape[2]:
        raise RouterError(f"router images must be [N, C, S, S], got {list(np.shape(images))}")
    if shape[1] % 8:
        raise RouterError(
            f"the router's three stride-2 stages need an image size divisible by 8; the data is "
            f"{shape[1]}x{shape[2]}: prepare it with another --size"
        )
    return RouterConfig(
        num_experts=manifest.num_experts,
        num_classes=manifest.num_classes,
        width=cfg.width,
        emb_dim=cfg.emb_dim,
        image_size=shape[1],
        in_channels=shape[0],
    )


def train_targets(manifest: Manifest, num_images: int) -> tuple[np.ndarray, np.ndarray]:
    """(indices int64 [M], expert ids int64 [M]) of every train image some expert holds."""
    if manifest.num_images != num_images:
        raise RouterError(
            f"manifest indexes a split of {manifest.num_images} images but {num_images} were loaded; "
            "load the same split (and --limit) the partition was made from"
        )
    owner = manifest.expert_of_index()
    idx = np.flatnonzero(owner >= 0)
    return idx, owner[idx]


RESUME_NAME = "router_resume.pt"


def manifest_digest(manifest: Manifest) -> str:
    """sha256 of the manifest's canonical JSON: identifies the partition a resume file was trained on."""
    return hashlib.sha256(manifest.model_dump_json(by_alias=True, exclude_none=True).encode()).hexdigest()


def _load_resume(path: Path, manifest: Manifest, net_cfg: RouterConfig, steps: int) -> dict:
    """Read a router resume file and check that it belongs to this partition and network config."""
    import torch

    if not path.is_file():
        raise RouterError(
            f"--resume: {path} does not exist (start without --resume, or pass the --run-dir of the interrupted run)"
        )
    try:
        ck = torch.load(path, map_location="cpu", weights_only=True)  # tensors and plain data only: no code runs
    except Exception as exc:  # truncated or foreign file
        raise RouterError(f"--resume: cannot read {path}: {exc}") from exc
    if not isinstance(ck, dict) or ck.get("kind") != "router":
        raise RouterError(f"--resume: {path} is not a router resume file")
    if ck["manifest_sha256"] != manifest_digest(manifest):
        raise RouterError(
            f"--resume: {path} was trained on another partition manifest "
            f"({ck.get('manifest_file') or 'unknown file'}); resume with the same --partition "
            "and --limit, or start without --resume"
        )
    if ck["router_config"] != net_cfg.to_dict():
        raise RouterError(
            f"--resume: {path} holds a router {ck['router_config']}, not {net_cfg.to_dict()}; "
            "keep the same --width to continue it"
        )
    if ck["step"] > steps:
        raise RouterError(f"--resume: {path} is already at step {ck['step']}, beyond --steps {steps}")
    return ck


def train_router(
    manifest: Manifest,
    images: np.ndarray,
    labels: np.ndarray,
    cfg: RouterTrainConfig,
    progress: bool = True,
    log_every: int = 25,
    *,
    resume: bool = False,
    stop_after: int | None = None,
    manifest_file: str | None = None,
):
    """Train a RouterNet. images float32 [N, C, S, S] (the split the manifest indexes), labels int64 [N].

    ``resume``: continue from ``<cfg.run_dir>/router_resume.pt`` up to ``cfg.steps`` (RouterError if it is
    missing or from another manifest / network config). ``stop_after``: end the loop once that many steps
    are done, as an interruption would (the resume file is written; stats say ``complete: False``).
    ``manifest_file`` is only recorded in the resume file for error messages.

    Returns (net in eval mode, stats dict with steps, wall time, final loss / accuracy over the last 100 steps).
    """
    import torch
    from torch.nn import functional as F
    from tqdm.auto import tqdm

    from models.router import RouterNet
    from training.train_torch import restore_resume_state, save_resume_state

    if resume and not cfg.run_dir:
        raise RouterError("--resume needs a run directory (--run-dir) holding the resume file")
    idx, targets = train_targets(manifest, len(images))
    torch.manual_seed(cfg.seed)
    rng = np.random.default_rng(cfg.seed)
    net_cfg = router_config(manifest, images, cfg)
    net = RouterNet(cfg=net_cfg)
    opt = torch.optim.AdamW(net.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    warmup = max(1, min(100, cfg.steps // 10))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / cfg.steps)))
    )
    resume_path = Path(cfg.run_dir) / RESUME_NAME if cfg.run_dir else None
    digest = manifest_digest(manifest) if resume_path is not None else ""
    step, wall_before, recent = 0, 0.0, []
    if resume:
        ck = _load_resume(resume_path, manifest, net_cfg, cfg.steps)
        step, wall_before, recent = restore_resume_state(ck, net, [], opt, rng)  # no EMA for the router
        sched.load_state_dict(ck["scheduler"])
    stop = cfg.steps if stop_after is None else max(step, min(cfg.steps, stop_after))
    x_all = torch.from_numpy(np.ascontiguousarray(images, dtype=np.float32))
    y_all = torch.from_numpy(np.asarray(labels, dtype=np.int64))
    k_all = torch.from_numpy(targets)
    idx_t = torch.from_numpy(idx)
    losses, accs = [r[0] for r in recent], [r[1] for r in recent]
    t0 = time.perf_counter()

    def save() -> None:
        resume_path.parent.mkdir(parents=True, exist_ok=True)
        save_resume_state(
            resume_path,
            net,
            [],
            opt,
            rng,
            step=step,
            wall_s=round(wall_before + time.perf_counter() - t0, 1),
            history=[[a, b] for a, b in zip(losses[-100:], accs[-100:])],
            kind="router",
            scheduler=sched.state_dict(),
            manifest_sha256=digest,
            manifest_file=manifest_file,
            router_config=net_cfg.to_dict(),
        )

    net.train()
    bar = tqdm(total=cfg.steps, initial=step, desc="router", unit="step", disable=not progress)
    while step < stop:
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
        bar.update(1)
        if step % log_every == 0 or step == cfg.steps - 1:
            bar.set_postfix(loss=f"{np.mean(losses[-100:]):.3f}", acc=f"{np.mean(accs[-100:]):.3f}")
        step += 1
        if resume_path is not None and step % cfg.save_every == 0 and step < stop:
            save()
    bar.close()
    if resume_path is not None:
        save()
    net.eval()
    stats = {
        "steps": step,
        "batch_size": cfg.batch_size,
        "wall_s": round(wall_before + time.perf_counter() - t0, 1),
        "final_loss": round(float(np.mean(losses[-100:])), 4) if losses else None,
        "final_train_acc": round(float(np.mean(accs[-100:])), 4) if accs else None,
        "complete": step >= cfg.steps,
        "config": asdict(cfg),
    }
    return net, stats


def accuracy_vs_t(
    net,
    manifest: Manifest,
    images: np.ndarray,
    labels: np.ndarray,
    bins: int = 10,
    seed: int = 1234,
    batch_size: int = 500,
    progress: bool = False,
    features: np.ndarray | None = None,
    targets: np.ndarray | None = None,
) -> dict[str, Any]:
    """Top-1 router accuracy per t bin on held-out images (float32 [N, C, S, S], labels int64 [N]).

    ``features`` float32 [N, D]: the held-out images' features, needed for a ``features`` partition
    (made by the extractor its manifest names; the caller computes them). ``targets`` int64 [N]: the
    images' experts when the caller assigned them (a router on latents whose partition clusters the
    source images assigns by those images); default ``manifest.assign`` of ``images``.

    Each image is noised once per bin at a t drawn uniformly inside the bin (seeded). Returns
    {"bins": [[lo, hi], ...], "acc_label": [...], "acc_no_label": [...], "chance": majority-class rate, "n": N}.
    """
    import torch
    from tqdm.auto import tqdm

    if targets is None:
        targets = manifest.assign(images, labels, seed=seed, features=features)
    elif len(targets) != len(images):
        raise RouterError(f"{len(targets)} targets for {len(images)} held-out images")
    rng = np.random.default_rng(seed)
    edges = np.linspace(0.0, 1.0, bins + 1)
    acc_label, acc_none = [], []
    with torch.no_grad():
        for b in tqdm(range(bins), desc="eval t-bins", disable=not progress):
            hits_l = hits_n = 0
            for s in range(0, len(images), batch_size):
                x = images[s : s + batch_size]
                n = len(x)
                t = rng.uniform(edges[b], edges[b + 1], size=n).astype(np.float32)
                noise = rng.standard_normal(x.shape).astype(np.float32)
                x_t = torch.from_numpy((1 - t)[:, None, None, None] * noise + t[:, None, None, None] * x)
                tt, k = torch.from_numpy(t), targets[s : s + n]
                y = torch.from_numpy(np.asarray(labels[s : s + n], dtype=np.int64))
                hits_l += int((net(x_t, tt, y).argmax(1).numpy() == k).sum())
                hits_n += int((net(x_t, tt, torch.full_like(y, -1)).argmax(1).numpy() == k).sum())
            acc_label.append(round(hits_l / len(images), 4))
            acc_none.append(round(hits_n / len(images), 4))
    chance = float(np.bincount(targets, minlength=manifest.num_experts).max() / max(1, len(targets)))
    return {
        "bins": [[round(float(edges[i]), 3), round(float(edges[i + 1]), 3)] for i in range(bins)],
        "acc_label": acc_label,
        "acc_no_label": acc_none,
        "chance": round(chance, 4),
        "n": int(len(images)),
    }


def format_accuracy_table(acc: dict[str, Any]) -> str:
    """Markdown table of accuracy vs t (as written to checkpoints/README.md)."""
    lines = ["| t bin | acc (label given) | acc (label unknown) |", "|---|---|---|"]
    for (lo, hi), a, b in zip(acc["bins"], acc["acc_label"], acc["acc_no_label"]):
        lines.append(f"| {lo:.1f}-{hi:.1f} | {a:.3f} | {b:.3f} |")
    lines.append(f"\nchance (majority expert) = {acc['chance']:.3f}, n = {acc['n']} held-out images per bin")
    return "\n".join(lines)
