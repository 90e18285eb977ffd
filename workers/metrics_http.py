"""Serve a prometheus_client registry on GET /metrics (aiohttp, on the running event loop).

    runner = await serve_metrics(registry_or_metrics, port, host="127.0.0.1")
    ...
    await runner.cleanup()

Used by the expert worker (`workers.metrics.WorkerMetrics`) and the coordinator
(`coordinator.metrics.CoordinatorMetrics`). The scrape runs on the event loop, so collectors that
read live state (queue depth, ...) see it between two loop steps, never half-updated.

Default ports (the Prometheus exporter range 9100-9999 is fully allocated on the Prometheus
wiki's "default port allocations" page; 9100 is node_exporter's, 9464 OpenTelemetry's, so
ddm-fleet uses neither): worker 9477, coordinator 9478 (`DEFAULT_WORKER_PORT`,
`DEFAULT_COORDINATOR_PORT`). Both are plain defaults: pass another with `--metrics-port`.

Both bind `DEFAULT_METRICS_HOST` (127.0.0.1, loopback) unless told otherwise (`--metrics-host
0.0.0.0` for a Prometheus on another machine): the metrics name worker hosts, devices and load.
"""

from __future__ import annotations

from typing import Any

#: Interface the worker's and the coordinator's /metrics bind unless `--metrics-host` says otherwise.
DEFAULT_METRICS_HOST = "127.0.0.1"

#: Conventional metrics port of an expert worker (`ddm-fleet worker --metrics-port`).
DEFAULT_WORKER_PORT = 9477
#: Default metrics port of the coordinator (`ddm-fleet coordinator --metrics-port`).
DEFAULT_COORDINATOR_PORT = 9478

#: The exposition `prometheus_client.generate_latest` writes (text format 0.0.4).
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _registry(source: Any):
    """A CollectorRegistry, or the `.registry` of a metrics object."""
    registry = getattr(source, "registry", source)
    if not hasattr(registry, "collect"):
        raise TypeError(
            f"serve_metrics needs a prometheus_client registry (or an object with .registry), "
            f"got {type(source).__name__}"
        )
    return registry


async def serve_metrics(source: Any, port: int, host: str = DEFAULT_METRICS_HOST):
    """Serve GET /metrics (Prometheus text) for `source` on host:port; returns the aiohttp AppRunner.

    port 0 picks a free port (read it back with `bound_port(runner)`). Raises OSError("cannot serve
    metrics on host:port: ...") when the port is taken."""
    from aiohttp import web
    from prometheus_client import generate_latest

    from bus import http_log

    registry = _registry(source)
    http_log.install()  # malformed requests: one summarised line per 10 s, not a traceback each

    async def handle(_request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE})

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


def bound_port(runner) -> int:
    """The TCP port a runner from `serve_metrics` listens on."""
    for addr in runner.addresses:
        return int(addr[1])
    raise RuntimeError("the metrics server is not listening")
