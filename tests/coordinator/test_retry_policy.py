"""The retry policy of expert requests (coordinator/retry_policy.py), pure: hand-made outcomes of failed
tries in, what the next try does out. Then how the transport turns what a try raised into an outcome."""

from __future__ import annotations

import logging
import time

import pytest

from coordinator.errors import BadExpertReply, ExpertUnavailable
from coordinator.retry_policy import (
    MAX_LOST_TO_RECONNECT,
    NO_RESPONDERS_BACKOFF,
    Failed,
    Outcome,
    RetryPolicy,
)
from schemas import ErrorCode

EXPERT = 3


def policy(**kw) -> RetryPolicy:
    kw.setdefault("retries", 2)
    kw.setdefault("bad_reply_retries", 4)
    kw.setdefault("step_timeout", 10.0)
    return RetryPolicy(EXPERT, **kw)


def timeout(lost: bool = False) -> Outcome:
    return Outcome(Failed.TIMEOUT, "s1", connection_lost=lost)


def bad(worker: str = "w-1", why: str = "velocity has NaN/Inf values as float32") -> Outcome:
    return Outcome(Failed.BAD_REPLY, "s1", why=why, worker=worker)


def error(code: ErrorCode, message: str = "no") -> Outcome:
    return Outcome(Failed.ERROR_REPLY, "s1", code=code, why=message)


def test_no_responders_gives_up_at_once_unless_the_workers_are_reconnecting():
    p = policy()
    for _ in range(20):  # within the grace period: wait a little, as often as it takes, counting nothing
        step = p.after(Outcome(Failed.NO_RESPONDERS, "s1", reconnecting=True))
        assert step.error is None and step.delay_s == NO_RESPONDERS_BACKOFF and not step.note
    assert p.tries == 0 and not p.insist
    step = p.after(Outcome(Failed.NO_RESPONDERS, "s2"))
    assert type(step.error) is ExpertUnavailable and str(step.error) == f"expert {EXPERT}: has no responders"


def test_time_outs_count_against_retries_and_send_the_next_try_to_a_known_worker():
    p = policy(retries=2, step_timeout=2.5)
    assert not p.insist  # the first try may go to the queue group
    for n in (1, 2):
        step = p.after(Outcome(Failed.TIMEOUT, f"s{n}"))
        assert step.error is None and step.delay_s == 0 and p.insist
        assert step.note == f"request s{n} timed out after 2.5 s (try {n}/3)" and step.level == logging.WARNING
    step = p.after(Outcome(Failed.TIMEOUT, "s3"))
    assert step.note == "request s3 timed out after 2.5 s (try 3/3)"  # logged, then given up
    assert type(step.error) is ExpertUnavailable
    assert step.error.reason == "no usable reply after 3 tries (last: timed out after 2.5 s)"


def test_a_try_lost_with_the_connection_is_free_a_few_times():
    p = policy(retries=0)
    for _ in range(MAX_LOST_TO_RECONNECT):
        step = p.after(timeout(lost=True))
        assert step.error is None and "lost with the NATS connection" in step.note
    assert p.tries == 0 and not p.insist  # a lost try says nothing of the worker
    step = p.after(timeout(lost=True))  # the free ones are spent: it counts, and retries=0
    assert type(step.error) is ExpertUnavailable and "timed out" in step.error.reason


def test_a_try_not_sent_while_reconnecting_waits_and_counts():
    p = policy(retries=1, step_timeout=0.4)
    step = p.after(Outcome(Failed.NOT_SENT, "s1", why="OutboundBufferLimitError"))
    assert step.error is None and step.delay_s == 0.4 and not step.note  # min(step_timeout, 1 s)
    assert policy(step_timeout=30).after(Outcome(Failed.NOT_SENT, why="X")).delay_s == 1.0
    step = p.after(Outcome(Failed.NOT_SENT, "s2", why="ConnectionReconnectingError"))
    assert step.error.reason == (
        "no usable reply after 2 tries (last: not sent (ConnectionReconnectingError: NATS is reconnecting))"
    )


def test_bad_replies_have_their_own_budget_and_give_up_as_bad_reply():
    p = policy(retries=0, bad_reply_retries=1)
    step = p.after(bad("rogue-1"))
    assert step.error is None and p.tries == 0 and not p.insist
    assert step.note == (
        "bad reply to request s1 from worker rogue-1: velocity has NaN/Inf values as float32 (bad reply 1 of at most 2)"
    )
    step = p.after(bad(""))
    assert "from worker (unnamed)" in step.note  # logged, then given up
    assert type(step.error) is BadExpertReply and step.error.code == ErrorCode.BAD_REPLY
    assert step.error.reason.startswith("no usable reply after 2 tries (last: bad reply from worker (unnamed):")


def test_giving_up_says_bad_reply_only_when_bad_replies_were_at_least_half():
    p = policy(retries=5, bad_reply_retries=0)
    p.after(timeout())
    p.after(timeout())
    step = p.after(bad())  # 1 bad reply, 2 time-outs: mostly silence
    assert type(step.error) is ExpertUnavailable and "after 3 tries (last: bad reply" in step.error.reason
    p = policy(retries=5, bad_reply_retries=1)
    p.after(timeout())
    p.after(bad())
    assert type(p.after(bad()).error) is BadExpertReply  # 2 bad, 1 silent


def test_the_budgets_are_apart_and_a_time_out_keeps_insisting():
    p = policy(retries=1, bad_reply_retries=1)
    assert p.after(timeout()).error is None and p.insist
    assert p.after(bad()).error is None and p.insist  # a bad reply since does not undo it
    assert p.after(error(ErrorCode.OVERLOADED)).error is not None  # the 2nd counted failure: retries=1 spent


