"""What the coordinator answers, as docs/PROTOCOL.md states it, over a real nats-server with real
tiny expert workers: every rejected submit counts in `fleet_status.jobs_rejected` (undecodable
bytes too), `accepted.queue_position` / `job_status.queue_position` are 0 for a job that runs at
once and 1 for the next to start, a cancelled job's status reports the step it reached, and a cancel
whose body names another job is refused with `cancelled: false`."""

from __future__ import annotations

import asyncio

import pytest

from coordinator.client import JobFailed, cancel_job, fleet_status, job_status, run_job, submit_job
from coordinator.local_fleet import LabelRouter
from coordinator.service import Coordinator
from schemas import (CancelReply, CancelRequest, ErrorCode, FrameEvent, JobAccepted, JobRejected, JobRequest,
                     SubmitReply, pack, subjects, unpack)
from tests.coordinator.helpers import make_tiny_experts

C2E = [0] * 5 + [1] * 5


@pytest.fixture(scope="module")
def experts(tmp_path_factory):
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield make_tiny_experts(tmp_path_factory.mktemp("reply-experts"))
    torch.set_num_threads(threads)


@pytest.fixture
async def workers(nats_url, experts):
    from workers.service import ExpertWorker

    ws = []
    try:
        for k, path in enumerate(experts):
            ws.append(ExpertWorker(expert=k, checkpoint=path, nats_url=nats_url, buckets=(1, 4)))
            await ws[-1].start()
        yield ws
    finally:
        for w in ws:
            await w.stop()


async def _submit_raw(nc, data: bytes):
    return unpack((await nc.request(subjects.JOBS_SUBMIT, data, timeout=5)).data, SubmitReply)


async def test_every_rejected_submit_counts_and_carries_a_reason(nats_url, nc, workers):
    async with Coordinator(LabelRouter(C2E, 2), num_experts=2, nats_url=nats_url, max_rows=8):
        bad = [
            b"\xc1",                                                        # undecodable: FormatError
            b"\x00garbage",                                                 # undecodable: trailing bytes
            pack(JobRequest(digits=[1])).replace(b"\xa1v\x01", b"\xa1v\x07"),  # unsupported_version
            pack(JobRequest(digits=[1])).replace(b"\xa6digits", b"\xa6DIGITS"),  # unknown field
            pack(JobRequest(digits=[1] * 9)),                               # too_large for max_rows 8 (scheduler)
            pack(JobRequest(digits=[1], strategy="oracle")),                # no partition manifest (scheduler)
        ]
        for data in bad:
            reply = await _submit_raw(nc, data)
            assert isinstance(reply, JobRejected), reply  # never `error`
            assert reply.reason.strip() and not reply.reason.rstrip().endswith(":"), reply.reason
        first = await _submit_raw(nc, b"\xc1")
        assert "FormatError: " in first.reason and "0xc1" in first.reason
        accepted = await _submit_raw(nc, pack(JobRequest(digits=[2], steps=2, seed=1)))
        assert isinstance(accepted, JobAccepted)
        st = await fleet_status(nc)
        assert st.jobs_rejected == len(bad) + 1 and st.jobs_submitted == 1


async def test_queue_position_is_zero_when_running_and_one_for_the_next(nats_url, nc, workers):
    async with Coordinator(LabelRouter(C2E, 2), num_experts=2, nats_url=nats_url, max_rows=2):
        running = await submit_job(nc, JobRequest(job_id="qp-run", digits=[1, 2], steps=1000, stream=False))
        next_up = await submit_job(nc, JobRequest(job_id="qp-next", digits=[3], steps=2, stream=False))
        after = await submit_job(nc, JobRequest(job_id="qp-after", digits=[4], steps=2, stream=False))
        assert (running.queue_position, next_up.queue_position, after.queue_position) == (0, 1, 2)
        assert (await job_status(nc, "qp-run")).queue_position == 0
        st = await job_status(nc, "qp-next")
        assert (st.state, st.queue_position) == ("queued", 1)
        for job_id in ("qp-after", "qp-next", "qp-run"):
            assert await cancel_job(nc, job_id)


async def test_a_cancelled_job_reports_the_step_it_reached(nats_url, nc, workers):
    async with Coordinator(LabelRouter(C2E, 2), num_experts=2, nats_url=nats_url):
        seen = asyncio.Event()

        def on(ev):
            if isinstance(ev, FrameEvent) and ev.step >= 3:
                seen.set()

        task = asyncio.create_task(run_job(nc, JobRequest(job_id="stop-me", digits=[1, 7], steps=1000), on))
        await asyncio.wait_for(seen.wait(), 60)
        before = await job_status(nc, "stop-me")
        assert await cancel_job(nc, "stop-me") is True
        with pytest.raises(JobFailed) as err:
            await asyncio.wait_for(task, 10)
        assert err.value.code == ErrorCode.CANCELLED
        st = await job_status(nc, "stop-me")
        assert st.state == "failed" and st.steps == 1000
        assert before.step <= st.step < 1000 and st.step >= 3, st

        done = await run_job(nc, JobRequest(job_id="run-out", digits=[2], steps=3))
        st = await job_status(nc, "run-out")
        assert (st.state, st.step, st.steps) == ("done", 3, 3) and done.steps == 3


async def test_a_cancel_whose_body_names_another_job_is_refused(nats_url, nc, workers):
    async with Coordinator(LabelRouter(C2E, 2), num_experts=2, nats_url=nats_url):
        await submit_job(nc, JobRequest(job_id="keep-me", digits=[1], steps=1000, stream=False))
        msg = await nc.request(subjects.job_cancel("keep-me"), pack(CancelRequest(job_id="other")), timeout=5)
        reply = unpack(msg.data, CancelReply)
        assert reply.cancelled is False and "does not match the subject" in reply.reason
        assert (await job_status(nc, "keep-me")).state in ("queued", "running")
        assert await cancel_job(nc, "keep-me") is True


async def test_last_frame_and_done_differ_by_float16_rounding_only(nats_url, nc, workers):
    import numpy as np

    async with Coordinator(LabelRouter(C2E, 2), num_experts=2, nats_url=nats_url):
        frames = []
        done = await run_job(nc, JobRequest(digits=[0, 3, 5, 9], steps=4, seed=11, strategy="full"),
                             lambda ev: frames.append(ev) if isinstance(ev, FrameEvent) else None)
    last = frames[-1]
    assert last.step == 4 and last.x.dtype == np.float16 and done.images.dtype == np.float32
    gap = np.abs(np.clip(last.x.astype(np.float32), -1, 1) - done.images)
    assert gap.max() <= 2.0**-12, gap.max()
    assert np.abs(done.images).max() <= 1.0
    # full: every expert has a router weight > 0 on every evaluation, and each one counts in usage
    assert (done.usage == 1.0).all(), done.usage


async def test_srv_replies_are_json(nc, workers):
    import json

    msg = await nc.request("$SRV.PING.ddm-expert", b"", timeout=5)
    info = json.loads(msg.data)  # nats.micro: JSON, not msgpack
    assert info["name"] == "ddm-expert" and info["type"].startswith("io.nats.micro")
