"""The jobs a scheduler holds (pure, no I/O): `Job`, and `JobTable`, the waiting queue, the running
jobs and those with a batch out, with each client's and session's usage kept in step with them.

A job is waiting (in `queue`, arrival order) or running (in `active`, least recently scheduled
first); a running job whose batch has not come back is also `in_flight`. Every move between these
goes through a `JobTable` method, so the usage counts (`client_rows`, `client_queued`, by client "c"
and by session "c/s", no zero entries) and `active_rows` never drift from the jobs themselves.
Who is admitted, and when, is `coordinator.admission`'s; this table only records it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from schemas import JobRequest

from .rows import RowGroup

#: Most notes (fallback messages) a job keeps for its done event.
MAX_NOTES = 50

#: Client key used when the caller names none (an open bus's anonymous clients share it).
DEFAULT_CLIENT = "anon"


def owner_of_key(key: str) -> str:
    """The client of a fairness key: "c" for "c" and for "c/<session>"."""
    return key.split("/", 1)[0]


def usage_keys(key: str) -> tuple[str, ...]:
    """The usage counters a job of fairness key `key` counts in: its client's, and its session's."""
    owner = owner_of_key(key)
    return (owner,) if owner == key else (owner, key)


@dataclass(eq=False)
class Job:
    request: JobRequest
    job_id: str
    digits: list[int]
    seed: int
    submitted_at: float
    deadline: float | None
    client: str = DEFAULT_CLIENT
    seq: int = 0  # arrival order (ties in fair admission)
    group: RowGroup | None = None  # created when the job is admitted
    step: int = 0
    started_at: float | None = None
    notes: list[str] = field(default_factory=list)
    pending_notes: list[str] = field(default_factory=list)
    deferred: bool = False  # left out of the last batch to keep expert requests whole (see cohorts)

    @property
    def n(self) -> int:
        return len(self.digits)

    def expected_expert(self) -> int:
        """The one expert every row of this job went to at its last evaluation (top1 / oracle
        rows usually keep theirs), i.e. where its rows will most likely go next; -1 if unknown
        (not evaluated yet, several experts, or a strategy that mixes them)."""
        g = self.group
        if g is None or g.evals == 0 or g.strategy not in ("top1", "oracle"):
            return -1
        e = g.last_experts
        k = int(e[0])
        if k < 0 or (len(e) > 1 and bool((e != k).any())):
            return -1
        return k


class JobTable:
    """Waiting, running and in-flight jobs, and the usage of each client and session."""

    def __init__(self) -> None:
        self.queue: deque[Job] = deque()  # waiting jobs, in arrival order
        self.active: dict[str, Job] = {}  # running jobs, least recently scheduled first
        self.in_flight: set[str] = set()  # ids of running jobs whose batch has not come back
        self.active_rows = 0  # sum of n over `active`
        # running rows / waiting jobs (no zero entries) of each client, all sessions together ("c"),
        # and of each session ("c/s")
        self.client_rows: dict[str, int] = {}
        self.client_queued: dict[str, int] = {}

    def find(self, job_id: str) -> Job | None:
        """The running or waiting job `job_id`, else None."""
        job = self.active.get(job_id)
        if job is None:
            job = next((j for j in self.queue if j.job_id == job_id), None)
        return job

    def knows(self, job_id: str) -> bool:
        return job_id in self.active or any(j.job_id == job_id for j in self.queue)

    def running(self, job_id: str, group: RowGroup) -> Job | None:
        """The running job `job_id` if `group` is still its rows (not cancelled, failed or replaced), else None."""
        job = self.active.get(job_id)
        return job if job is not None and job.group is group else None

    def heads(self) -> dict[str, Job]:
        """{client: its longest-waiting job}, clients in the order their head jobs arrived."""
        heads: dict[str, Job] = {}
        for job in self.queue:
            heads.setdefault(job.client, job)
        return heads

    @property
    def in_flight_rows(self) -> int:
        """Rows of the jobs whose batch is out (scheduled, not yet updated)."""
        return sum(self.active[j].n for j in self.in_flight)

    def enqueue(self, job: Job) -> None:
        self.queue.append(job)
        _count(self.client_queued, job.client, 1)

    def dequeue(self, job: Job) -> None:
        self.queue.remove(job)
        _count(self.client_queued, job.client, -1)

    def activate(self, job: Job) -> None:
        self.active[job.job_id] = job
        self.active_rows += job.n
        _count(self.client_rows, job.client, job.n)

    def deactivate(self, job: Job) -> None:
        del self.active[job.job_id]
        self.active_rows -= job.n
        self.in_flight.discard(job.job_id)
        _count(self.client_rows, job.client, -job.n)

    def remove(self, job_id: str) -> Job | None:
        """Take a job out of the running set or the queue; the job, or None if unknown."""
        job = self.active.get(job_id)
        if job is not None:
            self.deactivate(job)
            return job
        for j in self.queue:
            if j.job_id == job_id:
                self.dequeue(j)
                return j
        return None

    def send(self, jobs: list[Job]) -> None:
        """`jobs` ride in a batch now: in flight until it comes back, and to the back of the running
        order (least recently scheduled first)."""
        for job in jobs:
            self.active[job.job_id] = self.active.pop(job.job_id)
        self.in_flight.update(job.job_id for job in jobs)


def _count(counts: dict[str, int], client: str, delta: int) -> None:
    """Add `delta` to the counts of a key's client and session (dropping zeros)."""
    for key in usage_keys(client):
        left = counts.get(key, 0) + delta
        if left:
            counts[key] = left
        else:
            counts.pop(key, None)
