"""Train one expert (UNet or DiT) with PyTorch (CPU, CUDA or torch_xla) on ONLY its partition's images.

Entry point: `train(args)` (called by `ddm-fleet train-expert --backend torch`). The data is MNIST or the
prepared dataset the partition was made from (`--data DIR`, training/datasets.py); the image shape,
channels and classes come from it, the architecture from `--arch unet|dit` and its size flags
(`model_config`). The loop:

    batch x [B,C,S,S], y [B] from the expert's indices (shuffled each epoch, drop_last: static shapes)
    loss = flow-matching MSE (flow/path.py), AdamW, warmup + cosine LR, grad-norm clip 1.0
    EMA of the weights (what is saved), bf16 autocast optional, channels_last on CPU
    --label-dropout p > 0: each label becomes -1 ("unknown") with probability p, and the model gets a
    null class row (UNetConfig.null_label, recorded in the checkpoint's config), so one network
    generates with and without a label (classifier-free style); p = 0 (default) trains as before
    unlabelled dataset (labels all -1, conditioning none): every label is the null label (as if
    --label-dropout were 1.0); the model has one unused class row and a null row

The checkpoint's JSON stores the model spec (`models.spec.with_spec`: sample shape, classes and their
names, conditioning, null label, arch), so workers and the coordinator know what it produces.

Every `--save-every` steps and at the end it writes the shipping checkpoint (`--out`, EMA weights,
models/checkpoint.py format) and a resume file (`<run-dir>/resume.pt`: model, EMA, optimizer, step,
loss history, RNG state), so an interrupted run is usable and `--resume` continues it.
"""

from __future__ import annotations

import argparse
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from training.run_config import RunConfig, ema_decay_at, lr_at

log = logging.getLogger(__name__)


@dataclass
class TrainConfig(RunConfig):
    """Everything that defines a training run (stored in the checkpoint JSON under `training.config`):
    the shared `RunConfig` settings, the expert, its architecture and where it is saved."""

    expert: int
    partition: str
    arch: str = "unet"  # "unet" (widths) or "dit" (patch_size, hidden_size, depth, heads, mlp_ratio)
    widths: tuple[int, ...] = (32, 64, 128)
    patch_size: int = 2
    hidden_size: int = 128
    depth: int = 6
    heads: int = 4
    mlp_ratio: float = 4.0
    bf16: bool = False
    out: str = ""
    run_dir: str = ""
    data: str | None = None  # a prepared dataset directory (None: the partition's, or MNIST)

    def __post_init__(self) -> None:
        self.widths = tuple(self.widths)
        if not self.out:
            self.out = f"checkpoints/expert{self.expert}"
        if not self.run_dir:
            self.run_dir = f"runs/expert{self.expert}"
        super().__post_init__()
        if self.device not in ("cpu", "cuda", "xla") and not self.device.startswith("cuda:"):
            raise ValueError(f"--device must be cpu, cuda[:N] or xla, got {self.device!r}")
        if self.arch not in ARCHS:
            raise ValueError(f"--arch must be one of {', '.join(ARCHS)}, got {self.arch!r}")
        if self.arch == "dit":
            for name in ("patch_size", "hidden_size", "depth", "heads"):
                value = getattr(self, name)
                if isinstance(value, bool) or int(value) != value or value <= 0:
                    raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}")
            if self.hidden_size % self.heads:
                ok = [h for h in range(1, 17) if self.hidden_size % h == 0]
                raise ValueError(
                    f"--hidden-size {self.hidden_size} must be divisible by --heads {self.heads} "
                    f"(each head gets hidden-size / heads channels); --heads could be one of {ok}"
                )
            if self.hidden_size % 4:
                raise ValueError(
                    f"--hidden-size {self.hidden_size} must be a multiple of 4 (the 2-D position embedding "
                    "gives a quarter of it to each of sin/cos of row/column)"
                )
            if not self.mlp_ratio > 0:
                raise ValueError(f"--mlp-ratio must be positive (e.g. 4.0), got {self.mlp_ratio}")


#: The expert architectures train-expert builds (models/arch.py).
ARCHS = ("unet", "dit")


