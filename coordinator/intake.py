"""The coordinator's NATS endpoints: job submit, cancel and status in each client's namespace, and
the fleet status, each answered on the requester's reply inbox.

Subjects (see `schemas.subjects`; `<c>` is the client token, the job's owner):
* `ddm.v1.c.<c>.jobs.submit`        JobRequest -> JobAccepted | JobRejected (validation and
                                    admission errors carry their ErrorCode); queue group
                                    `ddm.v1.coordinators`, so several coordinators share the load.
                                    The job is owned by `<c>`; its fairness key is "<c>" or
                                    "<c>/<session>" (JobRequest.session). A job with digit -1
                                    rows (label unknown) is refused `bad_request` when an expert
                                    has no null label (a one-row probe per expert, kept
                                    NULL_LABEL_TTL_S).
* `ddm.v1.c.<c>.jobs.<id>.cancel`   CancelRequest (or empty body) -> CancelReply. A cancel of a job
                                    whose submit is still being handled (its null-label probe awaited)
                                    cancels it (the submit is answered `rejected` / `cancelled`); a
                                    cancel of a job this coordinator does not know, while submits
                                    wait here to be handled, is remembered CANCEL_MEMORY_S, so a
                                    submit of that id among them is refused `cancelled` rather than
                                    run for nobody
* `ddm.v1.c.<c>.jobs.<id>.status`   anything -> JobStatus (queued | running | done | failed | unknown);
                                    for a job that finished recently the terminal event is published
                                    again first, for a client that missed it (e.g. across a reconnect),
                                    at most once every REPUBLISH_EVERY_S per job and
                                    REPUBLISH_RATE per second per client (beyond: ErrorReply
                                    `rate_limited`)
* `ddm.v1.c.<c>.jobs.<id>.events`   published: JobAccepted, FrameEvent*, DoneEvent | FailedEvent
* `ddm.v1.fleet.status`             anything -> FleetStatus

Job ids are per client namespace: two clients may both run a job "abc" (each sees only its own
events); a cancel or status request in a namespace `<c>` that does not own the job is answered
exactly as for an unknown job (same reply, same delay) and never acted on.
Rate limits (`CoordinatorConfig.submit_rate` / `status_rate`, per client `<c>`, token buckets of
2 s worth): a submit over the limit is answered JobRejected(rate_limited), a job status request
ErrorReply(rate_limited), a cancel CancelReply(cancelled=False, reason "rate_limited: …"), before
the request is decoded; job status and cancel requests have a bucket each, of `status_rate`. Fleet
status requests are limited to `status_rate` per requester too, the requester named by its reply
inbox (`_INBOX_<c>.…`: client `<c>`; every `_INBOX.…` of an open bus shares one bucket); over it:
ErrorReply(rate_limited). The cancel, job status and fleet status subscriptions hold at most
INTAKE_PENDING_MSGS requests not yet handled (nats-py drops the rest, a slow-consumer warning), so
a flood costs the coordinator bounded work per request and a bounded backlog, and it keeps
stepping its jobs.
Replies go only to reply subjects under `_INBOX` (`_INBOX.…`, or `_INBOX_<c>.…` for a request
in `<c>`'s namespace); a request with any other reply subject is dropped (rate-limited log line).
A cancel / status request whose `<id>` token is not a job id (over 64 characters, or outside
[A-Za-z0-9_-]) is answered with ErrorReply(bad_request) at once.

`Intake` decodes and checks a request, asks the coordinator (`IntakeHost`: what it needs of
`coordinator.service.Coordinator`'s in-process API) and replies; it never keeps job state of its own.
A request whose reply subject is not an inbox of the requester is dropped (rate-limited log line); a
bad request gets an error reply.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Protocol

from bus.inbox import respond
from bus.ratelimited_log import RateLimitedLog
from schemas import (
    CancelReply,
    CancelRequest,
    DoneEvent,
    ErrorCode,
    ErrorReply,
    FailedEvent,
    FleetStatus,
    JobAccepted,
    JobRejected,
    JobRequest,
    JobStatus,
    ProtocolError,
    pack,
    subjects,
    unpack,
)
from schemas.errors import RETRY_AFTER_HEADER, shown

from .rate_limit import TokenBuckets
from .scheduler import Rejected

if TYPE_CHECKING:
    from .config import CoordinatorConfig
    from .durable_jobs import DurableJobs
    from .ledger import JobLedger
    from .metrics import CoordinatorMetrics
    from .null_labels import NullLabelProbes

log = logging.getLogger(__name__)

#: Seconds a coordinator that does not own a job waits before answering cancel / status with
#: "unknown", so that the owner (if another coordinator runs it) answers first.
#: Seconds a packed `rate_limited` reply is sent again to the same client's requests of one kind.
LIMITED_REPLY_REUSE_S = 0.1
#: Packed `rate_limited` replies kept (a flood from many client names clears them, no more).
MAX_LIMITED_REPLIES = 1024
#: Requests a cancel, job status or fleet status subscription holds before nats-py drops new ones
#: (a flood of them must not queue minutes of work ahead of the coordinator's other tasks).
INTAKE_PENDING_MSGS = 4096
NOT_MINE_DELAY = 0.25
#: Most delayed "unknown" answers pending at once; beyond it they are sent at once (a flood of
#: probes must not grow the task set without bound).
MAX_DELAYED_REPLIES = 1024
#: The reason of a cancel that is not acted on: no such job in the requester's namespace
#: (never had it, finished, cancelled, or another client's: indistinguishable on purpose).
UNKNOWN_JOB = "unknown job"
#: Seconds a cancel of a job this coordinator does not know is remembered: a submit of that job
#: arriving meanwhile (delayed behind other submits, or taken after its client gave up waiting) is
#: refused `cancelled` instead of running for nobody.
CANCEL_MEMORY_S = 120.0
#: Most such cancels remembered (the oldest are forgotten first).
MAX_REMEMBERED_CANCELS = 4096
#: A finished job's terminal event is published again for status requests at most this often (s);
#: a status request in between gets the state alone (the event went out less than this ago).
REPUBLISH_EVERY_S = 2.0
#: Terminal events published again per second per client, over all its jobs (bursts of twice that);
#: a status request beyond it is answered `rate_limited`: a `done` of 256 images is 1 MB.
REPUBLISH_RATE = 4.0
#: Most (client, job) republish times kept.
MAX_REPUBLISH_TIMES = 4096
#: Reason of a submit refused because its client cancelled the job first.
CANCELLED_BEFORE_ADMISSION = "cancelled by its client before the coordinator took it"


class IntakeHost(Protocol):
    """What `Intake` asks of its coordinator (`coordinator.service.Coordinator` is one): its settings,
    books and counters, and what each request turns into."""

    settings: CoordinatorConfig  # submit_rate, status_rate
    metrics: CoordinatorMetrics  # set when the coordinator is entered, before its first request
    ledger: JobLedger
    durable_jobs: DurableJobs | None  # --durable only
    jobs_restored: asyncio.Event  # set once jobs resumed at start are known (status and cancel wait for it)
    null_labels: NullLabelProbes  # `check(request)`: a job of unknown labels needs every null label
    name: str
    instance: str

    def own_inbox_prefixes(self) -> list[str]:
        """The prefixes of the coordinator's own reply inboxes: no request may direct its reply there."""
        ...

    def with_fleet_defaults(self, request: JobRequest) -> JobRequest: ...

    def admit(self, request: JobRequest, client: str) -> tuple[JobAccepted, Awaitable[None]]: ...

    async def cancel(self, job_id: str, client: str | None = None) -> bool: ...

    async def job_status(self, job_id: str, client: str | None = None) -> JobStatus | None: ...

    def finished_event(self, job_id: str, client: str | None = None) -> DoneEvent | FailedEvent | None: ...

    async def send_event(self, client: str, event: DoneEvent | FailedEvent) -> None: ...

    def status(self, include_spec: bool = False, include_images: bool = False) -> FleetStatus: ...

    async def learn_images(self) -> None: ...


