"""Measure generation quality: a monolith against the DDM with each routing strategy.

Trains (once, then cached under the data dir) two independent MNIST judges that must each reach
99% test accuracy: judge 1, a torch CNN, and judge 2, a JAX/Flax residual CNN with its own recipe.
Generates the same digits with the same seeds for every configuration through the fleet's public
path (a local in-process fleet by default, or --nats for a running fleet's DDM rows), and prints one
table: conditional accuracy (judge agrees with the requested digit) and FID in each judge's feature
space against the 10k test images, side by side, how often the two judges agree, experts used per
step and inference GFLOPs per image.

--rescore DIR generates nothing: it re-scores every <configuration>.npz in DIR with both judges:
images float32 [N,1,32,32] in [-1,1] or uint8 0..255 (read as x/127.5 - 1), labels int [N] (the
requested digits; -1 on every row of an unconditional file), usage [N,K] optional.
  conditional files: accuracy per judge with a 95% Wilson interval, FID with a 95% bootstrap
    interval, judge agreement, next to real validation digits with the same labels (real-val);
  unconditional files: no accuracy (no digit was asked for); each judge's predicted class histogram,
    its total variation (TV) distance to uniform with a bootstrap interval, entropy and chi-square p,
    and FID, next to as many random real validation digits;
  paired comparisons (rows share digits and seeds row for row): McNemar's test on per-image
    correctness (exact binomial p), accuracy / TV / FID differences with paired bootstrap intervals.
    By default every ddm-* row and distilled against monolith and every ddm-* row against distilled,
    within each kind; --compare A,B picks pairs instead.
  The quality study's names: monolith, ddm-top1, ddm-top2, ddm-full, ddm-oracle, distilled (.npz),
  and uncond-monolith, uncond-ddm-top1, ..., uncond-distilled for unconditional files.

Any prepared dataset (--data DIR, the one the fleet was trained on): the images are generated,
saved (--save-images, else a temporary directory) and re-scored as above. Judges 1 and 2 read the
images' digit view (luminance, background -1) when the classes are the digits 0-9 (colour MNIST);
the data judge, a CNN trained once on DIR's train split and cached there, adds accuracy and FID in
that data's own features (RGB, any size); a palette in DIR's manifest adds colour correctness
(McNemar-paired between configurations).

examples:
  ddm-fleet eval --data data/colour-mnist --checkpoints checkpoints/colour --per-class 100
  ddm-fleet eval --rescore out/colour --data data/colour-mnist   # saved colour images, all judges
  ddm-fleet eval                                   # monolith, top1, top2, full, oracle
  ddm-fleet eval --configs top1,oracle --per-class 20 --steps 20
  ddm-fleet eval --configs top1 --guidance 2 --checkpoints ck-null    # guided DDM rows (ddm-top1-cfg2)
  ddm-fleet eval --save-images out/eval --json     # keep the images for an independent re-score
  ddm-fleet eval --rescore out/eval                # both judges on those same images, paired tests
  ddm-fleet eval --rescore out/eval --compare ddm-top1,monolith --compare ddm-top1,ddm-full
  ddm-fleet eval --rescore out/eval --bootstrap 1000 --json   # steadier interval ends, machine-readable
  ddm-fleet eval --rescore out/eval --json-out out/eval/scores.json   # the table, and the numbers kept
"""

from __future__ import annotations

import argparse

