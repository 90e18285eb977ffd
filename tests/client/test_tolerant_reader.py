"""The Python client reads a newer service's replies and events: keys it does not know are ignored (at
any depth), as docs/PROTOCOL.md tells clients to do; services still refuse unknown keys in requests."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from bus.connect import flushed
from client.jobs import fleet_status, job_status, run_job
from schemas import (
    DoneEvent,
    FleetStatus,
    JobAccepted,
    JobRequest,
    JobStatus,
    ProtocolError,
    SubmitReply,
    pack,
    subjects,
    unpack,
)
from schemas.spec import legacy_spec


def _with_extra(message, **nested) -> bytes:
    """`message` packed, plus a key no release defines (and in each nested map named in `nested`)."""
    obj = msgpack.unpackb(pack(message), raw=False)
    obj["from_the_future"] = [1, {"x": 2}]
    for key in nested:
        obj[key]["also_new"] = True
    return msgpack.packb(obj, use_bin_type=True)


def test_unpack_drops_unknown_keys_only_when_asked():
    data = _with_extra(FleetStatus(num_experts=2, spec=legacy_spec()), spec=True)
    with pytest.raises(ProtocolError, match="from_the_future"):
        unpack(data, FleetStatus)  # a service reading a request: strict
    status = unpack(data, FleetStatus, ignore_unknown=True)
    assert status.num_experts == 2 and status.spec == legacy_spec()
    # a discriminated union (what run_job reads) picks the model by kind first
    data = _with_extra(JobAccepted(job_id="j", digits=[1], events_subject="s", seed=1))
    assert isinstance(unpack(data, SubmitReply, ignore_unknown=True), JobAccepted)


async def test_the_client_reads_replies_and_events_with_keys_it_does_not_know(nc):
    """A fake coordinator of a later release: every reply and event carries a key this client does not
    know; job_status, fleet_status and run_job all read them."""
    images = np.zeros((1, 1, 32, 32), np.float32)

    async def on_status(msg):
        await msg.respond(_with_extra(JobStatus(job_id="j1", state="running", step=2, steps=4)))

    async def on_fleet(msg):
        await msg.respond(_with_extra(FleetStatus(num_experts=2, spec=legacy_spec()), spec=True))

    async def on_submit(msg):
        req = unpack(msg.data, JobRequest)
        accepted = JobAccepted(
            job_id=req.job_id, digits=req.digits, events_subject=subjects.job_events("c", req.job_id), seed=5
        )
        await nc.publish(subjects.job_events("c", req.job_id), _with_extra(accepted))
        await msg.respond(_with_extra(accepted))
        done = DoneEvent(
            job_id=req.job_id,
            digits=req.digits,
            images=images,
            usage=np.ones((1, 2), np.float32),
            steps=4,
            strategy="top1",
            elapsed_s=0.1,
        )
        await nc.publish(subjects.job_events("c", req.job_id), _with_extra(done))

    subs = [
        await nc.subscribe(subjects.job_status("c", "j1"), cb=on_status),
        await nc.subscribe(subjects.FLEET_STATUS, cb=on_fleet),
        await nc.subscribe(subjects.jobs_submit("c"), cb=on_submit),
    ]
    await flushed(nc)
    try:
        st = await job_status(nc, "j1", client="c")
        assert (st.state, st.step) == ("running", 2)
        status = await fleet_status(nc, spec=True)
        assert status.spec == legacy_spec()
        done = await run_job(nc, JobRequest(job_id="j2", digits=[3], steps=4), client="c", timeout=10)
        np.testing.assert_array_equal(done.images, images)
    finally:
        for s in subs:
            await s.unsubscribe()
