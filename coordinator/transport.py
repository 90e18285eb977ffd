"""Expert velocity calls over NATS: one batched StepRequest per expert per tick.

`NatsTransport.velocity(expert, x [n, C, H, W], t [n], y [n], row_ids)` splits batches over
`max_rows` into concurrent requests and sends each either to one worker's direct subject or to the
expert's queue group, which hands it to one of the expert's workers at random.

Dispatch (`dispatch="direct"`, the default; see coordinator/dispatch.py): a try goes to the known
worker of the expert with the fewest requests outstanding from this transport (join the shortest
queue), on `subjects.expert_direct(k, worker_token(worker_id))`; to the queue group when no worker
is known, when every known worker already has `DispatchPolicy.depth` outstanding, and every
`explore_every`-th try (workers are learned from the `worker_id` of good replies). A direct try
answered "no responders" (the worker stopped, or predates direct subjects) forgets that worker and
goes to the queue group at once, within the same try; a direct try that times out, or gets an
error or unusable reply, forgets the worker and is retried as below (elsewhere). Counted in
`dispatch_counts[(expert, "direct" | "queue")]` (every leg sent, hedges included) and
`direct_fallbacks`. `dispatch="queue"`: every try to the queue group, as before direct subjects.

Worker specs: once the coordinator sets `fleet_spec`, every discovery (`refresh_workers`, every few
seconds) checks each worker's advertised spec (coordinator/fleet_spec.py `check_worker`). A worker
that differs goes into `rejected_workers` (a warning naming it once); its expert is fenced
(`DispatchPolicy.fence`): its requests go only to matching workers' direct subjects, which discovery
makes known, never to the queue group the odd worker shares (also with `dispatch="queue"`), unless no
matching worker is known. A reply claiming a rejected worker, or a `bad_shape` error (requests carry the
checked fleet's shape), is a bad reply: the request goes again.

A request is retried when:
* it times out, or gets a transient error reply (`overloaded`, `deadline_exceeded`,
  `unavailable`, `internal`): at most `retries` more tries; a try after a time-out goes to a known
  worker however busy, not to the queue group (`DispatchPolicy.pick(insist=True)`: a silent member,
  e.g. behind a cut route, may be picked there again);
* the reply is unusable: undecodable, not a `step_reply`, for another expert, wrong row ids,
  a velocity of the wrong shape or dtype, or with NaN/Inf (also after the cast to float32). Such
  a reply is logged with the worker id it claims and counted in `bad_replies` / `bad_workers`;
  a broken or hostile worker answers fast, so these get their own budget, `bad_reply_retries`;
* it timed out while the NATS connection was down or after it was re-established (the request
  or its reply went down with the old connection): a free retry, at most `MAX_LOST_TO_RECONNECT`
  per request (then time-outs count against `retries` again);
* the expert has no responders within `reconnect_grace` seconds of a reconnect (its workers
  have not reconnected yet): wait a little and try again, until the grace period ends.

It raises `ExpertUnavailable` when the expert has no responders at all, or every try failed, and
`BadExpertReply` (an ExpertUnavailable with code `bad_reply`) when it only ever got bad replies.

Forged replies: every request (every try) gets its own reply subject
`<inbox prefix>.<per-transport NUID>.<secrets.token_hex(16)>` (128 random bits), served by one
wildcard subscription whose callback accepts a message only on the token of a request this
transport has outstanding, and only once (the token is forgotten on the first reply, on time-out
and on give-up). A reply on any other subject under the prefix (a guessed or replayed token, a
second reply, a reply after its time-out) is dropped and counted in `stray_replies`. A process
that sees one request (a worker of that expert) learns only that request's token, so it cannot
answer anyone else's. The reply must also name the requested expert and echo its row ids.
`bad_workers` keeps the `BAD_WORKERS_KEPT` worker ids most recently blamed (LRU), so a reply
stream claiming ever new ids cannot grow it without bound.

Wire precision (`wire_dtype`): "float32" (default, what every peer has always sent), "float16" or
"bfloat16": x_t is sent in that precision and the request asks for the velocity back in it
(`StepRequest.reply_dtype`); the reply is widened to float32 here and checked for NaN/Inf as always.
An x_t that does not fit float16 is sent as float32; a worker's `non_finite` answer to a
reduced-precision request (its velocity overflowed float16) is retried once in float32
(`wire_fallbacks`), so the overflow costs a round trip, never a NaN in a sample.

Classifier-free guidance (`guidance=`, each row's scale, given by the engine only when some row is
guided): a request carries it as `StepRequest.guidance` only when one of its rows has a scale other
than 1, and holds half the rows it would otherwise (the worker evaluates each guided row twice, and
counts both against its request limit). Workers say whether they serve it (`guidance` in their service
metadata, learned at discovery: `guidance_of`); the coordinator refuses a guided job while a discovered
worker does not (`experts_without_guidance`), since an older worker refuses the field.

Hedged requests (`hedge="auto"`, see `HedgePolicy`): when a try has no reply after the expert's
hedge delay (1.5 x the p99 of its recent call latencies, `HEDGE_FLOOR_S` at least, `HEDGE_START_S`
before `HEDGE_MIN_SAMPLES` calls; or a fixed `hedge_after_s`), the same request bytes (same
`request_id`, same deadline) are published once more with a new reply subject, so the queue group
can hand the copy to another worker (with direct dispatch: to another known worker with room,
else to the queue group; never to the primary's worker directly). The first usable reply wins; the
other leg is cancelled and its reply, if it comes, is dropped quietly (`late_replies`, not a stray).
At most one hedge per try, and only for an expert whose recent replies came from at least two
workers (a copy sent to a single worker only queues behind the original); a token bucket
(`HEDGE_BUDGET` hedges per request, `HEDGE_BURST` at once) keeps a slow expert from doubling its own
load. Both legs share the try's `step_timeout`. Counted in `hedge_counts[(expert, outcome)]`: won
(the copy answered first), lost (the original did), failed (neither gave a usable reply).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import secrets
import time
from collections import OrderedDict, deque

import numpy as np

from bus.cancel import raise_if_cancelled
from bus.inbox import private_inbox
from schemas import (
    ErrorCode,
    ErrorReply,
    ProtocolError,
    StepReply,
    StepRequest,
    StepResult,
    loads,
    pack,
    subjects,
    validate,
)
from schemas.limits import MAX_RUN_AHEAD, MAX_STEP_ROWS
from schemas.tensor import WIRE_FLOATS, to_wire_dtype, widen_float32

from .dispatch import DISPATCH_MODES, DispatchPolicy
from .engine import ANSWERED_BY
from .errors import BadExpertReply, ExpertUnavailable
from .run_ahead import AheadStream

log = logging.getLogger(__name__)

#: Error codes worth a retry on another worker; anything else means our request is bad.
TRANSIENT = {ErrorCode.OVERLOADED, ErrorCode.DEADLINE_EXCEEDED, ErrorCode.UNAVAILABLE, ErrorCode.INTERNAL}

#: Free retries of one request whose connection was re-established while it waited.
MAX_LOST_TO_RECONNECT = 3

#: Pause between tries while an expert has no responders just after a reconnect (s).
NO_RESPONDERS_BACKOFF = 0.25

#: Most worker ids `NatsTransport.bad_workers` remembers (least recently blamed dropped first).
BAD_WORKERS_KEPT = 256
#: fewest seconds between two service discoveries for the workers' dtypes (`NatsTransport.worker_dtype`)
DTYPE_REFRESH_S = 2.0

#: Seconds between two log lines about stray (unexpected or forged) replies.
STRAY_LOG_INTERVAL = 10.0

#: The status nats-server puts on the reply of a request nobody subscribes to.
_NO_RESPONDERS = "503"

#: Bytes a request or reply spends per row beside its tensor (t, y, row id), and per message
#: (headers, expert, ids, deadline, ...): generous bounds for splitting under max_payload.
ROW_OVERHEAD_BYTES = 96
MESSAGE_OVERHEAD_BYTES = 4096

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
#: Seconds an expert's requests do not run ahead after one of its workers refused the fields (an older worker).
NO_AHEAD_S = 300.0
#: Tokens of cancelled hedge legs remembered, so that their late replies are dropped quietly.
RETIRED_TOKENS_KEPT = 4096

HEDGE_MODES = ("auto", "off")
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


class BoundedCounter(OrderedDict):
    """A Counter of at most `maxlen` keys: adding a new key past the bound forgets the key
    least recently counted. `c[key] += 1` works as with collections.Counter (missing -> 0)."""

    def __init__(self, maxlen: int = BAD_WORKERS_KEPT):
        super().__init__()
        if maxlen < 1:
            raise ValueError(f"maxlen must be >= 1, got {maxlen}")
        self.maxlen = maxlen

    def __missing__(self, key) -> int:
        return 0

    def __setitem__(self, key, value) -> None:
        super().__setitem__(key, value)
        self.move_to_end(key)
        while len(self) > self.maxlen:
            self.popitem(last=False)

    def most_common(self, n: int | None = None) -> list[tuple[str, int]]:
        ranked = sorted(self.items(), key=lambda kv: kv[1], reverse=True)
        return ranked if n is None else ranked[:n]


class _BadReply(Exception):
    """A reply we cannot use. `worker` is the worker id the reply claims ("" if none)."""

    def __init__(self, why: str, worker: str = ""):
        super().__init__(why)
        self.why = why
        self.worker = worker


def _claimed_worker(raw) -> str:
    """The worker_id a (possibly invalid) decoded reply claims, printable and short, or ""."""
    w = raw.get("worker_id") if isinstance(raw, dict) else None
    return w[:128] if isinstance(w, str) and w.isprintable() else ""


class NatsTransport:
    """Request/reply to `schemas.subjects.expert_velocity(k)` (the queue group) or to one worker's
    `expert_direct(k, token)`.

    step_timeout: seconds to wait for one reply; retries: extra tries after a timeout or a
    transient error reply; bad_reply_retries: extra tries after unusable replies; max_rows:
    rows per request (<= MAX_STEP_ROWS); reconnect_grace: seconds after a NATS reconnect during
    which "no responders" means "workers still reconnecting" (wait and retry), not "no workers";
    dispatch: "direct" (join-shortest-queue over the known workers, module docstring) or "queue"
    (every try to the queue group)."""

    def __init__(
        self,
        nc,
        *,
        step_timeout: float = 10.0,
        retries: int = 2,
        max_rows: int = MAX_STEP_ROWS,
        bad_reply_retries: int = 4,
        reconnect_grace: float = 10.0,
        wire_dtype: str = "float32",
        hedge: str = "auto",
        hedge_after_s: float | None = None,
        dispatch: str = "direct",
    ):
        if step_timeout <= 0:
            raise ValueError(f"step_timeout must be > 0 seconds, got {step_timeout}")
        if retries < 0:
            raise ValueError(f"retries must be >= 0, got {retries}")
        if bad_reply_retries < 0:
            raise ValueError(f"bad_reply_retries must be >= 0, got {bad_reply_retries}")
        if not 1 <= max_rows <= MAX_STEP_ROWS:
            raise ValueError(f"max_rows must be in [1, {MAX_STEP_ROWS}], got {max_rows}")
        if wire_dtype not in WIRE_FLOATS:
            raise ValueError(f"wire_dtype must be one of {list(WIRE_FLOATS)}, got {wire_dtype!r}")
        if dispatch not in DISPATCH_MODES:
            raise ValueError(f"dispatch must be one of {list(DISPATCH_MODES)}, got {dispatch!r}")
        self.wire_dtype = wire_dtype
        self.dispatch = dispatch
        #: join-shortest-queue over known workers (dispatch="direct"); None: always the queue group
        self.dispatcher = DispatchPolicy(subjects.worker_token) if dispatch == "direct" else None
        self.dispatch_counts: dict[tuple[int, str], int] = {}  # (expert, direct | queue) -> legs sent
        self.direct_fallbacks = 0  # direct legs answered "no responders", sent again to the queue group
        self.hedging = HedgePolicy(hedge, after_s=hedge_after_s)  # ValueError for a bad mode / delay
        self.hedge_counts: dict[tuple[int, str], int] = {}  # (expert, won | lost | failed) -> hedges
        self.requests_sent: dict[int, int] = {}  # expert -> tries sent (hedge copies not counted)
        self.late_replies = 0  # replies to a hedge leg cancelled because the other one won
        self.wire_fallbacks = 0  # reduced-precision tries answered non_finite and sent again in float32
        self._retired: OrderedDict[str, None] = OrderedDict()  # tokens of cancelled hedge legs
        self.nc = nc
        self.step_timeout = step_timeout
        self.retries = retries
        self.bad_reply_retries = bad_reply_retries
        self.max_rows = max_rows
        self.reconnect_grace = reconnect_grace
        self._ids = itertools.count()
        self.retried = 0  # requests that needed another try (for status / tests)
        self.bad_replies = 0  # unusable replies received
        self.bad_workers = BoundedCounter(BAD_WORKERS_KEPT)  # worker id ("?" if none claimed) -> bad replies
        self.stray_replies = 0  # replies on a token with no outstanding request (forged, duplicate, late)
        self._reconnects_seen = self._reconnects()
        self._reconnected_at = float("-inf")
        #: worker id -> the dtype it advertises (`dtype`, or `precision` of older workers) in its
        #: service metadata; replaced whole by `refresh_worker_dtypes` (at most every DTYPE_REFRESH_S)
        self.worker_dtypes: dict[str, str] = {}
        self._dtype_refresh: asyncio.Task | None = None
        self._dtype_refreshed_at = float("-inf")
        #: the fleet's model spec (set by the coordinator after its start check); None: workers unchecked
        self.fleet_spec = None
        #: worker id -> RejectedWorker (coordinator/fleet_spec.py): on the bus at the last discovery, with a
        #: spec that differs from `fleet_spec`. Never addressed directly; its replies are refused
        self.rejected_workers: dict = {}
        self.workers_rejected_total = 0  # distinct workers ever rejected (each counted once)
        self._rejected_ever: set[str] = set()
        self.rejected_replies = 0  # replies refused because their worker's spec differs (also in bad_replies)
        self._prefix: str | None = None  # "<inbox prefix>.<nuid>": the reply mux's subject is prefix + ".*"
        self._pending: dict[str, asyncio.Future] = {}  # reply token -> the request's future
        self._streams: dict[str, AheadStream] = {}  # token of a run-ahead subject -> its stream
        self._closed_streams: OrderedDict[str, None] = OrderedDict()  # their tokens once closed (late: quiet)
        #: expert -> monotonic time until which its requests do not run ahead (a worker refused the fields)
        self.no_ahead_until: dict[int, float] = {}
        #: expert -> the most steps every one of its workers runs ahead (service metadata `run_ahead`, learned
        #: at each discovery; an expert with a worker that does not say is absent: its requests never run ahead)
        self.run_ahead_of: dict[int, int] = {}
        #: expert -> whether every worker of it that discovery found serves classifier-free guidance (service
        #: metadata `guidance` "true"); learned with `run_ahead_of`, absent for an expert none was found of
        self.guidance_of: dict[int, bool] = {}
        self._discovered_at = float("-inf")  # monotonic time the last discovery that got answers ended
        self._mux_lock = asyncio.Lock()
        self._stray_logged_at = float("-inf")

    async def velocity(
        self,
        expert: int,
        x: np.ndarray,
        t: np.ndarray,
        y: np.ndarray,
        row_ids: list[str],
        guidance: np.ndarray | None = None,
    ) -> np.ndarray:
        """Expert's velocity [n, C, H, W] float32 of rows x [n, C, H, W] at t [n] with labels y [n]; `guidance`
        [n] float32: each row's classifier-free guidance scale (None: none), see the module docstring."""
        n = len(x)
        per = self._rows_per(x, guidance)
        if n <= per:
            return (await self._request(expert, x, t, y, row_ids, guidance=guidance))[0]
        parts = [slice(i, i + per) for i in range(0, n, per)]
        outs = await asyncio.gather(
            *(
                self._request(expert, x[s], t[s], y[s], row_ids[s], guidance=None if guidance is None else guidance[s])
                for s in parts
            )
        )
        return np.concatenate([v for v, _ in outs], axis=0)

    def _rows_per(self, x: np.ndarray, guidance: np.ndarray | None) -> int:
        """Rows per request: `rows_per_request`, halved when some row is guided (the worker computes it twice)."""
        per = self.rows_per_request(x)
        return max(1, per // 2) if _guided(guidance) else per

    async def velocity_ahead(
        self,
        expert: int,
        x: np.ndarray,
        t: np.ndarray,
        y: np.ndarray,
        row_ids: list[str],
        ahead_t: np.ndarray,
        ahead_dt: np.ndarray,
        guidance: np.ndarray | None = None,
    ) -> tuple[np.ndarray, AheadStream | None]:
        """`velocity`, in one request that also runs up to A = len(ahead_t) steps ahead (coordinator/run_ahead.py):
        (velocity float32 [n, C, H, W], the stream of the further velocities; its `steps` may be fewer than A:
        as many as every worker of the expert takes; guided steps, for guided rows). The stream is None, and
        the request an ordinary one,
        when the rows need several requests, a discovered worker of the expert does not advertise running
        ahead (an older or another implementation; none discovered yet), or its stream stalled lately."""
        most = min(len(ahead_t), self.run_ahead_of.get(expert, 0))
        if (
            most < 1
            or len(x) > self._rows_per(x, guidance)
            or time.monotonic() < self.no_ahead_until.get(expert, float("-inf"))
        ):
            return await self.velocity(expert, x, t, y, row_ids, guidance), None
        return await self._request(expert, x, t, y, row_ids, ahead=(ahead_t[:most], ahead_dt[:most]), guidance=guidance)

    def _open_stream(self, expert: int, steps: int, shape, row_ids) -> AheadStream:
        """The stream of a request that runs ahead: the replies after the first one on each leg's reply
        subject (`_ask` adds them) go to it, checked as replies; once closed, late ones are dropped quietly."""

        def check(data: bytes) -> tuple[np.ndarray, str, int]:
            v, worker, reply = self._check_reply(expert, data, shape, row_ids)
            return v, worker, reply.ahead_index

        def close() -> None:
            for token in stream.tokens:
                self._forget_stream_token(token)

        def stalled() -> None:  # e.g. a server that lets a worker answer only once: ask plainly for a while
            self.no_ahead_until[expert] = time.monotonic() + NO_AHEAD_S
            log.warning(
                "expert %d: a run-ahead stream stalled (its worker's further replies did not come: a frozen "
                "worker, or a NATS server whose permissions let workers answer only once, where allow_responses "
                "max must be >= 17); asking that expert plainly for %g s",
                expert,
                NO_AHEAD_S,
            )

        stream = AheadStream(steps, check, close, stalled)
        return stream

    def _forget_stream_token(self, token: str) -> None:
        if self._streams.pop(token, None) is not None:
            self._closed_streams[token] = None
            while len(self._closed_streams) > RETIRED_TOKENS_KEPT:
                self._closed_streams.popitem(last=False)

    def rows_per_request(self, x: np.ndarray) -> int:
        """Most rows of x [n, C, H, W] in one request: `max_rows`, and fewer when a request or its
        float32 reply would pass the server's max_payload (1 MiB by default: 512 rows of 1x32x32
        float32 are 2 MiB; nats-py refuses such a publish with MaxPayloadError)."""
        limit = getattr(self.nc, "max_payload", None)
        if callable(limit):
            limit = limit()
        if not isinstance(limit, int) or limit <= 0:
            return self.max_rows
        row_bytes = int(np.prod(x.shape[1:], dtype=np.int64)) * 4 + ROW_OVERHEAD_BYTES
        return max(1, min(self.max_rows, (limit - MESSAGE_OVERHEAD_BYTES) // row_bytes))

    # ------------------------------------------------------------ connection epochs
    def _reconnects(self) -> int:
        stats = getattr(self.nc, "stats", None)
        return int(stats.get("reconnects", 0)) if isinstance(stats, dict) else 0

    def _observe_reconnects(self) -> int:
        """The connection's reconnect count; notes when it changed (start of a grace period)."""
        n = self._reconnects()
        if n != self._reconnects_seen:
            self._reconnects_seen = n
            self._reconnected_at = time.monotonic()
        return n

    def _in_reconnect_grace(self) -> bool:
        self._observe_reconnects()
        return time.monotonic() - self._reconnected_at < self.reconnect_grace

    # ------------------------------------------------------------ reply mux
    @property
    def reply_prefix(self) -> str | None:
        """The prefix of this transport's reply subjects (`<inbox prefix>.<random>`, where the experts
        answer it); None before its first request."""
        return self._prefix

    async def _ensure_mux(self) -> str:
        """Subscribe the reply wildcard once; returns the reply prefix."""
        if self._prefix is None:
            async with self._mux_lock:
                if self._prefix is None:
                    prefix = private_inbox(self.nc)  # "<inbox prefix>.<random>": nothing like nats-py's own
                    await self.nc.subscribe(prefix + ".*", cb=self._on_reply)
                    self._prefix = prefix
        return self._prefix

    async def _on_reply(self, msg) -> None:
        token = _token_of(msg)
        fut = self._pending.pop(token, None)  # accepted once: a second reply finds nothing
        if fut is None and (stream := self._streams.get(token)) is not None:
            stream.put(msg.data, token)
            return
        if fut is None and token in self._closed_streams:  # a run ahead no longer wanted: its worker goes on
            self.late_replies += 1
            return
        if fut is None or fut.done():
            if fut is None and token in self._retired:  # the losing leg of a hedged try: expected
                del self._retired[token]
                self.late_replies += 1
                return
            self._stray(msg.subject)
            return
        fut.set_result(msg)

    def _stray(self, subject: str) -> None:
        self.stray_replies += 1
        now = time.monotonic()
        if now - self._stray_logged_at >= STRAY_LOG_INTERVAL:
            self._stray_logged_at = now
            log.warning(
                "dropped a reply on %s: no request of ours is waiting on that subject (forged, "
                "duplicate or late; %d so far)",
                subject[:200],
                self.stray_replies,
            )

    async def _ask(self, subject: str, payload: bytes, timeout: float, stream: AheadStream | None = None):
        """Publish a request with a fresh unguessable reply subject; the reply message.
        Raises nats.errors.TimeoutError or NoRespondersError like `nc.request`. With `stream` (a request
        that runs ahead), the replies after the first on that subject go to the stream."""
        import nats.errors
        from nats.js.api import Header

        prefix = await self._ensure_mux()
        token = secrets.token_hex(16)
        fut = asyncio.get_running_loop().create_future()
        self._pending[token] = fut
        if stream is not None:
            self._streams[token] = stream
            stream.tokens.append(token)
        try:
            await self.nc.publish(subject, payload, reply=f"{prefix}.{token}")
            try:
                msg = await asyncio.wait_for(fut, timeout)
            except TimeoutError:
                raise nats.errors.TimeoutError from None
        except BaseException as err:
            if isinstance(err, asyncio.CancelledError):  # a hedge leg that lost: its reply may still come, dropped
                self._retired[token] = None
                while len(self._retired) > RETIRED_TOKENS_KEPT:
                    self._retired.popitem(last=False)
            if stream is not None:  # this leg's further replies are not wanted either
                self._forget_stream_token(token)
            raise
        finally:
            self._pending.pop(token, None)
        if msg.headers and msg.headers.get(Header.STATUS) == _NO_RESPONDERS and not msg.data:
            raise nats.errors.NoRespondersError
        return msg

    # ------------------------------------------------------------ one request
    def _wire_x(self, expert: int, x32: np.ndarray) -> tuple[np.ndarray, str | None]:
        """x_t as it travels and the reply_dtype to ask for (None: float32, the field left out)."""
        if self.wire_dtype == "float32":
            return x32, None
        try:
            return to_wire_dtype(x32, self.wire_dtype, name="x_t"), self.wire_dtype
        except ProtocolError as err:  # an x_t beyond float16's range: this request goes as float32
            log.warning("expert %d: %s; sending this request in float32", expert, err.message)
            return x32, None

    async def _request(
        self,
        expert: int,
        x,
        t,
        y,
        row_ids,
        ahead: tuple[np.ndarray, np.ndarray] | None = None,
        guidance: np.ndarray | None = None,
    ) -> tuple[np.ndarray, AheadStream | None]:
        """(velocity, None), or with `ahead` = (ahead_t [A, n], ahead_dt [A, n]) (velocity, its run-ahead
        stream): the request tried as the module docstring says. `guidance` [n]: rows' guidance scales."""
        opened: list[AheadStream] = []
        try:
            return await self._tries(expert, x, t, y, row_ids, ahead, opened, guidance)
        except BaseException:
            for stream in opened:
                stream.close()
            raise

    async def _tries(
        self, expert: int, x, t, y, row_ids, ahead, opened: list[AheadStream], guidance: np.ndarray | None = None
    ) -> tuple[np.ndarray, AheadStream | None]:
        import nats.errors

        # classifier-free guidance travels only when a row of this request is guided (older workers refuse the key)
        guided = {"guidance": np.ascontiguousarray(guidance, np.float32)} if _guided(guidance) else {}
        subject = subjects.expert_velocity(expert)
        x32 = np.ascontiguousarray(x, np.float32)
        t32, y64 = t.astype(np.float32), y.astype(np.int64)
        x_wire, reply_dtype = self._wire_x(expert, x32)
        tries = bad_tries = lost = 0
        last = "no attempt"
        attempt = 0
        timed_out = False  # a try timed out: the next ones go to a known worker, not the queue group
        stream: AheadStream | None = None
        while True:
            if attempt:
                self.retried += 1
            attempt += 1
            epoch = self._observe_reconnects()
            fields: dict = dict(x_t=x_wire, reply_dtype=reply_dtype, deadline=time.time() + self.step_timeout)
            if stream is not None:
                stream.close()
                stream = None
            if ahead is not None and (reply_dtype or "float32") != self.wire_dtype:
                # this try fell back to float32 (an overflow of the wire's float16): a step run ahead would be
                # computed in float32 where a later plain request travels in float16 again, so ask plainly
                ahead = None
            if ahead is not None:  # x travels in float32 (the worker steps it); the model sees it as x_wire
                steps = len(ahead[0])
                stream = self._open_stream(expert, steps, x32.shape, row_ids)
                opened.append(stream)
                fields.update(
                    x_t=x32,
                    ahead_t=np.ascontiguousarray(ahead[0], np.float32),
                    ahead_dt=np.ascontiguousarray(ahead[1], np.float32),
                    input_dtype=reply_dtype,
                    deadline=time.time() + self.step_timeout * (1 + steps),
                )
            req = StepRequest(
                expert=expert,
                t=t32,
                y=y64,
                row_ids=list(row_ids),
                request_id=f"s{next(self._ids)}",
                **guided,
                **fields,
            )
            try:
                began = time.monotonic()
                v, worker, reply_token = await self._exchange(
                    expert, subject, pack(req), x32.shape, row_ids, stream, insist=timed_out
                )
                if stream is not None:  # only the answering leg's further replies count (a hedge's copy streams too)
                    stream.worker, stream.first_s = worker, time.monotonic() - began
                    stream.token = reply_token
                    for other in [tok for tok in stream.tokens if tok != reply_token]:
                        self._forget_stream_token(other)
                return v, stream
            except nats.errors.NoRespondersError:
                if self._in_reconnect_grace():
                    await asyncio.sleep(NO_RESPONDERS_BACKOFF)
                    continue
                raise ExpertUnavailable(expert, "has no responders") from None
            except (TimeoutError, nats.errors.TimeoutError):
                raise_if_cancelled()  # 3.11's wait_for can turn a cancel into a timeout: do not retry then
                down = self._observe_reconnects() != epoch or not getattr(self.nc, "is_connected", True)
                if down and lost < MAX_LOST_TO_RECONNECT:
                    lost += 1
                    log.warning(
                        "expert %d: request %s lost with the NATS connection; sending it again", expert, req.request_id
                    )
                    continue
                tries += 1
                timed_out = True
                last = f"timed out after {self.step_timeout:g} s"
                log.warning(
                    "expert %d: request %s %s (try %d/%d)", expert, req.request_id, last, tries, self.retries + 1
                )
                if tries > self.retries:
                    break
                continue
            except (nats.errors.OutboundBufferLimitError, nats.errors.ConnectionReconnectingError) as err:
                tries += 1  # disconnected and the outgoing buffer is full: wait, then try again
                last = f"not sent ({type(err).__name__}: NATS is reconnecting)"
                if tries > self.retries:
                    break
                await asyncio.sleep(min(self.step_timeout, 1.0))
                continue
            except _BadReply as bad:
                bad_tries += 1
                self.bad_replies += 1
                self.bad_workers[bad.worker or "?"] += 1
                last = f"bad reply from worker {bad.worker or '(unnamed)'}: {bad.why}"
                log.warning(
                    "expert %d: bad reply to request %s from worker %s: %s (bad reply %d of at most %d)",
                    expert,
                    req.request_id,
                    bad.worker or "(unnamed)",
                    bad.why,
                    bad_tries,
                    self.bad_reply_retries + 1,
                )
                if bad_tries > self.bad_reply_retries:
                    break
                continue
            except _ErrorReply as err:
                last = f"error reply {err.code.value}: {err.message}"
                if ahead is not None and err.code in (ErrorCode.BAD_REQUEST, ErrorCode.UNSUPPORTED_VERSION):
                    # a worker older than running ahead refuses its fields: ask plainly, and not again for a while
                    self.no_ahead_until[expert] = time.monotonic() + NO_AHEAD_S
                    log.info("expert %d: a worker refused to run ahead (%s); asking plainly", expert, last)
                    ahead = None
                    continue
                if err.code == ErrorCode.NON_FINITE and reply_dtype is not None:
                    # e.g. a velocity beyond float16's range: the worker said so; ask again in float32
                    self.wire_fallbacks += 1
                    log.warning(
                        "expert %d: request %s in %s: %s; sending it again in float32",
                        expert,
                        req.request_id,
                        reply_dtype,
                        last,
                    )
                    x_wire, reply_dtype = x32, None
                    continue
                if err.code not in TRANSIENT:
                    raise ExpertUnavailable(expert, last) from None
                tries += 1
                if tries > self.retries:
                    break
                continue
        n = tries + bad_tries
        summary = f"no usable reply after {n} tries (last: {last})"
        if bad_tries and bad_tries >= tries:  # mostly garbage, not silence: say so
            raise BadExpertReply(expert, summary)
        raise ExpertUnavailable(expert, summary)

    def workers_per_expert(self) -> int | None:
        """The most workers known for one expert (learned by direct dispatch from good replies,
        each forgotten `ttl_s` after its last one); None with dispatch="queue", which learns none.
        The engine's `cohorts="auto"` sizes its cohorts from it."""
        if self.dispatcher is None or self.dispatch == "queue":
            return None
        return self.dispatcher.most_known()

    # ------------------------------------------------------------ one try, maybe hedged
    def _pick(self, expert: int, exclude: tuple = (), explore: bool = True, insist: bool = False) -> str | None:
        """The worker token a leg goes to directly, or None: the queue group."""
        if self.dispatcher is None:
            return None
        return self.dispatcher.pick(expert, exclude, explore=explore, insist=insist)

    def _start_leg(
        self,
        expert: int,
        subject: str,
        payload: bytes,
        timeout: float,
        shape,
        row_ids,
        token: str | None,
        stream: AheadStream | None = None,
    ) -> asyncio.Future:
        """The task of one leg. A direct leg counts as outstanding at its worker from now (before the
        task first runs, so the next pick of a gathered batch sees it) until the task is done,
        whether it succeeded, failed or was cancelled (even before it started)."""
        leg = asyncio.ensure_future(self._leg(expert, subject, payload, timeout, shape, row_ids, token, stream))
        if token is not None:
            self.dispatcher.sent(expert, token)
            leg.add_done_callback(lambda _leg, d=self.dispatcher: d.finished(expert, token))
        return leg

    def _count_dispatch(self, expert: int, how: str) -> None:
        key = (expert, how)
        self.dispatch_counts[key] = self.dispatch_counts.get(key, 0) + 1

    def _usable(self, expert: int, data: bytes, shape, row_ids) -> tuple[np.ndarray, str]:
        """`_check`, and a good reply's worker is alive: learned (or kept) for direct dispatch."""
        v, worker = self._check(expert, data, shape, row_ids)
        if self.dispatcher is not None and worker:
            self.dispatcher.seen(expert, worker)
        return v, worker

    async def _leg(
        self,
        expert: int,
        subject: str,
        payload: bytes,
        timeout: float,
        shape,
        row_ids,
        token: str | None = None,
        stream: AheadStream | None = None,
    ):
        """Send the request once and check the reply: (velocity float32, worker id, the token of the reply
        subject it came on). token: send it
        to that worker's direct subject first; "no responders" there sends it to the queue group
        `subject` at once (same leg, the time left); any other failure forgets that worker."""
        import nats.errors

        if token is not None:
            loop = asyncio.get_running_loop()
            began = loop.time()
            self._count_dispatch(expert, "direct")
            try:
                msg = await self._ask(subjects.expert_direct(expert, token), payload, timeout, stream)
                return (*self._usable(expert, msg.data, shape, row_ids), _token_of(msg))
            except nats.errors.NoRespondersError:  # stopped, or a worker without a direct subject
                # (just after a reconnect the worker may only not have resubscribed yet: no ban then)
                self.dispatcher.forget(expert, token, ban=not self._in_reconnect_grace())
                self.direct_fallbacks += 1
                log.debug("expert %d: worker %s has no direct subscriber; sending to the queue group", expert, token)
            except (TimeoutError, nats.errors.TimeoutError):
                self.dispatcher.forget(expert, token)
                raise
            except _BadReply:
                self.dispatcher.forget(expert, token, ban=True)
                raise
            except _ErrorReply as err:
                if err.code in TRANSIENT:  # overloaded, failing: pick others until it answers well again
                    self.dispatcher.forget(expert, token)
                raise
            timeout = max(timeout - (loop.time() - began), 0.001)
        self._count_dispatch(expert, "queue")
        msg = await self._ask(subject, payload, timeout, stream)
        return (*self._usable(expert, msg.data, shape, row_ids), _token_of(msg))

    async def _exchange(
        self,
        expert: int,
        subject: str,
        payload: bytes,
        shape,
        row_ids,
        stream: AheadStream | None = None,
        *,
        insist: bool = False,
    ) -> tuple[np.ndarray, str, str]:
        """One try: (the velocity float32 [n, C, H, W], the worker id it claims, the token of the reply subject
        it came on), or the exception of its failure (NATS
        timeout / no responders, _BadReply, _ErrorReply). Hedged as the module docstring says."""
        loop = asyncio.get_running_loop()
        self.requests_sent[expert] = self.requests_sent.get(expert, 0) + 1
        self.hedging.on_request(expert)
        delay = self.hedging.delay(expert)
        sent = loop.time()
        token = self._pick(expert, insist=insist)
        primary = self._start_leg(expert, subject, payload, self.step_timeout, shape, row_ids, token, stream)
        hedge = None
        try:
            if delay is not None and delay < self.step_timeout:
                await asyncio.wait({primary}, timeout=delay)
            if primary.done() or delay is None or delay >= self.step_timeout or not self.hedging.take(expert):
                v, worker, reply_token = await primary
                self.hedging.observe(expert, loop.time() - sent, worker)
                _answered_by(worker)
                return v, worker, reply_token
            left = self.step_timeout - (loop.time() - sent)
            # a direct primary's copy goes to another known worker with room, else the queue group
            other = self._pick(expert, (token,), explore=False) if token is not None else None
            if other is None and self.dispatcher is not None and expert in self.dispatcher.fenced():
                # no other matching worker known, and the queue group holds one of another spec: no copy
                v, worker, reply_token = await primary
                self.hedging.observe(expert, loop.time() - sent, worker)
                _answered_by(worker)
                return v, worker, reply_token
            hedge = self._start_leg(expert, subject, payload, max(left, 0.001), shape, row_ids, other, stream)
            outcome_if_first = {primary: "lost", hedge: "won"}
            pending: set = {primary, hedge}
            failure: BaseException | None = None
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for leg in done:
                    err = leg.exception()
                    if err is None:
                        v, worker, reply_token = leg.result()
                        self._count_hedge(expert, outcome_if_first[leg])
                        if leg is hedge and token is not None:  # its worker is late (frozen?): stop picking it
                            self.dispatcher.forget(expert, token)
                        self.hedging.observe(expert, loop.time() - sent, worker)  # censored when the copy won
                        _answered_by(worker)
                        return v, worker, reply_token
                    failure = _worse(failure, err)
            self._count_hedge(expert, "failed")
            raise failure
        finally:
            for leg in (primary, hedge):
                if leg is not None and not leg.done():
                    leg.cancel()  # its token is retired: a reply that still comes is dropped quietly

    def worker_dtype(self, worker_id: str) -> str:
        """The dtype `worker_id` computes in ("float32", "bfloat16"), as its service metadata says;
        "" while unknown (a worker not discovered yet, whose discovery this starts, or one too old to say)."""
        got = self.worker_dtypes.get(worker_id)
        if got is None:
            self._refresh_dtypes_soon()
            return ""
        return got

    def _refresh_dtypes_soon(self) -> None:
        if self._dtype_refresh is not None and not self._dtype_refresh.done():
            return
        if time.monotonic() - self._dtype_refreshed_at < DTYPE_REFRESH_S:
            return
        try:
            self._dtype_refresh = asyncio.get_running_loop().create_task(self.refresh_worker_dtypes())
        except RuntimeError:  # no loop running (a synchronous caller): the next call on the loop will
            return

    async def refresh_worker_dtypes(self, window_s: float = 0.3) -> dict[str, str]:
        """Ask every expert worker for its service metadata (`$SRV.INFO.ddm-expert`, replies of
        `window_s` seconds) and keep each one's dtype. Never raises: a failed discovery keeps the old map."""
        import json

        from bus.gather import gather_replies

        from .fleet_spec import EXPERT_SERVICE

        self._dtype_refreshed_at = time.monotonic()
        try:
            replies = await gather_replies(self.nc, f"$SRV.INFO.{EXPERT_SERVICE}", window=window_s)
        except Exception as err:  # disconnected, closed: try again later
            log.debug("worker dtype discovery failed: %r", err)
            return self.worker_dtypes
        found: dict[str, str] = {}
        ahead: dict[int, int] = {}
        guides: dict[int, bool] = {}
        infos = []
        for raw in replies:
            try:
                info = json.loads(raw)
                md = info.get("metadata")
            except (ValueError, AttributeError):
                continue
            if isinstance(md, dict) and isinstance(md.get("worker_id"), str):
                dtype = md.get("dtype", md.get("precision", ""))
                found[md["worker_id"][:128]] = dtype if isinstance(dtype, str) and dtype.isalnum() else ""
                infos.append(info)
                expert, steps = _small_int(md.get("expert")), _small_int(md.get("run_ahead"))
                if expert is not None:
                    ahead[expert] = min(ahead.get(expert, MAX_RUN_AHEAD), steps or 0)
                    guides[expert] = guides.get(expert, True) and md.get("guidance") == "true"
        self.worker_dtypes = found
        self.run_ahead_of = {k: n for k, n in ahead.items() if n > 0}
        self.guidance_of = guides
        self._discovered_at = time.monotonic()
        if self.fleet_spec is not None:
            self._check_worker_specs(infos)
        return found

    async def experts_without_guidance(self, max_age_s: float = DTYPE_REFRESH_S) -> list[int]:
        """The experts with a discovered worker that does not serve classifier-free guidance (no `guidance`
        in its service metadata: it would refuse `StepRequest.guidance`), after a discovery of its own when the
        last one to finish is older than `max_age_s` seconds (one still gathering answers does not count).
        Experts no worker was found of are not listed."""
        if time.monotonic() - self._discovered_at >= max_age_s:
            await self.refresh_worker_dtypes()
        return sorted(k for k, ok in self.guidance_of.items() if not ok)

    async def refresh_workers(self, window_s: float = 0.3) -> dict:
        """Discover the expert workers now (`refresh_worker_dtypes`: dtypes, and every worker's spec checked
        against `fleet_spec`); returns `rejected_workers`. The coordinator calls it every few seconds."""
        await self.refresh_worker_dtypes(window_s)
        return self.rejected_workers

    def _check_worker_specs(self, infos: list[dict]) -> None:
        """Reject the discovered workers whose spec differs from the fleet's (a warning naming each the first
        time); experts with a rejected worker stop using their queue group (where the odd worker would take
        requests) while a matching worker is known: matching workers seen in discovery are addressed directly."""
        from .fleet_spec import check_worker

        rejected: dict = {}
        matching: dict[int, list[str]] = {}
        for info in infos:
            bad = check_worker(self.fleet_spec, info)
            md = info["metadata"]
            if bad is None:
                try:
                    matching.setdefault(int(md.get("expert", -1)), []).append(md["worker_id"][:128])
                except (TypeError, ValueError):
                    pass
                continue
            rejected[bad.worker_id] = bad
            if bad.worker_id not in self._rejected_ever:
                self._rejected_ever.add(bad.worker_id)
                self.workers_rejected_total += 1
                log.warning(
                    "not using %s: its model spec differs from the fleet's (%s); serving on with the matching workers",
                    bad.describe(),
                    bad.differs,
                )
        for gone in set(self.rejected_workers) - set(rejected):
            log.info("rejected worker %s is no longer on the bus", gone)
        self.rejected_workers = rejected
        fenced = {w.expert for w in rejected.values()}
        if self.dispatcher is None and fenced:  # dispatch="queue": steer only the fenced experts, directly
            self.dispatcher = DispatchPolicy(subjects.worker_token, only_fenced=True)
        if self.dispatcher is not None:
            self.dispatcher.fence(fenced)
            for expert in fenced:
                for worker in matching.get(expert, []):
                    self.dispatcher.seen(expert, worker)

    def _count_hedge(self, expert: int, outcome: str) -> None:
        key = (expert, outcome)
        self.hedge_counts[key] = self.hedge_counts.get(key, 0) + 1

    @property
    def hedges_sent(self) -> int:
        return sum(self.hedge_counts.values())

    def _check(self, expert: int, data: bytes, shape: tuple[int, ...], row_ids) -> tuple[np.ndarray, str]:
        """The reply's velocity as float32 [n, C, H, W] and the worker id it claims; raises
        _BadReply or _ErrorReply (also for a run-ahead reply where the first is due)."""
        v, worker, reply = self._check_reply(expert, data, shape, row_ids)
        if reply.ahead_index:
            raise _BadReply(f"a run-ahead velocity ({reply.ahead_index}) where the step's own was due", worker)
        return v, worker

    def _check_reply(
        self, expert: int, data: bytes, shape: tuple[int, ...], row_ids
    ) -> tuple[np.ndarray, str, StepReply]:
        """`_check`'s checks: (velocity float32 [n, C, H, W], claimed worker id, the reply)."""
        try:
            raw = loads(data)
        except ProtocolError as err:
            raise _BadReply(f"undecodable ({err.code.value}: {err.message})") from None
        worker = _claimed_worker(raw)
        odd = self.rejected_workers.get(worker) if worker else None
        if odd is not None:
            self.rejected_replies += 1
            raise _BadReply(f"its model spec differs from the fleet's ({odd.differs}); reply not used", worker)
        try:
            reply = validate(raw, StepResult)
        except ProtocolError as err:
            raise _BadReply(f"{err.code.value}: {err.message}", worker) from None
        if isinstance(reply, ErrorReply):
            if reply.code == ErrorCode.BAD_SHAPE and self.fleet_spec is not None:
                # requests carry the checked fleet's shape: only a worker of another spec says bad_shape (from
                # the queue group, unnamed); try again elsewhere, and find out who it is
                self.rejected_replies += 1
                self._refresh_dtypes_soon()
                raise _BadReply(f"bad_shape: {reply.message} (a worker whose model spec differs from the fleet's)")
            raise _ErrorReply(reply.code, reply.message)
        assert isinstance(reply, StepReply)
        if reply.expert != expert:
            raise _BadReply(f"answers for expert {reply.expert}, not {expert}", worker)
        if reply.row_ids and reply.row_ids != list(row_ids):
            raise _BadReply("row_ids do not match the request", worker)
        v = reply.velocity
        if v.shape != shape:
            raise _BadReply(f"velocity shape {list(v.shape)} != request {list(shape)}", worker)
        if v.dtype.kind != "f":
            raise _BadReply(f"velocity dtype {v.dtype.str} is not float", worker)
        v = widen_float32(v)  # float32: the received bytes' read-only view, no copy
        if not np.isfinite(v).all():  # e.g. float64 values beyond float32's range
            raise _BadReply("velocity has NaN/Inf values as float32", worker)
        return v, worker, reply


def _worse(a: BaseException | None, b: BaseException) -> BaseException:
    """Of two failed legs of one try, the failure to report: a reply (error or unusable) says more
    than "no responders", which says more than a time-out."""
    import nats.errors

    def rank(e: BaseException | None) -> int:
        if e is None:
            return -1
        if isinstance(e, (_BadReply, _ErrorReply)):
            return 3
        if isinstance(e, nats.errors.NoRespondersError):
            return 2
        if isinstance(e, (nats.errors.TimeoutError, asyncio.TimeoutError)):
            return 0
        return 1

    return b if rank(b) >= rank(a) else a


class _ErrorReply(Exception):
    def __init__(self, code: ErrorCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


def _guided(guidance: np.ndarray | None) -> bool:
    """Does some row carry a classifier-free guidance scale other than 1?"""
    return guidance is not None and bool((np.asarray(guidance) != 1).any())


def _small_int(value) -> int | None:
    """A service-metadata value that should be a small non-negative int ("16"), else None (never raises)."""
    text = str(value) if isinstance(value, (str, int)) and not isinstance(value, bool) else ""
    return int(text) if text.isascii() and text.isdigit() and len(text) <= 6 else None


def _token_of(msg) -> str:
    """The token of the reply subject a message came on (the last token of `<prefix>.<token>`)."""
    return msg.subject.rsplit(".", 1)[-1]


def _answered_by(worker: str) -> None:
    """Note the worker whose reply a call used, for the engine's call in flight (`engine.ANSWERED_BY`)."""
    seen = ANSWERED_BY.get()
    if seen is not None:
        seen.append(worker)
