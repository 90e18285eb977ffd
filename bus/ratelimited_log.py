"""A log line that a flood of bad messages cannot turn into a flood of lines.

Used by every process that drops messages it will not answer (the coordinator and the workers:
requests whose reply subject is not a NATS inbox).
"""

from __future__ import annotations

import logging
import time


class RateLimitedLog:
    """At most one log line per `every_s` seconds; the lines held back are counted in the next one."""

    def __init__(self, logger: logging.Logger, every_s: float = 10.0, clock=time.monotonic):
        self.logger, self.every_s, self.clock = logger, every_s, clock
        self._last = -float("inf")
        self.suppressed = 0
        self.total = 0

    def warning(self, fmt: str, *args) -> bool:
        """Log (returns True) unless a line went out less than `every_s` ago (then counts it)."""
        self.total += 1
        now = self.clock()
        if now - self._last < self.every_s:
            self.suppressed += 1
            return False
        held, self.suppressed, self._last = self.suppressed, 0, now
        self.logger.warning(fmt + (f" ({held} more since the last such line)" if held else ""), *args)
        return True
