"""workers.metrics: counters, histograms, Prometheus text, and the /metrics HTTP endpoint."""

from __future__ import annotations

import re

import pytest

from infra.nats_server import free_port
from workers.metrics import Histogram, WorkerMetrics, serve_metrics


def test_histogram_is_cumulative():
    h = Histogram((1, 2, 4))
    for v in (1, 1, 3, 9):
        h.observe(v)
    assert h.cumulative() == [("1", 2), ("2", 2), ("4", 3), ("+Inf", 4)]
    assert h.count == 4 and h.sum == 14


def test_snapshot_and_prometheus_text():
    m = WorkerMetrics(labels={"expert": "3", "backend": "torch"}, batch_bounds=(1, 2, 4))
    m.request(3)
    m.request(1)
    m.batch(rows=4, bucket=4, compute_s=0.02)
    m.batch(rows=3, bucket=4, compute_s=0.03)
    m.reply(0.05)
    m.error("bad_shape")
    m.error("bad_shape")
    snap = m.snapshot()
    assert snap["requests"] == 2 and snap["rows"] == 4 and snap["errors"] == 2
    assert snap["errors_by_code"] == {"bad_shape": 2}
    assert snap["batches"] == 2 and snap["padded_rows"] == 1 and snap["mean_batch_rows"] == 3.5
    assert snap["batch_size"]["buckets"]["4"] == 2 and snap["expert"] == "3"
    text = m.prometheus_text()
    assert 'ddm_worker_requests_total{backend="torch",expert="3"} 2' in text
    assert 'ddm_worker_errors_total{backend="torch",expert="3",code="bad_shape"} 2' in text
    assert 'ddm_worker_padding_fraction_bucket{backend="torch",expert="3",le="0.25"} 2' in text
    assert re.search(r'ddm_worker_compute_seconds_count\{backend="torch",expert="3"\} 2', text)
    # every sample line is `name{labels} number`
    for line in text.splitlines():
        if not line.startswith("#"):
            assert re.fullmatch(r'[a-z_]+\{[^}]*\} [0-9.e+-]+', line), line


async def test_metrics_http_endpoint():
    import aiohttp

    m = WorkerMetrics(labels={"expert": "0"})
    m.request(5)
    port = free_port()
    runner = await serve_metrics(m, port, host="127.0.0.1")
    try:
        async with aiohttp.ClientSession() as s:
            async with s.get(f"http://127.0.0.1:{port}/metrics") as r:
                assert r.status == 200
                assert r.headers["Content-Type"].startswith("text/plain")
                body = await r.text()
        assert 'ddm_worker_rows_total{expert="0"} 5' in body
        with pytest.raises(OSError, match="cannot serve metrics"):
            await serve_metrics(m, port, host="127.0.0.1")  # port taken: clear error
    finally:
        await runner.cleanup()