def model_config(cfg: TrainConfig, shape: tuple[int, int, int], num_classes: int, null_label: bool):
    """The expert's UNetConfig / DiTConfig for data of `shape` [C, S, S] with `num_classes` classes
    (0 = unlabelled: one unused class row; the model then always has a null label). ValueError naming
    the flag to change when the architecture does not fit the data."""
    from models.config import DiTConfig, UNetConfig

    c, s, w = shape
    if s != w:
        raise ValueError(f"the data's images are {s}x{w}; experts take square images (prepare them with --size S)")
    null_label = bool(null_label or num_classes == 0)
    classes = max(1, int(num_classes))
    if cfg.arch == "dit":
        if s % cfg.patch_size:
            ok = [p for p in range(1, min(s, 8) + 1) if s % p == 0]
            raise ValueError(f"--patch-size {cfg.patch_size} must divide the data's image size {s}; choose one of {ok}")
        return DiTConfig(
            in_channels=c,
            image_size=s,
            patch_size=int(cfg.patch_size),
            hidden_size=int(cfg.hidden_size),
            depth=int(cfg.depth),
            num_heads=int(cfg.heads),
            mlp_ratio=float(cfg.mlp_ratio),
            num_classes=classes,
            null_label=null_label,
        )
    levels = len(cfg.widths)
    if s % (2**levels):
        raise ValueError(
            f"--widths {','.join(map(str, cfg.widths))} has {levels} levels, which needs an image size divisible "
            f"by {2**levels}; the data's images are {s}x{s}: give fewer widths or prepare another --size"
        )
    return UNetConfig(in_channels=c, image_size=s, num_classes=classes, widths=cfg.widths, null_label=null_label)


def data_model(cfg: TrainConfig, partition_info: dict):
    """(model config, model spec) of this run on the data `partition_info` describes (its "dataset"
    block from `load_expert_data`; absent = MNIST)."""
    from dataset.partition import DatasetRef
    from training.datasets import num_classes_of, shape_of, spec_for

    ref = DatasetRef.model_validate(partition_info["dataset"]) if "dataset" in partition_info else None
    nc = num_classes_of(ref)
    mcfg = model_config(cfg, shape_of(ref), nc, cfg.label_dropout > 0)
    return mcfg, spec_for(ref, null_label=mcfg.null_label, arch=cfg.arch)


def load_expert_data(cfg: TrainConfig):
    """-> (images float32 [N,C,S,S] in [-1,1], labels int64 [N] (-1 = unlabelled), partition info dict)
    for this expert only. The data is the partition's dataset (`--data`, checked against the partition;
    MNIST when the partition names none); info["dataset"] describes a prepared one."""
    from dataset.partition import load_manifest
    from training.datasets import load_split, resolve_data

    manifest = load_manifest(cfg.partition)
    if not 0 <= cfg.expert < manifest.num_experts:
        raise ValueError(
            f"--expert {cfg.expert} not in partition {cfg.partition} (experts 0..{manifest.num_experts - 1})"
        )
    part = manifest.experts[cfg.expert]
    path, ref = resolve_data(manifest, cfg.data, cfg.partition)
    images, labels, _ = load_split(path, manifest.split, data_dir=cfg.data_dir)
    if len(images) != manifest.num_images:
        raise ValueError(
            f"partition {cfg.partition} indexes {manifest.num_images} {manifest.split} images "
            f"but the data set has {len(images)}"
        )
    idx = np.asarray(part.indices, dtype=np.int64)
    if cfg.limit is not None:
        idx = idx[: cfg.limit]
    if len(idx) < cfg.batch_size:
        raise ValueError(f"expert {cfg.expert} has {len(idx)} images, fewer than --batch-size {cfg.batch_size}")
    info = {
        "file": str(cfg.partition),
        "method": manifest.method,
        "seed": manifest.seed,
        "split": manifest.split,
        "classes": list(part.classes),
        "num_images": int(len(idx)),
        "class_counts": np.bincount(labels[idx][labels[idx] >= 0], minlength=manifest.num_classes).tolist()
        if manifest.num_classes
        else [],
    }
    if ref is not None:
        info["dataset"] = ref.model_dump()
    return images[idx], labels[idx], info


