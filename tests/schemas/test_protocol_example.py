"""docs/examples/raw_client.py (nats-py + raw msgpack, no project imports) really works
against a real nats-server, and what it sends is exactly what `schemas` accepts.

The expert is a tiny responder written with raw msgpack; the job side is a small fake
coordinator that speaks through the real `schemas` messages. The fake publishes the first
events *before* it answers the submit request, so a client that subscribed late would miss
them: the example's subscribe-then-submit order is what makes the test pass.
"""

from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path

import msgpack
import numpy as np
import pytest

from bus.connect import flushed
from schemas import (
    CancelReply,
    CancelRequest,
    DoneEvent,
    ErrorCode,
    FailedEvent,
    FrameEvent,
    JobAccepted,
    JobRequest,
    StepReply,
    StepRequest,
    StepResult,
    pack,
    subjects,
    unpack,
)

EXAMPLE = Path(__file__).resolve().parents[2] / "docs" / "examples" / "raw_client.py"


@pytest.fixture(scope="module")
def raw():
    spec = importlib.util.spec_from_file_location("raw_client_example", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_example_imports_nothing_from_the_project():
    source = EXAMPLE.read_text()
    for pkg in ("schemas", "coordinator", "workers", "infra", "web"):
        assert f"from {pkg}" not in source and f"import {pkg}" not in source


# ---------------------------------------------------------------- expert step


async def _raw_expert(nc, expert: int, seen: list[bytes]):
    """An expert written with msgpack only: velocity = -x_t (any known function will do)."""

    async def on_request(msg):
        seen.append(msg.data)
        req = msgpack.unpackb(msg.data, raw=False)
        x = req["x_t"]
        if req["v"] != 1:
            reply = {"v": 1, "kind": "error", "code": "unsupported_version", "message": "v1 only"}
        elif x["dtype"] != "<f4":
            reply = {"v": 1, "kind": "error", "code": "bad_dtype", "message": "x_t must be <f4 here"}
        else:
            v = -np.frombuffer(x["data"], "<f4")
            reply = {
                "v": 1,
                "kind": "step_reply",
                "expert": req["expert"],
                "velocity": {"dtype": "<f4", "shape": x["shape"], "data": v.tobytes()},
                "row_ids": req["row_ids"],
                "backend": "raw-msgpack",
                "device": "cpu",
                "worker_id": "w0",
                "compute_ms": 0.1,
                "batch_rows": x["shape"][0],
            }
        await msg.respond(msgpack.packb(reply, use_bin_type=True))

    return await nc.subscribe(
        subjects.expert_velocity(expert), queue=subjects.expert_queue_group(expert), cb=on_request
    )


async def test_raw_step_request_round_trip(nc, raw):
    seen: list[bytes] = []
    sub = await _raw_expert(nc, 5, seen)
    x = np.random.default_rng(3).standard_normal((4, 1, 32, 32)).astype(np.float32)
    reply = await raw.step(nc, 5, x, np.linspace(0, 1, 4).astype(np.float32), np.arange(4))
    np.testing.assert_array_equal(reply["velocity"], -x)
    assert reply["velocity"].shape == (4, 1, 32, 32) and not reply["velocity"].flags.writeable
    assert reply["row_ids"] == [f"row-{i}" for i in range(4)] and reply["backend"] == "raw-msgpack"
    # what the example sent is a valid StepRequest, and the raw reply a valid StepReply
    req = unpack(seen[-1], StepRequest)
    np.testing.assert_array_equal(req.x_t, x)
    assert req.expert == 5 and req.y.dtype.str == "<i8" and req.t.tolist() == pytest.approx([0, 1 / 3, 2 / 3, 1])
    assert isinstance(
        unpack(msgpack.packb({**reply, "velocity": raw.encode_tensor(reply["velocity"])}), StepResult), StepReply
    )
    await sub.unsubscribe()


async def test_raw_client_surfaces_error_replies(nc, raw):
    sub = await _raw_expert(nc, 6, [])
    with pytest.raises(raw.ProtocolFailure) as info:
        # step() always sends <f4; build a raw request with a <f8 x_t, which this expert refuses
        bad = raw.encode(
            {
                "kind": "step_request",
                "expert": 6,
                "x_t": raw.encode_tensor(np.zeros((1, 1, 2, 2))),
                "t": raw.encode_tensor(np.zeros(1, np.float32)),
                "y": raw.encode_tensor(np.zeros(1, np.int64)),
            }
        )
        raw.raise_if_error(raw.decode((await nc.request(subjects.expert_velocity(6), bad, timeout=5)).data))
    assert info.value.code == "bad_dtype"
    await sub.unsubscribe()


async def test_example_command_line_step(nc, nats_url, raw, capsys):
    sub = await _raw_expert(nc, 0, [])
    await nc.flush()
    assert await raw._main(["--url", nats_url, "step", "--expert", "0", "--batch", "3"]) == 0
    out = capsys.readouterr().out
    assert "velocity [3, 1, 32, 32] float32" in out and "raw-msgpack" in out
    await sub.unsubscribe()


# ---------------------------------------------------------------- job flow


class FakeCoordinator:
    """Answers submit / cancel with real `schemas` messages; emits one frame per step.

    Events for a job start *before* the submit reply is sent (late subscribers lose them).
    """

    def __init__(self, nc, step_delay: float = 0.0):
        self.nc = nc
        self.step_delay = step_delay
        self.cancelled: set[str] = set()
        self.requests: list[JobRequest] = []
        self.tasks: list[asyncio.Task] = []

    async def start(self):
        self.owner: dict[str, str] = {}  # job id -> client token of its submit subject
        self.subs = [
            await self.nc.subscribe(subjects.ALL_JOBS_SUBMIT, cb=self.on_submit),
            await self.nc.subscribe(subjects.ALL_JOB_CANCELS, cb=self.on_cancel),
        ]
        await flushed(self.nc)

    async def stop(self):
        for s in self.subs:
            await s.unsubscribe()
        for t in self.tasks:
            t.cancel()

    async def publish(self, event):
        await self.nc.publish(subjects.job_events(self.owner[event.job_id], event.job_id), pack(event))

    async def on_submit(self, msg):
        req = unpack(msg.data, JobRequest)
        self.requests.append(req)
        self.owner[req.job_id] = subjects.parse_submit_subject(msg.subject)
        events = subjects.job_events(self.owner[req.job_id], req.job_id)
        accepted = JobAccepted(job_id=req.job_id, events_subject=events, digits=req.digits, seed=req.seed or 0)
        await self.publish(accepted)
        await self.publish(self.frame(req, 0))
        await self.nc.flush()
        await msg.respond(pack(accepted))
        self.tasks.append(asyncio.create_task(self.run(req)))

    def frame(self, req: JobRequest, step: int) -> FrameEvent:
        n = len(req.digits)
        return FrameEvent(
            job_id=req.job_id,
            step=step,
            steps=req.steps,
            t=step / req.steps,
            x=np.full((n, 1, 32, 32), step / req.steps, np.float16),
            experts=[d // 5 for d in req.digits],
            weights=np.eye(2, dtype=np.float32)[[d // 5 for d in req.digits]],
        )

    async def run(self, req: JobRequest):
        for step in range(1, req.steps + 1):
            await asyncio.sleep(self.step_delay)
            if req.job_id in self.cancelled:
                await self.publish(
                    FailedEvent(job_id=req.job_id, code=ErrorCode.CANCELLED, reason="cancelled by client")
                )
                return
            await self.publish(self.frame(req, step))
        n = len(req.digits)
        await self.publish(
            DoneEvent(
                job_id=req.job_id,
                images=np.ones((n, 1, 32, 32), np.float32),
                digits=req.digits,
                usage=np.eye(2, dtype=np.float32)[[d // 5 for d in req.digits]],
                steps=req.steps,
                strategy=req.strategy,
                elapsed_s=0.01,
            )
        )

    async def on_cancel(self, msg):
        client, job_id, _ = subjects.parse_job_subject(msg.subject)
        req = unpack(msg.data, CancelRequest)
        assert req.job_id == job_id
        known = self.owner.get(job_id) == client  # only the owner's namespace may cancel
        if known:
            self.cancelled.add(job_id)
        await msg.respond(pack(CancelReply(job_id=job_id, cancelled=known, reason="" if known else "no such job")))


async def test_raw_generate_sees_every_event_in_order(nc, raw):
    coord = FakeCoordinator(nc)
    await coord.start()
    events: list[dict] = []
    done = await raw.generate(nc, [3, 7, 9], steps=6, seed=11, on_event=events.append)
    kinds = [e["kind"] for e in events]
    assert kinds == ["accepted"] + ["frame"] * 7 + ["done"], kinds
    assert [e["step"] for e in events if e["kind"] == "frame"] == list(range(7))
    frame = events[3]
    assert frame["x"].dtype == np.float16 and frame["x"].shape == (3, 1, 32, 32)
    assert frame["weights"].shape == (3, 2) and frame["experts"] == [0, 1, 1]
    assert done["images"].shape == (3, 1, 32, 32) and done["digits"] == [3, 7, 9]
    req = coord.requests[-1]
    assert req.job_id.startswith("raw-") and req.digits == [3, 7, 9] and req.steps == 6 and req.seed == 11
    await coord.stop()


async def test_raw_cancel_ends_the_job_with_failed_cancelled(nc, raw):
    coord = FakeCoordinator(nc, step_delay=0.02)
    await coord.start()
    cancels: list[asyncio.Task] = []

    def on_event(e):
        if e["kind"] == "frame" and e["step"] == 1:
            cancels.append(asyncio.ensure_future(raw.cancel(nc, e["job_id"], client="someone-else")))
            cancels.append(asyncio.ensure_future(raw.cancel(nc, e["job_id"], client="alice")))

    with pytest.raises(raw.ProtocolFailure) as info:
        await raw.generate(nc, [1], steps=200, on_event=on_event, client="alice")
    assert info.value.code == "cancelled"
    assert await cancels[0] is False and await cancels[1] is True  # the example cancels in its own namespace
    assert coord.owner[coord.requests[-1].job_id] == "alice"
    assert await raw.cancel(nc, "raw-nonexistent") is False
    await coord.stop()
