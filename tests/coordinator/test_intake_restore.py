"""A coordinator restarting with --durable subscribes before it has restored its previous run's jobs;
a status or cancel request that arrives in between must wait for the restore, not answer "unknown"
(a client takes "unknown" from its job's coordinator as the job lost). Pure unit: `Intake` fed a
hand-made host and hand-made messages, no server."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from coordinator.intake import Intake
from schemas import subjects
from schemas.messages import CancelReply, JobStatus
from schemas.wire import unpack


class _Msg:
    def __init__(self, subject: str):
        self.subject, self.reply, self.data, self.headers = subject, "_INBOX.restore-test", b"", None
        self.replies: list[bytes] = []

    async def respond(self, data: bytes) -> None:
        self.replies.append(data)


class _RestartingHost:
    """Knows job "j1" of client "c1" only once its restore has run (as `DurableJobs.start` does)."""

    def __init__(self):
        self.settings = SimpleNamespace(submit_rate=0.0, status_rate=0.0)
        self.metrics = SimpleNamespace(rate_limited=lambda kind: None, rejected=lambda code: None)
        self.durable_jobs = None
        self.jobs_restored = asyncio.Event()
        self.name, self.instance = "dur", "run2"
        self.restored = False

    def own_inbox_prefixes(self) -> list[str]:
        return ["_INBOX.coordinator-own"]

    def restore(self) -> None:
        self.restored = True
        self.jobs_restored.set()

    async def job_status(self, job_id: str, client: str | None = None):
        if self.restored and (client, job_id) == ("c1", "j1"):
            return JobStatus(job_id=job_id, state="running", step=20, steps=60, coordinator=self.name)
        return None

    async def cancel(self, job_id: str, client: str | None = None) -> bool:
        return self.restored and (client, job_id) == ("c1", "j1")


async def test_status_and_cancel_asked_during_the_restore_are_answered_after_it():
    host = _RestartingHost()
    intake = Intake(host)
    status_msg = _Msg(subjects.job_status("c1", "j1"))
    cancel_msg = _Msg(subjects.job_cancel("c1", "j1"))
    asking = asyncio.gather(intake.on_job_status(status_msg), intake.on_cancel(cancel_msg))
    await asyncio.sleep(0.3)
    assert status_msg.replies == [] and cancel_msg.replies == []  # nothing said while restoring
    host.restore()
    await asyncio.wait_for(asking, 5)
    status = unpack(status_msg.replies[0], JobStatus)
    assert (status.state, status.step) == ("running", 20)
    assert unpack(cancel_msg.replies[0], CancelReply).cancelled
    intake.close()
