"""Train one expert flow-matching model (UNet or DiT) on ONLY its own data partition.

Reads the partition manifest (`ddm-fleet partition`), keeps the images of `--expert` from the dataset
the partition was made from (MNIST, or a prepared dataset: `--data DIR`, refused when it is not the
partition's), builds `--arch unet` (`--widths`) or `--arch dit` (`--patch-size --hidden-size --depth
--heads --mlp-ratio`) for the data's image shape and classes, and trains with
the chosen backend: `torch` (CPU / CUDA / torch_xla, training/train_torch.py) or `jax`
(training/train_jax.py). Writes the shipping checkpoint `<out>.safetensors` + `<out>.json` (EMA weights)
every --save-every steps and at the end, plus `<run-dir>/resume.pt` (jax: `resume_jax.msgpack`) for --resume.

The checkpoint's JSON carries the model spec (sample shape, classes and their names, conditioning,
null label, arch), which workers advertise and the coordinator checks.

Examples (a DiT expert on a prepared dataset; the shipped small MNIST expert 0):
  ddm-fleet train-expert --data data/prepared/pets --partition runs/pets/partition.json --expert 0 \\
      --arch dit --patch-size 4 --hidden-size 192 --depth 6 --heads 6 --out runs/pets/expert0
  ddm-fleet train-expert --expert 0 --partition checkpoints/partition.json --widths 32,64,128 \\
      --steps 2000 --batch-size 128 --dtype bfloat16 --out checkpoints/expert0

Data parallel on an island with several devices (--batch-size stays the global batch):
  torchrun --standalone --nproc_per_node 2 -m infra.cli train-expert --backend torch ...   (DDP: gloo / nccl)
  ddm-fleet train-expert --backend jax --devices 0 ...   (all JAX devices, SPMD over a data mesh)
"""

from __future__ import annotations

import argparse

from bus.options import add_device_option, add_dtype_option, add_threads_option
from dataset.options import add_data_dir_option


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument(
        "--expert", type=int, required=True, metavar="K", help="expert id K (index into the manifest's experts)"
    )
    parser.add_argument(
        "--partition",
        default="checkpoints/partition.json",
        metavar="PATH",
        help="partition manifest JSON (default %(default)s)",
    )
    parser.add_argument(
        "--backend", choices=("torch", "jax"), default="torch", help="training framework (default %(default)s)"
    )
    parser.add_argument(
        "--devices",
        type=int,
        default=0,
        help="jax backend: train data-parallel on the first N JAX devices, 0 = all (default %(default)s)",
    )
    add_device_option(parser, help_suffix=" or xla (--backend torch; jax takes --devices)")
    parser.add_argument("--steps", type=int, default=2000, help="optimizer steps in total (default %(default)s)")
    parser.add_argument(
        "--batch-size",
        type=int,
        default=128,
        help="images per step; fixed, last partial batch dropped (default %(default)s)",
    )
    parser.add_argument(
        "--lr", type=float, default=1e-3, help="peak AdamW learning rate; warmup then cosine (default %(default)s)"
    )
    parser.add_argument("--warmup", type=int, default=100, help="linear LR warmup steps (default %(default)s)")
    parser.add_argument(
        "--ema-decay", type=float, default=0.999, help="EMA decay of the saved weights (default %(default)s)"
    )
    add_dtype_option(
        parser,
        default="float32",
        help="torch backend: the forward pass's compute type; bfloat16 = autocast, about 2x faster on AVX-512 "
        "CPUs; auto = bfloat16 where --device computes it natively (CPU with AMX or AVX512-BF16, CUDA compute "
        "capability >= 8.0, XLA), else float32 (default %(default)s)",
    )
    parser.add_argument(
        "--data",
        default=None,
        metavar="DIR",
        help="prepared dataset directory (`ddm-fleet data prepare`); must be the one the partition was "
        "made from (default: the partition's dataset, MNIST for partitions that name none)",
    )
    parser.add_argument(
        "--arch", choices=("unet", "dit"), default="unet", help="expert architecture (default %(default)s)"
    )
    parser.add_argument(
        "--widths",
        default="32,64,128",
        help="--arch unet: channel widths per level (default %(default)s; reference 64,128,256)",
    )
    dit = parser.add_argument_group("--arch dit sizes")
    dit.add_argument(
        "--patch-size", type=int, default=2, help="pixels per patch side; must divide the image size (default 2)"
    )
    dit.add_argument("--hidden-size", type=int, default=128, help="token width (default %(default)s)")
    dit.add_argument("--depth", type=int, default=6, help="transformer blocks (default %(default)s)")
    dit.add_argument(
        "--heads", type=int, default=4, help="attention heads; must divide --hidden-size (default %(default)s)"
    )
    dit.add_argument("--mlp-ratio", type=float, default=4.0, help="MLP width / hidden size (default %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default %(default)s)")
    parser.add_argument(
        "--out", default=None, help="checkpoint path without extension (default: checkpoints/expert<K>)"
    )
    parser.add_argument("--run-dir", default=None, help="where resume.pt lives (default: runs/expert<K>)")
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue from <run-dir>/resume.pt (jax: resume_jax.msgpack) up to --steps",
    )
    parser.add_argument(
        "--save-every", type=int, default=250, help="checkpoint + resume file every N steps (default %(default)s)"
    )
    parser.add_argument(
        "--log-every",
        type=int,
        default=50,
        help="steps per loss_history entry in the checkpoint JSON (default %(default)s)",
    )
    parser.add_argument(
        "--save-dtype",
        choices=("float16", "float32"),
        default="float16",
        help="dtype of the shipped weights (default %(default)s)",
    )
    add_threads_option(parser)
    add_data_dir_option(parser)
    parser.add_argument(
        "--limit", type=int, default=None, metavar="N", help="use only the first N images of the partition (smoke runs)"
    )
    parser.add_argument(
        "--label-dropout",
        type=float,
        default=0.0,
        help="probability that a training label is replaced by 'unknown' (-1); > 0 gives the model "
        "a null label so it also generates unconditionally (y = -1), classifier-free style; "
        "torch backend only (default %(default)s = conditional only, as before)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar (log lines only)")


def run(args: argparse.Namespace) -> int:
    if args.backend == "jax":
        from training.train_jax import train
    else:
        from training.train_torch import train
    import os
    import sys

    try:
        code = train(args)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"train-expert: error: {e}", file=sys.stderr)
        code = 2
    if int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:
        # A torchrun rank whose work is done and saved (every rank passed the final barrier in
        # training.distributed.shutdown) ends here without interpreter teardown: on a loaded box the
        # C++ threads of torch.distributed occasionally race their static destructors at exit and
        # abort the rank ("terminate called without an active exception", exit -6), which torchrun
        # reports as a failed run although nothing failed.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(int(code or 0))
    return code
