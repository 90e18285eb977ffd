"""Expert velocity calls over NATS: one batched StepRequest per expert per tick.

`NatsTransport.velocity(expert, x [n, C, H, W], t [n], y [n], row_ids)` splits batches over
`max_rows` into concurrent requests and sends each to the expert's queue group, which hands
every try to one of the expert's workers (at random, so a retry usually lands elsewhere).

A request is retried when:
* it times out, or gets a transient error reply (`overloaded`, `deadline_exceeded`,
  `unavailable`, `internal`): at most `retries` more tries;
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
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import time
from collections import OrderedDict

import numpy as np

from schemas import (ErrorCode, ErrorReply, ProtocolError, StepReply, StepRequest, StepResult, loads, pack, subjects,
                     validate)
from schemas.limits import MAX_STEP_ROWS

from .engine import BadExpertReply, ExpertUnavailable

log = logging.getLogger(__name__)

#: Error codes worth a retry on another worker; anything else means our request is bad.
TRANSIENT = {ErrorCode.OVERLOADED, ErrorCode.DEADLINE_EXCEEDED, ErrorCode.UNAVAILABLE, ErrorCode.INTERNAL}

#: Free retries of one request whose connection was re-established while it waited.
MAX_LOST_TO_RECONNECT = 3

#: Pause between tries while an expert has no responders just after a reconnect (s).
NO_RESPONDERS_BACKOFF = 0.25

#: Most worker ids `NatsTransport.bad_workers` remembers (least recently blamed dropped first).
BAD_WORKERS_KEPT = 256

#: Seconds between two log lines about stray (unexpected or forged) replies.
STRAY_LOG_INTERVAL = 10.0

#: The status nats-server puts on the reply of a request nobody subscribes to.
_NO_RESPONDERS = "503"


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
    """Request/reply to `schemas.subjects.expert_velocity(k)`.

    step_timeout: seconds to wait for one reply; retries: extra tries after a timeout or a
    transient error reply; bad_reply_retries: extra tries after unusable replies; max_rows:
    rows per request (<= MAX_STEP_ROWS); reconnect_grace: seconds after a NATS reconnect during
    which "no responders" means "workers still reconnecting" (wait and retry), not "no workers"."""

    def __init__(self, nc, *, step_timeout: float = 10.0, retries: int = 2, max_rows: int = MAX_STEP_ROWS,
                 bad_reply_retries: int = 4, reconnect_grace: float = 10.0):
        if step_timeout <= 0:
            raise ValueError(f"step_timeout must be > 0 seconds, got {step_timeout}")
        if retries < 0:
            raise ValueError(f"retries must be >= 0, got {retries}")
        if bad_reply_retries < 0:
            raise ValueError(f"bad_reply_retries must be >= 0, got {bad_reply_retries}")
        if not 1 <= max_rows <= MAX_STEP_ROWS:
            raise ValueError(f"max_rows must be in [1, {MAX_STEP_ROWS}], got {max_rows}")
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
        self._prefix: str | None = None  # "<inbox prefix>.<nuid>": the reply mux's subject is prefix + ".*"
        self._pending: dict[str, asyncio.Future] = {}  # reply token -> the request's future
        self._mux_lock = asyncio.Lock()
        self._stray_logged_at = float("-inf")

    async def velocity(self, expert: int, x: np.ndarray, t: np.ndarray, y: np.ndarray,
                       row_ids: list[str]) -> np.ndarray:
        n = len(x)
        if n <= self.max_rows:
            return await self._request(expert, x, t, y, row_ids)
        parts = [slice(i, i + self.max_rows) for i in range(0, n, self.max_rows)]
        outs = await asyncio.gather(*(self._request(expert, x[s], t[s], y[s], row_ids[s]) for s in parts))
        return np.concatenate(outs, axis=0)

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
    async def _ensure_mux(self) -> str:
        """Subscribe the reply wildcard once; returns the reply prefix."""
        if self._prefix is None:
            async with self._mux_lock:
                if self._prefix is None:
                    prefix = self.nc.new_inbox()  # "<inbox prefix>.<nuid>": unique per transport
                    await self.nc.subscribe(prefix + ".*", cb=self._on_reply)
                    self._prefix = prefix
        return self._prefix

    async def _on_reply(self, msg) -> None:
        token = msg.subject.rsplit(".", 1)[-1]
        fut = self._pending.pop(token, None)  # accepted once: a second reply finds nothing
        if fut is None or fut.done():
            self._stray(msg.subject)
            return
        fut.set_result(msg)

    def _stray(self, subject: str) -> None:
        self.stray_replies += 1
        now = time.monotonic()
        if now - self._stray_logged_at >= STRAY_LOG_INTERVAL:
            self._stray_logged_at = now
            log.warning("dropped a reply on %s: no request of ours is waiting on that subject (forged, "
                        "duplicate or late; %d so far)", subject[:200], self.stray_replies)

    async def _ask(self, subject: str, payload: bytes, timeout: float):
        """Publish a request with a fresh unguessable reply subject; the reply message.
        Raises nats.errors.TimeoutError or NoRespondersError like `nc.request`."""
        import nats.errors
        from nats.js.api import Header

        prefix = await self._ensure_mux()
        token = secrets.token_hex(16)
        fut = asyncio.get_running_loop().create_future()
        self._pending[token] = fut
        try:
            await self.nc.publish(subject, payload, reply=f"{prefix}.{token}")
            try:
                msg = await asyncio.wait_for(fut, timeout)
            except asyncio.TimeoutError:
                raise nats.errors.TimeoutError from None
        finally:
            self._pending.pop(token, None)
        if msg.headers and msg.headers.get(Header.STATUS) == _NO_RESPONDERS and not msg.data:
            raise nats.errors.NoRespondersError
        return msg

    # ------------------------------------------------------------ one request
    async def _request(self, expert: int, x, t, y, row_ids) -> np.ndarray:
        import nats.errors

        subject = subjects.expert_velocity(expert)
        x32 = np.ascontiguousarray(x, np.float32)
        t32, y64 = t.astype(np.float32), y.astype(np.int64)
        tries = bad_tries = lost = 0
        last = "no attempt"
        attempt = 0
        while True:
            if attempt:
                self.retried += 1
            attempt += 1
            epoch = self._observe_reconnects()
            req = StepRequest(expert=expert, x_t=x32, t=t32, y=y64, row_ids=list(row_ids),
                              deadline=time.time() + self.step_timeout, request_id=f"s{next(self._ids)}")
            try:
                msg = await self._ask(subject, pack(req), self.step_timeout)
            except nats.errors.NoRespondersError:
                if self._in_reconnect_grace():
                    await asyncio.sleep(NO_RESPONDERS_BACKOFF)
                    continue
                raise ExpertUnavailable(expert, "has no responders") from None
            except (nats.errors.TimeoutError, asyncio.TimeoutError):
                down = self._observe_reconnects() != epoch or not getattr(self.nc, "is_connected", True)
                if down and lost < MAX_LOST_TO_RECONNECT:
                    lost += 1
                    log.warning("expert %d: request %s lost with the NATS connection; sending it again",
                                expert, req.request_id)
                    continue
                tries += 1
                last = f"timed out after {self.step_timeout:g} s"
                log.warning("expert %d: request %s %s (try %d/%d)", expert, req.request_id, last, tries,
                            self.retries + 1)
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
            try:
                return self._check(expert, msg.data, x32.shape, row_ids)
            except _BadReply as bad:
                bad_tries += 1
                self.bad_replies += 1
                self.bad_workers[bad.worker or "?"] += 1
                last = f"bad reply from worker {bad.worker or '(unnamed)'}: {bad.why}"
                log.warning("expert %d: bad reply to request %s from worker %s: %s (bad reply %d of at most %d)",
                            expert, req.request_id, bad.worker or "(unnamed)", bad.why, bad_tries,
                            self.bad_reply_retries + 1)
                if bad_tries > self.bad_reply_retries:
                    break
                continue
            except _ErrorReply as err:
                last = f"error reply {err.code.value}: {err.message}"
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

    def _check(self, expert: int, data: bytes, shape: tuple[int, ...], row_ids) -> np.ndarray:
        """The reply's velocity as float32 [n, C, H, W]; raises _BadReply or _ErrorReply."""
        try:
            raw = loads(data)
        except ProtocolError as err:
            raise _BadReply(f"undecodable ({err.code.value}: {err.message})") from None
        worker = _claimed_worker(raw)
        try:
            reply = validate(raw, StepResult)
        except ProtocolError as err:
            raise _BadReply(f"{err.code.value}: {err.message}", worker) from None
        if isinstance(reply, ErrorReply):
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
        with np.errstate(over="ignore", invalid="ignore"):
            v = v.astype(np.float32, copy=False)
        if not np.isfinite(v).all():  # e.g. float64 values beyond float32's range
            raise _BadReply("velocity has NaN/Inf values as float32", worker)
        return v


class _ErrorReply(Exception):
    def __init__(self, code: ErrorCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message
