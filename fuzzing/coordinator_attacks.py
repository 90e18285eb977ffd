"""Abuse of the coordinator's NATS endpoints by a client that follows the protocol, run against a
private fleet: a nats-server on a free port, one `--backend sim` worker per expert (tiny
checkpoints; the model is a sleep of `batch_ms`), a Coordinator with the shipped defaults.

    async with ProbeFleet(workdir) as fleet:
        result = await ATTACKS["quota"](fleet)     # {"attack", "held", "figures", "what"}

Attacks (each says what it measured and whether the defence held):
  quota      one client submits long 256-image jobs, each under a fresh `session`, until refused;
             held when it got at most its client quota and another client's job still started at
             once and finished
  status     300 status requests for a finished 64-image job at once; held when its `done` was
             published again at most once per 2 s and the surplus was answered `rate_limited`
  cancel     a cancel while the job's submit awaits the null-label probe, and a cancel that overtakes
             a submit queued behind it; held when neither job ran
  discovery  $SRV discovery naming another client's job events subject as its reply; held when
             nothing reached that subject
"""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

NUM_EXPERTS = 2
C2E = [0] * 5 + [1] * 5


class ProbeFleet:
    """nats-server + one sim worker per expert + a Coordinator with the shipped defaults, in this process."""

    def __init__(self, workdir: str | Path | None = None, batch_ms: float = 60.0):
        self._tmp = None if workdir is not None else tempfile.TemporaryDirectory(prefix="ddm-probe-")
        self.workdir = Path(workdir if workdir is not None else self._tmp.name)
        self.batch_ms = batch_ms
        self.server = self.coordinator = self.nc = None
        self.workers: list = []

    @property
    def url(self) -> str:
        return self.server.url

    async def __aenter__(self) -> ProbeFleet:
        from bus.connect import connect
        from bus.nats_server import NatsServer
        from coordinator.local_fleet import LabelRouter
        from coordinator.service import Coordinator
        from models.tiny import make_tiny_experts
        from workers.service import ExpertWorker

        try:
            self.server = NatsServer()
            await asyncio.to_thread(self.server.start)
            paths = await asyncio.to_thread(make_tiny_experts, self.workdir, NUM_EXPERTS, prefix="probe-expert")
            for k, path in enumerate(paths):
                w = ExpertWorker(
                    k,
                    str(path),
                    "sim",
                    nats_url=self.url,
                    buckets=(1, 16, 256, 512),
                    backend_options={"batch_ms": self.batch_ms, "row_ms": 0.0},
                    worker_id=f"probe-e{k}",
                )
                await w.start()
                self.workers.append(w)
            self.coordinator = Coordinator(
                LabelRouter(C2E, NUM_EXPERTS),
                num_experts=NUM_EXPERTS,
                class_to_expert=C2E,
                nats_url=self.url,
                name="probe-coordinator",
            )
            await self.coordinator.__aenter__()
            self.nc = await connect(self.url, name="ddm-probe", reconnect=2, first_connect_attempts=3)
        except BaseException:
            await self.__aexit__(None, None, None)
            raise
        return self

    async def __aexit__(self, *exc) -> None:
        if self.nc is not None:
            await self.nc.close()
        if self.coordinator is not None:
            await self.coordinator.__aexit__(None, None, None)
        for w in self.workers:
            await w.stop()
        if self.server is not None:
            await asyncio.to_thread(self.server.stop)
        if self._tmp is not None:
            self._tmp.cleanup()

    async def request(self, subject: str, data: bytes, kind, timeout: float = 10.0):
        from schemas import unpack

        return unpack((await self.nc.request(subject, data, timeout=timeout)).data, kind)


def _result(attack: str, held: bool, what: str, **figures: Any) -> dict:
    return {"attack": attack, "held": bool(held), "what": what, "figures": figures}


