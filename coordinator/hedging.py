"""When to hedge an expert request: send a second copy of a try that is late (pure: feed it, ask it).

A try of an expert whose recent replies came from at least two workers is hedged when it has no reply
after the expert's hedge delay: 1.5 x the p99 of its recent call latencies (`HEDGE_FLOOR_S` at least,
`HEDGE_START_S` before `HEDGE_MIN_SAMPLES` calls), or a fixed `hedge_after_s`. A copy sent to an expert
with a single worker would only queue behind the original, so none is. A token bucket per expert
(`HEDGE_BUDGET` hedges per request, `HEDGE_BURST` at once) keeps a slow expert from doubling its own load.

`HedgePolicy` only decides; a try's legs (coordinator/try_legs.py, `TryLegs.send`) send the copy, race
the two legs and report each successful call back (`observe`).
"""

from __future__ import annotations

import math
from collections import deque

from .choices import HEDGE_MODES  # noqa: F401 (re-exported: the one list, coordinator/choices.py)

#: Hedging: recent successful call latencies kept per expert.
HEDGE_WINDOW = 256
#: ... the quantile of them a try may take before it is hedged.
HEDGE_QUANTILE = 0.99
#: ... times this margin: a try is hedged when clearly late, not merely in the slowest 1%.
HEDGE_MARGIN = 1.5
#: ... calls needed before that quantile is trusted; until then the delay is HEDGE_START_S.
HEDGE_MIN_SAMPLES = 20
#: ... the hedge delay before HEDGE_MIN_SAMPLES calls (s): patient, since the expert's speed is unknown.
HEDGE_START_S = 1.0
#: ... the shortest hedge delay (s), however fast the expert.
HEDGE_FLOOR_S = 0.05
#: ... long-run hedges per request (token bucket refill) and hedges that may go out back to back.
HEDGE_BUDGET = 0.1
HEDGE_BURST = 8.0
#: ... recent replies whose worker ids say whether an expert has several workers.
HEDGE_WORKERS_WINDOW = 64

#: what `TryLegs.hedge_counts` counts per expert: the copy answered first, the original did, neither did.
HEDGE_OUTCOMES = ("won", "lost", "failed")


class LatencyWindow:
    """The last `size` latencies (s) of one expert's successful calls, and quantiles over them."""

    def __init__(self, size: int = HEDGE_WINDOW):
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        self._samples: deque[float] = deque(maxlen=size)

    def add(self, seconds: float) -> None:
        if math.isfinite(seconds) and seconds >= 0:
            self._samples.append(float(seconds))

    def __len__(self) -> int:
        return len(self._samples)

    def quantile(self, q: float) -> float | None:
        """The q-quantile (0..1, nearest rank, so p99 of 20 samples is their maximum); None when empty."""
        if not self._samples:
            return None
        ordered = sorted(self._samples)
        rank = min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))
        return ordered[rank]


class HedgePolicy:
    """When to send a second copy of an expert request (pure: feed it observations, ask it).

    mode: "auto" (hedge as below) or "off" (never). after_s: a fixed hedge delay instead of the
    latency quantile. A try of expert k is hedged after `delay(k)` seconds without a reply, when
    `delay(k)` is not None and `take(k)` grants a token:

    * delay: None when off, or when the last `workers_window` replies of k came from fewer than
      two distinct worker ids (one worker: a copy would only queue behind the original); else
      after_s if given, else max(floor_s, margin x the `quantile` of the last `window`
      latencies), or max(floor_s, start_s) while fewer than `min_samples` latencies are known.
    * take: a token bucket per expert, `budget` tokens per request sent (`on_request`), at most
      `burst`, starting full; a hedge spends one.
    """

    def __init__(
        self,
        mode: str = "auto",
        *,
        after_s: float | None = None,
        quantile: float = HEDGE_QUANTILE,
        margin: float = HEDGE_MARGIN,
        floor_s: float = HEDGE_FLOOR_S,
        start_s: float = HEDGE_START_S,
        min_samples: int = HEDGE_MIN_SAMPLES,
        window: int = HEDGE_WINDOW,
        budget: float = HEDGE_BUDGET,
        burst: float = HEDGE_BURST,
        workers_window: int = HEDGE_WORKERS_WINDOW,
    ):
        if mode not in HEDGE_MODES:
            raise ValueError(f"hedge mode must be one of {list(HEDGE_MODES)}, got {mode!r}")
        if after_s is not None and not after_s > 0:
            raise ValueError(f"hedge_after_s must be > 0 seconds, got {after_s}")
        if not 0 < quantile <= 1:
            raise ValueError(f"quantile must be in (0, 1], got {quantile}")
        if not margin >= 1:
            raise ValueError(f"margin must be >= 1, got {margin}")
        if floor_s < 0 or start_s <= 0 or min_samples < 1 or budget < 0 or burst < 1 or workers_window < 1:
            raise ValueError(
                "hedge floor_s >= 0, start_s > 0, min_samples >= 1, budget >= 0, burst >= 1 and "
                "workers_window >= 1 are required"
            )
        self.mode, self.after_s, self.q, self.margin = mode, after_s, quantile, margin
        self.floor_s, self.start_s, self.min_samples = floor_s, start_s, min_samples
        self.window, self.budget, self.burst, self.workers_window = window, budget, burst, workers_window
        self._latency: dict[int, LatencyWindow] = {}
        self._workers: dict[int, deque[str]] = {}
        self._tokens: dict[int, float] = {}

    def observe(self, expert: int, seconds: float, worker: str) -> None:
        """A successful call of `expert` that took `seconds`, answered by worker id `worker`."""
        self._latency.setdefault(expert, LatencyWindow(self.window)).add(seconds)
        self._workers.setdefault(expert, deque(maxlen=self.workers_window)).append(worker)

    def on_request(self, expert: int) -> None:
        """A try of `expert` is being sent: refill its hedge budget."""
        self._tokens[expert] = min(self.burst, self._tokens.get(expert, self.burst) + self.budget)

    def workers_seen(self, expert: int) -> int:
        """Distinct worker ids among `expert`'s recent replies."""
        return len(set(self._workers.get(expert, ())))

    def estimate(self, expert: int) -> float:
        """The latency-based hedge delay of `expert` (s), whatever the mode and worker count."""
        if self.after_s is not None:
            return self.after_s
        lat = self._latency.get(expert)
        if lat is None or len(lat) < self.min_samples:
            return max(self.floor_s, self.start_s)
        return max(self.floor_s, self.margin * (lat.quantile(self.q) or 0.0))

    def delay(self, expert: int) -> float | None:
        """Seconds without a reply after which a try of `expert` is hedged; None: never."""
        if self.mode == "off" or self.workers_seen(expert) < 2:
            return None
        return self.estimate(expert)

    def take(self, expert: int) -> bool:
        """Spend one hedge token of `expert`; False (send no hedge) when its bucket is empty."""
        left = self._tokens.get(expert, self.burst)
        if left < 1:
            return False
        self._tokens[expert] = left - 1
        return True
