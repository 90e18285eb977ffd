"""Client side of a generation job over NATS (used by `ddm-fleet generate`, the web page, benches).

    done = await run_job(nc, JobRequest(digits=[3, 7, 7], steps=40), on_event=print)
    done.images   # [N, 1, 32, 32] float32 in [-1, 1]

`run_job` picks a job id if the request has none, subscribes to the job's events subject
BEFORE submitting (so no frame is missed), submits, and returns the DoneEvent; it raises
`JobFailed` (with the ErrorCode) on rejection, failure, cancellation or timeout, and cancels
the job on the coordinator if the caller is cancelled.

Every job lives in its client's namespace (`ddm.v1.c.<client>.jobs.…`, see schemas.subjects):
`client=` names it; by default it is the NATS user of the connection (`nats://alice:pw@…` ->
"alice"), else "anon". On an authenticated bus connect with `client_connect_options(client)`
(the reply inbox `_INBOX_<client>` that user's permissions allow).

No job is waited on forever: when no event has come for `probe_every` seconds, run_job asks the
coordinator about the job (`ddm.v1.c.<client>.jobs.<id>.status`, see `JobProbe`). queued / running: keep
waiting. done / failed: the coordinator publishes the result again (it was lost, e.g. across a
NATS reconnect). unknown from the job's own coordinator (the name in its `accepted`: a restart of
it; other coordinators sharing the bus say unknown for every job not theirs, and are not believed)
or no coordinator at all for `lost_after` seconds: `JobFailed(unavailable, "coordinator lost the job
...")`. A coordinator that is connected but answers nothing (frozen: SIGSTOP, a hung host) for
`unresponsive_after` seconds, neither an event nor a status request:
`JobFailed(unavailable, "the coordinator has not answered for N s")`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import inspect
import logging
import math
import secrets
import time
from collections.abc import Callable
from typing import Any

from bus.inbox import private_inbox, private_request
from bus.ratelimited_log import RateLimitedLog
from client.done_parts import MAX_RESULT_ASKS, REPUBLISH_GAP_S, DoneParts
from client.epochs import EpochFilter, epoch_of
from schemas import (
    CancelReply,
    CancelRequest,
    DoneEvent,
    DonePartEvent,
    ErrorCode,
    ErrorReply,
    FailedEvent,
    FleetStatus,
    FrameEvent,
    JobAccepted,
    JobEvent,
    JobRejected,
    JobRequest,
    JobStatus,
    ProtocolError,
    SubmitReply,
    pack,
    subjects,
    unpack,
)
from schemas.errors import RETRY_AFTER_HEADER

log = logging.getLogger(__name__)
#: Status replies about another job than the one asked about (JobProbe): one line per 10 s at most.
_FORGED_LOG = RateLimitedLog(log)

#: The status header of the server's reply to a request nobody subscribes to.
_NO_RESPONDERS = "503"


class JobFailed(Exception):
    """The job did not produce images. `code` is an ErrorCode, `reason` a sentence; `retry_after_s`: for a
    submit refused `rate_limited`, the seconds the coordinator said to wait (its Ddm-Retry-After header)."""

    def __init__(
        self, code: ErrorCode | str, reason: str, job_id: str | None = None, retry_after_s: float | None = None
    ):
        super().__init__(f"{ErrorCode(code).value}: {reason}")
        self.code = ErrorCode(code)
        self.reason = reason
        self.job_id = job_id
        self.retry_after_s = retry_after_s


def retry_after(msg) -> float | None:
    """The seconds a `rate_limited` reply says to wait (its RETRY_AFTER_HEADER; docs/PROTOCOL.md section 8), or
    None when the reply has no such header or a value that is not a finite number >= 0."""
    value = (getattr(msg, "headers", None) or {}).get(RETRY_AFTER_HEADER)
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        return None
    return seconds if math.isfinite(seconds) and seconds >= 0 else None


class _NoSubmitReply(JobFailed):
    """The submit got no reply in time: the coordinator may have taken the job all the same."""


# ---------------------------------------------------------------- client names


def new_job_id() -> str:
    return "j" + secrets.token_hex(8)


def _checked_user(user: str, where: str) -> str:
    if not subjects.is_token(user):
        raise ValueError(
            f"the NATS user {user!r} of {where} cannot name a client: a client name is 1-64 characters "
            "of [A-Za-z0-9_-]; pass a client name explicitly"
        )
    return user


def client_from_url(urls: str | list[str] | None) -> str:
    """The client name for a connection to `urls` (one URL, a comma-separated list, or a list):
    the NATS user of the first URL that has one (`nats://alice:pw@host` -> "alice"), else
    `subjects.DEFAULT_CLIENT` ("anon"). Raises ValueError if that user is no valid client token."""
    from urllib.parse import unquote, urlsplit

    items = urls.split(",") if isinstance(urls, str) else list(urls or [])
    for url in (u.strip() for u in items):
        if not url:
            continue
        parts = urlsplit(url if "://" in url else "nats://" + url)
        if parts.username:
            return _checked_user(unquote(parts.username), "the URL")
    return subjects.DEFAULT_CLIENT


def client_of(nc) -> str:
    """The client name of an open nats-py connection: `<client>` of its inbox prefix
    `_INBOX_<client>` (see `client_connect_options`), else its `user` option, else the user of the
    URL it is connected to, else "anon"."""
    prefix = bytes(getattr(nc, "_inbox_prefix", b"") or b"").decode("ascii", "replace")
    if prefix.startswith(subjects.INBOX + "_") and subjects.is_token(prefix[len(subjects.INBOX) + 1 :]):
        return prefix[len(subjects.INBOX) + 1 :]
    user = (getattr(nc, "options", None) or {}).get("user")
    if user:
        return _checked_user(user, "the connection")
    url = getattr(nc, "connected_url", None)
    if url is not None and url.username:
        from urllib.parse import unquote

        return _checked_user(unquote(url.username), "the connection")
    return subjects.DEFAULT_CLIENT


def client_connect_options(client: str) -> dict[str, str]:
    """Keyword arguments for `nats.connect` for a connection acting as `client`: its reply inbox
    prefix `_INBOX_<client>` (the only inbox its permissions let it subscribe to)."""
    return {"inbox_prefix": subjects.inbox_prefix(client)}


def _client(nc, client: str | None) -> str:
    return subjects.check_client(client) if client is not None else client_of(nc)


# ---------------------------------------------------------------- one request each: submit, cancel, status


async def submit_job(nc, request: JobRequest, *, timeout: float = 10.0, client: str | None = None) -> JobAccepted:
    """Submit only, as `client` (default `client_of(nc)`; the caller subscribes to the job's events
    itself, first). Raises JobFailed if refused. A submit refused for this client's rate (`rate_limited`:
    the coordinator read nothing of it) is sent again after the wait the reply names, while `timeout` lasts."""
    import nats.errors

    subject = subjects.jobs_submit(_client(nc, client))
    data = pack(request)
    deadline = time.monotonic() + timeout
    while True:
        left = max(deadline - time.monotonic(), 0.001)
        try:
            msg = await private_request(nc, subject, data, timeout=left)
        except nats.errors.NoRespondersError:
            raise JobFailed(
                ErrorCode.UNAVAILABLE, f"no coordinator is running: nothing answers on {subject}", request.job_id
            ) from None
        except nats.errors.TimeoutError:
            raise _NoSubmitReply(
                ErrorCode.UNAVAILABLE, f"the coordinator did not answer the submit within {timeout:g} s", request.job_id
            ) from None
        reply = unpack(msg.data, SubmitReply, ignore_unknown=True)
        if isinstance(reply, JobAccepted):
            return reply
        code, reason = (reply.code, reply.reason) if isinstance(reply, JobRejected) else (reply.code, reply.message)
        wait = retry_after(msg) if code == ErrorCode.RATE_LIMITED else None
        if wait is None or time.monotonic() + wait >= deadline:
            raise JobFailed(code, reason, request.job_id, retry_after_s=wait)
        log.info("submit of job %s refused for the rate; sending it again in %.2f s", request.job_id, wait)
        await asyncio.sleep(wait)


async def cancel_job(nc, job_id: str, *, timeout: float = 5.0, client: str | None = None) -> bool:
    """Ask the coordinator to cancel `client`'s job (default `client_of(nc)`); True if it did
    (False for a job of another client: it is not ours to cancel)."""
    import nats.errors

    subject = subjects.job_cancel(_client(nc, client), job_id)
    try:
        msg = await private_request(nc, subject, pack(CancelRequest(job_id=job_id)), timeout=timeout)
    except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
        return False
    try:
        return unpack(msg.data, CancelReply, ignore_unknown=True).cancelled
    except ProtocolError:
        return False


async def publish_cancel(nc, job_id: str, client: str) -> None:
    """Publish `client`'s cancel of `job_id` without waiting for a reply (for a coordinator that may not
    answer, or a caller that does not wait)."""
    await nc.publish(subjects.job_cancel(client, job_id), pack(CancelRequest(job_id=job_id)))


async def _send_cancel(nc, job_id: str, client: str) -> None:
    """Publish a cancel and flush: the server has it once this returns."""
    await publish_cancel(nc, job_id, client)
    await nc.flush(timeout=2)


async def job_status(nc, job_id: str, *, timeout: float = 2.0, client: str | None = None) -> JobStatus:
    """What the coordinators know of `client`'s job (default `client_of(nc)`; JobStatus, state
    "unknown" if none has it, or if it is another client's).
    Raises nats.errors.NoRespondersError when no coordinator serves job status, and
    nats.errors.TimeoutError when none answered in time."""
    msg = await private_request(nc, subjects.job_status(_client(nc, client), job_id), b"", timeout=timeout)
    st = unpack(msg.data, JobStatus, ignore_unknown=True)
    if st.job_id != job_id:
        raise ProtocolError(ErrorCode.BAD_REPLY, f"the status reply names job {st.job_id!r}, not {job_id!r}")
    return st


async def unsubscribe_quietly(sub) -> None:
    """Unsubscribe `sub`; nothing when that fails (the connection closed already: so is the subscription)."""
    try:
        await sub.unsubscribe()
    except Exception:
        pass


# ---------------------------------------------------------------- is the job lost?


def probe_timeout(probe_every: float | None) -> float:
    """How long one status probe of a job asked about every `probe_every` s reads answers: that interval,
    but at least 1 s (coordinators that do not hold the job say "unknown" after half a second; its owner's
    answer may come later) and at most 5 s (JobProbe's `timeout`, for run_job and the web session alike)."""
    return max(1.0, min(2.0 if probe_every is None else probe_every, 5.0))


class JobProbe:
    """Decides, from status requests, whether the fleet has lost a job its client waits for.

        probe = JobProbe(nc, job_id, lost_after=15, accepted=accepted)
        reason = await probe.check()     # None: keep waiting; a sentence: the job is lost

    Every coordinator on the bus answers a status request (one that does not hold the job says
    "unknown" after half a second); check() reads the answers for up to `timeout` seconds and
    weighs the job's own coordinator's: the one named in its `accepted` (`accepted=`, or
    `accepted_by()`; else the first coordinator that reported the job alive).
    * a coordinator knows the job (queued, running; done / failed: it publishes the result
      again): keep waiting;
    * the job's own coordinator (by name: itself, or its restart) answers "unknown": it lost the
      job (it was restarted since the submit). "unknown" from a coordinator of another name says
      nothing about this job and is no sign of life of its owner either: a lagging owner is waited
      for (`unresponsive_after` judges one that never answers). Without a known owner (a
      coordinator that does not name itself), the first answer counts, "unknown" included;
    * nobody serves job status and nobody serves `ddm.v1.fleet.status` either (no coordinator is
      connected) for `lost_after` seconds in a row: the coordinator is gone;
    * one time-out proves nothing (a busy coordinator, or a client not allowed to publish the status
      subject): keep waiting; but with `unresponsive_after` set, when nothing has answered for that
      many seconds (no status reply, no fleet status reply, no event the caller reported with
      `heard()`), the coordinator is frozen. Stretches with no coordinator connected at all are
      `lost_after`'s to judge and do not count. `unresponsive` is True once that was the verdict.
    """

    def __init__(
        self,
        nc,
        job_id: str,
        *,
        lost_after: float = 15.0,
        timeout: float = 2.0,
        unresponsive_after: float | None = None,
        client: str | None = None,
        accepted: JobAccepted | None = None,
        epochs: EpochFilter | None = None,
    ):
        if unresponsive_after is not None and not unresponsive_after > 0:
            raise ValueError(f"unresponsive_after must be > 0 seconds or None, got {unresponsive_after}")
        self.nc, self.job_id = nc, job_id
        self.client = _client(nc, client)
        self.lost_after, self.timeout = lost_after, timeout
        self.unresponsive_after = unresponsive_after
        self.last: JobStatus | None = None  # the last answer
        self.unresponsive = False
        self._nobody_since: float | None = None
        self._last_answer = time.monotonic()
        self.owner: str | None = None  # name of the coordinator that holds the job, once known
        self.owner_instance: str | None = None  # its run that accepted the job, if it said
        self.ignored = 0  # "unknown" answers of other coordinators, not counted
        self.forged = 0  # answers about another job than this one: dropped, never acted on
        # the job's owner epochs (shared with its event follower): an answer of a lower epoch than the
        # events seen comes from a coordinator that lost the job, and is not acted on
        self.epochs = epochs
        if accepted is not None:
            self.accepted_by(accepted)

    def accepted_by(self, accepted: JobAccepted) -> None:
        """Note the coordinator that took the job (the submit reply, or the `accepted` event)."""
        if accepted.coordinator and self.owner is None:
            self.owner, self.owner_instance = accepted.coordinator, accepted.instance or None

    def heard(self) -> None:
        """The coordinator showed a sign of life outside check() (the submit reply, an event)."""
        self._last_answer = time.monotonic()

    def _silent(self) -> str | None:
        """The verdict when a probe got no answer: None, or why the coordinator counts as frozen."""
        if self.unresponsive_after is None or time.monotonic() - self._last_answer < self.unresponsive_after:
            return None
        self.unresponsive = True
        why = "" if self.nc.is_connected else "; this client is not connected to NATS either"
        return (
            f"the coordinator has not answered for {self.unresponsive_after:g} s: no event of job {self.job_id} "
            f"and no reply to its status requests (frozen or hung?{why})"
        )

    async def check(self) -> str | None:
        import nats.errors

        try:
            st = await self._ask()
        except nats.errors.NoRespondersError:
            fleet = await self._fleet_status()
            if fleet is None:  # fleet status timed out too (or the request failed)
                self._nobody_since = None
                return self._silent()
            now = time.monotonic()
            self._last_answer = now  # an answer, or nobody there to answer (lost_after's case)
            if fleet:
                self._nobody_since = None  # a coordinator is there but serves no job status (older build)
                return None
            if self._nobody_since is None:
                self._nobody_since = now
            if now - self._nobody_since >= self.lost_after:
                return (
                    f"coordinator lost the job: no coordinator has been connected for {self.lost_after:g} s "
                    "(crashed or stopped?)"
                )
            return None
        except (TimeoutError, nats.errors.TimeoutError):
            log.info("job %s: status request unanswered within %g s", self.job_id, self.timeout)
            return self._silent()
        except ProtocolError as err:
            self._last_answer = time.monotonic()  # something answered
            if err.code == ErrorCode.RATE_LIMITED:  # asked too often (this client's probes together): ask later
                log.info("job %s: status request refused: %s", self.job_id, err.message)
            else:
                log.warning("job %s: undecodable status reply (%s)", self.job_id, err)
            return None
        except (nats.errors.ConnectionClosedError, nats.errors.ConnectionDrainingError):
            raise
        except nats.errors.Error as err:  # e.g. reconnecting with a full buffer: try again later
            log.info("job %s: status request failed: %r", self.job_id, err)
            return self._silent()
        self._nobody_since = None
        if st is None:  # only other coordinators answered ("unknown"): the job's own one said nothing
            log.info(
                "job %s: no answer from its coordinator %r within %g s (other coordinators do not know the job)",
                self.job_id,
                self.owner,
                self.timeout,
            )
            return self._silent()
        self._last_answer = time.monotonic()
        self.last = st
        if st.state == "unknown":
            who = f"coordinator {st.coordinator!r}" if st.coordinator else "the coordinator"
            if self.owner_instance and st.instance and st.instance != self.owner_instance:
                who += f" (run {st.instance}, not {self.owner_instance} that accepted it)"
            return f"coordinator lost the job (restarted?): {who} does not know job {self.job_id}"
        if self.owner is None and st.coordinator:
            self.owner, self.owner_instance = st.coordinator, st.instance or None
        return None

    async def _ask(self) -> JobStatus | None:
        """Send one status request and read the answers for up to `timeout` s: the first one that
        counts (any state from the owner, or not "unknown" from anyone; without a known owner, the
        first), or None when only other coordinators' "unknown"s came. Raises NoRespondersError
        (nobody serves job status), TimeoutError (no answer at all), ProtocolError (only
        undecodable answers).

        The request goes out on a fresh `bus.inbox.private_inbox` (128 random bits), and an answer
        about another job than this one is dropped (counted in `forged`, logged at most every 10 s):
        whatever came there, it says nothing about this job and is never acted on."""
        import nats.errors

        inbox = private_inbox(self.nc)
        sub = await self.nc.subscribe(inbox)
        others = 0
        garbled: ProtocolError | None = None
        try:
            await self.nc.publish(subjects.job_status(self.client, self.job_id), b"", reply=inbox)
            deadline = time.monotonic() + self.timeout
            while (left := deadline - time.monotonic()) > 0:
                try:
                    msg = await sub.next_msg(timeout=left)
                except nats.errors.TimeoutError:
                    break
                if msg.headers and msg.headers.get("Status") == _NO_RESPONDERS:  # the server: nobody subscribes
                    raise nats.errors.NoRespondersError
                try:
                    st = unpack(msg.data, JobStatus, ignore_unknown=True)
                except ProtocolError as err:
                    garbled = _refusal(msg.data) or err
                    continue
                if st.job_id != self.job_id:
                    self.forged += 1
                    _FORGED_LOG.warning(
                        "job %s: dropped a status reply about job %r (not the job asked about; %d dropped so far)",
                        self.job_id,
                        st.job_id[:80],
                        self.forged,
                    )
                    continue
                if self.epochs is not None and not self.epochs.admit_status(st):
                    others += 1  # from an owner that lost the job since: it says nothing about it now
                    continue
                if st.state != "unknown" or self.owner is None or st.coordinator == self.owner:
                    return st
                others += 1
                self.ignored += 1
        finally:
            await unsubscribe_quietly(sub)
        if others:
            return None
        if garbled is not None:
            raise garbled
        raise nats.errors.TimeoutError

    async def _fleet_status(self) -> bool | None:
        """True: a coordinator answered `ddm.v1.fleet.status`; False: no responders (none is
        connected); None: it could not be told (time-out, connection trouble)."""
        import nats.errors

        try:
            await private_request(self.nc, subjects.FLEET_STATUS, b"", timeout=self.timeout)
        except nats.errors.NoRespondersError:
            return False
        except Exception:
            return None
        return True


def _refusal(data: bytes) -> ProtocolError | None:
    """The coordinator's `error` reply to a status request (e.g. `rate_limited`) as a ProtocolError
    with its code, or None if `data` is not one."""
    try:
        reply = unpack(data, ErrorReply, ignore_unknown=True)
    except ProtocolError:
        return None
    return ProtocolError(reply.code, reply.message)


# ---------------------------------------------------------------- run_job: submit and follow to the end


async def run_job(
    nc,
    request: JobRequest,
    on_event: Callable[[Any], Any] | None = None,
    *,
    timeout: float | None = None,
    idle_timeout: float = 120.0,
    submit_timeout: float = 10.0,
    probe_every: float | None = 3.0,
    lost_after: float = 15.0,
    unresponsive_after: float | None = 60.0,
    client: str | None = None,
    report_epoch: bool = True,
    on_stale: Callable[[Any], Any] | None = None,
    image_parts: bool = True,
) -> DoneEvent:
    """Submit `request` as `client` (default `client_of(nc)`: the NATS user, else "anon") and wait
    for its DoneEvent.

    on_event(event) (sync or async) sees JobAccepted, every FrameEvent, then the DoneEvent.
    timeout: whole-job limit in seconds (None = none); idle_timeout: longest gap between frames once
    the job streams. probe_every: after this many seconds without an event, ask the coordinator
    about the job (again every probe_every s; None: never). It raises JobFailed(unavailable) as soon
    as the job's own coordinator (by the name in `accepted`) says it does not know the job (it was
    restarted; another coordinator's "unknown" does not count), or when no coordinator has
    been connected for `lost_after` seconds; a queued or running job keeps waiting (see JobProbe).
    unresponsive_after (with probing on; None: never): when neither an event nor any status request
    has been answered for this many seconds, the coordinator is taken for frozen and run_job raises
    JobFailed(unavailable, "the coordinator has not answered for N s"); the cancel it then sends is
    published without waiting for a reply. Keep it above the longest tick the coordinator can take
    under its limits (step_timeout x (retries + 1) per round of expert calls: 10 s x 3 by default),
    although a live coordinator answers status requests while a tick waits on its experts. A client
    whose account may not publish the status subject gets no answers either: a job of its that stays
    silent that long fails the same way.
    report_epoch (default True): ask for the job's owner epoch on every event (`JobRequest.report_epoch`;
    a coordinator older than the field refuses the request: pass False for one) and drop the events of a
    lower epoch than the highest seen (client.epochs: frames or a `done` of a coordinator that lost the
    job to another, arriving late); on_stale(event) (sync or async) sees each event so dropped. An event
    whose epoch is more than client.epochs.MAX_EPOCH_JUMP above the highest (forged) is ignored too, not
    passed to on_stale.
    image_parts (default True): ask for a result too large for one message in parts (`JobRequest.image_parts`;
    a coordinator older than the field refuses the request: pass False for one, which then refuses such a
    job as too large) and put them back together (client.done_parts): the DoneEvent returned (and passed to
    on_event) carries all the images either way; the parts are not passed to on_event. Parts lost on the way
    are asked for again (a status request publishes the result again) up to client.done_parts.MAX_RESULT_ASKS
    times, then JobFailed(unavailable) names them: never a result with images left out.
    """
    if probe_every is not None and probe_every <= 0:
        raise ValueError(f"probe_every must be > 0 seconds or None, got {probe_every}")
    if unresponsive_after is not None and not unresponsive_after > 0:
        raise ValueError(f"unresponsive_after must be > 0 seconds or None, got {unresponsive_after}")
    request = _with_job_fields(request, report_epoch, image_parts)
    client = _client(nc, client)
    job = _JobRun(
        nc,
        request.job_id,
        client,
        probe_every=probe_every,
        idle_timeout=idle_timeout,
        lost_after=lost_after,
        unresponsive_after=unresponsive_after,
    )
    async with contextlib.AsyncExitStack() as cleanup:
        cleanup.push_async_callback(job.cancel_if_abandoned)  # runs last, after the unsubscribe
        # subscribed BEFORE the submit: no event of the job is missed
        sub = await job.events.subscribe(nc, subjects.job_events(client, request.job_id))
        cleanup.push_async_callback(unsubscribe_quietly, sub)
        try:
            await nc.flush()
            await job.submit(request, submit_timeout)
            following = job.follow(on_event, on_stale)
            return await (asyncio.wait_for(following, timeout) if timeout else following)
        except TimeoutError:
            raise JobFailed(
                ErrorCode.DEADLINE_EXCEEDED, f"job did not finish within {timeout:g} s", request.job_id
            ) from None


def _with_job_fields(request: JobRequest, report_epoch: bool, image_parts: bool = False) -> JobRequest:
    """`request` with a job id (a new one if it names none) and, with `report_epoch`, asking for epochs, with
    `image_parts`, for a result too large for one message in parts."""
    if request.job_id is None:
        request = request.model_copy(update={"job_id": new_job_id()})
    if report_epoch and not request.report_epoch:
        request = request.model_copy(update={"report_epoch": True})
    if image_parts and not request.image_parts:
        request = request.model_copy(update={"image_parts": True})
    return request


class _EventInbox:
    """One job's event messages, handed from the subscription's callback (`put`) to the task that follows
    the job (`next`). Waiting costs one future (and a timer when a limit applies) per wait, where
    `sub.next_msg(timeout)` made two tasks and a timer per event (about a fifth of a streaming client's
    CPU, `bench scale --coordinator-capacity`)."""

    def __init__(self) -> None:
        self.sub: Any = None  # the subscription that puts here (its own queue counts as pending)
        self._messages: collections.deque = collections.deque()
        self._waiter: asyncio.Future | None = None  # the wait in progress, if any

    async def subscribe(self, nc, subject: str):
        """Subscribe to `subject` into this inbox; returns the subscription."""
        self.sub = await nc.subscribe(subject, cb=self.put)
        return self.sub

    async def put(self, msg) -> None:
        self._messages.append(msg)
        if self._waiter is not None:
            _wake(self._waiter)

    async def next(self, timeout: float | None):
        """The next event message, or None after `timeout` seconds without one (None: no limit)."""
        if not self._messages:
            loop = asyncio.get_running_loop()
            self._waiter = fut = loop.create_future()
            timer = loop.call_later(timeout, _wake, fut) if timeout is not None else None
            try:
                await fut
            finally:
                self._waiter = None
                if timer is not None:
                    timer.cancel()
        return self._messages.popleft() if self._messages else None

    def pending(self) -> bool:
        """Whether messages came that were not read yet (here, or still in the subscription's queue)."""
        return bool(self._messages or self.sub.pending_msgs)

    def holds_accepted(self) -> bool:
        """Whether the job's `accepted` event is among the unread messages (undecodable ones skipped)."""
        for msg in list(self._messages):
            try:
                if isinstance(unpack(msg.data, JobEvent, ignore_unknown=True), JobAccepted):
                    return True
            except ProtocolError:
                continue
        return False


def _wake(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


class _JobRun:
    """One `run_job` call's job: submitted (`submit`), followed to its end (`follow`: owner-epoch
    filtering, the tolerant reader, the idle time-out and the status probe), and cancelled on the
    coordinator if given up before its end (`cancel_if_abandoned`), so it does not hold rows for nobody."""

    def __init__(
        self,
        nc,
        job_id: str,
        client: str,
        *,
        probe_every: float | None,
        idle_timeout: float,
        lost_after: float,
        unresponsive_after: float | None,
    ):
        self.nc, self.job_id, self.client = nc, job_id, client
        self.probe_every, self.idle_timeout = probe_every, idle_timeout
        self.events = _EventInbox()
        self.epochs = EpochFilter(job_id)  # shared with the probe: a stale owner's status is not believed
        self.parts = DoneParts(job_id)  # a result too large for one message, in parts
        self.probe = JobProbe(
            nc,
            job_id,
            lost_after=lost_after,
            timeout=probe_timeout(probe_every),
            unresponsive_after=unresponsive_after,
            client=client,
            epochs=self.epochs,
        )
        self.submitted = False  # a coordinator may hold the job: cancel it unless it finished
        self.finished = False  # the coordinator told us the end (done or failed)
        self._accepted_seen = False
        self._streaming = False  # a frame came: the idle time-out applies
        self._last_event = time.monotonic()

    async def submit(self, request: JobRequest, timeout: float) -> None:
        """Submit the job; raises JobFailed when refused, or unanswered with no `accepted` event come."""
        try:
            reply = await submit_job(self.nc, request, timeout=timeout, client=self.client)
        except _NoSubmitReply:
            self.submitted = True  # the coordinator may have taken the job all the same: cancel it at the end
            # A coordinator publishes `accepted` on the job's events before it answers the submit: when
            # the answer is lost (the coordinator stopped between the two), that event says it has the job.
            if not self.events.holds_accepted():
                raise
            log.info(
                "job %s: the submit was not answered, but the job's accepted event came: following it", self.job_id
            )
        else:
            self.probe.accepted_by(reply)
            self.epochs.owner_accepted(reply)
        self.submitted = True
        self.probe.heard()

    async def follow(self, on_event, on_stale) -> DoneEvent:
        """Read the job's events until its DoneEvent (returned) or FailedEvent (raised as JobFailed),
        passing each one delivered to on_event and each stale one to on_stale."""
        while True:
            msg = await self.events.next(self._wait_limit())
            if msg is None:
                await self._on_silence()
                continue
            ev = await self._admit(msg, on_stale)
            if isinstance(ev, DonePartEvent):
                self.parts.add(ev)
                continue
            if ev is None:
                continue
            if isinstance(ev, FailedEvent):
                self.finished = True
                raise JobFailed(ev.code, ev.reason, self.job_id)
            if isinstance(ev, DoneEvent):
                self.finished = True
                ev = await self._whole(ev)
                if ev is None:
                    continue
            await _call(on_event, ev)
            if isinstance(ev, DoneEvent):
                return ev

    async def _whole(self, done: DoneEvent) -> DoneEvent | None:
        """`done` with all its images (`client.done_parts`); None when parts of it are missing: the job's status
        is asked for (its coordinator then publishes the parts and the done again), at most MAX_RESULT_ASKS
        times, REPUBLISH_GAP_S apart, before JobFailed(unavailable) names the parts that never came."""
        try:
            whole = self.parts.whole(done)
        except ProtocolError as err:
            raise JobFailed(err.code, err.message, self.job_id) from None
        if whole is not None:
            return whole
        why = self.parts.incomplete(done)
        if self.parts.asks >= MAX_RESULT_ASKS:
            raise JobFailed(
                ErrorCode.UNAVAILABLE, f"{why}, still after asking for it again {self.parts.asks} times", self.job_id
            )
        log.info("job %s: %s; asking for it again", self.job_id, why)
        if self.parts.asks:
            await asyncio.sleep(REPUBLISH_GAP_S)
        self.parts.asks += 1
        lost = await self.probe.check()
        if lost is not None and not self.events.pending():
            raise JobFailed(ErrorCode.UNAVAILABLE, f"{why}, and asked for it again: {lost}", self.job_id)
        return None

    def _wait_limit(self) -> float | None:
        """How long to wait for the next event: until the next probe, or the idle time-out once streaming."""
        idle_left = self.idle_timeout - (time.monotonic() - self._last_event) if self._streaming else None
        waits = [w for w in (self.probe_every, idle_left) if w is not None]
        return max(min(waits), 0.01) if waits else None

    async def _on_silence(self) -> None:
        """No event came in time: raise JobFailed when the job went idle or its probe says it is lost."""
        if self._streaming and time.monotonic() - self._last_event >= self.idle_timeout:
            raise JobFailed(
                ErrorCode.DEADLINE_EXCEEDED,
                f"no frame for {self.idle_timeout:g} s: is the coordinator still running?",
                self.job_id,
            )
        if self.probe_every is None or (lost := await self.probe.check()) is None:
            return
        if self.events.pending():  # events came while we asked (e.g. the result, published before an
            await asyncio.sleep(0)  # "unknown" from a coordinator that already forgot the job): read them first
            return
        raise JobFailed(ErrorCode.UNAVAILABLE, lost, self.job_id)

    async def _admit(self, msg, on_stale) -> Any:
        """The event in `msg` to deliver, or None: undecodable (logged), of a stale owner (to on_stale) or of
        an implausible epoch (counted by the filter), or an `accepted` seen before. Any message is a sign of
        life of the coordinator."""
        self._last_event = time.monotonic()
        self.probe.heard()
        try:
            ev = unpack(msg.data, JobEvent, ignore_unknown=True)
        except ProtocolError as err:
            log.warning("job %s: skipping undecodable event (%s)", self.job_id, err)
            return None
        if not self.epochs.admit(ev):  # from a coordinator that lost the job to another: never delivered
            if epoch_of(ev) < self.epochs.highest:  # (not one of an implausible epoch: ignored, counted, logged)
                await _call(on_stale, ev)
            return None
        if isinstance(ev, FrameEvent):
            self._streaming = True
        if isinstance(ev, JobAccepted):
            if self._accepted_seen:
                return None
            self._accepted_seen = True
            self.probe.accepted_by(ev)
        return ev

    async def cancel_if_abandoned(self) -> None:
        """Submitted but not finished (the caller cancelled us, or we gave up): free the job's rows. A
        coordinator that would not answer gets the cancel published, to read if it wakes up."""
        if not self.submitted or self.finished:
            return
        try:
            if self.probe.unresponsive:
                await asyncio.shield(_send_cancel(self.nc, self.job_id, self.client))
            else:
                await asyncio.shield(cancel_job(self.nc, self.job_id, client=self.client))
        except BaseException:
            pass


async def _call(callback: Callable[[Any], Any] | None, ev: Any) -> None:
    """callback(ev), awaited when it is a coroutine function; nothing when there is no callback."""
    if callback is not None:
        out = callback(ev)
        if inspect.isawaitable(out):
            await out


# ---------------------------------------------------------------- the fleet


async def fleet_status(nc, *, timeout: float = 2.0, spec: bool = False, image_spec: bool = False) -> FleetStatus:
    """The coordinator's status snapshot; with `spec`, the fleet's model spec too (`status.spec`,
    None from a coordinator older than specs); with `image_spec` as well, the spec also names the images
    the fleet's jobs return (`spec.image_shape`, `spec.image_value_range`; None from a coordinator older
    than them, or a latent fleet whose decoder it has not found). Raises JobFailed(unavailable) if none answers."""
    import msgpack
    import nats.errors

    if spec and image_spec:
        body = msgpack.packb({"spec": True, "image_spec": True})
    else:
        body = b"\x81\xa4spec\xc3" if spec else b""  # msgpack {"spec": true}
    try:
        msg = await private_request(nc, subjects.FLEET_STATUS, body, timeout=timeout)
    except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
        raise JobFailed(ErrorCode.UNAVAILABLE, "no coordinator answers on " + subjects.FLEET_STATUS) from None
    return unpack(msg.data, FleetStatus, ignore_unknown=True)