async def quota(fleet: ProbeFleet) -> dict:
    from client.jobs import run_job
    from schemas import JobAccepted, JobRequest, SubmitReply, pack, subjects

    cfg = fleet.coordinator.scheduler_config
    accepted = refused = 0
    codes: set[str] = set()
    for i in range(cfg.max_queued_jobs + cfg.max_rows // 256 + 8):
        req = JobRequest(job_id=f"greedy-{i}", count=256, steps=1000, stream=False, seed=i, session=f"tab{i}")
        reply = await fleet.request(subjects.jobs_submit("greedy"), pack(req), SubmitReply)
        if isinstance(reply, JobAccepted):
            accepted += 1
        else:
            refused += 1
            codes.add(reply.code.value)
            if refused >= 3:
                break
        await asyncio.sleep(0.025)  # stay under the submit rate: this attack is about quotas
    usage = fleet.coordinator.engine.scheduler.client_usage("greedy")
    t0 = time.monotonic()
    try:
        done = await asyncio.wait_for(run_job(fleet.nc, JobRequest(digits=[3], steps=3, seed=1), client="light"), 60)
        light_s, served = time.monotonic() - t0, done.images.shape[0] == 1
    except Exception:
        light_s, served = None, False
    for i in range(accepted + refused):  # leave the fleet idle for the next attack
        await fleet.coordinator.cancel(f"greedy-{i}", client="greedy")
    held = served and usage["running_rows"] < cfg.max_rows and usage["queued_jobs"] < cfg.max_queued_jobs
    return _result(
        "quota",
        held,
        "a client naming a new session per job takes at most its quota; another client is served",
        greedy_accepted=accepted,
        greedy_refused_codes=sorted(codes),
        greedy_running_rows=usage["running_rows"],
        greedy_queued_jobs=usage["queued_jobs"],
        max_rows=cfg.max_rows,
        max_queued_jobs=cfg.max_queued_jobs,
        other_client_job_s=None if light_s is None else round(light_s, 2),
    )


async def status(fleet: ProbeFleet) -> dict:
    from client.jobs import run_job
    from schemas import ErrorReply, JobRequest, JobStatus, ProtocolError, subjects, unpack

    await run_job(fleet.nc, JobRequest(job_id="big", count=64, steps=2, stream=False, seed=1), client="amp")
    published: list[int] = []
    replies: list = []

    async def on_event(msg):
        published.append(len(msg.data))

    async def on_reply(msg):
        try:
            replies.append(unpack(msg.data, JobStatus))
        except ProtocolError:
            replies.append(unpack(msg.data, ErrorReply))

    await fleet.nc.subscribe(subjects.job_events("amp", "big"), cb=on_event)
    inbox = fleet.nc.new_inbox()
    await fleet.nc.subscribe(inbox, cb=on_reply)
    await fleet.nc.flush()
    n, t0 = 300, time.monotonic()
    for _ in range(n):
        await fleet.nc.publish(subjects.job_status("amp", "big"), b"", reply=inbox)
    await fleet.nc.flush()
    deadline = time.monotonic() + 30
    while len(replies) < n and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    took = time.monotonic() - t0
    await asyncio.sleep(0.3)
    limited = sum(1 for r in replies if isinstance(r, ErrorReply))
    sent = sum(published)
    held = len(published) <= 1 + took / 2 and limited > 0
    return _result(
        "status",
        held,
        f"{n} status requests for a finished job publish its result at most once per 2 s, the surplus is rate-limited",
        requests=n,
        request_bytes=n * len(subjects.job_status("amp", "big")),
        results_published=len(published),
        bytes_published=sent,
        replies=len(replies),
        rate_limited=limited,
        seconds=round(took, 2),
    )


async def cancel(fleet: ProbeFleet) -> dict:
    from schemas import CancelReply, CancelRequest, JobRequest, SubmitReply, pack, subjects

    # a fresh null-label probe: a coordinator that asked recently does not wait at all
    fleet.coordinator.null_labels.known.clear()
    slow = list(fleet.workers)
    for w in slow:  # a slow forward pass (the sim's sleep), so the submit waits on the null-label probe
        w.backend.batch_ms = 1500.0
    try:
        first = JobRequest(job_id="orphan", digits=[-1, 4], steps=2, stream=False, seed=5)
        late = JobRequest(job_id="late", digits=[2], steps=2, stream=False, seed=2)
        t1 = asyncio.create_task(fleet.request(subjects.jobs_submit("tab"), pack(first), SubmitReply))
        await asyncio.sleep(0.2)
        t2 = asyncio.create_task(fleet.request(subjects.jobs_submit("tab"), pack(late), SubmitReply))
        await asyncio.sleep(0.2)
        replies = []
        for job in ("orphan", "late"):
            replies.append(
                await fleet.request(
                    subjects.job_cancel("tab", job), pack(CancelRequest(job_id=job)), CancelReply, timeout=5
                )
            )
        submits = [await t1, await t2]
    finally:
        for w in slow:
            w.backend.batch_ms = fleet.batch_ms
    await asyncio.sleep(0.5)
    sched = fleet.coordinator.engine.scheduler
    ran = [j for j in ("orphan", "late") if sched.knows(j) or fleet.coordinator.finished_event(j, "tab") is not None]
    return _result(
        "cancel",
        not ran,
        "a cancel before the coordinator took the job (probe awaited, submit still queued) stops it",
        cancel_replies=[f"cancelled={r.cancelled} {r.reason}".strip() for r in replies],
        submit_replies=[getattr(s, "code", None) and s.code.value or s.kind for s in submits],
        jobs_that_ran=ran,
    )


async def discovery(fleet: ProbeFleet) -> dict:
    from schemas import subjects

    target = subjects.job_events("web", "j1")
    got: list = []

    async def on_event(msg):
        got.append(msg.data)

    await fleet.nc.subscribe(target, cb=on_event)
    await fleet.nc.flush()
    for verb in ("PING", "INFO", "STATS"):
        await fleet.nc.publish(f"$SRV.{verb}", b"", reply=target)
    await fleet.nc.flush()
    answer = json.loads((await fleet.nc.request("$SRV.PING.ddm-expert", b"", timeout=2)).data)
    await asyncio.sleep(0.5)
    return _result(
        "discovery",
        not got,
        "$SRV discovery naming a job's events subject as its reply gets no answer there",
        forged_requests=3,
        messages_on_the_job_subject=len(got),
        inbox_discovery_answered=answer.get("name") == "ddm-expert",
    )


ATTACKS: dict[str, Callable[[ProbeFleet], Awaitable[dict]]] = {
    "quota": quota,
    "status": status,
    "cancel": cancel,
    "discovery": discovery,
}
