"""What an expert request does after a try that failed (pure: tell it each failure, ask it what next).

`NatsTransport` (coordinator/transport.py) sends the tries of one request and does the I/O; one
`RetryPolicy` per request decides. Each try that brings no usable velocity becomes an `Outcome` (what
came back: no responders, a time-out, not sent, a bad reply, an error reply, and the facts only the
transport can see, such as a reconnect meanwhile); `after(outcome)` answers with a `Next`: try again
after `delay_s`, or give up raising `error`, and what to log. Between tries the policy's state says how
the next try goes: `insist` (to a known worker however busy), `ahead` (still asks to run ahead),
`reply_dtype` (the reduced wire precision it travels in, None: float32). No I/O, clock or asyncio,
so each branch is tested by feeding hand-made outcomes (tests/coordinator/test_retry_policy.py).

A request is tried again when:
* it times out, gets a transient error reply (`overloaded`, `deadline_exceeded`, `unavailable`,
  `internal`), or could not be sent (the connection is reconnecting and nats-py's outgoing buffer is
  full; the next try after min(step_timeout, 1 s)): at most `retries` more tries. A try after a
  time-out goes to a known worker however busy, not to the queue group
  (`DispatchPolicy.pick(insist=True)`: a silent member, e.g. behind a cut route, may be picked there again);
* the reply is unusable (coordinator/reply_check.py says which are): a broken or hostile worker
  answers fast, so these get their own budget, `bad_reply_retries`;
* it timed out while the NATS connection was down or after it was re-established (the request or its
  reply went down with the old connection): a free retry, at most `MAX_LOST_TO_RECONNECT` per request
  (then time-outs count against `retries` again);
* the expert has no responders within the reconnect grace period (its workers have not reconnected
  yet): again after `NO_RESPONDERS_BACKOFF`, uncounted, until the grace period ends;
* a worker older than running ahead refuses those fields (`bad_request`, `unsupported_version`):
  again at once without them, uncounted (`Next.refused_ahead`: the transport stops asking that expert
  to run ahead for a while);
* a reduced-precision try is answered `non_finite` (the velocity overflowed float16): once again in
  float32, uncounted, and without running ahead (a step run ahead would be computed in float32 where a
  later plain request travels in float16 again).

It gives up with `ExpertUnavailable` on no responders (outside the grace period), on any other error
reply (our request is bad: asking again cannot help), or when a budget is spent; with `BadExpertReply`
(code `bad_reply`) when at least as many tries got bad replies as failed otherwise.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass

from schemas import ErrorCode

from .errors import BadExpertReply, ExpertUnavailable

#: Error codes worth a retry on another worker; anything else means our request is bad.
TRANSIENT = frozenset({ErrorCode.OVERLOADED, ErrorCode.DEADLINE_EXCEEDED, ErrorCode.UNAVAILABLE, ErrorCode.INTERNAL})

#: Error codes with which a worker older than running ahead refuses the run-ahead fields.
REFUSED_AHEAD = frozenset({ErrorCode.BAD_REQUEST, ErrorCode.UNSUPPORTED_VERSION})

#: Free retries of one request whose connection was re-established while it waited.
MAX_LOST_TO_RECONNECT = 3

#: Pause between tries while an expert has no responders just after a reconnect (s).
NO_RESPONDERS_BACKOFF = 0.25

#: Longest pause before trying again a request that could not be sent (s; shorter when step_timeout is).
NOT_SENT_BACKOFF = 1.0


class Failed(enum.Enum):
    """How a try failed."""

    NO_RESPONDERS = "no responders"  # nobody subscribes to the subject it went to
    TIMEOUT = "timeout"  # no reply within the step time-out
    NOT_SENT = "not sent"  # the connection is reconnecting and its outgoing buffer is full
    BAD_REPLY = "bad reply"  # a reply that cannot be used
    ERROR_REPLY = "error reply"  # a worker's ErrorReply


@dataclass(frozen=True)
class Outcome:
    """What one failed try came back with, as the transport saw it."""

    failed: Failed
    request_id: str = ""  # the try's StepRequest.request_id, for the log
    code: ErrorCode | None = None  # ERROR_REPLY: the worker's error code
    why: str = ""  # BAD_REPLY: what is wrong with it; ERROR_REPLY: the worker's message; NOT_SENT: the error's name
    worker: str = ""  # BAD_REPLY: the worker id the reply claims ("" none)
    connection_lost: bool = False  # TIMEOUT: the NATS connection was down, or re-established, meanwhile
    reconnecting: bool = False  # NO_RESPONDERS: within the grace period after a reconnect


@dataclass(frozen=True)
class Next:
    """The policy's answer: with `error` None, try again after `delay_s` seconds; else give up, raising `error`.
    `note` (logged at `level`, after "expert K: ") says what happened, "" when nothing is worth a line."""

    delay_s: float = 0.0
    error: ExpertUnavailable | None = None
    note: str = ""
    level: int = logging.WARNING
    refused_ahead: bool = False  # a worker refused to run ahead: do not ask this expert to for a while
    wire_fallback: bool = False  # a reduced-precision try overflowed: the next ones travel in float32


class RetryPolicy:
    """The retry decisions of one request to `expert` (module docstring). retries: tries after the first
    counted against time-outs, transient error replies and unsent tries; bad_reply_retries: after bad
    replies; step_timeout: a try's time-out (s), named in notes and bounding the pause of an unsent try;
    ahead: the first try asks to run ahead; reply_dtype: the reduced precision it travels in (None: float32)."""

    def __init__(
        self,
        expert: int,
        *,
        retries: int,
        bad_reply_retries: int,
        step_timeout: float,
        ahead: bool = False,
        reply_dtype: str | None = None,
    ):
        self.expert, self.retries, self.bad_reply_retries = expert, retries, bad_reply_retries
        self.step_timeout = step_timeout
        self.ahead = ahead  # the next try asks to run ahead
        self.reply_dtype = reply_dtype  # the next try's reduced precision (None: float32)
        self.insist = False  # the next try goes to a known worker however busy (a try timed out)
        self.tries = 0  # failures counted against `retries`
        self.bad_tries = 0  # bad replies, counted against `bad_reply_retries`
        self.lost = 0  # time-outs forgiven because the connection went down meanwhile
        self.last = "no attempt"  # the last failure, for the error given up with

    def after(self, outcome: Outcome) -> Next:
        """What to do after a try that failed as `outcome` says; updates the state the next try reads."""
        answer = {
            Failed.NO_RESPONDERS: self._no_responders,
            Failed.TIMEOUT: self._timed_out,
            Failed.NOT_SENT: self._not_sent,
            Failed.BAD_REPLY: self._bad_reply,
            Failed.ERROR_REPLY: self._error_reply,
        }[outcome.failed]
        return answer(outcome)

    def _no_responders(self, outcome: Outcome) -> Next:
        if outcome.reconnecting:  # its workers have not reconnected yet
            return Next(delay_s=NO_RESPONDERS_BACKOFF)
        return Next(error=ExpertUnavailable(self.expert, "has no responders"))

    def _timed_out(self, outcome: Outcome) -> Next:
        if outcome.connection_lost and self.lost < MAX_LOST_TO_RECONNECT:
            self.lost += 1
            return Next(note=f"request {outcome.request_id} lost with the NATS connection; sending it again")
        self.tries += 1
        self.insist = True
        self.last = f"timed out after {self.step_timeout:g} s"
        note = f"request {outcome.request_id} {self.last} (try {self.tries}/{self.retries + 1})"
        return self._give_up(note) if self.tries > self.retries else Next(note=note)

    def _not_sent(self, outcome: Outcome) -> Next:
        self.tries += 1
        self.last = f"not sent ({outcome.why}: NATS is reconnecting)"
        if self.tries > self.retries:
            return self._give_up()
        return Next(delay_s=min(self.step_timeout, NOT_SENT_BACKOFF))

    def _bad_reply(self, outcome: Outcome) -> Next:
        self.bad_tries += 1
        worker = outcome.worker or "(unnamed)"
        self.last = f"bad reply from worker {worker}: {outcome.why}"
        note = (
            f"bad reply to request {outcome.request_id} from worker {worker}: {outcome.why} "
            f"(bad reply {self.bad_tries} of at most {self.bad_reply_retries + 1})"
        )
        return self._give_up(note) if self.bad_tries > self.bad_reply_retries else Next(note=note)

    def _error_reply(self, outcome: Outcome) -> Next:
        code = outcome.code
        self.last = f"error reply {code.value}: {outcome.why}"
        if self.ahead and code in REFUSED_AHEAD:  # a worker older than running ahead: ask plainly
            self.ahead = False
            note = f"a worker refused to run ahead ({self.last}); asking plainly"
            return Next(note=note, level=logging.INFO, refused_ahead=True)
        if code == ErrorCode.NON_FINITE and self.reply_dtype is not None:  # e.g. beyond float16's range
            note = f"request {outcome.request_id} in {self.reply_dtype}: {self.last}; sending it again in float32"
            self.reply_dtype, self.ahead = None, False
            return Next(note=note, wire_fallback=True)
        if code not in TRANSIENT:
            return Next(error=ExpertUnavailable(self.expert, self.last))
        self.tries += 1
        return self._give_up() if self.tries > self.retries else Next()

    def _give_up(self, note: str = "") -> Next:
        summary = f"no usable reply after {self.tries + self.bad_tries} tries (last: {self.last})"
        mostly_bad = self.bad_tries and self.bad_tries >= self.tries  # mostly garbage, not silence: say so
        error = (BadExpertReply if mostly_bad else ExpertUnavailable)(self.expert, summary)
        return Next(error=error, note=note)
