"""Serve the web viewer: pick digits, steps, routing strategy and solver, press Generate and
watch every image denoise step by step, each tile outlined in the colour of the expert that
produced its current step, with the router weights under it. A fleet panel lists the experts,
their workers (backend, device, rows/s) and the coordinator's queue.

The server is a NATS client: it needs a running nats-server and, to generate anything, a
coordinator and expert workers on the same bus (`ddm-fleet up` starts all of them).

Example:  ddm-fleet web --port 8080 --nats nats://127.0.0.1:4222
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from bus.nats_server import default_nats_url

    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--host", default="127.0.0.1",
                        help="interface to listen on (default: 127.0.0.1; use 0.0.0.0 to serve other machines)")
    parser.add_argument("--port", type=int, default=8080, help="HTTP port (default: 8080)")
    parser.add_argument("--nats", default=default_nats_url(), metavar="URL",
                        help="NATS server URL, e.g. nats://user:password@host:4222 (the `web` user of "
                             "infra/nats/single.conf), or a comma-separated list of a cluster's nodes "
                             "(default: $NATS_URL, else nats://127.0.0.1:4222; the old $DDM_NATS_URL still works, with a "
                             "deprecation warning)")
    parser.add_argument("--fleet-interval", type=float, default=2.0, metavar="SECONDS",
                        help="how often the fleet panel is refreshed (default: 2)")
    parser.add_argument("--submit-timeout", type=float, default=5.0, metavar="SECONDS",
                        help="how long to wait for the coordinator to accept a job (default: 5)")


def run(args: argparse.Namespace) -> int:
    import sys

    if not 0 < args.port < 65536:
        print(f"ddm-fleet web: --port must be 1-65535, got {args.port}", file=sys.stderr)
        return 2
    from aiohttp import web

    from web.app import WebConfig, create_app

    try:
        config = WebConfig(nats_url=args.nats, fleet_interval=args.fleet_interval,
                           submit_timeout=args.submit_timeout)
    except ValueError as err:
        print(f"ddm-fleet web: {err}", file=sys.stderr)
        return 2
    shown = _redact(args.nats)

    def serving(_msg: str) -> None:  # called by run_app once the socket listens (NATS is up by then)
        print(f"ddm-fleet web: serving http://{args.host}:{args.port}/  (NATS {shown}; Ctrl-C stops)", flush=True)

    try:
        web.run_app(create_app(config), host=args.host, port=args.port, print=serving, handle_signals=True)
    except RuntimeError as err:  # raised by the NATS cleanup_ctx: say why, no traceback
        print(f"ddm-fleet web: {str(err).replace(args.nats, shown)}", file=sys.stderr)
        return 1
    except OSError as err:
        print(f"ddm-fleet web: cannot listen on {args.host}:{args.port}: {err}", file=sys.stderr)
        return 1
    return 0


def _redact(url: str) -> str:
    """nats://user:secret@host:4222 -> nats://user:***@host:4222 (for logs)."""
    scheme, sep, rest = url.partition("://")
    creds, at, host = rest.rpartition("@")
    if not sep or not at:
        return url
    user = creds.split(":", 1)[0]
    return f"{scheme}://{user}:***@{host}" if ":" in creds else f"{scheme}://***@{host}"
