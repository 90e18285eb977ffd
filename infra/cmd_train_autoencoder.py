"""Train a small KL autoencoder on a prepared dataset, for latent-space experts.

The encoder maps each image [C, S, S] to latents [c, S/f, S/f] (f = patch * 2 ** (number of widths - 1)), the
decoder maps them back; the loss is reconstruction (L1 or MSE) plus a small KL term. The checkpoint
(`<out>.safetensors` + `<out>.json`) stores the spec (image and latent shapes, downsampling factor,
the scale and shift that bring the train latents to mean 0, variance 1), the reconstruction PSNR on
the val split and a content hash that names this autoencoder. Then `ddm-fleet data encode` caches the
dataset's latents, and partition / train-expert / train-router take that cache as `--data`.

Examples:
  ddm-fleet train-autoencoder --data data/colour-mnist --out runs/colour-latent/autoencoder
  ddm-fleet train-autoencoder --data data/colour-mnist --widths 16,32,64 --out runs/ae8   # 4x8x8 latents
  ddm-fleet train-autoencoder --data data/colour-mnist --out runs/colour-latent/autoencoder --resume --steps 4000
  ddm-fleet train-autoencoder --data data/colour-mnist-256px --patch 8 --widths 64 --batch-size 16 \
      --out runs/latent256/autoencoder          # 3x256x256 -> 4x32x32, Stable Diffusion's 8x geometry
"""

from __future__ import annotations

import argparse

from bus.options import add_device_option, add_threads_option


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument(
        "--data", required=True, metavar="DIR", help="a prepared image dataset (`ddm-fleet data prepare`)"
    )
    parser.add_argument(
        "--out",
        default="runs/autoencoder/autoencoder",
        metavar="PATH",
        help="checkpoint path without suffix (default %(default)s)",
    )
    parser.add_argument(
        "--run-dir", default=None, metavar="DIR", help="where resume.pt lives (default runs/<the --out's name>)"
    )
    parser.add_argument(
        "--widths",
        default="16,32",
        help="channels per level; each level after the first halves the size (default %(default)s: 32 -> 16)",
    )
    parser.add_argument(
        "--patch",
        type=int,
        default=1,
        help="fold each PxP pixel block into channels before the first level (and unfold after the decoder): "
        "large images at 1/P of the convolution cost; downsampling = P * 2 ** (widths - 1) (default %(default)s)",
    )
    parser.add_argument("--latent-channels", type=int, default=4, help="latent channels c (default %(default)s)")
    parser.add_argument("--loss", choices=("l1", "mse"), default="l1", help="reconstruction loss (default %(default)s)")
    parser.add_argument("--kl-weight", type=float, default=1e-4, help="weight of the KL term (default %(default)s)")
    parser.add_argument("--steps", type=int, default=1000, help="optimizer steps in total (default %(default)s)")
    parser.add_argument("--batch-size", type=int, default=64, help="images per step (default %(default)s)")
    parser.add_argument("--lr", type=float, default=2e-3, help="peak AdamW learning rate (default %(default)s)")
    parser.add_argument("--warmup", type=int, default=50, help="linear warmup steps (default %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="init and shuffling seed (default %(default)s)")
    parser.add_argument(
        "--save-every", type=int, default=250, help="steps between checkpoint saves (default %(default)s)"
    )
    parser.add_argument("--limit", type=int, default=None, metavar="N", help="use only the first N train images")
    parser.add_argument(
        "--val-limit",
        type=int,
        default=2000,
        metavar="N",
        help="val images the PSNR is measured on (default %(default)s)",
    )
    add_device_option(parser)
    add_threads_option(parser)
    parser.add_argument("--resume", action="store_true", help="continue from <run-dir>/resume.pt up to --steps")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar (log lines instead)")


def run(args: argparse.Namespace) -> int:
    import sys
    from pathlib import Path

    from dataset.mnist import DataError
    from models.autoencoder import AutoencoderError
    from models.config import parse_widths
    from training.train_autoencoder import AETrainConfig, train_autoencoder

    try:
        cfg = AETrainConfig(
            data=args.data,
            out=args.out,
            run_dir=args.run_dir or str(Path("runs") / Path(args.out).name),
            widths=parse_widths(args.widths),
            patch=args.patch,
            latent_channels=args.latent_channels,
            loss=args.loss,
            kl_weight=args.kl_weight,
            steps=args.steps,
            batch_size=args.batch_size,
            lr=args.lr,
            warmup=args.warmup,
            seed=args.seed,
            save_every=args.save_every,
            limit=args.limit,
            val_limit=args.val_limit,
            device=args.device,
            threads=args.threads,
        )
        print(
            f"autoencoder: {args.data}, widths {list(cfg.widths)}, patch {cfg.patch} (downsample "
            f"{cfg.patch * 2 ** (len(cfg.widths) - 1)}), "
            f"{cfg.latent_channels} latent channels, {cfg.loss} + {cfg.kl_weight:g} KL, "
            f"{cfg.steps} steps x batch {cfg.batch_size}",
            flush=True,
        )
        meta = train_autoencoder(cfg, resume=args.resume, progress=not args.no_progress)
    except (AutoencoderError, DataError, ValueError, FloatingPointError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    spec, stats = meta["spec"], meta["training"]
    print(
        f"saved {cfg.out}.safetensors: latents {'x'.join(map(str, spec['latent_shape']))}, scale "
        f"{spec['scale_factor']:.4g}, val PSNR {stats['val_psnr_db']} dB, {stats['steps']} steps, {stats['wall_s']} s"
    )
    print(f"content hash: {meta['content_hash']}")
    return 0
