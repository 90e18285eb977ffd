"""One try of an expert request on the wire: where its legs go (dispatch), a second leg when the first
is late (hedging), and the first usable reply of either.

`TryLegs.send` sends a try (one request's bytes) and returns the checked velocity, or raises what its
failure was; the transport (coordinator/transport.py) decides, with its retry policy, what follows.
The decisions are pure and apart: `DispatchPolicy` (coordinator/dispatch.py) says which worker a leg
goes to, `HedgePolicy` (coordinator/hedging.py) when a try gets a copy; the reply subjects and the
dropping of forged and late replies are the reply mux's (coordinator/reply_mux.py).

Dispatch (`dispatch="direct"`, the default): a try goes to the known worker of the expert with the
fewest requests outstanding from this transport (join the shortest queue), on
`subjects.expert_direct(k, worker_token(worker_id))`; to the queue group when no worker is known, when
every known worker already has `DispatchPolicy.depth` outstanding, and every `explore_every`-th try
(workers are learned from the `worker_id` of good replies). A direct try answered "no responders"
(the worker stopped, or predates direct subjects) forgets that worker and goes to the queue group at
once, within the same try; a direct try that times out, or gets an error or unusable reply, forgets the
worker, and the retry policy sends the request again (elsewhere). A try that goes unanswered (timed out,
direct or through the queue group, or beaten by its hedge copy) tells the policy (`unanswered`): while
a worker discovery feeds it (`fence`), the expert's tries then keep off its queue group for a while,
except where no worker is known. Counted in
`dispatch_counts[(expert, "direct" | "queue")]` (every leg sent, hedges included) and
`direct_fallbacks`. `dispatch="queue"` (no dispatcher): every try to the queue group, as before direct
subjects, except for the experts worker discovery fences (`fence`: a worker of another spec shares
their queue group), whose tries go to their matching workers directly.

Hedged tries (`hedge="auto"`): when a try has no reply after the expert's hedge delay, the same request
bytes (same `request_id`, same deadline) are published once more with a new reply subject, so the queue
group can hand the copy to another worker (with direct dispatch: to another known worker with room,
else to the queue group; never to the primary's worker directly, and no copy at all for a fenced expert
with no other matching worker known; an expert that only keeps off its queue group after an unanswered try
still sends its copy there when no other worker is known). The first usable reply wins; the other leg is
cancelled and its reply, if it comes, is dropped quietly (`late_replies`, not a stray). At most one hedge per try. Both
legs share the try's `step_timeout`. Counted in `hedge_counts[(expert, outcome)]`: won (the copy
answered first), lost (the original did), failed (neither gave a usable reply).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import numpy as np

from schemas import StepReply, subjects

from .dispatch import DispatchPolicy
from .engine import ANSWERED_BY
from .hedging import HedgePolicy
from .reply_check import BadReply, ReplyError
from .reply_mux import ReplyMux, reply_token
from .retry_policy import TRANSIENT
from .run_ahead import AheadStream

log = logging.getLogger(__name__)

#: A try's result: (the velocity float32 [n, C, H, W], the worker id it claims, the token of the reply
#: subject it came on).
Answer = tuple[np.ndarray, str, str]


class TryLegs:
    """The legs of each try of an expert request (module docstring). check(expert, data, shape, row_ids):
    a reply's (velocity, claimed worker id, reply), raising BadReply or ReplyError; in_reconnect_grace():
    just after a reconnect, when "no responders" on a direct subject may only mean "not resubscribed yet"."""

    def __init__(
        self,
        mux: ReplyMux,
        *,
        step_timeout: float,
        dispatcher: DispatchPolicy | None,
        hedging: HedgePolicy,
        check: Callable[[int, bytes, tuple, list], tuple[np.ndarray, str, StepReply]],
        in_reconnect_grace: Callable[[], bool],
    ):
        self.mux, self.step_timeout = mux, step_timeout
        #: join-shortest-queue over known workers (dispatch="direct"); None: always the queue group
        self.dispatcher = dispatcher
        self.hedging = hedging
        self._check, self._in_reconnect_grace = check, in_reconnect_grace
        self.dispatch_counts: dict[tuple[int, str], int] = {}  # (expert, direct | queue) -> legs sent
        self.direct_fallbacks = 0  # direct legs answered "no responders", sent again to the queue group
        self.hedge_counts: dict[tuple[int, str], int] = {}  # (expert, won | lost | failed) -> hedges
        self.requests_sent: dict[int, int] = {}  # expert -> tries sent (hedge copies not counted)

    async def send(
        self, expert: int, subject: str, payload: bytes, shape, row_ids, stream: AheadStream | None, *, insist: bool
    ) -> Answer:
        """One try of the request `payload` to expert `expert` (`subject`: its queue group), hedged as the
        module docstring says: its Answer, or the exception of its failure (NATS timeout / no responders,
        BadReply, ReplyError). insist: a known worker however busy (a try after a time-out)."""
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
                return self._answered(expert, sent, await primary)
            left = self.step_timeout - (loop.time() - sent)
            # a direct primary's copy goes to another known worker with room, else the queue group
            other = self._pick(expert, (token,), explore=False) if token is not None else None
            if other is None and self.dispatcher is not None and expert in self.dispatcher.fenced():
                # no other matching worker known, and the queue group holds one of another spec: no copy
                return self._answered(expert, sent, await primary)
            hedge = self._start_leg(expert, subject, payload, max(left, 0.001), shape, row_ids, other, stream)
            outcome_if_first = {primary: "lost", hedge: "won"}
            pending: set = {primary, hedge}
            failure: BaseException | None = None
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for leg in done:
                    err = leg.exception()
                    if err is None:
                        self._count_hedge(expert, outcome_if_first[leg])
                        if leg is hedge and self.dispatcher is not None:  # the primary's worker is late
                            self.dispatcher.unanswered(expert)
                            if token is not None:  # (frozen? cut off?): stop picking it
                                self.dispatcher.forget(expert, token)
                        return self._answered(expert, sent, leg.result())  # latency censored when the copy won
                    failure = _worse(failure, err)
            self._count_hedge(expert, "failed")
            raise failure
        finally:
            for leg in (primary, hedge):
                if leg is not None and not leg.done():
                    leg.cancel()  # its token is retired: a reply that still comes is dropped quietly

    @property
    def hedges_sent(self) -> int:
        return sum(self.hedge_counts.values())

    def fence(self, fenced: set[int], matching: dict[int, list[str]]) -> None:
        """A worker discovery's result: the workers of each expert whose spec matches (`matching`: expert ->
        worker ids) answered it, so they are alive and known from now on (not only once one has answered a
        request: a retry after a time-out then goes to another known worker, not to the queue group, whose
        random pick may be the silent one again). `fenced`: experts whose queue groups hold a worker of another
        spec: their tries go directly to their matching workers."""
        if self.dispatcher is None and fenced:  # dispatch="queue": steer only the fenced experts, directly
            self.dispatcher = DispatchPolicy(subjects.worker_token, only_fenced=True)
        if self.dispatcher is not None:
            self.dispatcher.fence(fenced)
            self.dispatcher.discovered()
            for expert, workers in matching.items():
                if expert in fenced or not self.dispatcher.only_fenced:
                    for worker in workers:
                        self.dispatcher.seen(expert, worker)

    def _answered(self, expert: int, sent: float, answer: Answer) -> Answer:
        """A try's usable answer: its latency and worker go to the hedge policy and the engine's call in flight."""
        worker = answer[1]
        self.hedging.observe(expert, asyncio.get_running_loop().time() - sent, worker)
        seen = ANSWERED_BY.get()  # the worker ids of the replies the engine's call used (`engine.ANSWERED_BY`)
        if seen is not None:
            seen.append(worker)
        return answer

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

    def _count_hedge(self, expert: int, outcome: str) -> None:
        key = (expert, outcome)
        self.hedge_counts[key] = self.hedge_counts.get(key, 0) + 1

    def _usable(self, expert: int, msg, shape, row_ids) -> Answer:
        """A leg's reply checked; a good reply's worker is alive: learned (or kept) for direct dispatch."""
        v, worker, _ = self._check(expert, msg.data, shape, row_ids)
        if self.dispatcher is not None and worker:
            self.dispatcher.seen(expert, worker)
        return v, worker, reply_token(msg)

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
    ) -> Answer:
        """Send the request once and check the reply. token: send it to that worker's direct subject first;
        "no responders" there sends it to the queue group `subject` at once (same leg, the time left); any
        other failure forgets that worker."""
        import nats.errors

        if token is not None:
            loop = asyncio.get_running_loop()
            began = loop.time()
            self._count_dispatch(expert, "direct")
            try:
                msg = await self.mux.ask(subjects.expert_direct(expert, token), payload, timeout, stream)
                return self._usable(expert, msg, shape, row_ids)
            except nats.errors.NoRespondersError:  # stopped, or a worker without a direct subject
                # (just after a reconnect the worker may only not have resubscribed yet: no ban then)
                self.dispatcher.forget(expert, token, ban=not self._in_reconnect_grace())
                self.direct_fallbacks += 1
                log.debug("expert %d: worker %s has no direct subscriber; sending to the queue group", expert, token)
            except (TimeoutError, nats.errors.TimeoutError):
                self.dispatcher.forget(expert, token)
                self.dispatcher.unanswered(expert)
                raise
            except BadReply:
                self.dispatcher.forget(expert, token, ban=True)
                raise
            except ReplyError as err:
                if err.code in TRANSIENT:  # overloaded, failing: pick others until it answers well again
                    self.dispatcher.forget(expert, token)
                raise
            timeout = max(timeout - (loop.time() - began), 0.001)
        self._count_dispatch(expert, "queue")
        try:
            msg = await self.mux.ask(subject, payload, timeout, stream)
        except (TimeoutError, nats.errors.TimeoutError):
            if self.dispatcher is not None:  # a member of the queue group took it and never answered
                self.dispatcher.unanswered(expert)
            raise
        return self._usable(expert, msg, shape, row_ids)


def _worse(a: BaseException | None, b: BaseException) -> BaseException:
    """Of two failed legs of one try, the failure to report: a reply (error or unusable) says more
    than "no responders", which says more than a time-out."""
    import nats.errors

    def rank(e: BaseException | None) -> int:
        if e is None:
            return -1
        if isinstance(e, (BadReply, ReplyError)):
            return 3
        if isinstance(e, nats.errors.NoRespondersError):
            return 2
        if isinstance(e, (nats.errors.TimeoutError, asyncio.TimeoutError)):
            return 0
        return 1

    return b if rank(b) >= rank(a) else a
