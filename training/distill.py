"""Distill a DDM ensemble (K experts + router) into one dense UNet that a worker serves like a monolith.

The teacher's velocity is the ensemble's, as the coordinator combines it:

    w = strategy(softmax(router(x_t, t, y)))        [B, K]   full: w = softmax; top1: one-hot argmax
    u = sum_k w_k v_k(x_t, t, y)                    [B, 1, 32, 32]

and the student v_s(x_t, t, y) (the ordinary expert UNet) minimises mean((v_s - u)^2).

Where the x_t come from: noised training images, x_t = (1 - t) noise + t x with x a train image,
noise ~ N(0, I), t ~ U[0, 1], exactly the points flow matching trains on, only the target is the
teacher's velocity u instead of x - noise. Why this first, not the ensemble's own sampling
trajectories: it costs one teacher evaluation per training point (a trajectory point costs the
whole ODE solve up to t), it needs no solver, every batch is independent (no replay buffer to go
stale), and at these points the teacher is in distribution, because its experts and router were
trained on exactly this noising. The gap it leaves is the trajectory distribution of the ensemble
itself (x_t from integrating u, not from noising data), which a later trajectory mode can add.

Everything else follows `train_torch`: AdamW, warmup + cosine learning rate, grad-norm clip, EMA
of the weights (what is saved), a tqdm bar, and every `save_every` steps the expert checkpoint
(`models/checkpoint.py` format, so `ddm-fleet worker --checkpoint OUT` serves it) plus
`<run_dir>/distill_resume.pt` for `--resume`.

With `label_dropout` p > 0 a fraction p of rows is distilled with the label unknown (y = -1 for
teacher and student; the student gets a null label, `UNetConfig.null_label`); this needs experts
trained with a null label (`train-expert --label-dropout`). The router always accepts -1.

The student's checkpoint stores the teacher fleet's model spec (`Teacher.spec`: the router's and the
experts' specs, which must agree), with the student's architecture and null label.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np

from training.run_config import RunConfig

log = logging.getLogger(__name__)

STRATEGIES = ("full", "top1")


class DistillError(ValueError):
    """Bad distillation setup (missing teacher files, mismatched experts, bad options)."""


@dataclass
class DistillConfig(RunConfig):
    """One distillation run (stored in the checkpoint JSON under `training.config`): the shared
    `RunConfig` settings, the teacher, the strategy and where the student is saved."""

    error: ClassVar[type[ValueError]] = DistillError

    checkpoints: str = "checkpoints"  # expert<k>.safetensors + router.safetensors
    out: str = "checkpoints/distilled"
    run_dir: str = "runs/distill"
    widths: tuple[int, ...] | None = None  # None: the teacher experts' widths
    strategy: str = "full"

    def __post_init__(self) -> None:
        if self.widths is not None:
            self.widths = tuple(int(w) for w in self.widths)
        super().__post_init__()
        if self.strategy not in STRATEGIES:
            raise DistillError(f"--strategy must be one of {', '.join(STRATEGIES)}, got {self.strategy!r}")
        if self.device != "cpu" and not self.device.startswith("cuda"):
            raise DistillError(f"--device must be cpu or cuda[:N], got {self.device!r}")


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


class Teacher:
    """The ensemble u(x_t, t, y) = sum_k w_k v_k(x_t, t, y), torch, no grad.

    experts: K `unet_torch.UNet` in eval mode, expert k at index k; router: a `RouterNet`.
    """

    def __init__(self, experts: Sequence, router, strategy: str = "full", sources: dict | None = None, spec=None):
        if strategy not in STRATEGIES:
            raise DistillError(f"strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
        if len(experts) != router.cfg.num_experts:
            raise DistillError(f"{len(experts)} experts but the router routes to {router.cfg.num_experts}")
        cfgs = {e.cfg for e in experts}
        self.experts = [e.eval() for e in experts]
        self.router = router.eval()
        self.strategy = strategy
        self.config = experts[0].cfg  # the student's default architecture
        self.null_label = all(c.null_label for c in cfgs)
        self.sources = sources or {}
        if spec is None:  # the spec the experts' config implies (checkpoints made before specs)
            from models.arch import arch_name
            from models.spec import spec_of

            spec = spec_of({"config": self.config.to_dict(), "arch": arch_name(self.config)})
        self.spec = spec  # schemas.spec.ModelSpec of the fleet the teacher is
        for m in (*self.experts, self.router):
            for p in m.parameters():
                p.requires_grad_(False)

    @property
    def num_experts(self) -> int:
        return len(self.experts)

    @classmethod
    def load(cls, directory: str | Path, strategy: str = "full", device: str = "cpu") -> Teacher:
        """`<directory>/router.safetensors` (+ .json) and `expert0..expert{K-1}.safetensors` (+ .json)."""
        import torch

        from models.arch import build_torch
        from models.checkpoint import CheckpointError, load_checkpoint
        from models.router import Router, RouterError, load_router_meta
        from models.spec import spec_of
        from schemas.spec import SpecError, fleet_spec

        d = Path(directory)
        router_path = d / "router.safetensors"
        try:
            router = Router.load(router_path).net
            specs = {"router": spec_of(load_router_meta(router_path), where=str(router_path))}
        except (RouterError, SpecError) as exc:
            raise DistillError(f"teacher router: {exc}") from None
        k = router.cfg.num_experts
        experts, sources = [], {"router": {"file": str(router_path), "sha256": _digest(router_path)}, "experts": []}
        for i in range(k):
            path = d / f"expert{i}.safetensors"
            if not path.exists():
                raise DistillError(f"the router routes to {k} experts but {path} is missing")
            try:
                meta, state = load_checkpoint(path)
                specs[f"expert {i}"] = spec_of(meta, where=str(path))
            except (CheckpointError, SpecError) as exc:
                raise DistillError(f"teacher expert {i}: {exc}") from None
            model = build_torch(meta)  # UNet or DiT, by the checkpoint's "arch"
            model.load_state_dict({n: torch.from_numpy(v) for n, v in state.items()})
            experts.append(model.to(device))
            sources["experts"].append(
                {
                    "file": str(path),
                    "sha256": meta.get("weights_sha256") or _digest(path),
                    "classes": (meta.get("partition") or {}).get("classes"),
                }
            )
        try:
            spec = fleet_spec(specs)
        except SpecError as exc:
            raise DistillError(f"teacher in {d}: {exc}") from None
        return cls(experts, router.to(device), strategy, sources, spec=spec)

    def weights(self, x_t, t, y):
        """Combination weights [B, K] float32 (rows sum to 1) for x_t [B,1,32,32], t [B], y [B] (-1 = unknown)."""
        import torch

        w = torch.softmax(self.router(x_t, t, y).float(), dim=1)
        if self.strategy == "top1":
            w = torch.nn.functional.one_hot(w.argmax(1), self.num_experts).to(w.dtype)
        return w

    def velocity(self, x_t, t, y):
        """u [B, 1, 32, 32] float32: the ensemble's velocity (experts with zero weight are skipped)."""
        import torch

        with torch.no_grad():
            w = self.weights(x_t, t, y)
            u = torch.zeros_like(x_t, dtype=torch.float32)
            for k, expert in enumerate(self.experts):
                rows = torch.nonzero(w[:, k] > 0).flatten()
                if len(rows) == 0:
                    continue
                v = expert(x_t[rows], t[rows], y[rows]).float()
                u[rows] += w[rows, k, None, None, None] * v
        return u


