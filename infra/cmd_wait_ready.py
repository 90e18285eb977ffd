"""Wait until a ddm-fleet process is ready, or check once that it still is (health checks).

Probes, one per call:
  PORT                 a TCP connect to HOST:PORT succeeds. A worker opens its --metrics-port
                       only after loading the model, warming every bucket and joining its queue
                       group, so this is "the worker serves" (systemd ExecStartPost).
  PORT --http PATH     GET http://HOST:PORT/PATH answers 2xx (the web viewer's /healthz is 200
                       while its NATS connection is up; a nats-server's monitoring /healthz).
  --fleet-status URL   a coordinator answers ddm.v1.fleet.status through NATS at URL (use a
                       user allowed to ask: client, web or ops).

Exit status: 0 ready; 1 --pid exited before it was ready; 2 bad arguments; 3 not ready after
--timeout seconds (default: wait forever and let systemd's TimeoutStartSec decide), or at once
with --once.

examples:
  ddm-fleet wait-ready 9477 --pid $MAINPID              # a worker unit's ExecStartPost
  ddm-fleet wait-ready 8080 --http /healthz --once      # web container health check
  ddm-fleet wait-ready --fleet-status nats://client:PW@nats:4222 --once
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable

READY, PID_GONE, NOT_READY = 0, 1, 3


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument(
        "port",
        nargs="?",
        type=_port,
        metavar="PORT",
        help="TCP port to probe (a worker's --metrics-port, the web port, 8222 for nats-server)",
    )
    parser.add_argument(
        "--host",
        default=os.environ.get("DDM_READY_HOST", "127.0.0.1"),
        help="host of PORT (default: $DDM_READY_HOST or 127.0.0.1)",
    )
    parser.add_argument(
        "--http", default=None, metavar="PATH", help="with PORT: GET this path and require a 2xx answer (e.g. /healthz)"
    )
    parser.add_argument(
        "--fleet-status",
        default=None,
        metavar="URL",
        help="instead of PORT: a coordinator must answer ddm.v1.fleet.status on this NATS URL",
    )
    parser.add_argument(
        "--pid", type=int, default=None, help="give up (exit 1) as soon as this process exits (systemd: $MAINPID)"
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=None,
        metavar="S",
        help="give up (exit 3) after S seconds (default: wait forever)",
    )
    parser.add_argument("--once", action="store_true", help="probe once: exit 0 if ready, else 3")
    parser.add_argument("--interval", type=float, default=1.0, metavar="S", help="seconds between probes (default 1)")


def _port(text: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"PORT must be 1-65535 (e.g. the worker's --metrics-port), got {text!r}")
    return int(text)


def tcp_probe(host: str, port: int, timeout: float = 1.0) -> Callable[[], bool]:
    """True when a TCP connection to host:port is accepted."""

    def probe() -> bool:
        try:
            with socket.create_connection((host, port), timeout=timeout):
                return True
        except OSError:
            return False

    return probe


def http_probe(host: str, port: int, path: str, timeout: float = 2.0) -> Callable[[], bool]:
    """True when GET http://host:port/path answers with a 2xx status."""
    url = f"http://{host}:{port}/{path.lstrip('/')}"

    def probe() -> bool:
        try:
            with urllib.request.urlopen(url, timeout=timeout) as resp:
                return 200 <= resp.status < 300
        except (OSError, urllib.error.URLError):  # HTTPError (non-2xx) is a URLError
            return False

    return probe


def fleet_status_probe(url: str, timeout: float = 2.0) -> Callable[[], bool]:
    """True when a coordinator answers ddm.v1.fleet.status (a valid FleetStatus) through NATS at url."""
    import asyncio

    async def ask() -> bool:
        import nats.errors

        from bus.connect import connect
        from schemas import FleetStatus, ProtocolError, subjects, unpack

        try:  # one try, no reconnects: the caller polls
            nc = await connect(
                url,
                name="ddm-wait-ready",
                reconnect=0,
                first_connect_attempts=1,
                connect_timeout_s=timeout,
                error_cb=_quiet,
            )
        except Exception:  # unreachable server, refused credentials, a bad URL: not ready
            return False
        try:
            msg = await nc.request(subjects.FLEET_STATUS, b"", timeout=timeout)
            unpack(msg.data, FleetStatus)
            return True
        except (TimeoutError, ProtocolError, nats.errors.Error):
            return False
        finally:
            await nc.close()

    async def bounded() -> bool:  # nats-py may keep retrying an unreachable server: cap the probe
        try:
            return await asyncio.wait_for(ask(), timeout + 1)
        except TimeoutError:
            return False

    return lambda: asyncio.run(bounded())


async def _quiet(err: Exception) -> None:
    pass


def pid_alive(pid: int) -> bool:
    """True while process pid exists (a process of another user counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def wait_ready(
    probe: Callable[[], bool],
    *,
    pid: int | None = None,
    timeout: float | None = None,
    once: bool = False,
    interval: float = 1.0,
) -> int:
    """Probe until ready. Returns READY (0), PID_GONE (1) or NOT_READY (3)."""
    start = time.monotonic()
    while True:
        if probe():
            return READY
        if once:
            return NOT_READY
        if pid is not None and not pid_alive(pid):
            return PID_GONE
        if timeout is not None and time.monotonic() - start >= timeout:
            return NOT_READY
        time.sleep(interval)


def run(args: argparse.Namespace) -> int:
    if (args.port is None) == (args.fleet_status is None):
        print("ddm-fleet wait-ready: give a PORT or --fleet-status URL (exactly one)", file=sys.stderr)
        return 2
    if args.http is not None and args.port is None:
        print("ddm-fleet wait-ready: --http needs a PORT", file=sys.stderr)
        return 2
    if args.fleet_status is not None:
        probe, what = fleet_status_probe(args.fleet_status), "a coordinator (ddm.v1.fleet.status)"
    elif args.http is not None:
        probe, what = (
            http_probe(args.host, args.port, args.http),
            f"http://{args.host}:{args.port}/{args.http.lstrip('/')}",
        )
    else:
        probe, what = tcp_probe(args.host, args.port), f"{args.host}:{args.port}"
    start = time.monotonic()
    code = wait_ready(probe, pid=args.pid, timeout=args.timeout, once=args.once, interval=args.interval)
    if code == READY:
        print(f"ddm-fleet wait-ready: {what} ready after {time.monotonic() - start:.0f} s")
    elif code == PID_GONE:
        print(f"ddm-fleet wait-ready: process {args.pid} exited before {what} was ready; see its log", file=sys.stderr)
    else:
        print(
            f"ddm-fleet wait-ready: {what} not ready" + ("" if args.once else f" after {args.timeout:g} s"),
            file=sys.stderr,
        )
    return code
