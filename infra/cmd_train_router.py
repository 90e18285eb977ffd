"""Train the router r(x_t, t, y) -> K logits that predicts which expert's partition a noisy sample
belongs to, under the experts' own noising (t ~ U[0, 1], x_t = (1 - t) noise + t x).

Reads the partition manifest and its dataset (MNIST, or the prepared dataset it was made from:
`--data DIR`, refused when it is another), trains a small CNN for the data's image shape and classes
on CPU with a tqdm bar (loss, accuracy), measures top-1 accuracy in 10 t bins on the val split (label
given and label unknown; for a `features` partition the val images are assigned through judge 2's
features, evaluation/features.py; a prepared dataset without a val split is not evaluated), and writes
<out>.safetensors + <out>.json (the accuracy table is in the JSON under "accuracy_vs_t", the model
spec under "spec": the fleet's sample shape and classes, which the coordinator serves).
Every --save-every steps and at the end it writes <run-dir>/router_resume.pt (network, optimizer,
LR schedule, step, RNG states); after an interruption, the same command with --resume continues
from there up to --steps on the same sample stream (it refuses a file from another --partition /
--limit or another --width). Example:

    ddm-fleet train-router --partition checkpoints/partition.json --steps 1500 --out checkpoints/router
    ddm-fleet train-router --partition checkpoints/partition.json --steps 1500 --out checkpoints/router --resume
"""

from __future__ import annotations

import argparse

from bus.options import add_threads_option
from dataset.options import add_data_dir_option


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--partition", required=True, metavar="PATH", help="partition manifest JSON (from `ddm-fleet partition`)"
    )
    parser.add_argument(
        "--out", default="checkpoints/router", help="checkpoint stem: writes <out>.safetensors + <out>.json"
    )
    parser.add_argument("--steps", type=int, default=1500, help="optimizer steps in total (default %(default)s)")
    parser.add_argument("--batch-size", type=int, default=128, help="images per step (default %(default)s)")
    parser.add_argument(
        "--lr", type=float, default=2e-3, help="peak AdamW learning rate; cosine decay (default %(default)s)"
    )
    parser.add_argument(
        "--label-dropout",
        type=float,
        default=0.5,
        help="fraction of samples trained with the class label hidden, so the router also "
        "works without a label and learns from pixels (default %(default)s)",
    )
    parser.add_argument(
        "--width", type=int, default=16, help="first conv channels (multiple of 8; default %(default)s)"
    )
    parser.add_argument("--seed", type=int, default=0, help="random seed (default %(default)s)")
    parser.add_argument(
        "--limit",
        type=int,
        default=None,
        metavar="N",
        help="train split size the partition was made with (its --limit)",
    )
    parser.add_argument(
        "--val-limit", type=int, default=None, help="evaluate on the first N val images (default: all 10k)"
    )
    parser.add_argument("--bins", type=int, default=10, help="t bins for the accuracy report (default %(default)s)")
    parser.add_argument("--run-dir", default="runs/router", help="where router_resume.pt lives (default %(default)s)")
    parser.add_argument(
        "--save-every",
        type=int,
        default=500,
        help="write the resume file every N steps, and at the end (default %(default)s)",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue from <run-dir>/router_resume.pt up to --steps; pass the same --partition, "
        "--limit, --width (and, for identical weights, the other flags) as the interrupted run",
    )
    add_threads_option(parser, default=1, default_help="the CPU is shared")
    parser.add_argument(
        "--features",
        default=None,
        metavar="CHOICE",
        help="a features partition: the extractor to ask for val targets when it moved (e.g. torch:NEWPATH or "
        "dinov2:NEWDIR; its weights must be the recorded ones; default: the one the partition names)",
    )
    parser.add_argument(
        "--data",
        default=None,
        metavar="DIR",
        help="prepared dataset directory; must be the partition's (default: the partition's dataset, or MNIST)",
    )
    add_data_dir_option(parser)


def run(args: argparse.Namespace) -> int:
    import sys

    import torch

    from dataset.mnist import DataError
    from dataset.partition import PartitionError, load_manifest
    from models.router import RouterError, save_router
    from models.spec import with_spec
    from training.datasets import describe, has_split, load_split, resolve_data, spec_for
    from training.train_router import RouterTrainConfig, accuracy_vs_t, format_accuracy_table, train_router

    torch.set_num_threads(max(1, args.threads))
    try:
        manifest = load_manifest(args.partition)
        cfg = RouterTrainConfig(
            steps=args.steps,
            batch_size=args.batch_size,
            lr=args.lr,
            label_dropout=args.label_dropout,
            seed=args.seed,
            width=args.width,
            run_dir=args.run_dir,
            save_every=args.save_every,
        )
        path, ref = resolve_data(manifest, args.data, args.partition)
        images, labels, _ = load_split(path, manifest.split, data_dir=args.data_dir, limit=args.limit)
        net, stats = train_router(manifest, images, labels, cfg, resume=args.resume, manifest_file=str(args.partition))
        del images
        acc = None
        if has_split(path, "val"):
            xv, yv, _ = load_split(path, "val", data_dir=args.data_dir, limit=args.val_limit)
            xa = xv  # what the partition assigns the val images by
            if ref is not None and ref.is_latent and manifest.dataset is not None and not manifest.dataset.is_latent:
                # a router on latents whose partition clusters the source images: assign by those images
                xa, _, _ = load_split(manifest.dataset.path, "val", limit=args.val_limit)
            fv = None
            if manifest.method == "features":  # val targets come from the same extractor's features
                from evaluation.features import ExtractorError, extractor_for

                if manifest.features is None:
                    raise PartitionError(f"{args.partition}: a features partition without its extractor's name")
                try:
                    ex = extractor_for(manifest.features.extractor, args.data_dir, choice=args.features)
                except ExtractorError as e:
                    raise PartitionError(str(e)) from e
                fv = ex.features(xa)
            targets = manifest.assign(xa, yv, seed=args.seed + 1, features=fv)
            acc = accuracy_vs_t(
                net, manifest, xv, yv, bins=args.bins, seed=args.seed + 1, progress=True, targets=targets
            )
        else:
            print(f"{ref.describe() if ref else 'the dataset'} has no val split: accuracy vs t not measured")
        meta = {
            "partition": {
                "file": str(args.partition),
                "method": manifest.method,
                "num_experts": manifest.num_experts,
                "classes": [e.classes for e in manifest.experts],
                "class_to_expert": manifest.class_owner,
            },
            "training": stats,
            "accuracy_vs_t": acc,
        }
        if ref is not None:
            meta["partition"]["dataset"] = describe(ref)
        spec = spec_for(ref, null_label=cfg.label_dropout > 0, arch="router")
        out_path = save_router(args.out, net, with_spec(meta, spec))
    except (RouterError, PartitionError, DataError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(
        f"trained {stats['steps']} steps in {stats['wall_s']} s: loss {stats['final_loss']}, "
        f"train acc {stats['final_train_acc']}"
    )
    if acc is not None:
        print(format_accuracy_table(acc))
    print(f"wrote {out_path} and {out_path.with_suffix('.json')}")
    return 0
