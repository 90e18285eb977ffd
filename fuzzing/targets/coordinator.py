"""Fuzz target `coordinator`: raw and mutated bytes on c.<client>.jobs.submit, c.<client>.jobs.<id>.cancel,
c.<client>.jobs.<id>.status (the fuzzer's own namespace, another one, and client tokens that are not
valid) and fleet.status."""

from __future__ import annotations

import asyncio
import logging
import random
import time

from ..fleet import Fleet, _drive, _local
from ..result import FuzzResult

log = logging.getLogger(__name__)


async def fuzz(fleet: Fleet, runs: int, seed: int, concurrency: int, timeout: float, bar) -> FuzzResult:
    import nats.errors

    from fuzzing.inputs import Mutator, job_request_variant, message_seeds
    from schemas import (
        CancelReply,
        CancelRequest,
        ErrorCode,
        ErrorReply,
        FleetStatus,
        JobAccepted,
        JobRejected,
        JobRequest,
        JobStatus,
        ProtocolError,
        SubmitReply,
        pack,
        subjects,
        unpack,
    )

    rng = random.Random(f"coordinator:{seed}")
    seeds = message_seeds()
    jobs = [s for s in seeds if s["kind"] in ("job_request", "cancel", "job_status")]
    mut = Mutator(rng, jobs * 4 + seeds)
    res = FuzzResult("coordinator", "random", runs)
    accepted: list[str] = []
    #: (client, job id) pairs a cancel was sent for: a coordinator refuses a later submit of one with `cancelled`
    #: (a cancel that overtook its submit, remembered; coordinator/intake.py), the one refusal of a valid job
    #: that depends on what came before it
    cancels: set[tuple[str, str]] = set()
    nc = fleet.nc
    allowed_for_valid = {ErrorCode.TOO_LARGE, ErrorCode.BAD_REQUEST, ErrorCode.OVERLOADED, ErrorCode.UNAVAILABLE}

    def job_token() -> str:
        p = rng.random()
        if p < 0.3 and accepted:
            return rng.choice(accepted)
        if p < 0.9:
            return rng.choice(["j1", "fuzz-job", "web0011223344556677", "x", "A_-9" * 16])
        return rng.choice(["x" * 65, "bad%token", "é", "a" * 200, "j1\u2028"])  # not a job id: a bad_request error

    def client_token() -> str:
        """Mostly the fuzzer's own namespace; sometimes another client's (the job is not theirs:
        "unknown"), rarely a token that is no client name (a bad_request error)."""
        p = rng.random()
        return "fuzz" if p < 0.7 else "other" if p < 0.95 else rng.choice(["c" * 65, "bad%client", "é"])

    def make(_i: int) -> tuple[str, str, bytes]:
        p = rng.random()
        if p < 0.6:
            return (
                "submit",
                subjects.jobs_submit(rng.choice(["fuzz", "fuzz", "other"])),
                job_request_variant(rng) if rng.random() < 0.25 else mut.message_bytes(),
            )
        token, client = job_token(), client_token()
        body = b"" if rng.random() < 0.15 else mut.message_bytes()
        if p < 0.78:
            cancels.add((client, token))
            return "cancel", f"{subjects.CLIENTS_PREFIX}.{client}.jobs.{token}.cancel", body
        if p < 0.93:
            return "job_status", f"{subjects.CLIENTS_PREFIX}.{client}.jobs.{token}.status", body
        return "fleet_status", subjects.FLEET_STATUS, body

    async def probe(item: tuple[str, str, bytes]) -> None:
        what, subject, data = item
        res.tried += 1
        try:
            msg = await nc.request(subject, data, timeout=timeout)
        except nats.errors.MaxPayloadError:
            return (
                res.count("clear", "nats_max_payload")
                if len(data) > nc.max_payload
                else res.crash(data, "MaxPayloadError under the server's max_payload")
            )
        except nats.errors.NoRespondersError:
            return res.crash(data, f"no responders on {subject}: the coordinator is gone")
        except nats.errors.TimeoutError:
            return res.crash(data, f"no reply on {subject} in {timeout} s")
        if what in ("cancel", "job_status") and subjects.parse_job_subject(subject) is None:
            try:  # not a job id: the documented answer is an error reply with bad_request
                err = unpack(msg.data, ErrorReply)
            except ProtocolError as e:
                return res.crash(
                    data,
                    f"{what} on {subject!r} (not a job id) answered with something other than "
                    f"an error reply: {e.code.value}: {e.message}",
                )
            if err.code is not ErrorCode.BAD_REQUEST or not ("job id" in err.message or "client name" in err.message):
                return res.crash(data, f"{what} on {subject!r} (not a job id) answered {err.code.value}: {err.message}")
            return res.count("clear", "not_a_job_id")
        try:
            if what == "submit":
                reply = unpack(msg.data, SubmitReply)
            elif what == "cancel":
                reply = unpack(msg.data, CancelReply)
            elif what == "job_status":
                reply = unpack(msg.data, JobStatus)
            else:
                reply = unpack(msg.data, FleetStatus)
        except ProtocolError as err:
            return res.crash(data, f"undecodable {what} reply: {err.code.value}: {err.message}")
        if what != "submit":
            if what == "job_status" and reply.job_id != subjects.parse_job_subject(subject).job_id:
                return res.crash(data, f"status request on {subject!r} answered for job {reply.job_id!r}")
            if what == "cancel" and not reply.cancelled:
                return res.count("clear", "cancel_refused")
            return res.count("ok", "cancelled" if what == "cancel" else what)
        local, local_code = _local(data, JobRequest)
        client = subjects.parse_submit_subject(subject)
        if isinstance(reply, JobAccepted):
            if local is None:
                return res.crash(data, f"coordinator accepted a job the schema refuses ({local_code.value})")
            accepted.append(reply.job_id)
            cancels.add((client, reply.job_id))
            try:  # do not let accepted fuzz jobs pile up
                await nc.publish(
                    subjects.job_cancel(client, reply.job_id),
                    pack(CancelRequest(job_id=reply.job_id)),
                )
            except Exception as err:
                log.warning("cancel publish failed: %s", err)
            return res.count("ok", "accepted")
        assert isinstance(reply, (JobRejected, ErrorReply))
        if reply.code is ErrorCode.INTERNAL:
            return res.crash(data, f"internal error: {getattr(reply, 'reason', None) or reply.message}")
        if local_code is not None and reply.code is not local_code:
            return res.crash(data, f"rejected with {reply.code.value} where the schema says {local_code.value}")
        if local_code is None and reply.code is ErrorCode.CANCELLED and local.job_id is not None:
            if (client, local.job_id) in cancels:
                return res.count("clear", "cancelled_before")
        if local_code is None and reply.code not in allowed_for_valid:
            return res.crash(data, f"valid job rejected with {reply.code.value}")
        return res.count("clear", reply.code.value)

    await _drive(runs, concurrency, make, probe, bar, res)

    # after the run: the engine is alive and a real job completes
    try:
        if fleet.coordinator._task is None or fleet.coordinator._task.done():
            raise AssertionError("the engine task has ended")
        done = await _real_job(nc, "fuzz-check-" + str(seed), timeout=60)
        msg = await nc.request(subjects.FLEET_STATUS, b"", timeout=timeout)
        unpack(msg.data, FleetStatus)
        res.check = f"a real job completes ({done}); fleet status answers"
    except Exception as err:
        res.check = f"FAILED: {type(err).__name__}: {err}"
        res.crash(b"", f"after the run the coordinator does not serve: {type(err).__name__}: {err}")
    return res