class _Device:
    """Device handling for cpu / cuda / xla: placement, autocast, step boundary."""

    def __init__(self, name: str, bf16: bool):
        import torch

        self.name, self.bf16 = name, bf16
        self.xla = name == "xla"
        if self.xla:
            try:
                import torch_xla
            except ImportError:
                raise RuntimeError(
                    "--device xla needs torch_xla (install the '.[xla]' extra on the XLA host)"
                ) from None
            self._torch_xla = torch_xla
            self.device = (
                torch_xla.device()
                if hasattr(torch_xla, "device")
                else __import__("torch_xla.core.xla_model", fromlist=["xla_device"]).xla_device()
            )
            self.autocast_type = "xla"
        else:
            if name.startswith("cuda") and not torch.cuda.is_available():
                raise RuntimeError("--device cuda requested but torch.cuda.is_available() is False")
            self.device = torch.device(name)
            self.autocast_type = "cuda" if name.startswith("cuda") else "cpu"
        self.channels_last = name == "cpu"
        # Reading the loss back (float(loss)) waits for the GPU: on CUDA do it once per 25 steps so the
        # host runs ahead of the device; on CPU it is free and XLA reads it after each step's graph anyway.
        self.readback_every = 25 if self.autocast_type == "cuda" else 1

    def autocast(self):
        import contextlib

        import torch

        if not self.bf16:
            return contextlib.nullcontext()
        return torch.autocast(self.autocast_type, dtype=torch.bfloat16)

    def step_boundary(self) -> None:
        """Cut the lazy graph once per step on XLA (one compiled graph per step)."""
        if self.xla:
            if hasattr(self._torch_xla, "sync"):
                self._torch_xla.sync()
            else:
                import torch_xla.core.xla_model as xm

                xm.mark_step()


class _TorchRun:
    """One torch run's state (model, EMA, optimizer, numpy RNG, step, loss history): what `--resume`
    restores and every save writes, kept together so the loop, resume and save are each one short step."""

    def __init__(self, cfg: TrainConfig, ucfg, spec, partition_info: dict, dist_info, dev: _Device):
        import torch

        from models.arch import build_torch

        self.cfg, self.ucfg, self.spec, self.partition_info, self.dist_info = cfg, ucfg, spec, partition_info, dist_info
        self.model = build_torch(ucfg).to(dev.device)
        if dev.channels_last:
            self.model = self.model.to(memory_format=torch.channels_last)
        self.params = list(self.model.parameters())
        self.ema = [p.detach().clone() for p in self.params]
        self.opt = torch.optim.AdamW(self.params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.99))
        self.resume_path = Path(cfg.run_dir) / "resume.pt"
        self.step, self.wall_before, self.history = 0, 0.0, []
        self.rng = np.random.default_rng(cfg.seed)
        self.t_start = time.time()

    def restore(self) -> None:
        """Continue from the resume file; refused when it holds another expert, model or data."""
        import torch

        cfg, path = self.cfg, self.resume_path
        if not path.exists():
            raise FileNotFoundError(f"--resume: {path} does not exist (start without --resume)")
        ck = torch.load(path, map_location="cpu", weights_only=True)  # tensors and plain data only: no code runs
        if tuple(ck["widths"]) != tuple(cfg.widths) or ck["expert"] != cfg.expert:
            raise ValueError(
                f"--resume: {path} is for expert {ck['expert']} widths {ck['widths']}, "
                f"not expert {cfg.expert} widths {list(cfg.widths)}"
            )
        if bool(ck.get("null_label", False)) != self.ucfg.null_label:
            raise ValueError(
                f"--resume: {path} was trained with{'' if ck.get('null_label') else 'out'} a null "
                f"label; keep --label-dropout {'> 0' if ck.get('null_label') else '0'} to continue it"
            )
        check_resume_model(ck, self.ucfg, path)
        check_resume_data(ck, self.partition_info, path)
        self.step, self.wall_before, self.history = restore_resume_state(ck, self.model, self.ema, self.opt, self.rng)
        log.info("resumed from %s at step %d", path, self.step)

    def stats(self, final: bool) -> dict:
        """The training stats the checkpoint JSON carries."""
        import torch

        from models.unet_torch import count_params

        cfg, recent = self.cfg, [h["loss"] for h in self.history[-5:]]
        return {
            "backend": "torch",
            "device": cfg.device,
            "steps": self.step,
            "images_seen": self.step * cfg.batch_size,
            "wall_s": round(self.wall_before + (time.time() - self.t_start), 1),
            "final_loss": round(float(np.mean(recent)), 5) if recent else None,
            "loss_history": self.history,
            "complete": final and self.step >= cfg.steps,
            "params": count_params(self.model),
            "torch": torch.__version__,
            "world_size": self.dist_info.world_size,
            "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(cfg).items()},
        }

    def save(self, final: bool, digests=None) -> dict:
        """The shipping checkpoint (EMA weights) and the resume file (rank 0 only); the stats."""
        from models.checkpoint import save_checkpoint, torch_state_to_numpy
        from models.spec import with_spec

        cfg, ucfg = self.cfg, self.ucfg
        self.resume_path.parent.mkdir(parents=True, exist_ok=True)
        stats = self.stats(final)
        if digests:
            stats["param_digests"] = digests
        if not self.dist_info.is_main:  # only rank 0 writes
            return stats
        ema_sd = dict(self.model.state_dict())
        ema_sd.update(zip([k for k, _ in self.model.named_parameters()], self.ema))
        meta = {
            "config": ucfg,
            "expert_id": cfg.expert,
            "partition": self.partition_info,
            "training": stats,
            "weights": "ema",
        }
        save_checkpoint(cfg.out, torch_state_to_numpy(ema_sd), with_spec(meta, self.spec), dtype=cfg.save_dtype)
        save_resume_state(
            self.resume_path,
            self.model,
            self.ema,
            self.opt,
            self.rng,
            step=self.step,
            wall_s=stats["wall_s"],
            history=self.history,
            widths=list(cfg.widths),
            expert=cfg.expert,
            null_label=ucfg.null_label,
            arch=cfg.arch,
            model_config=ucfg.to_dict(),
            **resume_data_fields(self.partition_info),
        )
        return stats


