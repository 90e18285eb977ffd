"""Expert velocity calls over NATS: one batched StepRequest per expert per tick.

`NatsTransport.velocity(expert, x [n, C, H, W], t [n], y [n], row_ids)` splits batches over
`max_rows` into concurrent requests and sends each either to one worker's direct subject or to the
expert's queue group, which hands it to one of the expert's workers at random.

`NatsTransport` builds each request and sends its tries, and is what the engine, the service and the
metrics talk to. The parts it is made of have a module each:

    coordinator/retry_policy.py      what follows a failed try: again where, after what, or give up (pure)
    coordinator/try_legs.py          one try on the wire: direct or queue group, a hedge copy when late
    coordinator/dispatch.py          which worker a leg goes to: join the shortest queue (pure)
    coordinator/hedging.py           when a late try gets a copy (pure)
    coordinator/reply_mux.py         a reply subject per leg, one subscription; forged and late replies dropped
    coordinator/reply_check.py       what makes a reply usable (pure)
    coordinator/worker_discovery.py  what the workers on the bus serve; the spec check of late joiners

Bad replies (reply_check.py) are logged with the worker id they claim and counted in `bad_replies` /
`bad_workers`, which keeps the `BAD_WORKERS_KEPT` worker ids most recently blamed (LRU), so a reply
stream claiming ever new ids cannot grow it without bound; those refused because their worker serves
another model spec are also in `rejected_replies` (a `bad_shape` starts a discovery, to find out who
answered). Once the coordinator sets `fleet_spec`, discovery (`refresh_workers`, every few seconds)
rejects the workers of another spec and fences their experts.

Wire precision (`wire_dtype`): "float32" (default, what every peer has always sent), "float16" or
"bfloat16": x_t is sent in that precision and the request asks for the velocity back in it
(`StepRequest.reply_dtype`); the reply is widened to float32 and checked for NaN/Inf as always.
An x_t that does not fit float16 is sent as float32; a worker's `non_finite` answer to a
reduced-precision request (its velocity overflowed float16) is retried once in float32
(`wire_fallbacks`), so the overflow costs a round trip, never a NaN in a sample.

Classifier-free guidance (`guidance=`, each row's scale, given by the engine only when some row is
guided): a request carries it as `StepRequest.guidance` only when one of its rows has a scale other
than 1, and holds half the rows it would otherwise (the worker evaluates each guided row twice, and
counts both against its request limit). Workers say whether they serve it (`guidance` in their service
metadata, learned at discovery: `guidance_of`); the coordinator refuses a guided job while a discovered
worker does not (`experts_without_guidance`), since an older worker refuses the field.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time
from collections import OrderedDict

import numpy as np

from bus.cancel import raise_if_cancelled
from schemas import ProtocolError, StepReply, StepRequest, pack, subjects
from schemas.limits import MAX_STEP_ROWS
from schemas.tensor import WIRE_FLOATS, to_wire_dtype

from .dispatch import DISPATCH_MODES, DispatchPolicy
from .hedging import HedgePolicy
from .reply_check import BadReply, ReplyError, check_reply
from .reply_mux import ReplyMux
from .retry_policy import Failed, Next, Outcome, RetryPolicy
from .run_ahead import AheadStream
from .try_legs import TryLegs
from .worker_discovery import DTYPE_REFRESH_S, WorkerDiscovery

log = logging.getLogger(__name__)

#: Most worker ids `NatsTransport.bad_workers` remembers (least recently blamed dropped first).
BAD_WORKERS_KEPT = 256

#: Bytes a request or reply spends per row beside its tensor (t, y, row id), and per message
#: (headers, expert, ids, deadline, ...): generous bounds for splitting under max_payload.
ROW_OVERHEAD_BYTES = 96
MESSAGE_OVERHEAD_BYTES = 4096

#: Seconds an expert's requests do not run ahead after one of its workers refused the fields (an older worker).
NO_AHEAD_S = 300.0


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


def _view(part: str, name: str, doc: str) -> property:
    """A read-only attribute of one of the transport's parts, under the name the metrics, the service and
    the tests know it by on the transport."""
    return property(lambda self: getattr(getattr(self, part), name), doc=doc)


class NatsTransport:
    """Request/reply to `schemas.subjects.expert_velocity(k)` (the queue group) or to one worker's
    `expert_direct(k, token)`.

    step_timeout: seconds to wait for one reply; retries: extra tries after a timeout or a
    transient error reply; bad_reply_retries: extra tries after unusable replies; max_rows:
    rows per request (<= MAX_STEP_ROWS); reconnect_grace: seconds after a NATS reconnect, or after an
    expert's last good reply, during which "no responders" for it means "workers still reconnecting"
    (wait and retry), not "no workers" (a worker whose NATS node died reconnects to another one while
    this connection never dropped);
    dispatch: "direct" (join-shortest-queue over the known workers, coordinator/try_legs.py) or "queue"
    (every try to the queue group)."""

    @classmethod
    def from_settings(cls, nc, settings) -> NatsTransport:
        """The transport of a coordinator's `TransportSettings` (coordinator.config), handed whole:
        `request_rows` is its `max_rows`; the other fields have the names of the keywords below."""
        return cls(
            nc,
            step_timeout=settings.step_timeout,
            retries=settings.retries,
            bad_reply_retries=settings.bad_reply_retries,
            wire_dtype=settings.wire_dtype,
            hedge=settings.hedge,
            hedge_after_s=settings.hedge_after_s,
            dispatch=settings.dispatch,
            max_rows=settings.request_rows,
        )

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
        self.wire_fallbacks = 0  # reduced-precision tries answered non_finite and sent again in float32
        self.nc = nc
        self.step_timeout = step_timeout
        self.retries = retries
        self.bad_reply_retries = bad_reply_retries
        self.max_rows = max_rows
        self.reconnect_grace = reconnect_grace
        self._answered_at: dict[int, float] = {}  # expert -> monotonic time of its last good reply
        self.mux = ReplyMux(nc)  # every leg's reply subject; forged and late replies dropped
        self.legs = TryLegs(  # where each try's legs go, hedged when late
            self.mux,
            step_timeout=step_timeout,
            dispatcher=DispatchPolicy(subjects.worker_token) if dispatch == "direct" else None,
            hedging=HedgePolicy(hedge, after_s=hedge_after_s),  # ValueError for a bad mode / delay
            check=self._check_reply,
            in_reconnect_grace=self._in_reconnect_grace,
        )
        self.discovery = WorkerDiscovery(nc, self.legs.fence)  # what the workers serve; the spec check
        self._ids = itertools.count()
        self.retried = 0  # requests that needed another try (for status / tests)
        self.bad_replies = 0  # unusable replies received
        self.bad_workers = BoundedCounter(BAD_WORKERS_KEPT)  # worker id ("?" if none claimed) -> bad replies
        self.rejected_replies = 0  # replies refused because their worker's spec differs (also in bad_replies)
        self._reconnects_seen = self._reconnects()
        self._reconnected_at = float("-inf")
        #: expert -> monotonic time until which its requests do not run ahead (a worker refused the fields)
        self.no_ahead_until: dict[int, float] = {}

    dispatcher = _view("legs", "dispatcher", "Join-shortest-queue over the known workers; None: the queue group.")
    dispatch_counts = _view("legs", "dispatch_counts", "(expert, direct | queue) -> legs sent.")
    direct_fallbacks = _view("legs", "direct_fallbacks", "Direct legs answered no responders, sent to the queue group.")
    hedging = _view("legs", "hedging", "The HedgePolicy: when a try gets a copy.")
    hedge_counts = _view("legs", "hedge_counts", "(expert, won | lost | failed) -> hedges.")
    hedges_sent = _view("legs", "hedges_sent", "Hedges sent, whatever their outcome.")
    requests_sent = _view("legs", "requests_sent", "expert -> tries sent (hedge copies not counted).")
    reply_prefix = _view(
        "mux", "prefix", "The prefix of the reply subjects, where the experts answer; None before a request."
    )
    stray_replies = _view(
        "mux", "stray_replies", "Replies on a token with no outstanding request (forged, duplicate, late)."
    )
    late_replies = _view("mux", "late_replies", "Replies to a cancelled hedge leg or a closed run-ahead stream.")
    run_ahead_of = _view("discovery", "run_ahead_of", "expert -> the most steps all its workers run ahead.")
    guidance_of = _view("discovery", "guidance_of", "expert -> whether all its workers serve guidance.")
    rejected_workers = _view("discovery", "rejected_workers", "worker id -> RejectedWorker (another model spec).")
    workers_rejected_total = _view("discovery", "workers_rejected_total", "Distinct workers ever rejected.")

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
        subject (the mux adds them) go to it, checked as replies; once closed, late ones are dropped quietly."""

        def check(data: bytes) -> tuple[np.ndarray, str, int]:
            v, worker, reply = self._check_reply(expert, data, shape, row_ids, first=False)
            return v, worker, reply.ahead_index

        def close() -> None:
            for token in stream.tokens:
                self.mux.forget_stream(token)

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
        stream): the request tried as its retry policy says. `guidance` [n]: rows' guidance scales."""
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
        """Send tries until one brings a usable velocity: after each failed one the request's `RetryPolicy`
        (coordinator/retry_policy.py) says whether, when and how the next goes. Streams opened go to `opened`."""
        x32 = np.ascontiguousarray(x, np.float32)
        x_wire, reply_dtype = self._wire_x(expert, x32)
        # an x_t beyond float16's range travels in float32 (`_wire_x`): a step run ahead would be computed in
        # float32 where a later plain request travels in float16 again, so this request asks plainly
        plain = (reply_dtype or "float32") != self.wire_dtype
        policy = RetryPolicy(
            expert,
            retries=self.retries,
            bad_reply_retries=self.bad_reply_retries,
            step_timeout=self.step_timeout,
            ahead=ahead is not None and not plain,
            reply_dtype=reply_dtype,
        )
        stream: AheadStream | None = None
        while True:
            epoch = self._observe_reconnects()
            if stream is not None:
                stream.close()
            stream = self._open_stream(expert, len(ahead[0]), x32.shape, row_ids) if policy.ahead else None
            if stream is not None:
                opened.append(stream)
            x_try = x_wire if policy.reply_dtype is not None else x32
            req = self._step_request(expert, x_try, x32, t, y, row_ids, guidance, policy, ahead)
            began = time.monotonic()
            try:
                v, worker, token = await self.legs.send(
                    expert,
                    subjects.expert_velocity(expert),
                    pack(req),
                    x32.shape,
                    row_ids,
                    stream,
                    insist=policy.insist,
                )
            except Exception as err:
                outcome = self._outcome(err, epoch, req.request_id, expert)
                if outcome is None:  # not a failure a retry is for
                    raise
            else:
                self._answered_at[expert] = time.monotonic()
                if stream is not None:  # only the answering leg's further replies count (a hedge's copy streams too)
                    stream.worker, stream.first_s, stream.token = worker, time.monotonic() - began, token
                    for other in [tok for tok in stream.tokens if tok != token]:
                        self.mux.forget_stream(other)
                return v, stream
            step = policy.after(outcome)
            self._note(expert, outcome, step)
            if step.error is not None:
                raise step.error
            if step.delay_s:
                await asyncio.sleep(step.delay_s)
            self.retried += 1

    def _step_request(
        self, expert: int, x_try, x32, t, y, row_ids, guidance, policy: RetryPolicy, ahead
    ) -> StepRequest:
        """The StepRequest of one try (a request id of its own): x_t as `policy` says it travels, or, asking
        to run ahead, in float32 (the worker steps it; `input_dtype` says what its model sees)."""
        fields: dict = dict(x_t=x_try, reply_dtype=policy.reply_dtype, deadline=time.time() + self.step_timeout)
        if policy.ahead:
            steps = len(ahead[0])
            fields.update(
                x_t=x32,
                ahead_t=np.ascontiguousarray(ahead[0], np.float32),
                ahead_dt=np.ascontiguousarray(ahead[1], np.float32),
                input_dtype=policy.reply_dtype,
                deadline=time.time() + self.step_timeout * (1 + steps),
            )
        if _guided(guidance):  # guidance travels only when a row of this request is guided (older workers refuse it)
            fields["guidance"] = np.ascontiguousarray(guidance, np.float32)
        return StepRequest(
            expert=expert,
            t=t.astype(np.float32),
            y=y.astype(np.int64),
            row_ids=list(row_ids),
            request_id=f"s{next(self._ids)}",
            **fields,
        )

    def _outcome(self, err: Exception, epoch: int, request_id: str, expert: int) -> Outcome | None:
        """What a failed try came back with, for the retry policy; None for an error no retry is for.
        epoch: the connection's reconnect count when the try was sent."""
        import nats.errors

        if isinstance(err, nats.errors.NoRespondersError):
            recent = time.monotonic() - self._answered_at.get(expert, -math.inf) < self.reconnect_grace
            return Outcome(Failed.NO_RESPONDERS, request_id, reconnecting=recent or self._in_reconnect_grace())
        if isinstance(err, (TimeoutError, nats.errors.TimeoutError)):
            raise_if_cancelled()  # 3.11's wait_for can turn a cancel into a timeout: do not retry then
            down = self._observe_reconnects() != epoch or not getattr(self.nc, "is_connected", True)
            return Outcome(Failed.TIMEOUT, request_id, connection_lost=down)
        if isinstance(err, (nats.errors.OutboundBufferLimitError, nats.errors.ConnectionReconnectingError)):
            return Outcome(Failed.NOT_SENT, request_id, why=type(err).__name__)
        if isinstance(err, BadReply):
            return Outcome(Failed.BAD_REPLY, request_id, why=err.why, worker=err.worker)
        if isinstance(err, ReplyError):
            return Outcome(Failed.ERROR_REPLY, request_id, code=err.code, why=err.message)
        return None

    def _note(self, expert: int, outcome: Outcome, step: Next) -> None:
        """Count and log a failed try, and what the retry policy made of it."""
        if outcome.failed is Failed.BAD_REPLY:
            self.bad_replies += 1
            self.bad_workers[outcome.worker or "?"] += 1
        if step.refused_ahead:  # an older worker: ask that expert plainly for a while
            self.no_ahead_until[expert] = time.monotonic() + NO_AHEAD_S
        if step.wire_fallback:
            self.wire_fallbacks += 1
        if step.note:
            log.log(step.level, "expert %d: %s", expert, step.note)

    def workers_per_expert(self) -> int | None:
        """The most workers known for one expert (learned by direct dispatch from good replies,
        each forgotten `ttl_s` after its last one); None with dispatch="queue", which learns none.
        The engine's `cohorts="auto"` sizes its cohorts from it."""
        if self.dispatcher is None or self.dispatch == "queue":
            return None
        return self.dispatcher.most_known()

    # ------------------------------------------------------------ worker discovery (coordinator/worker_discovery.py)
    @property
    def fleet_spec(self):
        """The fleet's model spec the workers are checked against (set by the coordinator after its start
        check); None: workers unchecked."""
        return self.discovery.fleet_spec

    @fleet_spec.setter
    def fleet_spec(self, spec) -> None:
        self.discovery.fleet_spec = spec

    def worker_dtype(self, worker_id: str) -> str:
        """The dtype `worker_id` computes in, as its service metadata says; "" while unknown."""
        return self.discovery.dtype(worker_id)

    async def experts_without_guidance(self, max_age_s: float = DTYPE_REFRESH_S) -> list[int]:
        """The experts with a discovered worker that does not serve classifier-free guidance."""
        return await self.discovery.experts_without_guidance(max_age_s)

    async def refresh_workers(self, window_s: float = 0.3) -> dict:
        """Discover the expert workers now (dtypes, run-ahead, guidance, and every worker's spec checked
        against `fleet_spec`); returns `rejected_workers`. The coordinator calls it every few seconds."""
        await self.discovery.refresh(window_s)
        return self.rejected_workers

    def _check_reply(
        self, expert: int, data: bytes, shape: tuple[int, ...], row_ids, first: bool = True
    ) -> tuple[np.ndarray, str, StepReply]:
        """`check_reply` against what worker discovery knows (coordinator/reply_check.py); a reply refused
        because its worker serves another spec is counted, and a bad_shape, which names no worker, starts a
        discovery, to find out who it is."""
        try:
            return check_reply(
                data,
                expert,
                shape,
                row_ids,
                rejected=self.discovery.rejected_workers,
                fleet_checked=self.fleet_spec is not None,
                first=first,
            )
        except BadReply as bad:
            if bad.odd_spec:
                self.rejected_replies += 1
                if not bad.worker:
                    self.discovery.refresh_soon()
            raise


def _guided(guidance: np.ndarray | None) -> bool:
    """Does some row carry a classifier-free guidance scale other than 1?"""
    return guidance is not None and bool((np.asarray(guidance) != 1).any())
