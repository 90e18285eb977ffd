"""Worker metrics: counters and histograms, as a dict (micro STATS) and Prometheus text.

    m = WorkerMetrics(labels={"expert": "0", "backend": "torch"})
    m.request(rows=3); m.batch(rows=3, bucket=4, compute_s=0.01); m.error("bad_shape")
    m.snapshot()          # JSON-able dict, served as endpoint `data` in $SRV.STATS
    m.prometheus_text()   # text exposition format 0.0.4, served on GET /metrics

`serve_metrics(metrics, port)` starts an aiohttp server with GET /metrics and returns its runner
(call `await runner.cleanup()` to stop it).
"""

from __future__ import annotations

import bisect
import time
from typing import Iterable, Optional

#: Compute-time histogram bounds (seconds).
TIME_BOUNDS: tuple[float, ...] = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
#: Padding-fraction histogram bounds (padded rows / bucket).
PAD_BOUNDS: tuple[float, ...] = (0.0, 0.1, 0.25, 0.5, 0.75, 1.0)


class Histogram:
    """Cumulative-bucket histogram (Prometheus semantics: le = upper bound, +Inf implied)."""

    def __init__(self, bounds: Iterable[float]):
        self.bounds = tuple(float(b) for b in bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # last = +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def cumulative(self) -> list[tuple[str, int]]:
        out, total = [], 0
        for bound, c in zip(list(self.bounds) + [float("inf")], self.counts):
            total += c
            out.append(("+Inf" if bound == float("inf") else _fmt(bound), total))
        return out

    def to_dict(self) -> dict:
        return {"buckets": dict(self.cumulative()), "sum": self.sum, "count": self.count}


def _fmt(v: float) -> str:
    return repr(int(v)) if float(v).is_integer() else repr(float(v))


class WorkerMetrics:
    """Counters for one worker. Single-threaded use (the asyncio loop) only."""

    def __init__(self, labels: Optional[dict[str, str]] = None, batch_bounds: Iterable[int] = (1, 2, 4, 8, 16, 32, 64, 128)):
        self.labels = dict(labels or {})
        self.started = time.time()
        self.requests = 0
        self.rows = 0
        self.replies = 0
        self.errors: dict[str, int] = {}
        self.batches = 0
        self.batch_rows = 0
        self.padded_rows = 0
        self.compute_s = 0.0
        self.batch_size = Histogram(batch_bounds)
        self.padding = Histogram(PAD_BOUNDS)
        self.compute = Histogram(TIME_BOUNDS)
        self.latency = Histogram(TIME_BOUNDS)

    # ---------------------------------------------------------------- recording

    def request(self, rows: int) -> None:
        self.requests += 1
        self.rows += rows

    def reply(self, latency_s: float) -> None:
        self.replies += 1
        self.latency.observe(latency_s)

    def error(self, code: str) -> None:
        self.errors[code] = self.errors.get(code, 0) + 1

    def batch(self, rows: int, bucket: int, compute_s: float) -> None:
        self.batches += 1
        self.batch_rows += rows
        self.padded_rows += bucket - rows
        self.compute_s += compute_s
        self.batch_size.observe(rows)
        self.padding.observe((bucket - rows) / bucket if bucket else 0.0)
        self.compute.observe(compute_s)

    # ---------------------------------------------------------------- export

    @property
    def error_total(self) -> int:
        return sum(self.errors.values())

    def snapshot(self) -> dict:
        """JSON-able view of every metric."""
        return {
            **self.labels,
            "uptime_s": round(time.time() - self.started, 3),
            "requests": self.requests,
            "rows": self.rows,
            "replies": self.replies,
            "errors": self.error_total,
            "errors_by_code": dict(self.errors),
            "batches": self.batches,
            "batch_rows": self.batch_rows,
            "padded_rows": self.padded_rows,
            "compute_s": round(self.compute_s, 6),
            "mean_batch_rows": round(self.batch_rows / self.batches, 3) if self.batches else 0.0,
            "batch_size": self.batch_size.to_dict(),
            "padding_fraction": self.padding.to_dict(),
            "compute_seconds": self.compute.to_dict(),
            "latency_seconds": self.latency.to_dict(),
        }

    def prometheus_text(self) -> str:
        """Prometheus text exposition (version 0.0.4)."""
        base = self._labels()
        lines: list[str] = []

        def counter(name: str, help_text: str, value: float, extra: str = "") -> None:
            lines.append(f"# HELP {name} {help_text}")
            lines.append(f"# TYPE {name} counter")
            lines.append(f"{name}{{{_join(base, extra)}}} {value}")

        def histogram(name: str, help_text: str, h: Histogram) -> None:
            lines.append(f"# HELP {name} {help_text}")
            lines.append(f"# TYPE {name} histogram")
            for le, c in h.cumulative():
                lines.append(f'{name}_bucket{{{_join(base, f"le={_q(le)}")}}} {c}')
            lines.append(f"{name}_sum{{{base}}} {h.sum}")
            lines.append(f"{name}_count{{{base}}} {h.count}")

        counter("ddm_worker_requests_total", "Step requests received.", self.requests)
        counter("ddm_worker_rows_total", "Rows (images) requested.", self.rows)
        counter("ddm_worker_replies_total", "Successful step replies sent.", self.replies)
        lines.append("# HELP ddm_worker_errors_total Error replies sent, by error code.")
        lines.append("# TYPE ddm_worker_errors_total counter")
        for code, n in sorted(self.errors.items()) or [("none", 0)]:
            lines.append(f"ddm_worker_errors_total{{{_join(base, f'code={_q(code)}')}}} {n}")
        counter("ddm_worker_batches_total", "Forward passes run.", self.batches)
        counter("ddm_worker_padded_rows_total", "Padding rows computed and thrown away.", self.padded_rows)
        counter("ddm_worker_compute_seconds_total", "Wall time inside the model.", self.compute_s)
        histogram("ddm_worker_batch_rows", "Real rows per forward pass.", self.batch_size)
        histogram("ddm_worker_padding_fraction", "Padded share of each forward pass.", self.padding)
        histogram("ddm_worker_compute_seconds", "Model time per forward pass.", self.compute)
        histogram("ddm_worker_latency_seconds", "Receive-to-reply time per request.", self.latency)
        return "\n".join(lines) + "\n"

    def _labels(self) -> str:
        return ",".join(f"{k}={_q(v)}" for k, v in sorted(self.labels.items()))


def _q(value: str) -> str:
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _join(*parts: str) -> str:
    return ",".join(p for p in parts if p)


async def serve_metrics(metrics: WorkerMetrics, port: int, host: str = "0.0.0.0"):
    """Serve GET /metrics (Prometheus text) on host:port; returns the aiohttp AppRunner."""
    from aiohttp import web

    async def handle(_request: "web.Request") -> "web.Response":
        return web.Response(body=metrics.prometheus_text().encode(),
                            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    app = web.Application()
    app.router.add_get("/metrics", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
    except OSError as err:
        await runner.cleanup()
        raise OSError(f"cannot serve metrics on {host}:{port}: {err.strerror or err}") from None
    return runner
