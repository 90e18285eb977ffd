"""Split a dataset's train split into K disjoint expert partitions and write a JSON manifest.

The dataset is MNIST (the default) or a prepared dataset directory (`--data DIR`, made by `ddm-fleet
data prepare`: any image size, channel count and class count, or unlabelled); the manifest records
which one, and train-expert / train-router refuse to use it with other data.

Methods: `classes` (digit lists per expert; default for 2 experts 0-4 / 5-9), `kmeans` (two-stage
k-means on PCA'd pooled pixels, the DDM paper's recipe on cheap features), `features` (the same
k-means in the feature space of a pretrained network trained for another purpose, the paper's
DINOv2 recipe; `--features` picks the network: judge 2's penultimate layer `embed` (128-d, the
default), `data-judge:DIR` (a CNN trained on a prepared dataset's classes), `torch:PATH` (your
own TorchScript module) or `dinov2:DIR` (a transformers DINOv2 saved with save_pretrained: its CLS
token; the pretrained extra); see evaluation/features.py), `random`. Prints a table of images and the
class histogram per expert. The manifest lists each expert's train indices, its classes and
`class_to_expert` (the oracle route). Examples:

    ddm-fleet partition --method classes --experts 2 --classes 0-4,5-9 --out checkpoints/partition.json
    ddm-fleet partition --data data/prepared/pets --method kmeans --experts 4 --out runs/pets/partition.json
    ddm-fleet partition --method features --experts 8 --out checkpoints/features8/partition.json
    ddm-fleet partition --data data/pets --method features --features torch:my_encoder.pt --experts 4 --out p.json
    ddm-fleet partition --data data/pets --method features --features dinov2:dinov2-small --experts 4 --out p.json

Cost of `features`: judge 2 loads from checkpoints/judges/ (or the data dir's cache) in about a
second; without either it is trained once (about 5 minutes on 2 CPU cores) and cached. Its features
of the 50k train images take well under a minute on a CPU, the k-means a few seconds.
"""

from __future__ import annotations

import argparse

from bus.options import add_deprecated_alias
from dataset.options import add_data_dir_option


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument(
        "--method",
        choices=("classes", "kmeans", "features", "random"),
        default="classes",
        help="how to split (default: classes); features = k-means of a network's features (--features)",
    )
    parser.add_argument(
        "--experts",
        "-k",
        dest="experts",
        type=int,
        default=2,
        metavar="K",
        help="number of experts K (default %(default)s)",
    )
    add_deprecated_alias(parser, "--num-experts", "--experts", type=int, metavar="K")
    parser.add_argument(
        "--classes",
        default=None,
        help="classes method: comma-separated groups, one per expert, ranges joined with '+' "
        "(e.g. 0-4,5-9 or 0-2+7,3-6,8+9); default: contiguous near-equal ranges",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="random seed of kmeans, features and random (default %(default)s)"
    )
    parser.add_argument(
        "--limit", type=int, default=None, metavar="N", help="use only the first N train images (quick experiments)"
    )
    parser.add_argument(
        "--features",
        default=None,
        metavar="CHOICE",
        help="--method features: the network whose features are clustered: judge2 (default; digits, RGB through "
        "their luminance), data-judge:DIR (a CNN trained on the prepared dataset DIR), torch:PATH (your "
        "TorchScript module, [N,C,H,W] in [-1,1] -> [N,D]) or dinov2:DIR (a transformers DINOv2 directory, "
        "save_pretrained; its CLS token; the pretrained extra)",
    )
    parser.add_argument(
        "--data",
        default=None,
        metavar="DIR",
        help="a prepared dataset directory (`ddm-fleet data prepare`) to partition instead of MNIST",
    )
    add_data_dir_option(parser)
    parser.add_argument("--out", required=True, help="manifest JSON to write, e.g. checkpoints/partition.json")


def run(args: argparse.Namespace) -> int:
    import sys

    from dataset.mnist import DataError
    from dataset.partition import PartitionError, make_partition, parse_class_groups, save_manifest
    from training.datasets import load_split

    try:
        groups = parse_class_groups(args.classes) if args.classes else None
        if groups is not None and args.method != "classes":
            raise PartitionError("--classes only applies to --method classes")
        if groups is not None and len(groups) != args.experts:
            raise PartitionError(f"--classes gives {len(groups)} groups but --experts is {args.experts}")
        if args.features is not None and args.method != "features":
            raise PartitionError("--features only applies to --method features")
        images, labels, ref = load_split(args.data, "train", data_dir=args.data_dir, limit=args.limit)
        features, extractor = None, "unnamed"
        if args.method == "features":
            from evaluation.features import partition_features

            features, extractor = partition_features(images, args.data_dir, choice=args.features or "judge2")
        m = make_partition(
            args.method,
            labels,
            images,
            args.experts,
            seed=args.seed,
            classes=groups,
            progress=True,
            features=features,
            extractor=extractor,
            dataset=ref,
        )
        path = save_manifest(m, args.out)
    except (PartitionError, DataError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(m.summary())
    print(f"wrote {path}")
    return 0