def _optimizer_step(run: _TorchRun, dev: _Device, train_model, x, y):
    """One AdamW step on the batch (x, y) at the learning rate of `run.step`, then the EMA update;
    returns the loss, still on the device."""
    import torch

    from flow.path import torch_flow_loss

    cfg = run.cfg
    for g in run.opt.param_groups:
        g["lr"] = lr_at(run.step, cfg)
    with dev.autocast():
        loss = torch_flow_loss(train_model, x, y)
    run.opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(run.params, cfg.grad_clip)
    run.opt.step()
    with torch.no_grad():
        torch._foreach_lerp_(run.ema, [p.detach() for p in run.params], 1.0 - ema_decay_at(run.step, cfg.ema_decay))
    dev.step_boundary()
    return loss


def _train_steps(run: _TorchRun, dev: _Device, train_model, images: np.ndarray, labels: np.ndarray, progress: bool):
    """Step from `run.step` to `cfg.steps`, saving every `save_every` steps; losses are read back in
    batches (`dev.readback_every`, and whenever a history entry or a save is due)."""
    import torch

    from training import distributed as ddp
    from training.progress import TrainProgress

    cfg, dist_info = run.cfg, run.dist_info
    n = len(images)
    data_x = torch.from_numpy(np.ascontiguousarray(images)).to(dev.device)
    data_y = torch.from_numpy(labels.astype(np.int64)).to(dev.device)
    per_epoch = n // cfg.batch_size  # drop_last: every batch has the same static shape
    run.model.train()
    run.t_start = time.time()
    perm, pos = run.rng.permutation(n), 0
    hint = "lower --lr or train with --dtype float32"
    prog = TrainProgress(
        cfg,
        run.history,
        step=run.step,
        desc=f"expert{cfg.expert}",
        progress=progress,
        main=dist_info.is_main,
        hint=hint,
    )
    pending: list = []  # device losses not yet read back
    while run.step < cfg.steps:
        if pos + cfg.batch_size > per_epoch * cfg.batch_size:
            perm, pos = run.rng.permutation(n), 0
        idx = torch.from_numpy(ddp.shard(perm[pos : pos + cfg.batch_size], dist_info)).to(dev.device)
        pos += cfg.batch_size
        x, y = data_x[idx], data_y[idx]
        if cfg.label_dropout > 0:  # classifier-free style: some labels become "unknown" (-1 -> null row)
            y = torch.where(torch.rand(y.shape, device=y.device) < cfg.label_dropout, torch.full_like(y, -1), y)
        if dev.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        pending.append(_optimizer_step(run, dev, train_model, x, y).detach())
        run.step += 1
        step = run.step
        prog.advance()
        if not (
            len(pending) >= dev.readback_every
            or step % cfg.log_every == 0
            or step == cfg.steps
            or step % cfg.save_every == 0
        ):
            continue
        # one host<->device sync for the steps since the last read (on XLA after the step's graph ran)
        values = torch.stack(pending).float().cpu().tolist() if len(pending) > 1 else [float(pending[0])]
        pending.clear()
        for lv in values:
            prog.add(ddp.mean_across(lv, dist_info, dev.device), step)  # the global batch's loss
        prog.report(step)
        if step % cfg.save_every == 0 and step < cfg.steps:
            run.save(final=False)
    prog.close()


