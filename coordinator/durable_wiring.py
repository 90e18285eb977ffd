"""A coordinator's durable jobs (`--durable`) wired up at start: the JetStream store, the loop that
snapshots, leases and takes over jobs in it (`coordinator.durable_jobs`), and the scheduler that says
when a job's snapshot is due."""

from __future__ import annotations

from collections.abc import Callable

from .config import DurableSettings
from .durable_jobs import DurableJobs
from .durable_store import CheckpointingScheduler, JobStore
from .ledger import JobLedger
from .scheduler import SchedulerConfig


async def open_durable_jobs(
    nc,
    settings: DurableSettings,
    scheduler_config: SchedulerConfig,
    ledger: JobLedger,
    *,
    name: str,
    instance: str,
    on_fence: Callable[[list[tuple[str, str]], bool], str],
) -> tuple[JobStore, DurableJobs, CheckpointingScheduler]:
    """Open the store of coordinator `name` (this run: `instance`; its buckets created with
    `settings.js_replicas` copies when missing) and the durable jobs over it; the scheduler wakes their
    loop whenever a job is due for a snapshot. `on_fence(names, lapsed)`: jobs were fenced, after a lapse
    of this run's leases or a take-over; it takes their unsent events back (raises JetStreamUnavailable
    without JetStream)."""
    store = await JobStore(nc, name, instance, lease_s=settings.lease_s, replicas=settings.js_replicas).open()
    jobs = DurableJobs(store, ledger, name=name, checkpoint_every=settings.checkpoint_every, on_fence=on_fence)
    scheduler = CheckpointingScheduler(scheduler_config, settings.checkpoint_every, on_due=jobs.wake.set)
    return store, jobs, scheduler
