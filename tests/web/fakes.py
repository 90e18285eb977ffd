"""Fakes for the web viewer's tests.

`FakeCoordinator`: a small nats-py responder that speaks the real schemas (JobRequest in,
JobAccepted / FrameEvent / DoneEvent out, CancelRequest honoured). It does no denoising: frames
interpolate from noise to a flat image per digit.
`FakeWorkerService`: a real `nats.micro` service advertising like an expert worker."""

from __future__ import annotations

import asyncio

import numpy as np

from bus.connect import flushed
from schemas import (
    CancelRequest,
    DoneEvent,
    ErrorCode,
    ErrorReply,
    FrameEvent,
    JobAccepted,
    JobRejected,
    JobRequest,
    ProtocolError,
    pack,
    subjects,
    unpack,
)

K = 2


class FakeCoordinator:
    def __init__(
        self,
        nc,
        *,
        frame_delay: float = 0.01,
        reject_over: int | None = None,
        status: dict | None = None,
        reply_late: bool = False,
        probe: bool = True,
    ):
        self.nc = nc
        self.probe = probe  # False for a connection without publish rights on the submit subject
        self.reply_late = reply_late  # run the whole job before answering the submit request
        self.frame_delay = frame_delay
        self.reject_over = reject_over
        self.status = status
        self.jobs: dict[str, JobRequest] = {}
        self.owners: dict[str, str] = {}  # job id -> client token of the submit subject
        self.cancelled: list[str] = []
        self.finished: list[str] = []
        self._subs = []
        self._tasks: set[asyncio.Task] = set()

    async def __aenter__(self) -> FakeCoordinator:
        self._subs.append(await self.nc.subscribe(subjects.ALL_JOBS_SUBMIT, cb=self._on_submit))
        self._subs.append(await self.nc.subscribe(subjects.ALL_JOB_CANCELS, cb=self._on_cancel))
        if self.status is not None:
            self._subs.append(await self.nc.subscribe(subjects.FLEET_STATUS, cb=self._on_status))
        # the server must have our interest before this returns: a request through the same buffer (queued
        # after the SUBs) that our own handler answers proves it, and so does `flushed` (one flush() does not)
        if self.probe:
            reply = await self.nc.request(subjects.jobs_submit("probe"), b"", timeout=10)
            assert unpack(reply.data, ErrorReply).code == ErrorCode.BAD_REQUEST
        else:
            await flushed(self.nc)
        return self

    async def __aexit__(self, *exc) -> None:
        for sub in self._subs:
            await sub.unsubscribe()
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _on_status(self, msg) -> None:
        import msgpack

        await msg.respond(msgpack.packb({"v": 1, **self.status}))

    async def _on_submit(self, msg) -> None:
        try:
            req = unpack(msg.data, JobRequest)
        except ProtocolError as err:
            await msg.respond(pack(ErrorReply(code=err.code, message=err.message)))
            return
        if self.reject_over is not None and req.n_images > self.reject_over:
            await msg.respond(
                pack(
                    JobRejected(code=ErrorCode.OVERLOADED, reason=f"fake fleet takes at most {self.reject_over} images")
                )
            )
            return
        rng = np.random.default_rng(req.seed or 0)
        digits = req.classes if req.classes is not None else [int(d) for d in rng.integers(0, 10, req.count)]
        self.jobs[req.job_id] = req
        self.owners[req.job_id] = subjects.parse_submit_subject(msg.subject)
        accepted = pack(
            JobAccepted(
                job_id=req.job_id,
                events_subject=subjects.job_events(self.owners[req.job_id], req.job_id),
                **{req.label_field: digits},  # events name the labels as the request did
                seed=req.seed or 0,
            )
        )
        if self.reply_late:
            await self._run(req, digits, rng)
            await self.nc.flush()
            await msg.respond(accepted)
            return
        await msg.respond(accepted)
        task = asyncio.ensure_future(self._run(req, digits, rng))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _on_cancel(self, msg) -> None:
        req = unpack(msg.data, CancelRequest)
        self.cancelled.append(req.job_id)

    async def _run(self, req: JobRequest, digits: list[int], rng) -> None:
        n = len(digits)
        subject = subjects.job_events(self.owners[req.job_id], req.job_id)
        noise = rng.standard_normal((n, 1, 32, 32)).astype(np.float32)
        target = np.array([(d / 4.5) - 1.0 for d in digits], np.float32).reshape(n, 1, 1, 1) * np.ones(
            (1, 1, 32, 32), np.float32
        )
        experts = [0 if d < 5 else 1 for d in digits]
        weights = np.array([[0.9, 0.1] if e == 0 else [0.2, 0.8] for e in experts], np.float32)
        x = noise
        for step in range(1, req.steps + 1):
            if req.job_id in self.cancelled:
                return
            t = step / req.steps
            x = (1 - t) * noise + t * target
            if req.stream and step % req.frame_every == 0 and step < req.steps:
                await self.nc.publish(
                    subject,
                    pack(
                        FrameEvent(
                            job_id=req.job_id,
                            step=step,
                            steps=req.steps,
                            t=t,
                            x=x.astype(np.float16),
                            experts=experts,
                            weights=weights,
                        )
                    ),
                )
            await asyncio.sleep(self.frame_delay)
        usage = np.zeros((n, K), np.float32)
        usage[np.arange(n), experts] = 1.0
        await self.nc.publish(
            subject,
            pack(
                DoneEvent(
                    job_id=req.job_id,
                    images=x,
                    **{req.label_field: digits},
                    usage=usage,
                    steps=req.steps,
                    strategy=req.strategy,
                    elapsed_s=0.1,
                )
            ),
        )
        self.finished.append(req.job_id)


class FakeWorkerService:
    """A micro service that advertises like an expert worker and counts rows in its stats."""

    def __init__(
        self,
        nc,
        expert: int,
        backend: str,
        device: str,
        subject: str | None = None,
        dtype: str = "float32",
        compiled: bool | None = None,
    ):
        self.nc, self.expert, self.backend, self.device, self.dtype = nc, expert, backend, device, dtype
        self.compiled = compiled  # None: the key is absent (a worker of an older release)
        self.subject = subject or f"test.fleet.{id(self)}"
        self.rows = 0
        self.latency: tuple[float, int] | None = None  # (seconds, requests): reported like a worker's histogram

    def _stats(self) -> dict:
        out: dict = {"rows": self.rows}
        if self.latency is not None:
            out["latency_seconds"] = {"buckets": {}, "sum": self.latency[0], "count": self.latency[1]}
        return out

    async def __aenter__(self):
        from nats.micro import add_service

        self.svc = await add_service(
            self.nc,
            name="ddm-expert",
            version="0.1.0",
            metadata={
                "expert": str(self.expert),
                "backend": self.backend,
                "device": self.device,
                "dtype": self.dtype,
                "host": "testhost",
                **({} if self.compiled is None else {"compiled": str(self.compiled).lower()}),
            },
            stats_handler=lambda _ep: self._stats(),
        )

        async def handler(req):
            await req.respond(b"ok")

        await self.svc.add_endpoint(name="velocity", subject=self.subject, handler=handler)
        return self

    async def __aexit__(self, *exc):
        await self.svc.stop()

    @property
    def id(self) -> str:
        return self.svc.id
