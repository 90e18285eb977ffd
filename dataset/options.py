"""`--data-dir`, declared once for every command that reads or writes the data directory.

Six commands (data, partition, train-expert, train-router, distill, eval) take the directory where
the MNIST cache, the prepared datasets and the trained judges live; declaring it here keeps its
spelling, metavar, default and help the same in each (`dataset.mnist.resolve_data_dir` turns the
value into the directory).
"""

from __future__ import annotations

import argparse


def add_data_dir_option(parser: argparse.ArgumentParser) -> None:
    """`--data-dir DIR` into `data_dir` (None when not given: $DDM_DATA_DIR, else ./data)."""
    parser.add_argument(
        "--data-dir",
        default=None,
        metavar="DIR",
        help="data directory: the MNIST cache, prepared datasets and judges (default: $DDM_DATA_DIR or ./data)",
    )
