"""Fuzz the wire decoders, an expert worker, the coordinator and the web socket with hostile input.

targets (default: all, in this order):
  codec        msgpack bytes -> schemas.loads -> decode_tensor (in-process)
  messages     bytes -> schemas.unpack for every message type and union (in-process)
  worker       raw / mutated requests over NATS to a real expert worker
  coordinator  raw / mutated bytes on c.<client>.jobs.submit, c.<client>.jobs.<id>.cancel|status, fleet.status
  websocket    random / mutated frames to the real web app's /ws

The network targets start a private fleet in this process (nats-server on a free port, two tiny
random torch experts, a coordinator, the web app) and afterwards check it still serves.

Per target it prints inputs tried, ok (valid, served), clear errors (the documented error answer,
by code), crashes (any other exception, wrong or missing reply, dead socket or process, an ERROR
logged by the server side, a failed after-run check) and the wall time. Exit status 1 when any
target crashed. Same --seed, same inputs (the atheris engine is seeded too, but coverage feedback
makes its inputs depend on timing-free program behaviour only).

examples:
  ddm-fleet fuzz codec messages --runs 100000          # pure decoders (atheris if installed)
  ddm-fleet fuzz worker coordinator websocket --runs 3000
  ddm-fleet fuzz --runs 500 --seed 7 --json
"""

from __future__ import annotations

import argparse

TARGET_NAMES = ("codec", "messages", "worker", "coordinator", "websocket")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("targets", nargs="*", metavar="TARGET", help=f"any of {', '.join(TARGET_NAMES)} (default: all)")
    parser.add_argument(
        "--runs",
        type=int,
        default=None,
        metavar="N",
        help="inputs per target (default: 20000 for codec/messages, 2000 for the network targets)",
    )
    parser.add_argument("--seed", type=int, default=0, help="input generator seed (default %(default)s)")
    parser.add_argument(
        "--engine",
        choices=("auto", "atheris", "random"),
        default="auto",
        help="pure targets: atheris (coverage-guided) or the random generator; auto = atheris when installed",
    )
    parser.add_argument(
        "--concurrency",
        type=int,
        default=8,
        metavar="N",
        help="network targets: requests in flight (websocket: up to 4 sockets); default 8",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=10.0,
        metavar="S",
        help="network targets: seconds to wait for each answer (default 10)",
    )
    parser.add_argument("--json", action="store_true", help="print the results as JSON instead of a table")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    import json
    import sys

    from fuzzing.run import format_table
    from fuzzing.run import run as fuzz

    targets = list(args.targets) or list(TARGET_NAMES)
    bad = [t for t in targets if t not in TARGET_NAMES]
    if bad:
        print(
            f"ddm-fleet fuzz: unknown target(s) {', '.join(bad)}; choose from {', '.join(TARGET_NAMES)}",
            file=sys.stderr,
        )
        return 2
    if args.runs is not None and args.runs < 1:
        print("ddm-fleet fuzz: --runs must be at least 1", file=sys.stderr)
        return 2
    try:
        results = fuzz(
            targets,
            runs=args.runs,
            seed=args.seed,
            engine=args.engine,
            concurrency=max(1, args.concurrency),
            timeout=args.timeout,
            progress=not args.no_progress and sys.stderr.isatty(),
        )
    except (RuntimeError, ValueError) as err:
        print(f"ddm-fleet fuzz: {err}", file=sys.stderr)
        return 2
    crashes = sum(r.crashes for r in results)
    if args.json:
        print(
            json.dumps(
                {"seed": args.seed, "runs": args.runs, "crashes": crashes, "targets": [r.as_dict() for r in results]},
                indent=2,
            )
        )
    else:
        print(format_table(results))
        print(f"total: {sum(r.tried for r in results)} inputs, {crashes} crashes")
    return 1 if crashes else 0