def train_expert(
    cfg: TrainConfig,
    images: np.ndarray,
    labels: np.ndarray,
    partition_info: dict,
    resume: bool = False,
    progress: bool = True,
) -> dict:
    """Run the training loop; returns the training stats written into the checkpoint JSON.

    images float32 [N,C,S,S] in [-1,1], labels int64 [N] (-1 = unlabelled): the expert's own data only;
    partition_info["dataset"] (when present) names the prepared dataset they come from (else MNIST).
    """
    import torch

    from training import distributed as ddp

    if cfg.threads > 0:
        torch.set_num_threads(cfg.threads)
    dist_info = ddp.detect()  # torchrun: data parallel over WORLD_SIZE processes (training/distributed.py)
    ddp.check_batch(cfg.batch_size, dist_info)
    device = ddp.local_device(dist_info, cfg.device)
    ddp.init(dist_info, device)
    torch.manual_seed(cfg.seed)
    dev = _Device(device, cfg.bf16)
    ucfg, spec = data_model(cfg, partition_info)
    if tuple(images.shape[1:]) != tuple(spec.sample_shape):
        raise ValueError(f"images are {list(images.shape[1:])} but the data's spec says {list(spec.sample_shape)}")
    run = _TorchRun(cfg, ucfg, spec, partition_info, dist_info, dev)
    if resume:
        run.restore()
    if dist_info.enabled and dist_info.rank > 0:  # own noise stream per rank (init weights come from rank 0)
        torch.manual_seed(ddp.rank_seed(cfg.seed, dist_info.rank, run.step))
    _train_steps(run, dev, ddp.wrap(run.model, dist_info, device), images, labels, progress)
    digests = ddp.param_digests(run.params, dist_info)  # every rank must hold the same weights
    if len(set(digests)) > 1:
        raise RuntimeError(f"data-parallel ranks diverged: parameter digests {digests}")
    stats = run.save(final=True, digests=digests if dist_info.enabled else None)
    ddp.shutdown(dist_info)
    return stats


def check_resume_model(ck: dict, mcfg, resume_path) -> None:
    """Refuse a resume file of another architecture or model config (files made before it recorded
    them are UNets, checked by their widths)."""
    from models.arch import arch_name

    arch = ck.get("arch", "unet")
    if arch != arch_name(mcfg):
        raise ValueError(f"--resume: {resume_path} holds a {arch}, not a {arch_name(mcfg)}; keep --arch {arch}")
    if "model_config" in ck and ck["model_config"] != mcfg.to_dict():
        raise ValueError(
            f"--resume: {resume_path} holds a {arch} {ck['model_config']}, not {mcfg.to_dict()}; "
            "keep the size flags and --data of the interrupted run"
        )


def resume_data_fields(partition_info: dict) -> dict:
    """What a resume file records of its data: the prepared dataset's content hash and, for a latent
    cache, the decoder (autoencoder) its latents belong to (nothing for MNIST)."""
    d = partition_info.get("dataset") or {}
    out = {"data_hash": d["content_hash"]} if "content_hash" in d else {}
    if d.get("decoder"):
        out["decoder"] = d["decoder"]
    return out


def check_resume_data(ck: dict, partition_info: dict, resume_path) -> None:
    """Refuse to continue a run on other data than it was trained on: above all, latents of another
    autoencoder (files made before this was recorded are not checked)."""
    now = resume_data_fields(partition_info)
    if ck.get("decoder") != now.get("decoder") and ("decoder" in ck or "decoder" in now):
        raise ValueError(
            f"--resume: {resume_path} was trained on {ck.get('decoder') or 'images'}, but the data given is "
            f"{now.get('decoder') or 'images'}; latents of two autoencoders do not mix: keep the run's --data"
        )
    if "data_hash" in ck and ck["data_hash"] != now.get("data_hash"):
        raise ValueError(
            f"--resume: {resume_path} was trained on the dataset with content sha256 {ck['data_hash'][:12]}..., "
            "not on the data given; keep the run's --data"
        )


