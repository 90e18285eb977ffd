"""aiohttp's log of malformed HTTP requests, summarised and throttled.

aiohttp logs every request it cannot parse (a bad header, a bad Content-Length, a second request with
a bad method) as an error with a full traceback, on logger `aiohttp.server`: anyone who can reach the
port can fill the log. `install()` (the web viewer's `create_app` and the coordinator's and workers'
`/metrics` server call it) adds a filter to that logger that turns each
such record into one warning line without the traceback, naming the peer and what was wrong, and lets
at most one through per `EVERY_S` seconds; the line says how many were held back since the last one.
Other errors on that logger (an exception in a handler: a bug) keep their traceback.

    malformed HTTP request from 203.0.113.5: Invalid character in Content-Length (41 more since the last such line)
"""

from __future__ import annotations

import logging
import time

#: Seconds between two log lines about malformed requests.
EVERY_S = 10.0
LOGGER = "aiohttp.server"


class MalformedRequestLog(logging.Filter):
    """A logging filter: summarise and throttle records of malformed HTTP requests; pass the rest."""

    def __init__(self, every_s: float = EVERY_S, clock=time.monotonic):
        super().__init__()
        self.every_s, self.clock = every_s, clock
        self._last = -float("inf")
        self.suppressed = 0
        self.total = 0

    def reset(self) -> None:
        """Let the next malformed request be logged at once (a new period)."""
        self._last, self.suppressed = -float("inf"), 0

    def filter(self, record: logging.LogRecord) -> bool:
        from aiohttp.http_exceptions import HttpProcessingError

        exc = record.exc_info[1] if record.exc_info else None
        if not isinstance(exc, HttpProcessingError):
            return True
        self.total += 1
        now = self.clock()
        if now - self._last < self.every_s:
            self.suppressed += 1
            return False
        held, self.suppressed, self._last = self.suppressed, 0, now
        peer = record.args[0] if isinstance(record.args, tuple) and record.args else "?"
        lines = [line.strip() for line in str(getattr(exc, "message", "") or exc).splitlines() if line.strip()]
        reason = (lines[0] if lines else type(exc).__name__).rstrip(":")[:200]
        more = f" ({held} more since the last such line)" if held else ""
        record.msg = f"malformed HTTP request from {str(peer)[:100]}: {reason}{more}"
        record.args = ()
        record.levelno, record.levelname = logging.WARNING, "WARNING"
        record.exc_info, record.exc_text = None, None
        return True


def install() -> MalformedRequestLog:
    """Add the filter to aiohttp's server logger once per process; returns it."""
    logger = logging.getLogger(LOGGER)
    for f in logger.filters:
        if isinstance(f, MalformedRequestLog):
            return f
    f = MalformedRequestLog()
    logger.addFilter(f)
    return f
