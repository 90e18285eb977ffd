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
* `ddm.v1.c.<c>.jobs.<id>.cancel`   CancelRequest (or empty body) -> CancelReply
* `ddm.v1.c.<c>.jobs.<id>.status`   anything -> JobStatus (queued | running | done | failed | unknown);
                                    for a job that finished recently the terminal event is published
                                    again first, for a client that missed it (e.g. across a reconnect)
* `ddm.v1.c.<c>.jobs.<id>.events`   published: JobAccepted, FrameEvent*, DoneEvent | FailedEvent
* `ddm.v1.fleet.status`             anything -> FleetStatus

Job ids are per client namespace: two clients may both run a job "abc" (each sees only its own
events); a cancel or status request in a namespace `<c>` that does not own the job is answered
exactly as for an unknown job (same reply, same delay) and never acted on.
Replies go only to reply subjects under `_INBOX` (`_INBOX.…`, or `_INBOX_<c>.…` for a request
in `<c>`'s namespace); a request with any other reply subject is dropped (rate-limited log line).
A cancel / status request whose `<id>` token is not a job id (over 64 characters, or outside
[A-Za-z0-9_-]) is answered with ErrorReply(bad_request) at once.

`Intake` decodes and checks a request, asks the coordinator (`coordinator.service.Coordinator`'s
in-process API) and replies; it never keeps job state of its own. A request whose reply subject is
not an inbox of the requester is dropped (rate-limited log line); a bad request gets an error reply.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from bus.ratelimited_log import RateLimitedLog
from schemas import (
    CancelReply,
    CancelRequest,
    ErrorCode,
    ErrorReply,
    JobRejected,
    JobRequest,
    JobStatus,
    ProtocolError,
    pack,
    subjects,
    unpack,
)
from schemas.errors import shown

from .scheduler import Rejected

if TYPE_CHECKING:
    from .service import Coordinator

log = logging.getLogger(__name__)

#: Seconds a coordinator that does not own a job waits before answering cancel / status with
#: "unknown", so that the owner (if another coordinator runs it) answers first.
NOT_MINE_DELAY = 0.25
#: Most delayed "unknown" answers pending at once; beyond it they are sent at once (a flood of
#: probes must not grow the task set without bound).
MAX_DELAYED_REPLIES = 1024
#: The reason of a cancel that is not acted on: no such job in the requester's namespace
#: (never had it, finished, cancelled, or another client's: indistinguishable on purpose).
UNKNOWN_JOB = "unknown job"


class Intake:
    """Message handlers of one coordinator (`on_submit`, `on_cancel`, `on_job_status`, `on_status`)."""

    def __init__(self, coordinator: Coordinator):
        self.coord = coordinator
        self._bg: set[asyncio.Task] = set()
        self._dropped_log = RateLimitedLog(log)  # requests whose reply subject is outside _INBOX
        self.replies_dropped = 0
        self.rejected_unread = 0  # submits rejected before the scheduler saw them (undecodable, invalid, internal)
        self.republished = 0  # terminal events published again for status requests

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
        own = [getattr(self.coord.nc, "_resp_sub_prefix", None), getattr(self.coord.transport, "_prefix", None)]
        for prefix in own:
            if prefix:
                text = bytes(prefix).decode() if isinstance(prefix, (bytes, bytearray)) else str(prefix)
                if reply.startswith(text.rstrip(".") + "."):
                    return True
        return False

    async def _reply(self, msg, message) -> None:
        if msg.reply:
            try:
                await msg.respond(pack(message))
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

    def _refused(self, msg, code: ErrorCode, reason: str):
        self.rejected_unread += 1
        self.coord.metrics.rejected(code)
        return self._reply(msg, JobRejected(code=code, reason=reason))

    # ------------------------------------------------------------ handlers
    async def on_submit(self, msg) -> None:
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
        try:
            request = unpack(msg.data, JobRequest)
        except ProtocolError as err:
            await self._refused(msg, err.code, err.message)
            return
        try:
            await self.coord.null_labels.check(request)
        except Rejected as err:
            await self._refused(msg, err.code, err.reason)
            return
        except Exception:  # a failed probe never costs the job: its rows meet the workers' own check
            log.exception("null-label probe failed")
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
        ok = await self.coord.cancel(job_id, client=client)  # another client's job: not acted on, "unknown"
        if ok:
            await self._reply(msg, CancelReply(job_id=job_id, cancelled=True))
        else:  # answer "unknown" a little later, so the coordinator that owns the job (if any) answers first
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
                if ev is not None:
                    self.republished += 1
                    await coord.send_event(client, ev)
            await self._reply(msg, status)
        except Exception:
            log.exception("job status failed")

    async def on_status(self, msg) -> None:
        if not self._may_reply(msg):
            return
        try:
            await self._reply(msg, self.coord.status(include_spec=asks_for_spec(msg.data)))
        except Exception:
            log.exception("status failed")


def asks_for_spec(body: bytes) -> bool:
    """Whether a fleet status request asks for the fleet's model spec: a msgpack or JSON map with
    "spec": true. Anything else (an empty body, as v1 clients send) is a plain status request."""
    if not body or len(body) > 1024:
        return False
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
            return False
    return isinstance(data, dict) and data.get("spec") is True
