"""`ddm-fleet` command line: one entry point, one module per subcommand.

Each subcommand module defines `add_arguments(parser)` and `run(args) -> int`, and
keeps heavy imports (torch, jax, nats) inside `run`, so `ddm-fleet --help` is fast.
To add a command, add a row to COMMANDS.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

# (name, module, one-line help)
COMMANDS: list[tuple[str, str, str]] = [
    ("version", "infra.cmd_version", "print the package, protocol and library versions"),
    ("coordinator", "infra.cmd_coordinator", "run the coordinator: router + step-level batching of all jobs over NATS"),
    ("generate", "infra.cmd_generate", "generate digits through the fleet (or --local) into a PNG grid or .npz"),
    ("worker", "infra.cmd_worker", "serve one expert model over NATS (torch, xla or jax backend)"),
    ("bench", "infra.cmd_bench", "benchmarks: `bench worker` = worker rows/s through NATS vs in-process"),
    ("data", "infra.cmd_data", "fetch, cache and inspect MNIST (offline after the first run)"),
    ("train-expert", "infra.cmd_train_expert", "train one expert UNet on its partition only (torch / torch_xla / jax)"),
    ("sample", "infra.cmd_sample", "sample digits in-process from expert checkpoints to a PNG grid"),
    ("partition", "infra.cmd_partition", "split the train set into K expert partitions (JSON manifest)"),
    ("train-router", "infra.cmd_train_router", "train the router that predicts a noisy sample's expert partition"),
    ("eval", "infra.cmd_eval", "generation quality: monolith vs DDM routing strategies (accuracy, FID, FLOPs)"),
    ("up", "infra.cmd_up", "run the local fleet in one command: nats-server, workers, coordinator, web page"),
    ("web", "infra.cmd_web", "serve the web viewer: generate digits and watch them denoise live"),
    ("nats", "infra.cmd_nats", "NATS server tools: check the shipped configs, run them as a loopback cluster"),
    ("fuzz", "infra.cmd_fuzz", "throw hostile input at the decoders, a worker, the coordinator and the web socket"),
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ddm-fleet",
        description="Serve and train Decentralized Diffusion Model ensembles over NATS.",
        epilog="Run `ddm-fleet <command> --help` for a command's options.",
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv for debug)")
    sub = parser.add_subparsers(dest="command", metavar="<command>")
    for name, module, help_text in COMMANDS:
        mod = importlib.import_module(module)
        p = sub.add_parser(name, help=help_text, description=(mod.__doc__ or help_text).strip())
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    level = logging.WARNING - 10 * min(args.verbose + 1, 2)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(args._run(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