def _retry_after(seconds: float | None) -> dict[str, str] | None:
    """The RETRY_AFTER_HEADER of a refusal for the rate (at least 0.01 s, as its message says), else None."""
    return None if seconds is None else {RETRY_AFTER_HEADER: f"{max(seconds, 0.01):.2f}"}


def _per_client(rate: float | None) -> TokenBuckets | None:
    """Token buckets of `rate` per second per client, bursts of 2 s worth (at least 1); None: no limit."""
    return TokenBuckets(rate, max(1.0, 2 * rate)) if rate else None


class Intake:
    """Message handlers of one coordinator (`on_submit`, `on_cancel`, `on_job_status`, `on_status`)."""

    def __init__(self, coordinator: IntakeHost):
        self.coord = coordinator
        self._bg: set[asyncio.Task] = set()
        self._dropped_log = RateLimitedLog(log)  # requests whose reply subject is outside _INBOX
        self.replies_dropped = 0
        self.rejected_unread = 0  # submits rejected before the scheduler saw them (undecodable, invalid, internal)
        self.republished = 0  # terminal events published again for status requests
        self.rate_limited = 0  # submit / status requests answered `rate_limited`
        cfg = coordinator.settings
        self._submits = _per_client(cfg.submit_rate)
        self._statuses = _per_client(cfg.status_rate)
        self._cancels = _per_client(cfg.status_rate)
        self._fleet_statuses = _per_client(cfg.status_rate)
        self._limited_replies: dict[tuple[str, str], tuple[float, bytes]] = {}
        self._republishes = TokenBuckets(REPUBLISH_RATE, 2 * REPUBLISH_RATE)
        self._republished_at: OrderedDict[tuple[str, str], float] = OrderedDict()
        # submits being handled (awaiting the null-label probe): (client, job id) -> cancelled meanwhile
        self._pending: dict[tuple[str, str], bool] = {}
        # cancels of jobs unknown here: (client, job id) -> monotonic time of the cancel
        self._cancelled_unknown: OrderedDict[tuple[str, str], float] = OrderedDict()
        self._submits_in_hand = 0  # on_submit calls running
        self.submit_sub = None  # the submit subscription (set by the coordinator): its backlog

    def close(self) -> None:
        """Drop the delayed replies still pending."""
        for task in list(self._bg):
            task.cancel()

    # ------------------------------------------------------------ replies
    def _may_reply(self, msg, client: str | None = None) -> bool:
        """True if `msg` wants a reply and its reply subject is an inbox (`_INBOX.…`, or with
        `client` also `_INBOX_<client>.…`; without, any `_INBOX_<token>.…`); a request with any
        other reply subject is dropped, with a rate-limited log line."""
        if not msg.reply:
            return False
        if subjects.is_reply_inbox(msg.reply, client) and not self._is_own_inbox(msg.reply):
            return True
        self.replies_dropped += 1
        self._dropped_log.warning(
            "dropped a request on %s: its reply subject %s is not an inbox of the requester "
            "(replies go only to _INBOX.… or _INBOX_<client>.…)",
            shown(msg.subject),
            shown(msg.reply),
        )
        return False

    def _is_own_inbox(self, reply: str) -> bool:
        """True if `reply` is under one of this coordinator's own reply inboxes (where experts answer
        it): nobody may direct a reply there."""
        return any(reply.startswith(prefix.rstrip(".") + ".") for prefix in self.coord.own_inbox_prefixes())

    async def _reply(self, msg, message, retry_after_s: float | None = None) -> None:
        """Answer `msg` with `message`; `retry_after_s`: a refusal for the rate, said in RETRY_AFTER_HEADER."""
        if msg.reply:
            try:
                await respond(msg, pack(message), _retry_after(retry_after_s))
            except Exception:
                log.exception("reply failed")

    def _reply_later(self, msg, message, delay: float = NOT_MINE_DELAY) -> None:
        if not msg.reply:
            return
        if len(self._bg) >= MAX_DELAYED_REPLIES:  # flooded: answer at once rather than hold more tasks
            delay = 0.0

        async def later() -> None:
            await asyncio.sleep(delay)
            await self._reply(msg, message)

        task = asyncio.create_task(later())
        self._bg.add(task)
        task.add_done_callback(self._bg.discard)

    def _refused(self, msg, code: ErrorCode, reason: str, retry_after_s: float | None = None):
        self.rejected_unread += 1
        self.coord.metrics.rejected(code)
        return self._reply(msg, JobRejected(code=code, reason=reason), retry_after_s)

    def _over_rate(self, buckets: TokenBuckets | None, client: str, kind: str) -> float:
        """0.0 if `client` may make one more request of this kind now, else seconds to wait."""
        if buckets is None:
            return 0.0
        wait = buckets.take(client, time.monotonic())
        if wait:
            self.rate_limited += 1
            self.coord.metrics.rate_limited(kind)
        return wait

    @staticmethod
    def _too_fast(what: str, client: str, rate: float, wait: float) -> str:
        return (
            f"too many {what} from client {client!r} (limit {rate:g} per second, bursts of {max(1, 2 * rate):g}); "
            f"retry in {max(wait, 0.01):.2f} s"
        )

    async def _answer_limited(self, msg, kind: str, client: str, wait: float, what: str, who: str) -> None:
        """Answer a request over its rate with ErrorReply(rate_limited) ("too many <what> from client <who>"),
        packed once per (kind, client) and reused for LIMITED_REPLY_REUSE_S: a flood's replies cost a
        publish each, not a message built, validated and packed each (its "retry in" then reads up to that
        much too long)."""
        if not msg.reply:
            return
        now = time.monotonic()
        cached = self._limited_replies.get((kind, client))
        if cached is None or cached[0] <= now:
            if len(self._limited_replies) >= MAX_LIMITED_REPLIES:
                self._limited_replies.clear()
            wait += LIMITED_REPLY_REUSE_S
            message = self._too_fast(what, who, self.coord.settings.status_rate, wait)
            data = pack(ErrorReply(code=ErrorCode.RATE_LIMITED, message=message))
            cached = (now + LIMITED_REPLY_REUSE_S, data, _retry_after(wait))
            self._limited_replies[(kind, client)] = cached
        try:
            await respond(msg, cached[1], cached[2])
        except Exception:
            log.exception("reply failed")

    def _submits_waiting(self) -> bool:
        """True while a submit is being handled here or waits in the submit subscription's queue: a
        submit published before a cancel may then still come after it (submits are handled one at
        a time). With none, a submit of the job sent before the cancel went to another coordinator."""
        pending = getattr(self.submit_sub, "pending_msgs", 0) if self.submit_sub is not None else 0
        return self._submits_in_hand > 0 or bool(pending)

    def _remember_cancel(self, client: str, job_id: str) -> None:
        now = time.monotonic()
        self._cancelled_unknown.pop((client, job_id), None)
        self._cancelled_unknown[(client, job_id)] = now
        while self._cancelled_unknown:
            key, t = next(iter(self._cancelled_unknown.items()))
            if len(self._cancelled_unknown) <= MAX_REMEMBERED_CANCELS and now - t <= CANCEL_MEMORY_S:
                break
            del self._cancelled_unknown[key]

    def _was_cancelled(self, client: str, job_id: str) -> bool:
        """True (and forgotten) if `client` cancelled `job_id` within CANCEL_MEMORY_S, before this
        coordinator knew the job."""
        t = self._cancelled_unknown.pop((client, job_id), None)
        return t is not None and time.monotonic() - t <= CANCEL_MEMORY_S

    def _may_republish(self, client: str, job_id: str) -> bool | None:
        """Whether to publish a finished job's terminal event again now: True; False (it went out
        less than REPUBLISH_EVERY_S ago: the state alone answers); None (this client is over
        REPUBLISH_RATE: answer `rate_limited`)."""
        now = time.monotonic()
        last = self._republished_at.get((client, job_id))
        if last is not None and now - last < REPUBLISH_EVERY_S:
            return False
        if self._republishes.take(client, now):
            return None
        self._republished_at.pop((client, job_id), None)
        self._republished_at[(client, job_id)] = now
        while len(self._republished_at) > MAX_REPUBLISH_TIMES:
            self._republished_at.popitem(last=False)
        return True

    # ------------------------------------------------------------ handlers
    async def on_submit(self, msg) -> None:
        self._submits_in_hand += 1
        try:
            await self._on_submit(msg)
        finally:
            self._submits_in_hand -= 1

    async def _on_submit(self, msg) -> None:
        # Every submit is answered `accepted` or `rejected`; each `rejected` counts in jobs_rejected
        # (the scheduler counts its own refusals, this intake the rest).
        client = subjects.parse_submit_subject(msg.subject)
        if msg.reply and not self._may_reply(msg, client):
            return  # a reply subject outside _INBOX: not even the job is taken
        if client is None:
            await self._refused(
                msg,
                ErrorCode.BAD_REQUEST,
                (
                    f"the client name in the subject {shown(msg.subject)} is not valid: use 1-64 characters of "
                    "[A-Za-z0-9_-]"
                ),
            )
            return
        wait = self._over_rate(self._submits, client, "submit")
        if wait:
            reason = self._too_fast("submits", client, self.coord.settings.submit_rate, wait)
            await self._refused(msg, ErrorCode.RATE_LIMITED, reason, wait)
            return
        try:
            request = self.coord.with_fleet_defaults(unpack(msg.data, JobRequest))
        except ProtocolError as err:
            await self._refused(msg, err.code, err.message)
            return
        key = (client, request.job_id) if request.job_id is not None else None
        if key is not None and self._was_cancelled(*key):
            await self._refused(msg, ErrorCode.CANCELLED, CANCELLED_BEFORE_ADMISSION)
            return
        mine = key is not None and key not in self._pending
        if mine:
            self._pending[key] = False  # a cancel from here on cancels it (see on_cancel)
        try:
            try:
                await self.coord.null_labels.check(request)
            except Rejected as err:
                await self._refused(msg, err.code, err.reason)
                return
            except Exception:  # a failed probe never costs the job: its rows meet the workers' own check
                log.exception("null-label probe failed")
        finally:
            cancelled = self._pending.pop(key, False) if mine else False
        if cancelled:
            await self._refused(msg, ErrorCode.CANCELLED, CANCELLED_BEFORE_ADMISSION)
            return
        try:
            # admission + the accepted event are queued before any await, so the event
            # precedes every frame of this job on the events subject
            accepted, publish = self.coord.admit(request, client)
        except Rejected as err:
            await self._reply(msg, JobRejected(code=err.code, reason=err.reason))
            return
        except Exception as err:  # never die of one request
            log.exception("submit failed")
            await self._refused(msg, ErrorCode.INTERNAL, f"{type(err).__name__}: {err}")
            return
        await publish
        await self._reply(msg, accepted)

    async def _not_a_job_id(self, msg, what: str) -> None:
        """Answer a cancel / status request on `ddm.v1.c.<client>.jobs.<token>.<verb>` whose client
        or job token is not valid."""
        found = subjects.parse_job_namespace(msg.subject)
        what_token, token = (
            ("job id", found[1])
            if found
            else ("client name", msg.subject.split(".")[3] if msg.subject.count(".") >= 3 else msg.subject)
        )
        await self._reply(
            msg,
            ErrorReply(
                code=ErrorCode.BAD_REQUEST,
                message=(
                    f"{what}: the {what_token} in the subject, {shown(token)} ({len(token)} "
                    f"character{'s' * (len(token) != 1)}), is not valid: use 1-64 characters of [A-Za-z0-9_-]"
                ),
            ),
        )

    async def on_cancel(self, msg) -> None:
        parsed = subjects.parse_job_subject(msg.subject)
        found = subjects.parse_job_namespace(msg.subject)
        if msg.reply and not self._may_reply(msg, found[0] if found else None):
            return  # a reply subject outside _INBOX: not acted on either
        if parsed is None:
            await self._not_a_job_id(msg, "cancel")
            return
        client, job_id = parsed.client, parsed.job_id
        wait = self._over_rate(self._cancels, client, "cancel")
        if wait:
            rate = self.coord.settings.status_rate

            def limited(w, job_id=job_id):
                reason = f"rate_limited: {self._too_fast('cancel requests', client, rate, w)}"
                return CancelReply(job_id=job_id, cancelled=False, reason=reason)

            if msg.reply:  # a reply names its job: built each time (still no body read, nothing done)
                await self._reply(msg, limited(wait), wait)
            return
        if msg.data:
            try:
                req = unpack(msg.data, CancelRequest)
            except ProtocolError as err:
                await self._reply(
                    msg, CancelReply(job_id=job_id, cancelled=False, reason=f"{err.code.value}: {err.message}")
                )
                return
            if req.job_id != job_id:
                await self._reply(
                    msg,
                    CancelReply(
                        job_id=job_id, cancelled=False, reason=f"body job_id {req.job_id!r} does not match the subject"
                    ),
                )
                return
        await self.coord.jobs_restored.wait()  # a job being resumed at start is not "unknown"
        ok = await self.coord.cancel(job_id, client=client)  # another client's job: not acted on, "unknown"
        if not ok and (client, job_id) in self._pending:  # its submit awaits the null-label probe
            self._pending[(client, job_id)] = True
            ok = True
        if ok:
            await self._reply(msg, CancelReply(job_id=job_id, cancelled=True))
        else:  # answer "unknown" a little later, so the coordinator that owns the job (if any) answers first
            if self._submits_waiting() and self.coord.ledger.finished(client, job_id) is None:
                self._remember_cancel(client, job_id)  # its submit may be among them: refuse it then
            self._reply_later(msg, CancelReply(job_id=job_id, cancelled=False, reason=UNKNOWN_JOB))

    async def on_job_status(self, msg) -> None:
        parsed = subjects.parse_job_subject(msg.subject)
        found = subjects.parse_job_namespace(msg.subject)
        if not self._may_reply(msg, found[0] if found else None):
            return
        if parsed is None:
            await self._not_a_job_id(msg, "job status")
            return
        client, job_id = parsed.client, parsed.job_id
        coord = self.coord
        wait = self._over_rate(self._statuses, client, "status")
        if wait:
            await self._answer_limited(msg, "status", client, wait, "job status requests", client)
            return
        await coord.jobs_restored.wait()  # a job being resumed at start is not "unknown"
        if coord.durable_jobs is not None and coord.durable_jobs.is_fenced(client, job_id):
            return  # another coordinator took the job over: its answer counts, not our "unknown"
        try:
            status = await coord.job_status(job_id, client=client)
            # not ours, not this client's, or lost in a restart: "unknown", after the owner had its chance
            if status is None:
                self._reply_later(
                    msg,
                    JobStatus(job_id=job_id, state="unknown", coordinator=coord.name, instance=coord.instance),
                    delay=2 * NOT_MINE_DELAY,
                )
                return
            if status.state in ("done", "failed"):  # publish the result again, then say so
                ev = coord.finished_event(job_id, client=client)
                again = self._may_republish(client, job_id) if ev is not None else False
                if again is None:  # this client asks for more results again than REPUBLISH_RATE
                    self.rate_limited += 1
                    coord.metrics.rate_limited("republish")
                    message = (
                        f"too many finished jobs' results asked again by client {client!r} (limit "
                        f"{REPUBLISH_RATE:g} per second); retry in a second"
                    )
                    await self._reply(msg, ErrorReply(code=ErrorCode.RATE_LIMITED, message=message), 1.0)
                    return
                if again:
                    self.republished += 1
                    await coord.send_event(client, ev)
            await self._reply(msg, status)
        except Exception:
            log.exception("job status failed")

    async def on_status(self, msg) -> None:
        if not self._may_reply(msg):
            return
        requester = subjects.inbox_owner(msg.reply) or ""
        wait = self._over_rate(self._fleet_statuses, requester, "fleet_status")
        if wait:
            who = requester or "(open bus inboxes)"
            await self._answer_limited(msg, "fleet_status", requester, wait, "fleet status requests", who)
            return
        try:
            spec, images = status_options(msg.data)
            if spec and images:
                await self.coord.learn_images()  # a latent fleet whose decoders' images are not known yet
            await self._reply(msg, self.coord.status(include_spec=spec, include_images=spec and images))
        except Exception:
            log.exception("status failed")


def asks_for_spec(body: bytes) -> bool:
    """Whether a fleet status request asks for the fleet's model spec: a msgpack or JSON map with
    "spec": true. Anything else (an empty body, as v1 clients send) is a plain status request."""
    return status_options(body)[0]


def status_options(body: bytes) -> tuple[bool, bool]:
    """(spec, image_spec) a fleet status request asks for: a msgpack or JSON map (at most 1024 bytes)
    with "spec": true, and with "image_spec": true too; other keys (`v`, `kind` included) are ignored.
    Anything else (an empty body, as v1 clients send) is a plain status request: (False, False)."""
    data = _status_body(body)
    if not isinstance(data, dict) or data.get("spec") is not True:
        return False, False
    return True, data.get("image_spec") is True


def _status_body(body: bytes):
    if not body or len(body) > 1024:
        return None
    try:
        import msgpack

        data = msgpack.unpackb(
            body,
            raw=False,
            strict_map_key=True,
            max_bin_len=0,
            max_str_len=64,
            max_array_len=16,
            max_map_len=16,
            max_ext_len=0,
        )
    except Exception:
        try:
            import json

            data = json.loads(body)
        except Exception:
            return None
    return data