async def _real_job(nc, job_id: str, timeout: float) -> str:
    from schemas import DoneEvent, FailedEvent, JobAccepted, JobEvent, JobRequest, SubmitReply, pack, subjects, unpack

    events: asyncio.Queue = asyncio.Queue()
    sub = await nc.subscribe(subjects.job_events("fuzz", job_id), cb=events.put)
    try:
        msg = await nc.request(
            subjects.jobs_submit("fuzz"), pack(JobRequest(job_id=job_id, digits=[1, 6], steps=3)), timeout=10
        )
        reply = unpack(msg.data, SubmitReply)
        if not isinstance(reply, JobAccepted):
            raise AssertionError(f"the job was not accepted: {reply!r:.300}")
        deadline = time.monotonic() + timeout
        while True:
            ev = unpack((await asyncio.wait_for(events.get(), max(0.1, deadline - time.monotonic()))).data, JobEvent)
            if isinstance(ev, DoneEvent):
                if ev.images.shape != (2, 1, 32, 32):
                    raise AssertionError(f"done with images {list(ev.images.shape)}")
                return f"2 images in {ev.elapsed_s:.2f} s"
            if isinstance(ev, FailedEvent):
                raise AssertionError(f"the job failed: {ev.code.value}: {ev.reason}")
    finally:
        await sub.unsubscribe()
