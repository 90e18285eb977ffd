"""Command-line options the benches share: the coordinator's engine settings they pass through
(`ddm-fleet coordinator --cohorts / --route-every / --speculate`, declared by
`coordinator.config.CoordinatorConfig`), the line that names the coordinator defaults a bench changes,
and the router checkpoint (`ddm-fleet coordinator --router`)."""

from __future__ import annotations

import argparse
import os


def add_engine_options(parser: argparse.ArgumentParser, cohorts_default: str = "", where: str = "") -> None:
    """Add --cohorts, --route-every, --speculate / --no-speculate, --run-ahead and --run-ahead-rows, exactly
    as `ddm-fleet coordinator` declares them (`coordinator.config.CoordinatorConfig`). `cohorts_default`
    and `where` are kept for callers; the help is the coordinator's."""
    from coordinator.config import CoordinatorConfig

    CoordinatorConfig.add_arguments(parser, only=ENGINE_OPTIONS)


#: The coordinator's engine settings every bench takes.
ENGINE_OPTIONS = ("cohorts", "route_every", "speculate", "run_ahead", "run_ahead_rows", "early_update")


def announce_defaults(args: argparse.Namespace, defaults: dict) -> None:
    """Print the line that names the coordinator defaults this bench changes (stdout, or stderr with
    --json so that the JSON stays parsable)."""
    import sys

    from coordinator.config import CoordinatorConfig

    note = CoordinatorConfig.differing_defaults(defaults)
    if note:
        print(note, file=sys.stderr if getattr(args, "json", False) else sys.stdout, flush=True)


def add_router_option(parser: argparse.ArgumentParser) -> None:
    """Add --router: the router checkpoint the coordinator loads, as `ddm-fleet coordinator --router`
    takes it (default: router.safetensors in --checkpoints)."""
    parser.add_argument(
        "--router",
        metavar="PATH",
        default=None,
        help="router checkpoint (default: router.safetensors in --checkpoints); e.g. "
        "checkpoints/router-w16.safetensors, the width-16 router the shipped one replaced "
        '(four times its FLOPs per row: docs/CAPACITY.md, "A smaller router")',
    )


def router_path(args: argparse.Namespace) -> str:
    """The router checkpoint a bench uses: --router, else <--checkpoints>/router.safetensors.
    Raises ValueError when --router names a file that does not exist."""
    router = getattr(args, "router", None)
    if router is None:
        return os.path.join(args.checkpoints, "router.safetensors")
    if not os.path.exists(router):
        raise ValueError(f"--router {router} does not exist")
    return router


def positive_ints(text: str, what: str, allow_none: bool = False) -> list[int]:
    """`text` ("1,2,4") as a list of positive ints; ValueError naming the flag `what` otherwise. With
    `allow_none`, "none", "0" or "" mean the empty list (a series the bench can skip)."""
    if allow_none and text.strip().lower() in ("none", "0", ""):
        return []
    try:
        vals = [int(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise ValueError(f"{what} must be comma-separated positive integers, got {text!r}") from None
    if not vals or any(v < 1 for v in vals):
        raise ValueError(f"{what} must be comma-separated positive integers, got {text!r}")
    return vals


def require_at_least_one(args: argparse.Namespace, names: tuple[str, ...]) -> None:
    """ValueError naming the first of the options `names` (argparse dests) whose value is below 1."""
    for name in names:
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")


def coordinator_config(args: argparse.Namespace):
    """The `CoordinatorConfig` of a bench's coordinator flags (ValueError naming a bad one): the bench
    starts its coordinators with exactly these settings, and checks them before it starts anything."""
    from coordinator.config import CoordinatorConfig

    return CoordinatorConfig.from_args(args)
