"""What a running fleet looks like from the bus, in a terminal: the coordinator's status and every expert's
workers (host, backend, device, dtype, rows/s, latency, requests, errors), like the web viewer's fleet panel.

It asks what the viewer asks: NATS micro discovery (`$SRV.INFO` / `$SRV.STATS`, every reply within
--window) and the coordinator's `ddm.v1.fleet.status`; rates and latencies are the difference of two
snapshots --rate-over seconds apart. On a secured bus, use the `client` (or `web`) user: workers behind
leaf nodes answer discovery only on those users' inboxes (infra/nats/permissions.conf).

Exit status: 0 a coordinator answered; 3 none answered (workers are still listed); 1 the bus is unreachable;
2 bad arguments.

examples:
  ddm-fleet status                                   # $NATS_URL, else nats://127.0.0.1:4222
  ddm-fleet status --nats nats://client:PW@nats-1:4222 --json
  ddm-fleet status --watch 2                         # a new table every 2 s until Ctrl-C
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
import unicodedata
from typing import Any

from bus.options import add_nats_option

OK, NO_COORDINATOR, UNREACHABLE, BAD_ARGS = 0, 3, 1, 2
#: the coordinator's fields on the first line; the rest follow on a second
COORDINATOR_MAIN = ("active_jobs", "queued_jobs", "active_rows", "rows_per_s", "tick_ms_p50", "jobs_done")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    add_nats_option(parser)
    parser.add_argument(
        "--window",
        type=_seconds,
        default=0.5,
        metavar="S",
        help="how long to collect the workers' discovery replies (default 0.5; more on a slow or distant bus)",
    )
    parser.add_argument(
        "--rate-over",
        type=_seconds,
        default=1.0,
        metavar="S",
        help="seconds between the two snapshots that rows/s and latency come from (default 1; 0: no rates)",
    )
    parser.add_argument(
        "--watch", type=_seconds, default=None, metavar="S", help="print a new table every S seconds until Ctrl-C"
    )
    parser.add_argument("--json", action="store_true", help="print the snapshot as JSON (one object per line)")


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"seconds expected, got {text!r}") from None
    if not 0 <= value <= 3600:
        raise argparse.ArgumentTypeError(f"must be 0-3600 seconds, got {text!r}")
    return value


def _clean(text: Any, limit: int = 64) -> str:
    """A value a worker or the coordinator sent, safe to print on a terminal: control characters (escape
    sequences a hostile service could send to redraw or retitle the operator's terminal) become "?", and
    it is cut to `limit` characters."""
    text = str(text)
    out = "".join("?" if unicodedata.category(c)[0] == "C" else c for c in text[:limit])
    return out + ("…" if len(text) > limit else "")


def _num(value: Any, digits: int = 1) -> str:
    if value is None:
        return "…"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return _clean(value)


def format_status(snap: dict[str, Any]) -> str:
    """A fleet snapshot (`web.fleet.FleetMonitor.snapshot`) as the lines `ddm-fleet status` prints."""
    lines: list[str] = []
    coord = snap.get("coordinator")
    if coord is None:
        lines.append("coordinator: not answering")
    else:
        name = _clean(coord.get("coordinator") or "")
        title = "coordinator" if name in ("", "coordinator") else f"coordinator {name}"
        stale = " (no answer this time: its last status)" if snap.get("coordinator_stale") else ""
        main = " · ".join(f"{k} {_num(coord[k])}" for k in COORDINATOR_MAIN if k in coord)
        lines.append(f"{title}{stale}: {main}")
        more = [
            f"{_clean(k)} {_clean(v, 200)}" for k, v in coord.items() if k not in (*COORDINATOR_MAIN, "coordinator")
        ]
        line = ""
        for item in more:  # the other fields, a few to a line
            if line and len(line) + len(item) > 100:
                lines.append(line)
                line = ""
            line = f"{line} · {item}" if line else f"  {item}"
        if line:
            lines.append(line)
    header = ("worker", "host", "runs on", "dtype", "rows/s", "ms", "reqs", "errors")
    for group in snap.get("experts", []):
        workers = group["workers"]
        lines.append(f"expert {group['expert']} · {len(workers)} worker{'' if len(workers) == 1 else 's'}")
        rows = [header] + [_worker_cells(w) for w in workers]
        lines += _table(rows)
    if not snap.get("experts"):
        lines.append("no expert workers discovered")
    if snap.get("services"):
        lines.append("other services")
        rows = [("service", "id", "host", "serves")]
        for s in snap["services"]:
            serves = (
                f"decoder {_clean(s['decoder'], 12)} -> {_clean(s.get('image_shape', ''))}" if s.get("decoder") else ""
            )
            rows.append((_clean(s["name"]), _clean(s["id"][-8:]), _clean(s.get("host") or "?"), serves))
        lines += _table(rows)
    return "\n".join(lines)


def _worker_cells(w: dict[str, Any]) -> tuple[str, ...]:
    rate = _num(w.get("rows_per_s"))
    if w.get("rate_unit") == "req/s" and w.get("rows_per_s") is not None:
        rate += " req"
    dtype = _clean(w.get("dtype") or "?") + (", compiled" if w.get("compiled") else "")
    who = _clean(w["id"][-8:]) + (" (late)" if w.get("stale") else "")
    return (
        who,
        _clean(w.get("host") or "?"),
        f"{_clean(w.get('backend') or '?')} · {_clean(w.get('device') or '?')}",
        dtype,
        rate,
        _num(w.get("latency_ms")),
        _num(w.get("requests")),
        _num(w.get("errors")),
    )


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  " + "  ".join(c.ljust(wd) for c, wd in zip(r, widths, strict=True)).rstrip() for r in rows]


async def _watch(args: argparse.Namespace) -> int:
    from bus.connect import connect, drain_or_close
    from client.jobs import client_connect_options, client_from_url
    from web.fleet import FleetMonitor

    nc = await connect(
        args.nats,
        name="ddm-status",
        reconnect=0 if args.watch is None else "forever",
        first_connect_attempts=2,
        reconnect_wait_s=0.5,
        connect_timeout_s=3,
        **client_connect_options(client_from_url(args.nats)),
    )
    monitor = FleetMonitor(nc, window=args.window)
    try:
        snap = await monitor.snapshot()
        if args.rate_over > 0:  # rates come from two snapshots
            await asyncio.sleep(args.rate_over)
            snap = await monitor.snapshot()
        while True:
            if args.json:
                print(json.dumps(snap), flush=True)
            else:
                text = format_status(snap)
                if args.watch is not None:  # each table stamped, a blank line after it
                    text = f"{time.strftime('%H:%M:%S', time.localtime(snap['time']))}  {text}\n"
                print(text, flush=True)
            if args.watch is None:
                return OK if snap["coordinator"] is not None else NO_COORDINATOR
            await asyncio.sleep(args.watch)
            snap = await monitor.snapshot()
    finally:
        await drain_or_close(nc)


def run(args: argparse.Namespace) -> int:
    from bus.connect import BusUnavailable, without_credentials

    try:
        return asyncio.run(_watch(args))
    except KeyboardInterrupt:
        return OK
    except BrokenPipeError:  # `ddm-fleet status --watch 1 | head`: the reader has gone; so do we, quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return OK
    except BusUnavailable as err:
        print(f"ddm-fleet status: {err}", file=sys.stderr)
        return UNREACHABLE
    except ValueError as err:  # a --nats URL whose user is no valid client name
        print(f"ddm-fleet status: {err}", file=sys.stderr)
        return BAD_ARGS
    except Exception as err:
        if type(err).__module__.startswith("nats"):
            print(
                f"ddm-fleet status: NATS at {without_credentials(args.nats)}: {type(err).__name__} {err}",
                file=sys.stderr,
            )
            return UNREACHABLE
        raise