def uses_bf16(args: argparse.Namespace) -> bool:
    """Whether `--dtype` (auto resolved for the torch `--device`) asks for bfloat16 autocast. The run
    records the answer as `bf16`, the field its checkpoints and resume files have always had."""
    from models.precision import resolve_dtype

    return resolve_dtype(args.dtype, backend="torch", device=args.device) == "bfloat16"


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    from models.config import parse_widths

    widths = parse_widths(args.widths) if isinstance(args.widths, str) else tuple(args.widths)
    return TrainConfig(
        expert=args.expert,
        partition=args.partition,
        arch=getattr(args, "arch", "unet") or "unet",
        patch_size=getattr(args, "patch_size", 2),
        hidden_size=getattr(args, "hidden_size", 128),
        depth=getattr(args, "depth", 6),
        heads=getattr(args, "heads", 4),
        mlp_ratio=getattr(args, "mlp_ratio", 4.0),
        data=getattr(args, "data", None),
        widths=widths,
        steps=args.steps,
        batch_size=args.batch_size,
        lr=args.lr,
        warmup=args.warmup,
        ema_decay=args.ema_decay,
        bf16=uses_bf16(args),
        device=args.device,
        seed=args.seed,
        out=args.out or "",
        run_dir=args.run_dir or "",
        save_every=args.save_every,
        save_dtype=args.save_dtype,
        threads=args.threads,
        data_dir=args.data_dir,
        limit=args.limit,
        log_every=getattr(args, "log_every", 50),
        label_dropout=getattr(args, "label_dropout", 0.0) or 0.0,
    )


def save_resume_state(
    path: Path, model, ema, opt, rng: np.random.Generator, *, step: int, wall_s: float, history: list, **extra
) -> None:
    """Write what `--resume` needs (weights, EMA, optimizer, step, history, both RNG states, and
    `extra` for the caller's own checks) to `path`, atomically (a tmp file, then a rename)."""
    import torch

    tmp = Path(path).with_suffix(".tmp")
    torch.save(
        {
            "model": model.state_dict(),
            "ema": [e.cpu() for e in ema],
            "optimizer": opt.state_dict(),
            "step": step,
            "wall_s": wall_s,
            "history": history,
            "np_rng": rng.bit_generator.state,
            "torch_rng": torch.get_rng_state(),
            **extra,
        },
        tmp,
    )
    tmp.replace(path)


def restore_resume_state(ck: dict, model, ema, opt, rng: np.random.Generator) -> tuple[int, float, list]:
    """Load a `save_resume_state` dict into model, EMA, optimizer and RNGs; (step, wall_s, history)."""
    import torch

    model.load_state_dict(ck["model"])
    with torch.no_grad():
        for e, v in zip(ema, ck["ema"]):
            e.copy_(v)
    opt.load_state_dict(ck["optimizer"])
    rng.bit_generator.state = ck["np_rng"]
    torch.set_rng_state(ck["torch_rng"])
    return ck["step"], ck["wall_s"], ck["history"]


def data_name(info: dict) -> str:
    """'MNIST' or the prepared dataset's name and shape, for the start line."""
    d = info.get("dataset")
    return "MNIST" if d is None else f"{d['name']} ({'x'.join(map(str, d['sample_shape']))})"


def arch_summary(cfg: TrainConfig) -> str:
    """'unet widths [32, 64, 128]' or 'dit patch 2 hidden 128 depth 6 heads 4 mlp 4.0'."""
    if cfg.arch == "dit":
        return (
            f"dit patch {cfg.patch_size} hidden {cfg.hidden_size} depth {cfg.depth} heads {cfg.heads} "
            f"mlp {cfg.mlp_ratio:g}"
        )
    return f"unet widths {list(cfg.widths)}"


def train(args: argparse.Namespace) -> int:
    """CLI entry for `ddm-fleet train-expert --backend torch` (also under torchrun: data parallel)."""
    from training.distributed import detect

    cfg = config_from_args(args)
    images, labels, info = load_expert_data(cfg)
    dist_info = detect()
    if dist_info.is_main:
        print(
            f"expert {cfg.expert}: {info['num_images']} images of {data_name(info)}, classes {info['classes']}, "
            f"device {cfg.device}{' bf16' if cfg.bf16 else ''}, {arch_summary(cfg)}, "
            f"{cfg.steps} steps x batch {cfg.batch_size}"
            f"{f', data parallel x{dist_info.world_size}' if dist_info.enabled else ''}",
            flush=True,
        )
    stats = train_expert(cfg, images, labels, info, resume=args.resume, progress=not args.no_progress)
    if dist_info.is_main:
        print(
            f"saved {cfg.out}.safetensors: {stats['steps']} steps, final loss {stats['final_loss']}, "
            f"{stats['wall_s']} s",
            flush=True,
        )
    return 0
