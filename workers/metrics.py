"""Worker metrics with prometheus_client: one private registry per worker, shown two ways.

    m = WorkerMetrics(labels={"expert": "0", "backend": "torch"})
    m.request(rows=3); m.batch(rows=3, bucket=4, compute_s=0.01); m.error("bad_shape")
    m.snapshot()          # JSON-able dict, served as endpoint `data` in $SRV.STATS
    m.prometheus_text()   # text exposition format 0.0.4, served on GET /metrics
    m.registry            # the prometheus_client CollectorRegistry behind both

Each WorkerMetrics has its own `CollectorRegistry`, so several workers in one process (tests,
`LocalFleet`) never share or clash. Series, each labelled with `labels` (expert, backend):

    ddm_worker_requests_total            counter    step requests received
    ddm_worker_rows_total                counter    rows (images) requested
    ddm_worker_replies_total             counter    successful step replies sent
    ddm_worker_errors_total{code}        counter    error replies sent, by error code
    ddm_worker_requests_dropped_total    counter    requests never answered: their reply subject is no inbox
    ddm_worker_batches_total             counter    forward passes run
    ddm_worker_padded_rows_total         counter    padding rows computed and thrown away
    ddm_worker_compute_seconds_total     counter    wall time inside the model
    ddm_worker_batch_rows                histogram  real rows per forward pass
    ddm_worker_padding_ratio             histogram  padded share (0-1) of each forward pass
    ddm_worker_forward_seconds           histogram  model time per forward pass
    ddm_worker_latency_seconds           histogram  receive-to-reply time per request

`serve_metrics(metrics, port)` (from `workers.metrics_http`) starts an aiohttp server with
GET /metrics and returns its runner (call `await runner.cleanup()` to stop it).
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from .metrics_http import serve_metrics  # noqa: F401  (re-exported: the worker serves with it)

#: Compute-time histogram bounds (seconds).
TIME_BOUNDS: tuple[float, ...] = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
#: Padding-ratio histogram bounds (padded rows / bucket).
PAD_BOUNDS: tuple[float, ...] = (0.0, 0.1, 0.25, 0.5, 0.75, 1.0)


def _fmt(v: float) -> str:
    """A bucket bound as $SRV.STATS has always shown it: "4", "0.25", "+Inf"."""
    if v == float("inf"):
        return "+Inf"
    return repr(int(v)) if float(v).is_integer() else repr(float(v))


class WorkerMetrics:
    """The metrics of one worker. `labels` go on every series (e.g. expert, backend)."""

    def __init__(
        self, labels: dict[str, str] | None = None, batch_bounds: Iterable[int] = (1, 2, 4, 8, 16, 32, 64, 128)
    ):
        self.labels = {str(k): str(v) for k, v in (labels or {}).items()}
        self.started = time.time()
        self.registry = CollectorRegistry()
        names = sorted(self.labels)

        def bound(metric):  # the series with this worker's labels (created now, so it shows 0 at once)
            return metric.labels(**self.labels) if self.labels else metric

        def counter(name: str, doc: str):
            return bound(Counter(name, doc, names, registry=self.registry))

        def histogram(name: str, doc: str, bounds: Iterable[float]):
            return bound(Histogram(name, doc, names, buckets=tuple(float(b) for b in bounds), registry=self.registry))

        self._requests = counter("ddm_worker_requests", "Step requests received.")
        self._rows = counter("ddm_worker_rows", "Rows (images) requested.")
        self._replies = counter("ddm_worker_replies", "Successful step replies sent.")
        self._dropped = counter(
            "ddm_worker_requests_dropped", "Requests never answered: their reply subject is not a NATS inbox."
        )
        self._errors = Counter(
            "ddm_worker_errors", "Error replies sent, by error code.", [*names, "code"], registry=self.registry
        )  # a series per code, from its first error on
        self._batches = counter("ddm_worker_batches", "Forward passes run.")
        self._padded = counter("ddm_worker_padded_rows", "Padding rows computed and thrown away.")
        self._compute_s = counter("ddm_worker_compute_seconds", "Wall time inside the model.")
        self._batch_size = histogram("ddm_worker_batch_rows", "Real rows per forward pass.", batch_bounds)
        self._padding = histogram("ddm_worker_padding_ratio", "Padded share (0-1) of each forward pass.", PAD_BOUNDS)
        self._compute = histogram("ddm_worker_forward_seconds", "Model time per forward pass.", TIME_BOUNDS)
        self._latency = histogram("ddm_worker_latency_seconds", "Receive-to-reply time per request.", TIME_BOUNDS)
        self._error_codes: dict[str, object] = {}  # code -> bound child, created on first use

    # ---------------------------------------------------------------- recording

    def request(self, rows: int) -> None:
        self._requests.inc()
        self._rows.inc(rows)

    def reply(self, latency_s: float) -> None:
        self._replies.inc()
        self._latency.observe(latency_s)

    def dropped(self) -> None:
        """A request dropped unanswered (its reply subject is outside _INBOX)."""
        self._dropped.inc()

    def error(self, code: str) -> None:
        child = self._error_codes.get(code)
        if child is None:
            child = self._error_codes[code] = self._errors.labels(**self.labels, code=str(code))
        child.inc()

    def batch(self, rows: int, bucket: int, compute_s: float) -> None:
        self._batches.inc()
        self._padded.inc(bucket - rows)
        self._compute_s.inc(compute_s)
        self._batch_size.observe(rows)
        self._padding.observe((bucket - rows) / bucket if bucket else 0.0)
        self._compute.observe(compute_s)

    # ---------------------------------------------------------------- reading

    @staticmethod
    def _total(series) -> float:
        """The `_total` sample of one counter series."""
        for family in series.collect():
            for s in family.samples:
                if s.name.endswith("_total"):
                    return s.value
        return 0.0

    @staticmethod
    def _histogram(series) -> dict:
        """{"buckets": {bound: cumulative count}, "sum": float, "count": int} of one histogram series."""
        out: dict = {"buckets": {}, "sum": 0.0, "count": 0}
        for family in series.collect():
            for s in family.samples:
                if s.name.endswith("_bucket"):
                    out["buckets"][_fmt(float(s.labels["le"]))] = int(s.value)
                elif s.name.endswith("_sum"):
                    out["sum"] = s.value
                elif s.name.endswith("_count"):
                    out["count"] = int(s.value)
        return out

    @property
    def requests(self) -> int:
        return int(self._total(self._requests))

    @property
    def rows(self) -> int:
        return int(self._total(self._rows))

    @property
    def replies(self) -> int:
        return int(self._total(self._replies))

    @property
    def batches(self) -> int:
        return int(self._total(self._batches))

    @property
    def padded_rows(self) -> int:
        return int(self._total(self._padded))

    @property
    def compute_s(self) -> float:
        return self._total(self._compute_s)

    @property
    def errors(self) -> dict[str, int]:
        """{error code: error replies sent}."""
        out: dict[str, int] = {}
        for family in self._errors.collect():
            for s in family.samples:
                if s.name.endswith("_total"):
                    out[s.labels["code"]] = int(s.value)
        return out

    @property
    def error_total(self) -> int:
        return sum(self.errors.values())

    # ---------------------------------------------------------------- export

    def snapshot(self) -> dict:
        """JSON-able view of every metric (the $SRV.STATS `data`; keys unchanged since v1)."""
        batch_size = self._histogram(self._batch_size)
        batches = batch_size["count"]
        batch_rows = int(round(batch_size["sum"]))
        errors = self.errors
        return {
            **self.labels,
            "uptime_s": round(time.time() - self.started, 3),
            "requests": self.requests,
            "rows": self.rows,
            "replies": self.replies,
            "errors": sum(errors.values()),
            "errors_by_code": errors,
            "batches": batches,
            "batch_rows": batch_rows,
            "padded_rows": self.padded_rows,
            "compute_s": round(self.compute_s, 6),
            "mean_batch_rows": round(batch_rows / batches, 3) if batches else 0.0,
            "batch_size": batch_size,
            "padding_fraction": self._histogram(self._padding),
            "compute_seconds": self._histogram(self._compute),
            "latency_seconds": self._histogram(self._latency),
        }

    def prometheus_text(self) -> str:
        """Prometheus text exposition (version 0.0.4) of this worker's registry."""
        return generate_latest(self.registry).decode()
