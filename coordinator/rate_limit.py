"""Per-client token buckets: how many requests of a kind each client may make per second.

    buckets = TokenBuckets(rate=20.0, burst=40)
    wait = buckets.take("alice", now)      # 0.0: allowed (a token taken); > 0: refused, retry in `wait` s

Pure (the caller passes the clock), bounded: at most `max_clients` buckets are kept; the least
recently used is forgotten first (a forgotten client starts again with a full bucket).
"""

from __future__ import annotations

from collections import OrderedDict

#: Most clients whose bucket is kept.
MAX_CLIENTS = 4096


class TokenBuckets:
    """One token bucket per client: `burst` tokens at most, refilled at `rate` per second."""

    def __init__(self, rate: float, burst: float, max_clients: int = MAX_CLIENTS):
        if not rate > 0 or not burst >= 1:
            raise ValueError(f"a token bucket needs rate > 0 and burst >= 1, got rate={rate!r}, burst={burst!r}")
        self.rate, self.burst, self.max_clients = float(rate), float(burst), int(max_clients)
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # client -> (tokens, at)
        self.refused = 0

    def take(self, client: str, now: float) -> float:
        """Take a token of `client`'s bucket: 0.0 if there was one, else the seconds until there is
        (nothing taken)."""
        tokens, at = self._buckets.pop(client, (self.burst, now))
        tokens = min(self.burst, tokens + max(0.0, now - at) * self.rate)
        wait = 0.0
        if tokens >= 1.0:
            tokens -= 1.0
        else:
            wait = (1.0 - tokens) / self.rate
            self.refused += 1
        self._buckets[client] = (tokens, now)
        while len(self._buckets) > self.max_clients:
            self._buckets.popitem(last=False)
        return wait