from client.guidance import guidance_scale
from dataset.options import add_data_dir_option


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from bus.options import add_device_option, add_dtype_option, add_nats_option
    from evaluation.run import add_sampling_arguments

    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument(
        "--configs",
        default="monolith,top1,top2,full,oracle",
        help="comma list of monolith, top1, top2 (topK), full, oracle, sample (default %(default)s)",
    )
    parser.add_argument(
        "--checkpoints",
        default="checkpoints",
        metavar="DIR",
        help="expert<k>.safetensors, router.safetensors, partition.json, monolith.safetensors",
    )
    parser.add_argument(
        "--monolith", default=None, metavar="PATH", help="monolith checkpoint (default DIR/monolith.safetensors)"
    )
    parser.add_argument("--per-class", type=int, default=50, metavar="N", help="images per digit (default %(default)s)")
    add_sampling_arguments(parser)  # --steps, --solver, --seed, --images-per-job: as sample_inprocess's
    add_nats_option(
        parser,
        default=None,
        help="NATS server of a running fleet for the DDM rows, or a comma-separated "
        "list of a cluster's nodes (default: a local in-process fleet)",
    )
    add_device_option(parser, default=None, help_suffix=", of the local fleet's expert workers")
    add_dtype_option(
        parser,
        help="the local fleet's experts' compute type: auto = bfloat16 where the device computes it natively "
        "(CPU with AMX or AVX512-BF16, CUDA compute capability >= 8.0), else float32 (default %(default)s)",
    )
    add_data_dir_option(parser)
    parser.add_argument(
        "--data",
        default=None,
        metavar="DIR",
        help="the prepared dataset (`ddm-fleet data prepare`) the fleet was trained on: its test split is FID's "
        "reference, a judge trained on it (the data judge) joins judges 1 and 2, and a recorded palette "
        "adds the colour check; the images are saved and scored with intervals as --rescore does "
        "(default: MNIST)",
    )
    parser.add_argument(
        "--save-images", default=None, metavar="DIR", help="write <configuration>.npz with images, labels, usage"
    )
    parser.add_argument(
        "--rescore",
        default=None,
        metavar="DIR",
        help="generate nothing; re-score every <configuration>.npz in DIR with both judges",
    )
    parser.add_argument(
        "--compare",
        action="append",
        default=None,
        metavar="A,B",
        help="with --rescore: paired tests of configuration A against B (file stems, e.g. "
        "ddm-top1,monolith); repeatable; default: every ddm-* row and distilled vs monolith, "
        "every ddm-* row vs distilled",
    )
    parser.add_argument(
        "--bootstrap",
        type=int,
        default=200,
        metavar="B",
        help="with --rescore: bootstrap resamples for the FID/TV intervals and paired differences "
        "(fixed seed 0; 0 turns them off; default %(default)s)",
    )
    parser.add_argument(
        "--guidance",
        type=guidance_scale,
        default=1.0,
        metavar="S",
        help="classifier-free guidance scale of the DDM rows (1 = off, the default, also on a fleet whose default "
        "guides; rows named <config>-cfgS); needs experts with a null label; monolith rows stay unguided",
    )
    parser.add_argument("--json", action="store_true", help="print the results as JSON instead of a table")
    parser.add_argument(
        "--json-out",
        metavar="FILE",
        default=None,
        help="also write the results as JSON (what --json prints) to FILE; the table still prints",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    import asyncio
    import os

    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
    _check_json_out(args)
    if args.rescore:
        return _rescore(args)
    from evaluation.judges import Judges
    from evaluation.run import Config, baseline_row, evaluate, format_table

    try:
        configs = [Config.parse(c).guided(args.guidance) for c in args.configs.split(",") if c.strip()]
    except ValueError as e:
        raise SystemExit(f"ddm-fleet eval: {e}") from e
    if args.per_class < 2 or args.steps < 1:
        raise SystemExit("ddm-fleet eval: --per-class must be >= 2 and --steps >= 1")
    if args.data:
        return _generate_then_rescore(args, configs)
    spec = _eval_spec(args, configs, save_dir=args.save_images)
    try:
        judges = Judges.load(args.data_dir, progress=not args.no_progress)
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(f"ddm-fleet eval: {e}") from e
    try:
        rows = asyncio.run(evaluate(spec, judges))
    except FileNotFoundError as e:
        raise SystemExit(f"ddm-fleet eval: {e}") from e
    rows.append(baseline_row(judges, spec))  # real digits scored the same way, for scale
    _report(args, [r.as_dict() for r in rows], lambda: format_table(rows, spec, judges))
    return 0


def _check_json_out(args: argparse.Namespace) -> None:
    """Refuse a --json-out FILE that cannot be written before any image is generated or judged."""
    import os
    from pathlib import Path

    if not getattr(args, "json_out", None):
        return
    path = Path(args.json_out)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise SystemExit(f"ddm-fleet eval: --json-out {args.json_out}: {e}") from e
    if path.is_dir() or not os.access(path.parent, os.W_OK):
        raise SystemExit(f"ddm-fleet eval: --json-out {args.json_out}: not a file this user can write")


def _report(args: argparse.Namespace, doc, table) -> None:
    """Print the JSON document (--json) or the table (`table()`), and write the document to --json-out."""
    import json
    from pathlib import Path

    text = json.dumps(doc, indent=2)
    print(text if args.json else table())
    if getattr(args, "json_out", None):  # its directory made by _check_json_out, before the run
        try:
            Path(args.json_out).write_text(text + "\n")
        except OSError as e:
            raise SystemExit(f"ddm-fleet eval: --json-out {args.json_out}: {e}") from e


def _eval_spec(args: argparse.Namespace, configs, **extra):
    """The EvalSpec of the command line's generation options (`extra`: save_dir, num_classes)."""
    from evaluation.run import EvalSpec

    return EvalSpec(
        configs=configs,
        checkpoints=args.checkpoints,
        monolith=args.monolith,
        per_class=args.per_class,
        steps=args.steps,
        solver=args.solver,
        seed=args.seed,
        job_size=args.images_per_job,
        nats_url=args.nats,
        data_dir=args.data_dir,
        progress=not args.no_progress,
        device=args.device,
        dtype=args.dtype,
        guidance=args.guidance,
        **extra,
    )


def _generate_then_rescore(args: argparse.Namespace, configs) -> int:
    """`eval --data DIR`: generate every configuration through the fleet, save it, then re-score the
    directory with the dataset's judges (intervals, paired comparisons)."""
    import asyncio
    import tempfile

    from dataset.prepared import PreparedDataError, read_manifest
    from evaluation.run import evaluate

    try:
        manifest = read_manifest(args.data)
    except (PreparedDataError, FileNotFoundError, OSError) as e:
        raise SystemExit(f"ddm-fleet eval: --data {args.data}: {e}") from e
    classes = len(manifest.get("class_names") or [])
    if not classes:
        raise SystemExit(f"ddm-fleet eval: --data {args.data} is unlabelled; evaluation asks for classes")
    save = args.save_images or tempfile.mkdtemp(prefix="ddm-eval-")
    spec = _eval_spec(args, configs, save_dir=save, num_classes=classes)
    from client.jobs import JobFailed

    try:
        asyncio.run(evaluate(spec, score=False))
    except (FileNotFoundError, ValueError, JobFailed) as e:
        raise SystemExit(f"ddm-fleet eval: {e}") from e
    print(f"images saved in {save}", flush=True)
    args.rescore = save
    return _rescore(args)


def _rescore(args: argparse.Namespace) -> int:
    from evaluation.judges import Judges
    from evaluation.rescore import (
        UNCONDITIONAL,
        SavedImagesError,
        comparisons,
        format_rescore_table,
        load_dir,
        real_baseline,
        real_baseline_unconditional,
        rescore_dir,
    )

    pairs = None
    if args.compare:
        pairs = [tuple(p.strip() for p in c.split(",")) for c in args.compare]
        if any(len(p) != 2 or not all(p) for p in pairs):
            raise SystemExit(f"ddm-fleet eval: --compare takes A,B (two configuration names), got {args.compare}")
    if args.bootstrap < 0:
        raise SystemExit("ddm-fleet eval: --bootstrap must be >= 0")
    boot = {"resamples": args.bootstrap, "seed": 0}
    notes: list[str] = []
    try:
        # fail on a wrong DIR, a bad file or a --compare name before loading (or training) any judge
        saved = load_dir(args.rescore)
        found = sorted(s.name for s in saved)
        missing = sorted({n for pair in pairs or () for n in pair} - set(found))
        if missing:
            raise SavedImagesError(f"--compare names {', '.join(missing)}; the saved configurations are {found}")
        judges = Judges.load(args.data_dir, progress=not args.no_progress, dataset=args.data)
        rows = rescore_dir(args.rescore, judges, progress=not args.no_progress, saved=saved, **boot)
        del saved
        pairs_done, pair_notes = comparisons(rows, pairs)
        notes += pair_notes
        try:  # real digits for scale; too many of one digit for the validation split is a note, not a failure
            baseline = real_baseline(args.rescore, judges, args.data_dir, **boot)
        except ValueError as e:
            baseline = None
            notes.append(f"no conditional real-digit row: {e}")
        uncond = [r for r in rows if r.kind == UNCONDITIONAL]
        uncond_baseline = None
        if uncond:
            try:
                uncond_baseline = real_baseline_unconditional(uncond[0].score.n, judges, args.data_dir, **boot)
            except ValueError as e:
                notes.append(f"no unconditional real-digit row: {e}")
    except (SavedImagesError, ValueError) as e:
        raise SystemExit(f"ddm-fleet eval --rescore: {e}") from e
    doc = {
        "judges": {
            "judge1_test_accuracy": judges.test_accuracy1,
            "judge2_test_accuracy": judges.test_accuracy2,
            "test_agreement": judges.test_agreement,
            **(
                {"data_judge_test_accuracy": judges.test_accuracy_data, "dataset": judges.dataset}
                if judges.data_judge is not None
                else {}
            ),
        },
        "bootstrap": boot,
        "rows": [r.as_dict() for r in rows],
        "real_baseline": baseline.as_dict() if baseline is not None else None,
        "real_baseline_unconditional": uncond_baseline.as_dict() if uncond_baseline else None,
        "comparisons": [c.as_dict() for c in pairs_done],
        "notes": notes,
    }
    _report(
        args,
        doc,
        lambda: format_rescore_table(
            rows,
            judges,
            args.rescore,
            baseline,
            unconditional_baseline=uncond_baseline,
            comparisons=pairs_done,
            notes=notes,
            resamples=args.bootstrap,
        ),
    )
    return 0
