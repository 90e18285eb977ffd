"""Publishing a coordinator's job events: each to its job's owner, on the events subject of the job id
that client knows, after the checks that may hold it back.

The engine hands every event to `EventPublisher.publish`: a durable job that another coordinator runs
now publishes nothing (`coordinator.durable_jobs`), a latent fleet's `done` and preview frames go
through the decode stage first (`coordinator.decoding`), and the rest goes out at once
(`publish_now`): under the client's job id, stamped by the ledger, a job's end remembered for status
requests. A `done` too large for one message, of a job that asked for parts, goes out as its `done_part`
events then the `done` that counts them (`coordinator.done_parts`), one after another on the job's events
subject (NATS keeps one publisher's messages to a subject in order), each time it is published.
"""

from __future__ import annotations

import logging
from typing import Any

from schemas import ProtocolError, pack, subjects

from .done_parts import done_messages
from .ledger import JobLedger

log = logging.getLogger(__name__)


def as_client(event, client: str, job_id: str):
    """`event` under the job id its client knows (the same object when that is the internal id)."""
    if event.job_id == job_id:
        return event
    update: dict[str, Any] = {"job_id": job_id}
    if event.kind == "accepted":
        update["events_subject"] = subjects.job_events(client, job_id)
    return event.model_copy(update=update)


class EventPublisher:
    """The engine's events, to their jobs' owners. `durable_jobs` (--durable) and `decode_stage` (a
    latent fleet) are set once the coordinator has opened them; `nc` once it is connected."""

    def __init__(self, nc, ledger: JobLedger):
        self.nc, self.ledger = nc, ledger
        self.durable_jobs = None  # coordinator.durable_jobs.DurableJobs
        self.decode_stage = None  # coordinator.decoding.DecodeStage

    async def publish(self, event) -> None:
        """An event of the engine, to its job's owner under the job id it knows; through the decode stage
        when it needs the decoder, in the job's order, without holding up the engine."""
        if self.durable_jobs is not None and not self.durable_jobs.before_publish(event):
            return  # another coordinator runs this job now
        if self.decode_stage is not None and self.decode_stage.take(event):
            return
        await self.publish_now(event)

    async def publish_now(self, event) -> None:
        """Publish `event` (under its internal job id) to its owner now."""
        internal = event.job_id
        name = self.ledger.name_of(internal)
        if name is None:  # cannot happen for a job this coordinator admitted; never guess a namespace
            log.error("not publishing %s for job %s: its owner is not known", event.kind, internal)
            return
        if event.kind == "frame":
            self.ledger.note_progress(internal, event.step, event.steps)
        event = self.ledger.stamp(internal, as_client(event, *name))
        in_parts = self.ledger.in_parts(*name)  # asked before `remember`, which may keep no large result
        if event.kind in ("done", "failed"):
            self.ledger.remember(internal, event)
        await self.send(name[0], event, in_parts=in_parts)

    async def send(self, client: str, event, *, in_parts: bool | None = None) -> None:
        """Publish `event` (its job id as `client` knows it) on the job's events subject; a `done` in parts
        when it is too large for one message and its job asked for that (`in_parts`; None: as the ledger
        knows the job, live or finished: `coordinator.done_parts`)."""
        subject = subjects.job_events(client, event.job_id)
        try:
            if event.kind != "done":
                await self.nc.publish(subject, pack(event))
                return
            if in_parts is None:
                in_parts = self.ledger.in_parts(client, event.job_id)
            for data in done_messages(event, in_parts=in_parts):
                await self.nc.publish(subject, data)
        except ProtocolError as err:
            log.error("cannot publish %s for job %s: %s", event.kind, event.job_id, err.message)
        except Exception as err:  # connection trouble: the client will time out; keep serving
            log.error("cannot publish %s for job %s: %r", event.kind, event.job_id, err)
