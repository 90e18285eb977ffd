"""Distill the DDM ensemble (the experts + router of --checkpoints) into ONE dense UNet.

The student learns the ensemble's velocity u = sum_k r_k v_k (router weights r, `--strategy full`;
`top1` distills the one-expert route instead) at noised training images x_t = (1 - t) noise + t x,
the points flow matching trains on, with the teacher's velocity as the target (why these points
and not the ensemble's own trajectories: training/distill.py). The result is an ordinary expert
checkpoint, so a worker serves it like a monolith:

  ddm-fleet distill --checkpoints checkpoints --steps 2000 --out checkpoints/distilled
  ddm-fleet worker --checkpoint checkpoints/distilled.safetensors --expert 0 ...

Cost per step: one student training step plus the router and the experts chosen by the strategy
forward on the batch (full: all K), so about (K + 3) / 3 times an expert's training step.
Saves the checkpoint and <run-dir>/distill_resume.pt every --save-every steps; --resume continues.
"""

from __future__ import annotations

import argparse

from bus.options import add_device_option, add_threads_option
from dataset.options import add_data_dir_option


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument(
        "--checkpoints",
        default="checkpoints",
        metavar="DIR",
        help="teacher directory: router.safetensors and expert0..expert{K-1}.safetensors (default %(default)s)",
    )
    parser.add_argument(
        "--strategy",
        choices=("full", "top1"),
        default="full",
        help="how the teacher combines experts: full = router-weighted sum, top1 = argmax expert (default %(default)s)",
    )
    parser.add_argument(
        "--out", default="checkpoints/distilled", help="student checkpoint path without extension (default %(default)s)"
    )
    parser.add_argument("--run-dir", default="runs/distill", help="where distill_resume.pt lives (default %(default)s)")
    parser.add_argument("--resume", action="store_true", help="continue from <run-dir>/distill_resume.pt up to --steps")
    parser.add_argument("--widths", default=None, help="student UNet widths, e.g. 32,64,128 (default: the experts')")
    parser.add_argument("--steps", type=int, default=2000, help="optimizer steps in total (default %(default)s)")
    parser.add_argument("--batch-size", type=int, default=128, help="noised images per step (default %(default)s)")
    parser.add_argument(
        "--lr", type=float, default=1e-3, help="peak AdamW learning rate; warmup then cosine (default %(default)s)"
    )
    parser.add_argument("--warmup", type=int, default=100, help="linear LR warmup steps (default %(default)s)")
    parser.add_argument(
        "--ema-decay", type=float, default=0.999, help="EMA decay of the saved weights (default %(default)s)"
    )
    parser.add_argument(
        "--label-dropout",
        type=float,
        default=0.0,
        help="fraction of rows distilled with the label unknown (y = -1): the student gets a null "
        "label; needs experts trained with --label-dropout (default %(default)s)",
    )
    parser.add_argument("--seed", type=int, default=0, help="random seed (default %(default)s)")
    parser.add_argument(
        "--save-every", type=int, default=250, help="checkpoint + resume file every N steps (default %(default)s)"
    )
    parser.add_argument("--log-every", type=int, default=50, help="steps per loss_history entry (default %(default)s)")
    parser.add_argument(
        "--save-dtype",
        choices=("float16", "float32"),
        default="float16",
        help="dtype of the shipped weights (default %(default)s)",
    )
    add_device_option(parser)
    add_threads_option(parser)
    parser.add_argument(
        "--data",
        default=None,
        metavar="DIR",
        help="prepared dataset directory the experts were trained on (default: MNIST)",
    )
    add_data_dir_option(parser)
    parser.add_argument(
        "--limit", type=int, default=None, metavar="N", help="use only the first N train images (smoke runs)"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    import sys

    from dataset.mnist import DataError
    from models.config import parse_widths
    from training.datasets import load_split
    from training.distill import DistillConfig, DistillError, Teacher, distill

    try:
        cfg = DistillConfig(
            checkpoints=args.checkpoints,
            out=args.out,
            run_dir=args.run_dir,
            strategy=args.strategy,
            widths=parse_widths(args.widths) if args.widths else None,
            steps=args.steps,
            batch_size=args.batch_size,
            lr=args.lr,
            warmup=args.warmup,
            ema_decay=args.ema_decay,
            label_dropout=args.label_dropout,
            seed=args.seed,
            save_every=args.save_every,
            log_every=args.log_every,
            save_dtype=args.save_dtype,
            device=args.device,
            threads=args.threads,
            data_dir=args.data_dir,
            limit=args.limit,
        )
        teacher = Teacher.load(cfg.checkpoints, cfg.strategy, cfg.device)
        images, labels, _ = load_split(args.data, "train", data_dir=cfg.data_dir, limit=cfg.limit)
        print(
            f"distilling {teacher.num_experts} experts + router ({cfg.strategy}) from {cfg.checkpoints} into one "
            f"{teacher.spec.arch} on {len(images)} noised train images, {cfg.steps} steps x batch {cfg.batch_size}",
            flush=True,
        )
        stats = distill(cfg, teacher, images, labels, resume=args.resume, progress=not args.no_progress)
    except (DistillError, DataError, ValueError, RuntimeError) as exc:
        print(f"distill: error: {exc}", file=sys.stderr)
        return 2
    print(f"saved {cfg.out}.safetensors: {stats['steps']} steps, final loss {stats['final_loss']}, {stats['wall_s']} s")
    return 0
