"""Command-line options the benches share: the coordinator's engine settings they pass through
(`ddm-fleet coordinator --cohorts / --route-every / --speculate`)."""

from __future__ import annotations

import argparse


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
