"""workers.metrics: prometheus_client series, the $SRV.STATS snapshot, and the /metrics HTTP endpoint."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from bus.nats_server import free_port
from workers.metrics import WorkerMetrics, serve_metrics
from workers.metrics_http import bound_port


def families(text: str) -> dict:
    """{family name: Metric} of a Prometheus text exposition (raises on invalid text)."""
    return {f.name: f for f in text_string_to_metric_families(text)}


def value(fams: dict, sample: str, **labels) -> float:
    family = fams[sample.removesuffix("_total").removesuffix("_bucket").removesuffix("_count").removesuffix("_sum")]
    (v,) = [s.value for s in family.samples if s.name == sample and s.labels == labels]
    return v


def recorded() -> WorkerMetrics:
    m = WorkerMetrics(labels={"expert": "3", "backend": "torch"}, batch_bounds=(1, 2, 4))
    m.request(3)
    m.request(1)
    m.batch(rows=4, bucket=4, compute_s=0.02)
    m.batch(rows=3, bucket=4, compute_s=0.03)
    m.reply(0.05)
    m.error("bad_shape")
    m.error("bad_shape")
    return m


def test_snapshot_keeps_the_stats_shape():
    m = recorded()
    snap = m.snapshot()
    assert snap["requests"] == 2 and snap["rows"] == 4 and snap["errors"] == 2 and snap["replies"] == 1
    assert snap["errors_by_code"] == {"bad_shape": 2}
    assert snap["batches"] == 2 and snap["batch_rows"] == 7 and snap["padded_rows"] == 1
    assert snap["mean_batch_rows"] == 3.5 and snap["compute_s"] == pytest.approx(0.05)
    assert snap["batch_size"]["buckets"] == {"1": 0, "2": 0, "4": 2, "+Inf": 2} and snap["expert"] == "3"
    assert snap["padding_fraction"]["buckets"]["0.25"] == 2 and snap["padding_fraction"]["count"] == 2
    assert snap["compute_seconds"]["count"] == 2 and snap["latency_seconds"]["buckets"]["0.05"] == 1
    assert m.requests == 2 and m.replies == 1 and m.batches == 2 and m.error_total == 2
    fresh = WorkerMetrics(labels={"expert": "0"}).snapshot()
    assert fresh["requests"] == 0 and fresh["errors_by_code"] == {} and fresh["batch_size"]["buckets"]["+Inf"] == 0


def test_prometheus_text_is_valid_and_follows_naming_conventions():
    m = recorded()
    fams = families(m.prometheus_text())
    lab = {"backend": "torch", "expert": "3"}
    assert value(fams, "ddm_worker_requests_total", **lab) == 2
    assert value(fams, "ddm_worker_rows_total", **lab) == 4
    assert value(fams, "ddm_worker_errors_total", **lab, code="bad_shape") == 2
    assert value(fams, "ddm_worker_padding_ratio_bucket", **lab, le="0.25") == 2
    assert value(fams, "ddm_worker_forward_seconds_count", **lab) == 2
    assert value(fams, "ddm_worker_compute_seconds_total", **lab) == pytest.approx(0.05)
    assert value(fams, "ddm_worker_latency_seconds_count", **lab) == 1
    assert fams["ddm_worker_padding_ratio"].type == "histogram" and fams["ddm_worker_errors"].type == "counter"
    # one name per family: the compute-time counter and the per-pass histogram no longer collide
    assert (
        fams["ddm_worker_compute_seconds"].type == "counter" and fams["ddm_worker_forward_seconds"].type == "histogram"
    )
    # no placeholder series: error codes appear when they happen
    text = WorkerMetrics(labels={"expert": "0"}).prometheus_text()
    assert "ddm_worker_errors_total{" not in text and 'code="none"' not in text
    assert value(families(text), "ddm_worker_requests_total", expert="0") == 0


def test_workers_in_one_process_keep_separate_registries():
    a, b = WorkerMetrics(labels={"expert": "0"}), WorkerMetrics(labels={"expert": "0"})
    a.request(5)
    assert a.requests == 1 and b.requests == 0
    assert value(families(b.prometheus_text()), "ddm_worker_rows_total", expert="0") == 0
    assert WorkerMetrics().prometheus_text().count("ddm_worker_requests_total 0.0") == 1  # no labels at all


async def test_metrics_http_endpoint():
    import aiohttp

    m = WorkerMetrics(labels={"expert": "0"})
    m.request(5)
    port = free_port()
    runner = await serve_metrics(m, port, host="127.0.0.1")
    try:
        assert bound_port(runner) == port
        async with aiohttp.ClientSession() as s:
            async with s.get(f"http://127.0.0.1:{port}/metrics") as r:
                assert r.status == 200
                assert r.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
                body = await r.text()
        assert value(families(body), "ddm_worker_rows_total", expert="0") == 5
        with pytest.raises(OSError, match="cannot serve metrics"):
            await serve_metrics(m, port, host="127.0.0.1")  # port taken: clear error
    finally:
        await runner.cleanup()
    with pytest.raises(TypeError, match="registry"):
        await serve_metrics(object(), 0)
