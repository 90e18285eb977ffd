"""Which dtype each expert computed a job in, through a real fleet (nats-server, tiny torch experts
of different dtypes, coordinator): `done.expert_dtypes` / `job_status.expert_dtypes` only for a job
that asked (`report_dtypes`), never on the wire otherwise (v1 clients refuse unknown keys)."""

from __future__ import annotations

import msgpack
import pytest

from client.jobs import job_status, run_job
from coordinator.local_fleet import LabelRouter
from coordinator.service import Coordinator
from schemas import DoneEvent, JobRequest
from schemas.wire import pack

C2E = [0] * 5 + [1] * 5


@pytest.fixture
async def mixed_workers(nats_url, tiny_experts):
    """Expert 0 served in float32, expert 1 in bfloat16."""
    from workers.service import ExpertWorker

    ws = []
    try:
        for k, dtype in enumerate(("float32", "bfloat16")):
            ws.append(
                ExpertWorker(expert=k, checkpoint=tiny_experts[k], nats_url=nats_url, buckets=(1, 4), dtype=dtype)
            )
            await ws[-1].start()
        yield ws
    finally:
        for w in ws:
            await w.stop()


async def test_done_and_job_status_say_each_experts_dtype_only_when_asked(nats_url, nc, mixed_workers):
    async with Coordinator(
        LabelRouter(C2E, 2), num_experts=2, class_to_expert=C2E, nats_url=nats_url, step_timeout=10
    ) as coord:
        learned = await coord.transport.discovery.refresh()
        assert {learned[w.worker_id] for w in mixed_workers} == {"float32", "bfloat16"}

        both = await run_job(nc, JobRequest(digits=[1, 7], seed=5, steps=3, report_dtypes=True), timeout=120)
        assert both.expert_dtypes == ["float32", "bfloat16"]
        only0 = await run_job(
            nc, JobRequest(digits=[2], seed=5, steps=2, strategy="oracle", report_dtypes=True), timeout=120
        )
        assert only0.expert_dtypes == ["float32", ""]  # expert 1 computed none of its rows
        st = await job_status(nc, only0.job_id)
        assert st.state == "done" and st.expert_dtypes == ["float32", ""]

        plain = await run_job(nc, JobRequest(digits=[1, 7], seed=5, steps=3), timeout=120)
        assert plain.expert_dtypes is None
        assert "expert_dtypes" not in msgpack.unpackb(pack(plain), raw=False)  # what a v1 client receives
        assert (await job_status(nc, plain.job_id)).expert_dtypes is None
        # the request's new key is left off the wire unless used, so older coordinators still take it
        assert "report_dtypes" not in msgpack.unpackb(pack(JobRequest(digits=[1])), raw=False)


def test_a_done_event_from_the_wire_is_checked():
    import numpy as np

    from schemas import ProtocolError, unpack

    ev = DoneEvent(
        job_id="j",
        images=np.zeros((1, 1, 2, 2), np.float32),
        digits=[3],
        usage=np.ones((1, 2), np.float32),
        steps=1,
        strategy="top1",
        elapsed_s=0.0,
        expert_dtypes=["float32", "float32,bfloat16"],
    )
    assert unpack(pack(ev), DoneEvent).expert_dtypes == ["float32", "float32,bfloat16"]
    raw = msgpack.unpackb(pack(ev), raw=False)
    raw["expert_dtypes"] = ["float32"]  # one entry for two experts
    with pytest.raises(ProtocolError, match="expert_dtypes has 1 entries for 2 experts"):
        unpack(msgpack.packb(raw, use_bin_type=True), DoneEvent)
