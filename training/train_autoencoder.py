"""Train the KL autoencoder (models/autoencoder_torch.py) on a prepared dataset's train split.

Entry point: `train_autoencoder(cfg)` (called by `ddm-fleet train-autoencoder`). The loop:

    batch x [B, C, S, S] in [-1, 1] (shuffled each epoch), z ~ posterior(x), x' = decoder(z)
    loss = reconstruction (L1 or MSE, mean over pixels) + kl_weight * KL(posterior || N(0, I)) (mean over latents)
    AdamW, warmup + cosine LR, grad-norm clip 1.0

Every `save_every` steps and at the end it measures the latent scaling on train images (shift = mean,
scale = 1 / std of the posterior means, over up to `scale_images` images; `latent_range` = the largest
|z| seen, rounded up to 0.5) and the reconstruction PSNR on the val split (posterior mean, clipped to
[-1, 1]; up to `val_limit` images), then writes the checkpoint (models/autoencoder.py format) and
`<run_dir>/resume.pt` (weights, optimizer, step, history, RNG states), so `--resume` continues an
interrupted run.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from models.autoencoder import AutoencoderConfig, AutoencoderError

log = logging.getLogger(__name__)

LOSSES = ("l1", "mse")


@dataclass
class AETrainConfig:
    data: str
    out: str = "runs/autoencoder/autoencoder"
    run_dir: str = "runs/autoencoder"
    widths: tuple[int, ...] = (16, 32)
    patch: int = 1
    latent_channels: int = 4
    loss: str = "l1"
    kl_weight: float = 1e-4
    steps: int = 1000
    batch_size: int = 64
    lr: float = 2e-3
    warmup: int = 50
    min_lr_ratio: float = 0.05
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    seed: int = 0
    save_every: int = 250
    log_every: int = 25
    threads: int = 0
    device: str = "cpu"
    limit: int | None = None  # first N train images only
    val_limit: int | None = 2000  # val images for the PSNR
    scale_images: int = 5000  # train images the latent scaling is measured on

    def __post_init__(self) -> None:
        self.widths = tuple(int(w) for w in self.widths)
        for name in ("steps", "batch_size", "save_every", "log_every", "latent_channels", "scale_images", "patch"):
            if getattr(self, name) <= 0:
                raise AutoencoderError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        if self.loss not in LOSSES:
            raise AutoencoderError(f"--loss must be one of {', '.join(LOSSES)}, got {self.loss!r}")
        if not self.kl_weight >= 0:
            raise AutoencoderError(f"--kl-weight must be >= 0, got {self.kl_weight}")
        if not self.lr > 0:
            raise AutoencoderError(f"--lr must be positive, got {self.lr}")
        if self.val_limit is not None and self.val_limit <= 0:
            raise AutoencoderError(f"--val-limit must be positive, got {self.val_limit}")


def lr_at(step: int, cfg: AETrainConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    frac = min(1.0, (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


def load_data(cfg: AETrainConfig):
    """(train images uint8 [N, C, S, S], val images uint8 or None, the dataset's manifest). They stay
    uint8 (a quarter of float32's memory: 20,000 images of 3x256x256 are 3.9 GB) and become [-1, 1]
    floats a batch at a time (`as_model_batch`)."""
    from dataset.prepared import PreparedDataError, load_prepared, read_manifest

    manifest = read_manifest(cfg.data)
    if manifest.get("space") == "latent":
        raise PreparedDataError(
            f"{cfg.data} is a latent cache; train the autoencoder on the image dataset it came from"
        )
    train_u8, _, manifest = load_prepared(cfg.data, "train", limit=cfg.limit)
    if len(train_u8) < cfg.batch_size:
        raise AutoencoderError(f"{cfg.data} has {len(train_u8)} train images, fewer than --batch-size {cfg.batch_size}")
    val = None
    if "val" in manifest["splits"]:
        val = load_prepared(cfg.data, "val", limit=cfg.val_limit)[0]
    return train_u8, val, manifest


def as_model_batch(images_u8: np.ndarray):
    """uint8 images -> a float32 torch tensor in the model range [-1, 1] (`to_model_range`)."""
    import torch

    from dataset.prepared import to_model_range

    return torch.from_numpy(np.ascontiguousarray(to_model_range(np.asarray(images_u8))))


def model_config(cfg: AETrainConfig, shape: tuple[int, int, int]) -> AutoencoderConfig:
    c, s, w = shape
    if s != w:
        raise AutoencoderError(f"the data's images are {s}x{w}; the autoencoder takes square images")
    return AutoencoderConfig(
        in_channels=c, image_size=s, latent_channels=cfg.latent_channels, widths=cfg.widths, patch=cfg.patch
    )


def measure_scaling(model, images: np.ndarray, n: int, seed: int, batch: int = 256) -> tuple[float, float, float]:
    """(shift, scale, latent_range) from the posterior means of up to n images (a seeded random subset):
    shift = their mean, scale = 1 / their std, range = max |(mean - shift) * scale| rounded up to 0.5."""
    import torch

    idx = np.sort(np.random.default_rng(seed).permutation(len(images))[:n])
    means = []
    model.eval()
    with torch.no_grad():
        for i in range(0, len(idx), batch):
            xb = as_model_batch(images[idx[i : i + batch]])
            means.append(model.posterior(xb)[0].double().numpy())
    model.train()
    z = np.concatenate(means)
    shift, std = float(z.mean()), float(z.std())
    if not (np.isfinite(std) and std > 0):
        raise FloatingPointError(f"latent std is {std}: the encoder collapsed; lower --lr or --kl-weight")
    scale = 1.0 / std
    return shift, scale, math.ceil(float(np.abs((z - shift) * scale).max()) * 2) / 2


def val_psnr(model, images: np.ndarray | None, batch: int = 256) -> float | None:
    """Reconstruction PSNR (dB, peak 2 = the [-1, 1] range) of the posterior mean, over `images`."""
    import torch

    if images is None or not len(images):
        return None
    se, count = 0.0, 0
    model.eval()
    with torch.no_grad():
        for i in range(0, len(images), batch):
            xb = as_model_batch(images[i : i + batch])
            rec = model.decoder(model.posterior(xb)[0]).clamp(-1, 1)
            se += float(((rec.double() - xb.double()) ** 2).sum())
            count += xb.numel()
    model.train()
    return round(10.0 * math.log10(4.0 / max(se / count, 1e-20)), 3)


def train_autoencoder(cfg: AETrainConfig, resume: bool = False, progress: bool = True) -> dict:
    """Run the loop; returns the checkpoint's metadata (as written to `<out>.json`)."""
    import torch
    from tqdm import tqdm

    from models.autoencoder import load_autoencoder_meta, make_spec, save_autoencoder
    from models.autoencoder_torch import Autoencoder, count_params, kl_loss
    from models.checkpoint import torch_state_to_numpy

    if cfg.threads > 0:
        torch.set_num_threads(cfg.threads)
    images, val, manifest = load_data(cfg)
    acfg = model_config(cfg, tuple(images.shape[1:]))
    torch.manual_seed(cfg.seed)
    model = Autoencoder(acfg).to(cfg.device)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.99))
    rng = np.random.default_rng(cfg.seed)
    run_dir = Path(cfg.run_dir)
    resume_path = run_dir / "resume.pt"
    step, wall_before, history = 0, 0.0, []
    if resume:
        from training.train_torch import restore_resume_state

        if not resume_path.is_file():
            raise AutoencoderError(f"--resume: {resume_path} does not exist (start without --resume)")
        ck = torch.load(resume_path, map_location="cpu", weights_only=True)
        if ck.get("kind") != "autoencoder":
            raise AutoencoderError(f"--resume: {resume_path} is not an autoencoder resume file")
        if ck["model_config"] != acfg.to_dict():
            raise AutoencoderError(
                f"--resume: {resume_path} holds an autoencoder {ck['model_config']}, not {acfg.to_dict()}; "
                "keep --widths, --patch, --latent-channels and --data of the interrupted run"
            )
        if ck["dataset_hash"] != manifest["content_hash"]:
            raise AutoencoderError(f"--resume: {resume_path} was trained on other data; keep the run's --data")
        step, wall_before, history = restore_resume_state(ck, model, [], opt, rng)
        log.info("resumed from %s at step %d", resume_path, step)

    n, per_epoch = len(images), len(images) // cfg.batch_size
    dataset = {"name": manifest["name"], "path": str(cfg.data), "content_hash": manifest["content_hash"]}
    t_start = time.time()

    def save(final: bool) -> dict:
        shift, scale, lrange = measure_scaling(model, images, cfg.scale_images, cfg.seed)
        psnr = val_psnr(model, val)
        recent = [h["loss"] for h in history[-4:]]
        stats = {
            "backend": "torch",
            "steps": step,
            "images_seen": step * cfg.batch_size,
            "wall_s": round(wall_before + time.time() - t_start, 1),
            "final_loss": round(float(np.mean(recent)), 5) if recent else None,
            "val_psnr_db": psnr,
            "val_images": 0 if val is None else len(val),
            "loss_history": history,
            "complete": final and step >= cfg.steps,
            "params": count_params(model),
            "torch": torch.__version__,
            "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(cfg).items()},
        }
        meta = {
            "config": acfg.to_dict(),
            "spec": make_spec(acfg, scale_factor=scale, shift_factor=shift, latent_range=lrange),
            "dataset": dataset,
            "training": stats,
        }
        save_autoencoder(cfg.out, torch_state_to_numpy(model.state_dict()), meta)
        run_dir.mkdir(parents=True, exist_ok=True)
        from training.train_torch import save_resume_state

        save_resume_state(
            resume_path,
            model,
            [],
            opt,
            rng,
            step=step,
            wall_s=stats["wall_s"],
            history=history,
            kind="autoencoder",
            model_config=acfg.to_dict(),
            dataset_hash=manifest["content_hash"],
        )
        return load_autoencoder_meta(cfg.out)

    bar = tqdm(total=cfg.steps, initial=step, disable=not progress, desc="autoencoder", unit="step", dynamic_ncols=True)
    perm, pos = rng.permutation(n), 0
    win_loss = win_rec = 0.0
    win_n, win_t = 0, time.time()
    meta = None
    model.train()
    while step < cfg.steps:
        if pos + cfg.batch_size > per_epoch * cfg.batch_size:
            perm, pos = rng.permutation(n), 0
        x = as_model_batch(images[perm[pos : pos + cfg.batch_size]]).to(cfg.device)
        pos += cfg.batch_size
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg)
        rec, mean, logvar = model(x)
        err = rec - x
        rec_loss = err.abs().mean() if cfg.loss == "l1" else err.pow(2).mean()
        loss = rec_loss + cfg.kl_weight * kl_loss(mean, logvar)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        step += 1
        lv = float(loss.detach())
        if not math.isfinite(lv):
            raise FloatingPointError(f"loss became {lv} at step {step}; lower --lr")
        win_loss, win_rec, win_n = win_loss + lv, win_rec + float(rec_loss.detach()), win_n + 1
        bar.update(1)
        if step % cfg.log_every == 0 or step == cfg.steps:
            ips = win_n * cfg.batch_size / max(1e-6, time.time() - win_t)
            history.append({"step": step, "loss": round(win_loss / win_n, 5), "rec": round(win_rec / win_n, 5)})
            bar.set_postfix(loss=f"{win_loss / win_n:.4f}", img_s=f"{ips:.0f}", lr=f"{lr_at(step, cfg):.1e}")
            if not progress:
                log.info("autoencoder step %d loss %.4f %.0f img/s", step, win_loss / win_n, ips)
            win_loss = win_rec = 0.0
            win_n, win_t = 0, time.time()
        if step % cfg.save_every == 0 and step < cfg.steps:
            save(final=False)
    bar.close()
    meta = save(final=True)
    return meta
