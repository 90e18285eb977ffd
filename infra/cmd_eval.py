"""Measure generation quality: a monolith against the DDM with each routing strategy.

Trains (once, then cached under the data dir) two independent MNIST judges that must each reach
99% test accuracy: judge 1, a torch CNN, and judge 2, a JAX/Flax residual CNN with its own recipe.
Generates the same digits with the same seeds for every configuration through the fleet's public
path (a local in-process fleet by default, or --nats for a running fleet's DDM rows), and prints one
table: conditional accuracy (judge agrees with the requested digit) and FID in each judge's feature
space against the 10k test images, side by side, how often the two judges agree, experts used per
step and inference GFLOPs per image.

--rescore DIR generates nothing: it re-scores every <configuration>.npz that --save-images wrote
to DIR with both judges and prints the same side-by-side columns.

examples:
  ddm-fleet eval                                   # monolith, top1, top2, full, oracle
  ddm-fleet eval --configs top1,oracle --per-class 20 --steps 20
  ddm-fleet eval --save-images out/eval --json     # keep the images for an independent re-score
  ddm-fleet eval --rescore out/eval                # both judges on those same images
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
    parser.add_argument("--device", default=None,
                        help="device of the local fleet's expert workers, e.g. cuda (default: the CPU)")
    parser.add_argument("--data-dir", default=None, help="MNIST + classifier cache (default $DDM_DATA_DIR or ./data)")
    parser.add_argument("--save-images", default=None, metavar="DIR", help="write <configuration>.npz with images, labels, usage")
    parser.add_argument("--rescore", default=None, metavar="DIR",
                        help="generate nothing; re-score every <configuration>.npz in DIR with both judges")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON instead of the table (as bench and fuzz do)")
    parser.add_argument("--no-progress", action="store_true")


def run(args: argparse.Namespace) -> int:
    import asyncio
    import json
    import os

    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
    if args.rescore:
        return _rescore(args)
    from evaluation.judges import Judges
    from evaluation.run import Config, EvalSpec, baseline_row, evaluate, format_table

    try:
        configs = [Config.parse(c) for c in args.configs.split(",") if c.strip()]
    except ValueError as e:
        raise SystemExit(f"ddm-fleet eval: {e}")
    if args.per_class < 2 or args.steps < 1:
        raise SystemExit("ddm-fleet eval: --per-class must be >= 2 and --steps >= 1")
    spec = EvalSpec(configs=configs, checkpoints=args.checkpoints, monolith=args.monolith, per_class=args.per_class,
                    steps=args.steps, solver=args.solver, seed=args.seed, job_size=args.job_size, nats_url=args.nats,
                    data_dir=args.data_dir, save_dir=args.save_images, progress=not args.no_progress,
                    device=args.device)
    try:
        judges = Judges.load(args.data_dir, progress=not args.no_progress)
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(f"ddm-fleet eval: {e}")
    try:
        rows = asyncio.run(evaluate(spec, judges))
    except FileNotFoundError as e:
        raise SystemExit(f"ddm-fleet eval: {e}")
    rows.append(baseline_row(judges, spec))  # real digits scored the same way, for scale
    if args.json:
        print(json.dumps([r.as_dict() for r in rows], indent=2))
    else:
        print(format_table(rows, spec, judges))
    return 0


def _rescore(args: argparse.Namespace) -> int:
    import json

    from evaluation.judges import Judges
    from evaluation.rescore import (SavedImagesError, format_rescore_table, real_baseline, rescore_dir,
                                    saved_configurations)

    try:
        saved_configurations(args.rescore)  # fail on a wrong DIR before loading (or training) any judge
        judges = Judges.load(args.data_dir, progress=not args.no_progress)
        rows = rescore_dir(args.rescore, judges)
        baseline = real_baseline(args.rescore, judges, args.data_dir)
    except (SavedImagesError, ValueError) as e:
        raise SystemExit(f"ddm-fleet eval --rescore: {e}")
    if not args.json:
        print(format_rescore_table(rows, judges, args.rescore, baseline))
    else:
        print(json.dumps({"judges": {"judge1_test_accuracy": judges.test_accuracy1,
                                     "judge2_test_accuracy": judges.test_accuracy2,
                                     "test_agreement": judges.test_agreement},
                          "rows": [r.as_dict() for r in rows], "real_baseline": baseline.as_dict()}, indent=2))
    return 0