def distill_batch(teacher: Teacher, x, y, generator=None):
    """Noised training images and their teacher targets: x [B,1,32,32], y [B] -> (x_t, t [B], u)."""
    from flow.path import torch_flow_batch

    x_t, t, _ = torch_flow_batch(x, generator)
    return x_t, t, teacher.velocity(x_t, t, y)


def distill_loss(student, x_t, t, y, u):
    """mean((student(x_t, t, y) - u)^2), scalar fp32 tensor."""
    return ((student(x_t, t, y).float() - u) ** 2).mean()


def distill(
    cfg: DistillConfig,
    teacher: Teacher,
    images: np.ndarray,
    labels: np.ndarray,
    resume: bool = False,
    progress: bool = True,
) -> dict:
    """Train the student; returns the training stats written into the checkpoint JSON.

    images float32 [N, C, S, S] in [-1, 1] (the teacher's sample shape), labels int64 [N] (the train
    split, or a --limit prefix).
    """
    import torch
    from tqdm import tqdm

    from models.arch import arch_name, build_torch
    from models.checkpoint import save_checkpoint, torch_state_to_numpy
    from models.config import DiTConfig
    from models.spec import with_spec
    from models.unet_torch import count_params
    from training.train_torch import ema_decay_at, lr_at, restore_resume_state, save_resume_state

    if len(images) != len(labels) or len(images) < cfg.batch_size:
        raise DistillError(
            f"{len(images)} images / {len(labels)} labels: need equal counts and at least --batch-size {cfg.batch_size}"
        )
    if cfg.label_dropout > 0 and not teacher.null_label:
        raise DistillError(
            "--label-dropout needs teacher experts trained with a null label "
            "(train-expert --label-dropout); these refuse y = -1"
        )
    if cfg.threads > 0:
        torch.set_num_threads(cfg.threads)
    device = torch.device(cfg.device)
    torch.manual_seed(cfg.seed)
    if tuple(images.shape[1:]) != tuple(teacher.spec.sample_shape):
        raise DistillError(
            f"the images are {list(images.shape[1:])} but the teacher's experts make "
            f"{list(teacher.spec.sample_shape)}: distill on the dataset they were trained on (--data)"
        )
    unconditional = teacher.spec.conditioning.kind == "none"  # every label is the null label
    base = teacher.config.to_dict()
    base.update(null_label=cfg.label_dropout > 0 or unconditional)
    if cfg.widths is not None:
        if isinstance(teacher.config, DiTConfig):
            raise DistillError(
                "--widths sets a UNet student's widths; these teacher experts are DiTs (the student "
                "copies their architecture): leave --widths out"
            )
        base["widths"] = list(cfg.widths)
    scfg = type(teacher.config).from_dict(base)  # the teachers' architecture (UNet or DiT)
    cond = teacher.spec.conditioning.model_copy(update={"null_label": bool(scfg.null_label)})
    student_spec = teacher.spec.model_copy(update={"arch": arch_name(scfg), "conditioning": cond})
    student = build_torch(scfg).to(device)
    params = list(student.parameters())
    ema = [p.detach().clone() for p in params]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.99))
    teacher_ids = [e["sha256"] for e in teacher.sources.get("experts", [])] + [
        teacher.sources.get("router", {}).get("sha256")
    ]

    run_dir = Path(cfg.run_dir)
    resume_path = run_dir / "distill_resume.pt"
    step, wall_before, history = 0, 0.0, []
    rng = np.random.default_rng(cfg.seed)
    if resume:
        if not resume_path.exists():
            raise DistillError(f"--resume: {resume_path} does not exist (start without --resume)")
        ck = torch.load(resume_path, map_location="cpu", weights_only=True)  # tensors and plain data only
        if ck["student_config"] != scfg.to_dict():
            raise DistillError(f"--resume: {resume_path} holds a student {ck['student_config']}, not {scfg.to_dict()}")
        if ck["teacher"] != teacher_ids or ck["strategy"] != cfg.strategy:
            raise DistillError(f"--resume: {resume_path} was distilled from another teacher or strategy")
        step, wall_before, history = restore_resume_state(ck, student, ema, opt, rng)
        log.info("resumed distillation from %s at step %d", resume_path, step)

    data_x = torch.from_numpy(np.ascontiguousarray(images, dtype=np.float32)).to(device)
    data_y = torch.from_numpy(np.asarray(labels, dtype=np.int64)).to(device)
    n = len(images)
    per_epoch = n // cfg.batch_size
    t_start = time.time()

    def ema_state() -> dict:
        sd = dict(student.state_dict())
        for (name, _), e in zip(student.named_parameters(), ema):
            sd[name] = e
        return torch_state_to_numpy(sd)

    def save(final: bool) -> dict:
        recent = [h["loss"] for h in history[-5:]]
        stats = {
            "backend": "torch",
            "kind": "distillation",
            "device": cfg.device,
            "steps": step,
            "images_seen": step * cfg.batch_size,
            "wall_s": round(wall_before + time.time() - t_start, 1),
            "final_loss": round(float(np.mean(recent)), 6) if recent else None,
            "loss_history": history,
            "complete": final and step >= cfg.steps,
            "params": count_params(student),
            "torch": torch.__version__,
            "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(cfg).items()},
        }
        meta = {
            "arch": arch_name(scfg),
            "config": scfg.to_dict(),
            "expert_id": 0,
            "weights": "ema",
            "partition": {"method": "distilled", "classes": list(range(scfg.num_classes)), "num_images": n},
            "distilled_from": {
                "checkpoints": str(cfg.checkpoints),
                "strategy": cfg.strategy,
                "targets": "noised training images",
                **teacher.sources,
            },
            "training": stats,
        }
        save_checkpoint(cfg.out, ema_state(), with_spec(meta, student_spec), dtype=cfg.save_dtype)
        run_dir.mkdir(parents=True, exist_ok=True)
        save_resume_state(
            resume_path,
            student,
            ema,
            opt,
            rng,
            step=step,
            wall_s=stats["wall_s"],
            history=history,
            student_config=scfg.to_dict(),
            teacher=teacher_ids,
            strategy=cfg.strategy,
        )
        return stats

    student.train()
    perm, pos = rng.permutation(n), 0
    window, window_n, window_t = 0.0, 0, time.time()
    bar = tqdm(
        total=cfg.steps,
        initial=step,
        disable=not progress,
        desc="distill",
        unit="step",
        dynamic_ncols=True,
        mininterval=2.0,
    )
    while step < cfg.steps:
        if pos + cfg.batch_size > per_epoch * cfg.batch_size:
            perm, pos = rng.permutation(n), 0
        idx = torch.from_numpy(perm[pos : pos + cfg.batch_size]).to(device)
        pos += cfg.batch_size
        x, y = data_x[idx], data_y[idx]
        if cfg.label_dropout > 0:
            y = torch.where(torch.rand(y.shape, device=device) < cfg.label_dropout, torch.full_like(y, -1), y)
        x_t, t, u = distill_batch(teacher, x, y)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg)
        loss = distill_loss(student, x_t, t, y, u)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        with torch.no_grad():
            torch._foreach_lerp_(ema, [p.detach() for p in params], 1.0 - ema_decay_at(step, cfg.ema_decay))
        step += 1
        lv = float(loss.detach())
        if not math.isfinite(lv):
            raise FloatingPointError(f"distillation loss became {lv} at step {step}; lower --lr")
        window, window_n = window + lv, window_n + 1
        bar.update(1)
        bar.set_postfix(loss=f"{window / window_n:.4f}", lr=f"{lr_at(step, cfg):.1e}", refresh=False)
        if step % cfg.log_every == 0 or step == cfg.steps:
            ips = window_n * cfg.batch_size / max(1e-6, time.time() - window_t)
            history.append({"step": step, "loss": round(window / window_n, 6), "img_s": round(ips, 1)})
            window, window_n, window_t = 0.0, 0, time.time()
        if step % cfg.save_every == 0 and step < cfg.steps:
            save(final=False)
    bar.close()
    return save(final=True)
