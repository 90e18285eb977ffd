"""GET /metrics for a coordinator: its `CoordinatorMetrics` as Prometheus text, over aiohttp
(`workers.metrics_http`)."""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)


class MetricsEndpoint:
    """Serves `metrics` on http://host:port/metrics once `start`ed. port 0: any free port (read back
    from `port`); optional: a taken port is a warning (then `port` is None), not an OSError."""

    def __init__(self, port: int | None, host: str = "127.0.0.1", optional: bool = False):
        self.port, self.host, self.optional = port, host, optional
        self._runner: Any = None

    async def start(self, metrics) -> None:
        if self.port is None:
            return
        from workers.metrics_http import bound_port, serve_metrics

        try:
            self._runner = await serve_metrics(metrics, self.port, self.host)
        except OSError as err:
            if not self.optional:
                raise
            log.warning("%s; serving without /metrics", err)
            self.port = None
            return
        self.port = bound_port(self._runner)

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
