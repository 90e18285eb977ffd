"""The reply multiplexer of the expert transport: every request's reply subject served by one wildcard
subscription, which lets through only the replies a request of this transport waits for.

Forged replies: every request (every try, every hedge leg) gets its own reply subject
`<inbox prefix>.<per-transport NUID>.<secrets.token_hex(16)>` (128 random bits), served by one
wildcard subscription whose callback accepts a message only on the token of a request this
transport has outstanding, and only once (the token is forgotten on the first reply, on time-out
and on give-up). A reply on any other subject under the prefix (a guessed or replayed token, a
second reply, a reply after its time-out) is dropped and counted in `stray_replies`. A process
that sees one request (a worker of that expert) learns only that request's token, so it cannot
answer anyone else's. (What makes the reply that got through usable is the transport's check.)

Two kinds of further replies are expected, not stray, and dropped quietly (`late_replies`): the reply
to a hedge leg cancelled because the other leg won (its token retired), and the further replies of a
request that ran ahead once its stream is closed. While a run-ahead stream is open, the replies after
the first on its subject go to it (coordinator/run_ahead.py `AheadStream`).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections import OrderedDict

from bus.inbox import private_inbox

from .run_ahead import AheadStream

log = logging.getLogger(__name__)

#: Seconds between two log lines about stray (unexpected or forged) replies.
STRAY_LOG_INTERVAL = 10.0

#: Tokens of cancelled hedge legs (and of closed run-ahead streams) remembered, so that their late
#: replies are dropped quietly.
RETIRED_TOKENS_KEPT = 4096

#: The status nats-server puts on the reply of a request nobody subscribes to.
_NO_RESPONDERS = "503"


class ReplyMux:
    """Request/reply over NATS with a reply subject per request, all served by one subscription
    (module docstring). `ask` is this transport's `nc.request`."""

    def __init__(self, nc):
        self.nc = nc
        self.stray_replies = 0  # replies on a token with no outstanding request (forged, duplicate, late)
        self.late_replies = 0  # replies to a hedge leg cancelled because the other one won, or a closed stream
        self._prefix: str | None = None  # "<inbox prefix>.<nuid>": the mux's subject is prefix + ".*"
        self._pending: dict[str, asyncio.Future] = {}  # reply token -> the request's future
        self._retired: OrderedDict[str, None] = OrderedDict()  # tokens of cancelled hedge legs
        self._streams: dict[str, AheadStream] = {}  # token of a run-ahead subject -> its stream
        self._closed_streams: OrderedDict[str, None] = OrderedDict()  # their tokens once closed (late: quiet)
        self._lock = asyncio.Lock()
        self._stray_logged_at = float("-inf")

    @property
    def prefix(self) -> str | None:
        """The prefix of the reply subjects (`<inbox prefix>.<random>`); None before the first request."""
        return self._prefix

    async def ask(self, subject: str, payload: bytes, timeout: float, stream: AheadStream | None = None):
        """Publish a request with a fresh unguessable reply subject; the reply message.
        Raises nats.errors.TimeoutError or NoRespondersError like `nc.request`. With `stream` (a request
        that runs ahead), the replies after the first on that subject go to the stream."""
        import nats.errors
        from nats.js.api import Header

        prefix = await self._ensure()
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
                _remember(self._retired, token)
            if stream is not None:  # this leg's further replies are not wanted either
                self.forget_stream(token)
            raise
        finally:
            self._pending.pop(token, None)
        if msg.headers and msg.headers.get(Header.STATUS) == _NO_RESPONDERS and not msg.data:
            raise nats.errors.NoRespondersError
        return msg

    def forget_stream(self, token: str) -> None:
        """The run-ahead replies on `token` are no longer wanted: drop the ones that still come, quietly."""
        if self._streams.pop(token, None) is not None:
            _remember(self._closed_streams, token)

    async def _ensure(self) -> str:
        """Subscribe the reply wildcard once; returns the reply prefix."""
        if self._prefix is None:
            async with self._lock:
                if self._prefix is None:
                    prefix = private_inbox(self.nc)  # "<inbox prefix>.<random>": nothing like nats-py's own
                    await self.nc.subscribe(prefix + ".*", cb=self._on_reply)
                    self._prefix = prefix
        return self._prefix

    async def _on_reply(self, msg) -> None:
        token = reply_token(msg)
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


def reply_token(msg) -> str:
    """The token of the reply subject a message came on (the last token of `<prefix>.<token>`)."""
    return msg.subject.rsplit(".", 1)[-1]


def _remember(tokens: OrderedDict[str, None], token: str) -> None:
    """Add `token`, forgetting the oldest past RETIRED_TOKENS_KEPT."""
    tokens[token] = None
    while len(tokens) > RETIRED_TOKENS_KEPT:
        tokens.popitem(last=False)
