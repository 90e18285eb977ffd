"""Measure generation quality: a monolith against the DDM with each routing strategy.

Trains (once, then cached under the data dir) an MNIST classifier that must reach 99% test
accuracy, generates the same digits with the same seeds for every configuration through the
fleet's public path (a local in-process fleet by default, or --nats for a running fleet's DDM
rows), and prints one table: conditional accuracy (classifier agrees with the requested digit),
FID in the classifier's feature space against the 10k test images, experts used per step and
inference GFLOPs per image.

examples:
  ddm-fleet eval                                   # monolith, top1, top2, full, oracle
  ddm-fleet eval --configs top1,oracle --per-class 20 --steps 20
  ddm-fleet eval --save-images out/eval --json     # keep the images for an independent re-score
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--configs", default="monolith,top1,top2,full,oracle",
                        help="comma list of monolith, top1, top2 (topK), full, oracle (default %(default)s)")
    parser.add_argument("--checkpoints", default="checkpoints", metavar="DIR",
                        help="expert<k>.safetensors, router.safetensors, partition.json, monolith.safetensors")
    parser.add_argument("--monolith", default=None, metavar="PATH", help="monolith checkpoint (default DIR/monolith.safetensors)")
    parser.add_argument("--per-class", type=int, default=50, metavar="N", help="images per digit (default %(default)s)")
    parser.add_argument("--steps", type=int, default=40, help="solver steps (default %(default)s)")
    parser.add_argument("--solver", choices=("euler", "heun"), default="euler")
    parser.add_argument("--seed", type=int, default=0, help="first job seed (default %(default)s)")
    parser.add_argument("--job-size", type=int, default=50, metavar="N", help="images per submitted job (default %(default)s)")
    parser.add_argument("--nats", default=None, metavar="URL", help="use a running fleet for the DDM rows instead of a local one")
    parser.add_argument("--data-dir", default=None, help="MNIST + classifier cache (default $DDM_DATA_DIR or ./data)")
    parser.add_argument("--save-images", default=None, metavar="DIR", help="write <configuration>.npz with images, labels, usage")
    parser.add_argument("--json", action="store_true", help="also print the rows as JSON")
    parser.add_argument("--no-progress", action="store_true")


def run(args: argparse.Namespace) -> int:
    import asyncio
    import json
    import os

    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
    from coordinator.evaluation.run import Config, EvalSpec, evaluate, format_table

    try:
        configs = [Config.parse(c) for c in args.configs.split(",") if c.strip()]
    except ValueError as e:
        raise SystemExit(f"ddm-fleet eval: {e}")
    if args.per_class < 2 or args.steps < 1:
        raise SystemExit("ddm-fleet eval: --per-class must be >= 2 and --steps >= 1")
    spec = EvalSpec(configs=configs, checkpoints=args.checkpoints, monolith=args.monolith, per_class=args.per_class,
                    steps=args.steps, solver=args.solver, seed=args.seed, job_size=args.job_size, nats_url=args.nats,
                    data_dir=args.data_dir, save_dir=args.save_images, progress=not args.no_progress)
    try:
        rows = asyncio.run(evaluate(spec))
    except FileNotFoundError as e:
        raise SystemExit(f"ddm-fleet eval: {e}")
    print(format_table(rows, spec))
    if args.json:
        print(json.dumps([{"config": r.config.name, "accuracy": r.accuracy, "fid": r.fid,
                           "experts_per_step": r.experts_per_step, "flops_per_image": r.flops_per_image,
                           "seconds": r.seconds, "n": r.n, "per_class_accuracy": r.per_class_accuracy,
                           "predicted_counts": r.predicted_counts} for r in rows], indent=2))
    return 0
