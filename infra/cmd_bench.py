"""Benchmarks: `ddm-fleet bench <what>`, one per row of BENCHES; `ddm-fleet bench <what> --help`
explains each (its module's docstring).

  worker   one expert worker: rows/s per bucket through NATS next to the same model called in-process
  fleet    whole fleet (client -> coordinator process -> worker processes): images/s and job latency vs
           in-process; every job's outcome (completed / rejected / failed / lost) and peak RSS per process
  scale    fleet rows/s as sim workers and coordinators are added, against the workers' capacity; one
           coordinator's own capacity (--coordinator-capacity); its CPU per 1000 rows and peak RSS
  engine   the coordinator's engine alone in one process (no NATS, instant experts): rows/s, CPU per
           1000 rows and the router's share of it
"""

from __future__ import annotations

import argparse
import importlib

# (name, "module:attribute", one-line help). The attribute (or the module itself when no
# ":attribute" is given) provides add_arguments(parser) and run(args) -> int, like a CLI command.
# `ddm-fleet bench --help` lists them in this order, one line each (keep a help under 70 characters).
BENCHES: list[tuple[str, str, str]] = [
    ("worker", "benchmarks.worker", "one expert worker: rows/s per bucket through NATS vs in-process"),
    ("fleet", "benchmarks.fleet", "whole fleet: images/s, job latency, job outcomes, RSS vs in-process"),
    ("scale", "benchmarks.scale", "fleet rows/s as sim workers and coordinators are added"),
    ("engine", "benchmarks.engine", "the coordinator's engine alone (no NATS, instant experts)"),
]

EXAMPLES = """examples:
  ddm-fleet bench worker                                  # random small UNet, torch, own nats-server
  ddm-fleet bench worker --checkpoint checkpoints/expert0.safetensors --dtype bfloat16 --buckets 1,8,64,128
  ddm-fleet bench worker --backend jax --nats nats://127.0.0.1:4222
  ddm-fleet bench worker --device cuda:0 --buckets 64,256 --in-flight 1,2,4 --wire-dtype float32,float16
  ddm-fleet bench fleet --concurrency 1000 --jobs-per-client 1 --steps 8 --only fleet \\
      --max-rows 100 --max-queued-jobs 100
  ddm-fleet bench scale --coordinator-capacity --workers 1,2,4,8 --coordinators 1,2
  ddm-fleet bench engine --route-every 4"""


def _resolve(target: str):
    module, _, attr = target.partition(":")
    mod = importlib.import_module(module)
    return getattr(mod, attr) if attr else mod


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from infra.cli import format_command_table

    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.usage = "%(prog)s [-h] [-v] <what> ..."
    parser.description = "Benchmarks; `ddm-fleet bench <what> --help` explains each.\n\n" + format_command_table(
        [("benches", [(name, help_text) for name, _t, help_text in BENCHES])]
    )
    parser.epilog = EXAMPLES
    # The table above lists the benches; the subparsers' own flat list is hidden.
    sub = parser.add_subparsers(dest="bench", metavar="<what>", help=argparse.SUPPRESS, prog=parser.prog)
    for name, target, help_text in BENCHES:
        impl = _resolve(target)
        p = sub.add_parser(
            name, description=(impl.__doc__ or help_text).strip(), formatter_class=argparse.RawDescriptionHelpFormatter
        )
        impl.add_arguments(p)
        p.set_defaults(_bench_run=impl.run)
    parser.set_defaults(_bench_parser=parser)


def run(args: argparse.Namespace) -> int:
    fn = getattr(args, "_bench_run", None)
    if fn is None:
        args._bench_parser.print_help()
        return 2
    return int(fn(args) or 0)