def test_transient_error_replies_count_and_others_give_up_at_once():
    for code in (ErrorCode.OVERLOADED, ErrorCode.DEADLINE_EXCEEDED, ErrorCode.UNAVAILABLE, ErrorCode.INTERNAL):
        p = policy(retries=1)
        step = p.after(error(code, "busy"))
        assert step.error is None and p.tries == 1 and not p.insist and not step.note
        step = p.after(error(code, "busy"))
        assert step.error.reason == f"no usable reply after 2 tries (last: error reply {code.value}: busy)"
    step = policy(retries=5).after(error(ErrorCode.BAD_SHAPE, "x_t must be [B, 1, 32, 32]"))
    assert type(step.error) is ExpertUnavailable  # our request is wrong: asking again cannot help
    assert step.error.reason == "error reply bad_shape: x_t must be [B, 1, 32, 32]"


@pytest.mark.parametrize("code", [ErrorCode.BAD_REQUEST, ErrorCode.UNSUPPORTED_VERSION])
def test_a_worker_refusing_to_run_ahead_is_asked_plainly_once(code):
    p = policy(retries=0, ahead=True)
    step = p.after(error(code, "ahead_t: Extra inputs are not permitted"))
    assert step.error is None and step.refused_ahead and step.level == logging.INFO
    assert not p.ahead and p.tries == 0 and "asking plainly" in step.note
    step = p.after(error(code))  # a plain request refused: that is our request's fault
    assert type(step.error) is ExpertUnavailable and not step.refused_ahead


def test_an_overflow_of_reduced_precision_is_asked_again_in_float32_once():
    p = policy(retries=0, ahead=True, reply_dtype="float16")
    step = p.after(error(ErrorCode.NON_FINITE, "velocity overflows float16"))
    assert step.error is None and step.wire_fallback and p.tries == 0
    assert p.reply_dtype is None and not p.ahead  # float32 from now on, and plainly
    assert (
        step.note
        == "request s1 in float16: error reply non_finite: velocity overflows float16; sending it again in float32"
    )
    assert type(p.after(error(ErrorCode.NON_FINITE)).error) is ExpertUnavailable  # non_finite in float32: given up
    assert type(policy().after(error(ErrorCode.NON_FINITE)).error) is ExpertUnavailable  # float32 from the start


def test_the_policies_do_no_io():
    """The retry and hedge policies and the reply check import nothing of the bus or asyncio (as the
    scheduler's core, tests/test_layers.py), so that these tests feed them hand-made input."""
    from tests.test_layers import IMPURE, ROOT, _imports

    for module in ("coordinator/retry_policy.py", "coordinator/hedging.py", "coordinator/reply_check.py"):
        bad = [n for n, _ in _imports(ROOT / module) if any(n == i or n.startswith(i + ".") for i in IMPURE)]
        assert not bad, (module, bad)


# ------------------------------------------------------------------ what a try raised, as an outcome


async def test_the_transport_turns_each_failure_of_a_try_into_its_outcome():
    import nats.errors

    from coordinator.reply_check import BadReply, ReplyError
    from coordinator.transport import NatsTransport

    tr = NatsTransport(None)
    cases = [
        (nats.errors.NoRespondersError(), Outcome(Failed.NO_RESPONDERS, "s1")),
        (nats.errors.TimeoutError(), Outcome(Failed.TIMEOUT, "s1")),
        (TimeoutError(), Outcome(Failed.TIMEOUT, "s1")),
        (nats.errors.OutboundBufferLimitError(), Outcome(Failed.NOT_SENT, "s1", why="OutboundBufferLimitError")),
        (BadReply("NaN", "w-1"), Outcome(Failed.BAD_REPLY, "s1", why="NaN", worker="w-1")),
        (
            ReplyError(ErrorCode.OVERLOADED, "busy"),
            Outcome(Failed.ERROR_REPLY, "s1", code=ErrorCode.OVERLOADED, why="busy"),
        ),
    ]
    for err, want in cases:
        assert tr._outcome(err, 0, "s1", 0) == want, err
    assert tr._outcome(ValueError("a bug"), 0, "s1", 0) is None  # raised as it is, never retried

    class Reconnected:  # the connection was re-established since the try was sent (epoch 0)
        stats = {"reconnects": 1}
        is_connected = True

    tr.nc = Reconnected()
    assert tr._outcome(nats.errors.TimeoutError(), 0, "s1", 0).connection_lost
    assert tr._outcome(nats.errors.NoRespondersError(), 1, "s1", 0).reconnecting  # within reconnect_grace

    # this connection never dropped, but the expert answered a moment ago: its workers may be reconnecting
    # to another node of the cluster (theirs died), so "no responders" waits and retries for a while
    fresh = NatsTransport(None, reconnect_grace=10.0)
    assert not fresh._outcome(nats.errors.NoRespondersError(), 0, "s1", 3).reconnecting  # never answered: none
    fresh._answered_at[3] = time.monotonic()
    assert fresh._outcome(nats.errors.NoRespondersError(), 0, "s1", 3).reconnecting
    assert not fresh._outcome(nats.errors.NoRespondersError(), 0, "s1", 4).reconnecting  # another expert
    fresh._answered_at[3] = time.monotonic() - 11.0
    assert not fresh._outcome(nats.errors.NoRespondersError(), 0, "s1", 3).reconnecting  # long gone: no workers
