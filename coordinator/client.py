"""Client side of a generation job over NATS (used by `ddm-fleet generate`, the web page, benches).

    done = await run_job(nc, JobRequest(digits=[3, 7, 7], steps=40), on_event=print)
    done.images   # [N, 1, 32, 32] float32 in [-1, 1]

`run_job` picks a job id if the request has none, subscribes to the job's events subject
BEFORE submitting (so no frame is missed), submits, and returns the DoneEvent; it raises
`JobFailed` (with the ErrorCode) on rejection, failure, cancellation or timeout, and cancels
the job on the coordinator if the caller is cancelled.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import secrets
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
        raise JobFailed(ErrorCode.UNAVAILABLE, f"the coordinator did not answer the submit within {timeout:g} s",
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


async def run_job(nc, request: JobRequest, on_event: Callable[[Any], Any] | None = None, *,
                  timeout: float | None = None, idle_timeout: float = 120.0,
                  submit_timeout: float = 10.0) -> DoneEvent:
    """Submit `request` and wait for its DoneEvent.

    on_event(event) (sync or async) sees JobAccepted, every FrameEvent, then the DoneEvent.
    timeout: whole-job limit in seconds (None = none); idle_timeout: longest gap between frames once
    the job streams (a queued job sends nothing until it starts, so that wait is bounded by timeout).
    """
    import nats.errors

    if request.job_id is None:
        request = request.model_copy(update={"job_id": new_job_id()})
    job_id = request.job_id
    sub = await nc.subscribe(subjects.job_events(job_id))
    submitted = False
    finished = False  # the coordinator told us the end (done or failed)

    async def deliver(ev) -> None:
        if on_event is not None:
            out = on_event(ev)
            if inspect.isawaitable(out):
                await out

    async def wait_events() -> DoneEvent:
        nonlocal finished
        accepted_seen = False
        streaming = False
        while True:
            try:
                msg = await sub.next_msg(timeout=idle_timeout if streaming else None)
            except nats.errors.TimeoutError:
                raise JobFailed(ErrorCode.DEADLINE_EXCEEDED, f"no frame for {idle_timeout:g} s: is the coordinator "
                                "still running?", job_id) from None
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
        await submit_job(nc, request, timeout=submit_timeout)
        submitted = True
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
                await asyncio.shield(cancel_job(nc, job_id))
            except BaseException:
                pass


async def fleet_status(nc, *, timeout: float = 2.0) -> FleetStatus:
    """The coordinator's status snapshot. Raises JobFailed(unavailable) if none answers."""
    import nats.errors

    try:
        msg = await nc.request(subjects.FLEET_STATUS, b"", timeout=timeout)
    except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
        raise JobFailed(ErrorCode.UNAVAILABLE, "no coordinator answers on " + subjects.FLEET_STATUS) from None
    return unpack(msg.data, FleetStatus)
