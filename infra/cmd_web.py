"""Serve the web viewer: pick digits, steps, routing strategy and solver, press Generate and
watch every image denoise step by step, each tile outlined in the colour of the expert that
produced its current step, with the router weights under it. A fleet panel lists the experts,
their workers (backend, device, rows/s) and the coordinator's queue.

The server is a NATS client: it needs a running nats-server and, to generate anything, a
coordinator and expert workers on the same bus (`ddm-fleet up` starts all of them).

Only its own page may use it: every request's Host must be the served address (or --allow-host),
a page's Origin must be the viewer's own (or --allow-origin); others get 421 / 403. Every response
carries CSP and frame headers. Beyond loopback, a token is required (--token-file or $DDM_WEB_TOKEN):
open the viewer once as http://HOST:PORT/#token=<token>. Binding a non-loopback address without a
token is refused unless --insecure-no-token says you mean it.

Examples:
  ddm-fleet web --port 8080 --nats nats://127.0.0.1:4222
  DDM_WEB_TOKEN=$(cat /etc/ddm/web.token) ddm-fleet web --host 0.0.0.0 --allow-host viewer.lan
  ddm-fleet web --token-file /etc/ddm/web.token --allow-host viewer.example.com \
      --allow-origin https://viewer.example.com --trusted-proxy 127.0.0.1   # behind a TLS reverse proxy
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from bus.options import add_nats_option

    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="interface to listen on (default 127.0.0.1; use 0.0.0.0 to serve other machines)",
    )
    parser.add_argument("--port", type=int, default=8080, help="HTTP port (default 8080)")
    add_nats_option(
        parser,
        help="NATS server URL, e.g. nats://user:password@host:4222 (the `web` user of "
        "infra/nats/single.conf), or a comma-separated list of a cluster's nodes "
        "(default: $NATS_URL, else nats://127.0.0.1:4222; the old $DDM_NATS_URL still works, "
        "with a deprecation warning)",
    )
    parser.add_argument(
        "--fleet-interval",
        type=float,
        default=2.0,
        metavar="S",
        help="seconds between two refreshes of the fleet panel (default %(default)s)",
    )
    parser.add_argument(
        "--preview-every",
        type=int,
        default=4,
        metavar="N",
        help="on a latent fleet (spec space: latent), jobs ask the coordinator for decoded preview frames "
        "every N steps (and the last), which the page draws instead of latents (default %(default)s; "
        "rounded up to a multiple of the job's frame interval)",
    )
    parser.add_argument(
        "--submit-timeout",
        type=float,
        default=5.0,
        metavar="S",
        help="how long to wait for the coordinator to accept a job (default 5)",
    )
    parser.add_argument(
        "--allow-origin",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="another page origin allowed to use the viewer, e.g. https://viewer.example.com "
        "(repeatable; default: only the viewer's own page)",
    )
    parser.add_argument(
        "--allow-host",
        action="append",
        default=[],
        metavar="NAME[:PORT]",
        help="another Host header to answer, e.g. a reverse proxy's name (repeatable; default: the "
        "served address, plus localhost/127.0.0.1/[::1] for a loopback one)",
    )
    parser.add_argument(
        "--token-file",
        metavar="PATH",
        help="file holding the viewer's token (16-256 URL-safe characters); default: $DDM_WEB_TOKEN. "
        "With a token the websocket and /api/* need it; open the page as /#token=<token>",
    )
    parser.add_argument(
        "--insecure-no-token",
        action="store_true",
        help="allow serving a non-loopback --host without a token (anyone who reaches the port "
        "can generate and see the fleet)",
    )
    parser.add_argument(
        "--max-sockets-per-client",
        type=int,
        default=16,
        metavar="N",
        help="open websockets per client IP address (default 16; all loopback addresses count as one, an "
        "IPv6 address by its /64; behind a reverse proxy all share its address unless --trusted-proxy names it)",
    )
    parser.add_argument(
        "--max-jobs-per-client",
        type=int,
        default=16,
        metavar="N",
        help="unfinished jobs per client IP address over all its tabs (default 16; the same address key as "
        "--max-sockets-per-client); each address's jobs also share the coordinator's rows fairly with others'",
    )
    parser.add_argument(
        "--trusted-proxy",
        action="append",
        default=[],
        metavar="CIDR",
        help="a reverse proxy's address or network (repeatable, e.g. 127.0.0.1 or 10.0.0.0/8): for requests "
        "from it the client is the right-most X-Forwarded-For hop that is not a trusted proxy (default: none; "
        "X-Forwarded-For is ignored). Name only proxies that set X-Forwarded-For themselves",
    )
    parser.add_argument(
        "--max-messages-per-second",
        type=float,
        default=20.0,
        metavar="N",
        help="messages a socket may send per second (bursts of twice that); more closes it (default 20)",
    )


def run(args: argparse.Namespace) -> int:
    import sys

    if not 0 < args.port < 65536:
        print(f"ddm-fleet web: --port must be 1-65535, got {args.port}", file=sys.stderr)
        return 2
    from aiohttp import web

    from web.app import WebConfig, create_app

    try:
        token = _read_token(args.token_file)
        if token is None and not _is_loopback(args.host) and not args.insecure_no_token:
            raise ValueError(
                f"refusing to serve {args.host} (beyond loopback) without a token: give --token-file "
                "PATH or $DDM_WEB_TOKEN (or --insecure-no-token if the network is trusted)"
            )
        config = WebConfig(
            nats_url=args.nats,
            fleet_interval=args.fleet_interval,
            submit_timeout=args.submit_timeout,
            allow_origins=tuple(args.allow_origin),
            allow_hosts=tuple(args.allow_host),
            token=token,
            max_sockets_per_client=args.max_sockets_per_client,
            max_jobs_per_client=args.max_jobs_per_client,
            trusted_proxies=tuple(args.trusted_proxy),
            max_messages_per_second=args.max_messages_per_second,
            preview_every=args.preview_every,
        )
    except ValueError as err:
        print(f"ddm-fleet web: {err}", file=sys.stderr)
        return 2
    shown = _redact(args.nats)

    def serving(_msg: str) -> None:  # called by run_app once the socket listens (NATS is up by then)
        print(f"ddm-fleet web: serving http://{args.host}:{args.port}/  (NATS {shown}; Ctrl-C stops)", flush=True)
        if token is not None:
            print(f"ddm-fleet web: a token is required: open http://{args.host}:{args.port}/#token=<token>", flush=True)

    try:
        web.run_app(create_app(config), host=args.host, port=args.port, print=serving, handle_signals=True)
    except RuntimeError as err:  # raised by the NATS cleanup_ctx: say why, no traceback
        print(f"ddm-fleet web: {str(err).replace(args.nats, shown)}", file=sys.stderr)
        return 1
    except OSError as err:
        print(f"ddm-fleet web: cannot listen on {args.host}:{args.port}: {err}", file=sys.stderr)
        return 1
    return 0


def _read_token(path: str | None) -> str | None:
    """The token from --token-file, else $DDM_WEB_TOKEN, else None. Raises ValueError (clear message)."""
    import os

    from web.guard import check_token

    if path is not None:
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read(4096)
        except OSError as err:
            raise ValueError(f"cannot read --token-file {path}: {err.strerror or err}") from None
        return check_token(text)
    env = os.environ.get("DDM_WEB_TOKEN")
    return check_token(env) if env else None


def _is_loopback(host: str) -> bool:
    import ipaddress

    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _redact(urls: str) -> str:
    """nats://user:secret@host:4222 -> nats://user:***@host:4222, for every URL of a list (for logs)."""
    from bus.connect import redacted

    return redacted(urls)
