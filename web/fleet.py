"""Fleet status for the page, from what the bus itself says.

* Workers: NATS micro service discovery. One request on `$SRV.INFO` and one on `$SRV.STATS`
  reach every service; all replies that arrive within a short window are collected (a plain
  request would keep only the first). A worker advertises its expert id, backend, device and the
  dtype its expert computes in in its service metadata (keys `expert` / `expert_id`, `backend`,
  `device`, `dtype`, or `precision` from workers older than `dtype`); services without an expert id
  are listed as "other services". A decoder (latent fleets) says which autoencoder it serves
  (metadata `decoder`, its content hash) and its `image_shape`: its row carries both.
* Throughput: rows/s from the difference of two STATS snapshots (endpoint stats `data.rows`
  when the worker reports it, else requests/s).
* Latency: `latency_ms`, the mean receive-to-reply time of the requests served between two
  snapshots: from the worker's `data.latency_seconds` histogram (`sum`, `count`) when it reports
  one, else from the endpoints' `processing_time` (ns) over `num_requests` (what nats.micro
  measures: the handler's own time). None until two snapshots exist or while no request came in
  between. `host` is the worker's metadata `host` (its hostname), so the page can say which worker runs where.
* Coordinator: a request on `schemas.subjects.FLEET_STATUS` (msgpack or JSON map); its scalar
  fields (queue depth, active jobs, ...) are shown as they come. No answer -> `null`, except that one missed
  answer (late on a busy host) repeats the last one with `coordinator_stale: true`.

A worker that misses one discovery round (its reply late on a busy host) stays in the snapshot with its
last metadata, `stale: true` and no rates, so the panel does not flicker; one that misses `keep_missed + 1`
rounds in a row is gone (a stopped worker leaves the second snapshot after it stopped, by default).

Reply subjects: discovery replies come on `<inbox prefix>.d.<random>` (every worker, leaf hosts too, may
answer there), the coordinator's status on a private `<inbox prefix>.<random>` of its own (bus/inbox.py):
fresh random bits each time, nothing a worker could predict from the requests it sees.

Bounded: at most `MAX_DISCOVERY_REPLIES` replies per request, each at most `MAX_REPLY_BYTES` (bigger
ones are skipped) and `MAX_DISCOVERY_BYTES` in all (the subscription's pending limits drop the rest);
a coordinator status over `MAX_REPLY_BYTES` counts as no answer.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

from bus.gather import MAX_DISCOVERY_BYTES, MAX_DISCOVERY_REPLIES, MAX_REPLY_BYTES, gather_replies  # noqa: F401
from bus.inbox import private_request
from schemas import subjects

log = logging.getLogger(__name__)

INFO_SUBJECT = "$SRV.INFO"
STATS_SUBJECT = "$SRV.STATS"


def _json_maps(raw: list[bytes]) -> list[dict[str, Any]]:
    out = []
    for data in raw:
        try:
            obj = json.loads(data)
        except (ValueError, UnicodeDecodeError):
            continue
        if isinstance(obj, dict) and isinstance(obj.get("id"), str):
            out.append(obj)
    return out


def _expert_of(meta: dict[str, Any]) -> int | None:
    for key in ("expert", "expert_id"):
        value = meta.get(key)
        try:
            if value is not None and str(value).strip().lstrip("-").isdigit():
                return int(value)
        except (TypeError, ValueError):
            pass
    return None


def _decode_status(data: bytes) -> dict[str, Any] | None:
    from schemas import ProtocolError, loads

    try:
        obj = loads(data)
    except ProtocolError:
        try:
            obj = json.loads(data)
        except (ValueError, UnicodeDecodeError):
            return None
    return obj if isinstance(obj, dict) else None


def _scalars(obj: dict[str, Any], depth: int = 0) -> dict[str, Any]:
    """Keep what a table can show: numbers, short strings, bools, small nested maps (one level)."""
    out: dict[str, Any] = {}
    for k, v in list(obj.items())[:40]:
        if not isinstance(k, str) or k in ("v", "kind"):
            continue
        if isinstance(v, bool) or isinstance(v, (int, float)):
            out[k] = v
        elif isinstance(v, str) and len(v) <= 200:
            out[k] = v
        elif isinstance(v, dict) and depth == 0:
            inner = _scalars(v, depth + 1)
            if inner:
                out[k] = inner
        elif isinstance(v, list) and len(v) <= 32 and all(isinstance(i, (int, float, str)) for i in v):
            out[k] = v
    return out


class FleetMonitor:
    """Polls the bus and builds snapshots; keeps the previous STATS to turn counters into rates."""

    def __init__(self, nc, *, window: float = 0.3, status_timeout: float = 0.5, keep_missed: int = 1):
        self.nc = nc
        self.window = window
        self.status_timeout = status_timeout
        self.keep_missed = keep_missed
        # worker id -> (monotonic time, rows or requests, requests, (latency seconds, latency count))
        self._prev: dict[str, tuple[float, float, int, tuple[float, int]]] = {}
        # worker id -> (rounds missed in a row, its last row); the coordinator's status the same under ""
        self._held_workers: dict[str, tuple[int, dict[str, Any]]] = {}
        self._held_coordinator: dict[str, tuple[int, dict[str, Any]]] = {}

    async def coordinator_status(self) -> dict[str, Any] | None:
        try:
            msg = await private_request(self.nc, subjects.FLEET_STATUS, b"", timeout=self.status_timeout)
        except Exception:
            return None
        if len(msg.data) > MAX_REPLY_BYTES:
            return None
        obj = _decode_status(msg.data)
        return _scalars(obj) if obj is not None else None

    async def snapshot(self) -> dict[str, Any]:
        """{"type": "fleet", "experts": [{"expert", "workers": [...]}], "services": [...],
        "coordinator": {...} | None, "coordinator_stale": bool, "time": unix seconds}."""
        info_raw, stats_raw, coord = await asyncio.gather(
            gather_replies(self.nc, INFO_SUBJECT, window=self.window),
            gather_replies(self.nc, STATS_SUBJECT, window=self.window),
            self.coordinator_status(),
        )
        infos = {i["id"]: i for i in _json_maps(info_raw)}
        stats = {s["id"]: s for s in _json_maps(stats_raw)}
        now = time.monotonic()
        experts: dict[int, list[dict[str, Any]]] = {}
        services: list[dict[str, Any]] = []
        seen = set()
        rows: dict[str, dict[str, Any]] = {}
        for wid, info in infos.items():
            meta = info.get("metadata") or {}
            meta = meta if isinstance(meta, dict) else {}
            row = {
                "id": wid,
                "name": str(info.get("name", "")),
                "version": str(info.get("version", "")),
                "backend": str(meta.get("backend", "")),
                "device": str(meta.get("device", "")),
                "dtype": str(meta.get("dtype", meta.get("precision", ""))),  # float32 / bfloat16; "" unknown
                "compiled": meta.get("compiled") == "true",  # a torch worker running its compiled forward
                "host": str(meta.get("host", meta.get("hostname", ""))),
                "requests": None,
                "errors": None,
                "rows_per_s": None,
                "rate_unit": "rows/s",
                "latency_ms": None,
                "stale": False,
            }
            if isinstance(meta.get("decoder"), str) and meta["decoder"]:  # a decoder of a latent fleet
                row["decoder"] = meta["decoder"][:128]
                row["image_shape"] = str(meta.get("image_shape", ""))[:64]
            st = stats.get(wid)
            if st is not None:
                self._add_rates(row, st, now)
                seen.add(wid)
            expert = _expert_of(meta)
            if expert is not None:
                row["expert"] = expert
            rows[wid] = row
        for wid, (last, stale) in self._carry(self._held_workers, rows).items():
            if stale:
                rows[wid] = {**last, "rows_per_s": None, "latency_ms": None, "stale": True}
                seen.add(wid)  # keep its counters: the rate resumes from them when it answers again
        for _wid, row in sorted(rows.items()):
            if "expert" in row:
                experts.setdefault(row["expert"], []).append(row)
            else:
                services.append(row)
        self._prev = {k: v for k, v in self._prev.items() if k in seen}
        coord, coord_stale = self._carry(self._held_coordinator, {} if coord is None else {"": coord}).get(
            "", (None, False)
        )
        return {
            "type": "fleet",
            "experts": [{"expert": e, "workers": ws} for e, ws in sorted(experts.items())],
            "services": services,
            "coordinator": coord,
            "coordinator_stale": coord_stale,
            "time": time.time(),
        }

    def _carry(self, held: dict[str, tuple[int, Any]], fresh: dict[str, Any]) -> dict[str, tuple[Any, bool]]:
        """key -> (value, stale): this round's values, and the last value of each key missing from this round
        for at most `keep_missed` rounds in a row (stale). Keeps `held` (rounds missed, last value) up to date."""
        out = {k: (v, False) for k, v in fresh.items()}
        for key, (missed, last) in list(held.items()):
            if key in fresh:
                continue
            if missed >= self.keep_missed:
                del held[key]
            else:
                held[key] = (missed + 1, last)
                out[key] = (last, True)
        held.update({k: (0, v) for k, v in fresh.items()})
        return out

    def _add_rates(self, row: dict[str, Any], st: dict[str, Any], now: float) -> None:
        requests = errors = busy_ns = 0
        rows: float | None = 0.0
        lat_sum = lat_count = None  # the worker's latency histogram, seconds
        for ep in st.get("endpoints") or []:
            if not isinstance(ep, dict):
                continue
            requests += _num(ep.get("num_requests"))
            errors += _num(ep.get("num_errors"))
            busy_ns += _num(ep.get("processing_time"))
            data = ep.get("data")
            got = None
            if isinstance(data, dict):
                for key in ("rows", "rows_total", "num_rows"):
                    if isinstance(data.get(key), (int, float)):
                        got = data[key]
                        break
            hist = data.get("latency_seconds") if isinstance(data, dict) else None
            if (
                isinstance(hist, dict)
                and isinstance(hist.get("sum"), (int, float))
                and isinstance(hist.get("count"), int)
            ):
                lat_sum, lat_count = float(hist["sum"]), int(hist["count"])
            if got is None:
                rows = None
            elif rows is not None:  # one metrics object per service: max, not sum, across endpoints
                rows = max(rows, float(got))
        counter = rows if rows is not None else float(requests)
        row["requests"], row["errors"] = int(requests), int(errors)
        row["rate_unit"] = "rows/s" if rows is not None else "req/s"
        if rows is not None:
            row["rows"] = int(rows)
        prev = self._prev.get(row["id"])
        # latency counters: (seconds, requests) from the histogram, else (ns / 1e9, requests) from micro
        lat = (lat_sum, lat_count) if lat_sum is not None else (busy_ns / 1e9, int(requests))
        if prev is not None and now > prev[0]:
            row["rows_per_s"] = round(max(0.0, counter - prev[1]) / (now - prev[0]), 1)
            served = lat[1] - prev[3][1]
            if served > 0 and lat[0] >= prev[3][0]:
                row["latency_ms"] = round((lat[0] - prev[3][0]) / served * 1e3, 3)
        self._prev[row["id"]] = (now, counter, int(requests), lat)


def _num(value: Any) -> int:
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0
