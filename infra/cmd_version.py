"""Print the ddm-fleet version, the wire protocol version and key library versions."""

from __future__ import annotations

import argparse
from importlib import metadata


def version_line() -> str:
    """One line for `ddm-fleet --version`: "ddm-fleet 0.1.0 (wire protocol v1)"."""
    from schemas.version import PROTOCOL_VERSION

    return f"ddm-fleet {metadata.version('ddm-fleet')} (wire protocol v{PROTOCOL_VERSION})"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print as JSON")


def run(args: argparse.Namespace) -> int:
    from schemas import PROTOCOL_VERSION, TIME_CONVENTION

    info = {
        "ddm-fleet": metadata.version("ddm-fleet"),
        "protocol": f"v{PROTOCOL_VERSION}",
        "time_convention": TIME_CONVENTION,
    }
    for dist in ("nats-py", "msgpack", "pydantic", "numpy", "torch", "jax", "flax", "aiohttp"):
        try:
            info[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            info[dist] = "not installed"
    if args.json:
        import json

        print(json.dumps(info, indent=2))
    else:
        for k, v in info.items():
            print(f"{k:16s} {v}")
    return 0
