"""Client side of a generation job over NATS (used by `ddm-fleet generate`, the web page, benches).

    done = await run_job(nc, JobRequest(digits=[3, 7, 7], steps=40), on_event=print)
    done.images   # [N, 1, 32, 32] float32 in [-1, 1]

`run_job` picks a job id if the request has none, subscribes to the job's events subject
BEFORE submitting (so no frame is missed), submits, and returns the DoneEvent; it raises
`JobFailed` (with the ErrorCode) on rejection, failure, cancellation or timeout, and cancels
the job on the coordinator if the caller is cancelled.

No job is waited on forever: when no event has come for `probe_every` seconds, run_job asks the
coordinator about the job (`ddm.v1.jobs.<id>.status`, see `JobProbe`). queued / running: keep
waiting. done / failed: the coordinator publishes the result again (it was lost, e.g. across a
NATS reconnect). unknown (a restarted coordinator) or no coordinator at all for `lost_after`
seconds: `JobFailed(unavailable, "coordinator lost the job ...")`. A coordinator that is connected
but answers nothing (frozen: SIGSTOP, a hung host) for `unresponsive_after` seconds, neither an
event nor a status request: `JobFailed(unavailable, "the coordinator has not answered for N s")`.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import secrets
import time
from typing import Any, Callable

from schemas import (
    CancelReply,
    CancelRequest,
    DoneEvent,
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

log = logging.getLogger(__name__)


class JobFailed(Exception):
    """The job did not produce images. `code` is an ErrorCode, `reason` a sentence."""

    def __init__(self, code: ErrorCode | str, reason: str, job_id: str | None = None):
        super().__init__(f"{ErrorCode(code).value}: {reason}")
        self.code = ErrorCode(code)
        self.reason = reason
        self.job_id = job_id


class _NoSubmitReply(JobFailed):
    """The submit got no reply in time: the coordinator may have taken the job all the same."""


def new_job_id() -> str:
    return "j" + secrets.token_hex(8)


async def submit_job(nc, request: JobRequest, *, timeout: float = 10.0) -> JobAccepted:
    """Submit only (caller subscribes to events itself, first). Raises JobFailed if refused."""
    import nats.errors

    try:
        msg = await nc.request(subjects.JOBS_SUBMIT, pack(request), timeout=timeout)
    except nats.errors.NoRespondersError:
        raise JobFailed(ErrorCode.UNAVAILABLE, f"no coordinator is running: nothing answers on {subjects.JOBS_SUBMIT}",
                        request.job_id) from None
    except nats.errors.TimeoutError:
        raise _NoSubmitReply(ErrorCode.UNAVAILABLE, f"the coordinator did not answer the submit within {timeout:g} s",
                             request.job_id) from None
    reply = unpack(msg.data, SubmitReply)
    if isinstance(reply, JobRejected):
        raise JobFailed(reply.code, reply.reason, request.job_id)
    if isinstance(reply, ErrorReply):
        raise JobFailed(reply.code, reply.message, request.job_id)
    return reply


async def cancel_job(nc, job_id: str, *, timeout: float = 5.0) -> bool:
    """Ask the coordinator to cancel; True if it did."""
    import nats.errors

    try:
        msg = await nc.request(subjects.job_cancel(job_id), pack(CancelRequest(job_id=job_id)), timeout=timeout)
    except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
        return False
    try:
        return unpack(msg.data, CancelReply).cancelled
    except ProtocolError:
        return False


async def job_status(nc, job_id: str, *, timeout: float = 2.0) -> JobStatus:
    """What the coordinators know of a job (JobStatus; state "unknown" if none has it).
    Raises nats.errors.NoRespondersError when no coordinator serves job status, and
    nats.errors.TimeoutError when none answered in time."""
    msg = await nc.request(subjects.job_status(job_id), b"", timeout=timeout)
    return unpack(msg.data, JobStatus)


class JobProbe:
    """Decides, from status requests, whether the fleet has lost a job its client waits for.

        probe = JobProbe(nc, job_id, lost_after=15)
        reason = await probe.check()     # None: keep waiting; a sentence: the job is lost

    * a coordinator knows the job (queued, running; done / failed: it publishes the result
      again): keep waiting;
    * a coordinator answers "unknown": it lost the job (it was restarted since the submit);
    * nobody serves job status and nobody serves `ddm.v1.fleet.status` either (no coordinator is
      connected) for `lost_after` seconds in a row: the coordinator is gone;
    * one time-out proves nothing (a busy coordinator, or a client not allowed to publish the status
      subject): keep waiting; but with `unresponsive_after` set, when nothing has answered for that
      many seconds (no status reply, no fleet status reply, no event the caller reported with
      `heard()`), the coordinator is frozen. Stretches with no coordinator connected at all are
      `lost_after`'s to judge and do not count. `unresponsive` is True once that was the verdict.
    """

    def __init__(self, nc, job_id: str, *, lost_after: float = 15.0, timeout: float = 2.0,
                 unresponsive_after: float | None = None):
        if unresponsive_after is not None and not unresponsive_after > 0:
            raise ValueError(f"unresponsive_after must be > 0 seconds or None, got {unresponsive_after}")
        self.nc, self.job_id = nc, job_id
        self.lost_after, self.timeout = lost_after, timeout
        self.unresponsive_after = unresponsive_after
        self.last: JobStatus | None = None  # the last answer
        self.unresponsive = False
        self._nobody_since: float | None = None
        self._last_answer = time.monotonic()

    def heard(self) -> None:
        """The coordinator showed a sign of life outside check() (the submit reply, an event)."""
        self._last_answer = time.monotonic()

    def _silent(self) -> str | None:
        """The verdict when a probe got no answer: None, or why the coordinator counts as frozen."""
        if self.unresponsive_after is None or time.monotonic() - self._last_answer < self.unresponsive_after:
            return None
        self.unresponsive = True
        why = "" if self.nc.is_connected else "; this client is not connected to NATS either"
        return (f"the coordinator has not answered for {self.unresponsive_after:g} s: no event of job {self.job_id} "
                f"and no reply to its status requests (frozen or hung?{why})")

    async def check(self) -> str | None:
        import nats.errors

        try:
            st = await job_status(self.nc, self.job_id, timeout=self.timeout)
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
                return (f"coordinator lost the job: no coordinator has been connected for {self.lost_after:g} s "
                        "(crashed or stopped?)")
            return None
        except (nats.errors.TimeoutError, asyncio.TimeoutError):
            log.info("job %s: status request unanswered within %g s", self.job_id, self.timeout)
            return self._silent()
        except ProtocolError as err:
            self._last_answer = time.monotonic()  # something answered
            log.warning("job %s: undecodable status reply (%s)", self.job_id, err)
            return None
        except (nats.errors.ConnectionClosedError, nats.errors.ConnectionDrainingError):
            raise
        except nats.errors.Error as err:  # e.g. reconnecting with a full buffer: try again later
            log.info("job %s: status request failed: %r", self.job_id, err)
            return self._silent()
        self._nobody_since = None
        self._last_answer = time.monotonic()
        self.last = st
        if st.state == "unknown":
            who = f"coordinator {st.coordinator!r}" if st.coordinator else "the coordinator"
            return f"coordinator lost the job (restarted?): {who} does not know job {self.job_id}"
        return None

    async def _fleet_status(self) -> bool | None:
        """True: a coordinator answered `ddm.v1.fleet.status`; False: no responders (none is
        connected); None: it could not be told (time-out, connection trouble)."""
        import nats.errors

        try:
            await self.nc.request(subjects.FLEET_STATUS, b"", timeout=self.timeout)
        except nats.errors.NoRespondersError:
            return False
        except Exception:
            return None
        return True


async def run_job(nc, request: JobRequest, on_event: Callable[[Any], Any] | None = None, *,
                  timeout: float | None = None, idle_timeout: float = 120.0,
                  submit_timeout: float = 10.0, probe_every: float | None = 3.0,
                  lost_after: float = 15.0, unresponsive_after: float | None = 60.0) -> DoneEvent:
    """Submit `request` and wait for its DoneEvent.

    on_event(event) (sync or async) sees JobAccepted, every FrameEvent, then the DoneEvent.
    timeout: whole-job limit in seconds (None = none); idle_timeout: longest gap between frames once
    the job streams. probe_every: after this many seconds without an event, ask the coordinator
    about the job (again every probe_every s; None: never). It raises JobFailed(unavailable) as soon
    as a coordinator says it does not know the job (it was restarted), or when no coordinator has
    been connected for `lost_after` seconds; a queued or running job keeps waiting (see JobProbe).
    unresponsive_after (with probing on; None: never): when neither an event nor any status request
    has been answered for this many seconds, the coordinator is taken for frozen and run_job raises
    JobFailed(unavailable, "the coordinator has not answered for N s"); the cancel it then sends is
    published without waiting for a reply. Keep it above the longest tick the coordinator can take
    under its limits (step_timeout x (retries + 1) per round of expert calls: 10 s x 3 by default),
    although a live coordinator answers status requests while a tick waits on its experts. A client
    whose account may not publish the status subject gets no answers either: a job of its that stays
    silent that long fails the same way.
    """
    import nats.errors

    if probe_every is not None and probe_every <= 0:
        raise ValueError(f"probe_every must be > 0 seconds or None, got {probe_every}")
    if unresponsive_after is not None and not unresponsive_after > 0:
        raise ValueError(f"unresponsive_after must be > 0 seconds or None, got {unresponsive_after}")
    if request.job_id is None:
        request = request.model_copy(update={"job_id": new_job_id()})
    job_id = request.job_id
    sub = await nc.subscribe(subjects.job_events(job_id))
    submitted = False
    finished = False  # the coordinator told us the end (done or failed)
    probe = JobProbe(nc, job_id, lost_after=lost_after, timeout=max(1.0, min(probe_every or 2.0, 5.0)),
                     unresponsive_after=unresponsive_after)

    async def deliver(ev) -> None:
        if on_event is not None:
            out = on_event(ev)
            if inspect.isawaitable(out):
                await out

    async def wait_events() -> DoneEvent:
        nonlocal finished
        accepted_seen = False
        streaming = False
        last_event = time.monotonic()
        while True:
            waits = [w for w in (probe_every, idle_timeout - (time.monotonic() - last_event) if streaming else None)
                     if w is not None]
            try:
                msg = await sub.next_msg(timeout=max(min(waits), 0.01) if waits else None)
            except nats.errors.TimeoutError:
                if streaming and time.monotonic() - last_event >= idle_timeout:
                    raise JobFailed(ErrorCode.DEADLINE_EXCEEDED, f"no frame for {idle_timeout:g} s: is the "
                                    "coordinator still running?", job_id) from None
                if probe_every is not None and (lost := await probe.check()) is not None:
                    if sub.pending_msgs:  # events came while we asked (e.g. the result, published before an
                        continue  # "unknown" from a coordinator that already forgot the job): read them first
                    raise JobFailed(ErrorCode.UNAVAILABLE, lost, job_id) from None
                continue
            last_event = time.monotonic()
            probe.heard()
            try:
                ev = unpack(msg.data, JobEvent)
            except ProtocolError as err:
                log.warning("job %s: skipping undecodable event (%s)", job_id, err)
                continue
            if isinstance(ev, FrameEvent):
                streaming = True
            if isinstance(ev, JobAccepted):
                if accepted_seen:
                    continue
                accepted_seen = True
            if isinstance(ev, FailedEvent):
                finished = True
                raise JobFailed(ev.code, ev.reason, job_id)
            if isinstance(ev, DoneEvent):
                finished = True
            await deliver(ev)
            if isinstance(ev, DoneEvent):
                return ev

    try:
        await nc.flush()
        try:
            await submit_job(nc, request, timeout=submit_timeout)
        except _NoSubmitReply:
            submitted = True  # the coordinator may have taken the job all the same: cancel it below
            raise
        submitted = True
        probe.heard()
        return await (asyncio.wait_for(wait_events(), timeout) if timeout else wait_events())
    except asyncio.TimeoutError:
        raise JobFailed(ErrorCode.DEADLINE_EXCEEDED, f"job did not finish within {timeout:g} s", job_id) from None
    finally:
        try:
            await sub.unsubscribe()
        except Exception:
            pass
        if submitted and not finished:  # caller cancelled us, or we timed out: free the rows
            try:
                if probe.unresponsive:  # it would not answer: leave the cancel for it to read if it wakes up
                    await asyncio.shield(_send_cancel(nc, job_id))
                else:
                    await asyncio.shield(cancel_job(nc, job_id))
            except BaseException:
                pass


async def _send_cancel(nc, job_id: str) -> None:
    """Publish a cancel without waiting for the reply (the server has it once flush returns)."""
    await nc.publish(subjects.job_cancel(job_id), pack(CancelRequest(job_id=job_id)))
    await nc.flush(timeout=2)


async def fleet_status(nc, *, timeout: float = 2.0) -> FleetStatus:
    """The coordinator's status snapshot. Raises JobFailed(unavailable) if none answers."""
    import nats.errors

    try:
        msg = await nc.request(subjects.FLEET_STATUS, b"", timeout=timeout)
    except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
        raise JobFailed(ErrorCode.UNAVAILABLE, "no coordinator answers on " + subjects.FLEET_STATUS) from None
    return unpack(msg.data, FleetStatus)
