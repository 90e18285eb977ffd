"""Command-line options the benches share: the coordinator's engine settings they pass through
(`ddm-fleet coordinator --cohorts / --route-every / --speculate`) and the router checkpoint
(`ddm-fleet coordinator --router`)."""

from __future__ import annotations

import argparse
import os


def add_engine_options(parser: argparse.ArgumentParser, cohorts_default: str, where: str = "") -> None:
    """Add --cohorts, --route-every and --speculate, as `ddm-fleet coordinator` takes them.
    `cohorts_default`: what "auto" picks in this bench; `where`: which of its paths they apply to
    (e.g. "both paths"), said in each help."""
    from coordinator.engine import parse_cohorts

    at = f"{where}; " if where else ""
    parser.add_argument("--cohorts", type=parse_cohorts, default="auto", metavar="N|auto",
                        help=f"batches out at once ({at}`ddm-fleet coordinator --cohorts`; default %(default)s: "
                             f"{cohorts_default})")
    parser.add_argument("--route-every", type=int, default=1, metavar="N",
                        help=f"router every N evaluations of a job ({at}`ddm-fleet coordinator --route-every`; "
                             "default %(default)s)")
    parser.add_argument("--speculate", choices=("on", "off"), default="on",
                        help=f"send the likely expert requests while the router runs ({at}`ddm-fleet coordinator "
                             "--speculate`; default %(default)s)")


def add_router_option(parser: argparse.ArgumentParser) -> None:
    """Add --router: the router checkpoint the coordinator loads, as `ddm-fleet coordinator --router`
    takes it (default: router.safetensors in --checkpoints)."""
    parser.add_argument("--router", metavar="PATH", default=None,
                        help="router checkpoint (default: router.safetensors in --checkpoints); e.g. "
                             "checkpoints/router-w16.safetensors, the width-16 router the shipped one replaced "
                             "(four times its FLOPs per row: docs/CAPACITY.md, \"A smaller router\")")


def router_path(args: argparse.Namespace) -> str:
    """The router checkpoint a bench uses: --router, else <--checkpoints>/router.safetensors.
    Raises ValueError when --router names a file that does not exist."""
    router = getattr(args, "router", None)
    if router is None:
        return os.path.join(args.checkpoints, "router.safetensors")
    if not os.path.exists(router):
        raise ValueError(f"--router {router} does not exist")
    return router
