"""run_job when the submit's answer is lost: a coordinator publishes `accepted` on the job's events
before it answers the submit, so a client that got the event follows the job instead of failing it.
The coordinator here is a stand-in on a real nats-server that publishes the events and never answers."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from bus.connect import flushed
from client.jobs import JobFailed, run_job
from schemas import DoneEvent, JobAccepted, JobRequest, subjects
from schemas.wire import pack, unpack


async def _silent_coordinator(nc, *, publish_accepted: bool):
    """Takes every submit of client `anon`, publishes its events (accepted first when asked, then done)
    and never answers the submit, as a coordinator stopped between the two would."""

    async def on_submit(msg):
        req = unpack(msg.data, JobRequest)
        events = subjects.job_events("anon", req.job_id)
        if publish_accepted:
            acc = JobAccepted(job_id=req.job_id, events_subject=events, digits=req.digits, seed=req.seed or 0)
            await nc.publish(events, pack(acc))
        await asyncio.sleep(1.5)  # the submit times out meanwhile (submit_timeout 1 s)
        n = len(req.digits)
        done = DoneEvent(
            job_id=req.job_id,
            images=np.zeros((n, 1, 32, 32), np.float32),
            digits=req.digits,
            usage=np.ones((n, 1), np.float32),
            steps=req.steps,
            strategy=req.strategy,
            elapsed_s=0.1,
        )
        await nc.publish(events, pack(done))

    sub = await nc.subscribe(subjects.jobs_submit("anon"), cb=on_submit)
    await flushed(nc)
    return sub


async def test_a_lost_submit_answer_with_the_accepted_event_still_gets_the_images(nc):
    sub = await _silent_coordinator(nc, publish_accepted=True)
    req = JobRequest(job_id="lost-reply", digits=[3, 7], steps=4, seed=1)
    done = await run_job(nc, req, submit_timeout=1.0, probe_every=None, timeout=20, client="anon")
    assert done.job_id == "lost-reply" and np.asarray(done.images).shape == (2, 1, 32, 32)
    await sub.unsubscribe()


async def test_no_answer_and_no_accepted_event_is_still_a_failure(nc):
    sub = await _silent_coordinator(nc, publish_accepted=False)
    req = JobRequest(job_id="never-taken", digits=[1], steps=4, seed=1)
    with pytest.raises(JobFailed, match="did not answer the submit"):
        await run_job(nc, req, submit_timeout=1.0, probe_every=None, timeout=20, client="anon")
    await sub.unsubscribe()
