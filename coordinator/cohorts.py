"""Cohorts (pure, no I/O): how many batches an engine keeps out at once, and which running jobs ride
in the next one.

No lock-step: a job sits in at most one batch at a time; it is "in flight" from `Scheduler.schedule`
until `Scheduler.update` (or `fail_batch`, `cancel`, `fail`) and the next `schedule` leaves it out.
With `cohorts=C` a batch takes free jobs, least recently scheduled first (so the oldest first, then
round robin), up to ceil(running rows / C) rows (at least one job), so C batches can be out at once:
while one cohort waits on the experts, the others are routed and updated. `cohorts=1` takes every
free job (with one batch out at a time: the lock-step tick). Which batch a job rides in never
changes its result (every per-row operation is elementwise). `next_cohort` makes that choice.

Whole requests (`request_rows` R, the rows of one expert request; None: off; only with C > 1, where a
held-back job rides in the next lane's batch instead of waiting a round trip): an expert's rows go
out in requests of at most R rows, and on a device whose forward costs about the same for a partial
batch as for a full one the last, partial request of each expert wastes most of a forward. So when
the batch holds at least R rows expected for an expert (by `Job.expected_expert`), its youngest jobs
that would only make up that expert's partial request wait for the next batch, where they go first.
A job is never deferred twice in a row, and the jobs a batch leaves out go to the front of the next
one (least recently scheduled first), so a held-back job waits a batch or two, not more
(`whole_requests`).

How many: the engine's `cohorts` setting, an int or "auto" (`parse_cohorts`, `check_cohorts`);
"auto" is `cohorts_for_workers` of the most workers the transport knows for one expert.
"""

from __future__ import annotations

from .job_table import Job, JobTable

#: Batches out at once: 2 lets one cohort be routed and updated while the experts work on the
#: other. Also the floor of `cohorts="auto"`.
DEFAULT_COHORTS = 2

#: `cohorts="auto"`: size the cohorts from the workers each expert has (see cohorts_for_workers).
AUTO_COHORTS = "auto"


def parse_cohorts(text: str) -> int | str:
    """A `--cohorts` value: "auto" or an int >= 1 (an argparse `type`: a ValueError reads as
    "invalid parse_cohorts value", so the message says what is allowed)."""
    import argparse

    if str(text).strip().lower() == AUTO_COHORTS:
        return AUTO_COHORTS
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be 'auto' or an int >= 1, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be 'auto' or an int >= 1, got {n}")
    return n


def check_cohorts(cohorts: int | str) -> int | str:
    """`cohorts` if it is an int >= 1 or "auto", else ValueError (the Engine's and the Coordinator's check)."""
    if cohorts != AUTO_COHORTS and (not isinstance(cohorts, int) or isinstance(cohorts, bool) or cohorts < 1):
        raise ValueError(f"cohorts must be an int >= 1 (batches out at once) or {AUTO_COHORTS!r}, got {cohorts!r}")
    return cohorts


def cohorts_for_workers(workers: int | None) -> int:
    """The cohorts `cohorts="auto"` keeps out for an expert served by `workers` worker processes
    (the most any expert has): 2 up to 3 workers, 3 from 4, 4 from 8. With W workers per expert a
    cohort holds about 1.5 W requests of an expert, so with two cohorts half the workers have a
    single request queued while the other cohort is routed and stepped; a third (fourth) cohort
    keeps them fed. Measured with `ddm-fleet bench scale` (docs/CAPACITY.md "Scaling efficiency"):
    efficiency 0.97 / 0.91 / 0.85 / 0.77 with 2 cohorts and 0.98 / 0.95 / 0.92 / 0.84 with 3 at 1 / 2
    / 4 / 8 workers per expert, 0.88 with 4 at 8; where one worker serves each expert (CPU workers
    on a small host) a third cohort only costs CPU (~10% per image, `bench fleet`)."""
    w = int(workers or 0)
    return DEFAULT_COHORTS + (w >= 4) + (w >= 8)


def cohorts_on_shared_cores(
    workers_per_expert: int, worker_processes: int, *, cores: int, accelerator: bool
) -> int | None:
    """The cohorts for a fleet whose processes all share one host's CPU cores: 1 where that host has no
    accelerator for the workers, one worker serves each expert and there are at most (worker processes + 2)
    cores; None elsewhere (keep the setting). A second cohort only overlaps work where a core is idle, and
    halves every expert request: on 2 cores one cohort served 1.1-1.3x the images at 4-16 clients with 20%
    less CPU per image (docs/CAPACITY.md, "Cohorts on one small host"). `ddm-fleet up` and `bench fleet`
    start their coordinators so."""
    if workers_per_expert != 1 or accelerator or cores > worker_processes + 2:
        return None
    return 1


def next_cohort(jobs: JobTable, cohorts: int, request_rows: int | None) -> list[Job]:
    """The running jobs not in flight that the next batch takes (see the module docstring), least
    recently scheduled first; [] if none is free."""
    if cohorts < 1:
        raise ValueError(f"cohorts must be >= 1, got {cohorts}")
    if request_rows is not None and request_rows < 1:
        raise ValueError(f"request_rows must be >= 1 or None, got {request_rows}")
    cap = -(-jobs.active_rows // cohorts)
    chosen, rows = [], 0
    for job_id, job in jobs.active.items():
        if job_id in jobs.in_flight:
            continue
        if chosen and rows + job.n > cap:
            break
        chosen.append(job)
        rows += job.n
    if request_rows is not None and cohorts > 1 and len(chosen) > 1:
        chosen = whole_requests(chosen, request_rows)
    for job in chosen:
        job.deferred = False
    return chosen


def whole_requests(jobs: list[Job], request_rows: int) -> list[Job]:
    """`jobs` (oldest first) less, per expected expert with at least `request_rows` rows, the
    youngest jobs not deferred last time whose rows only fill that expert's last partial request
    (marked `deferred`). Jobs with no expected expert always stay."""
    bins: dict[int, list[Job]] = {}
    for job in jobs:
        k = job.expected_expert()
        if k >= 0:
            bins.setdefault(k, []).append(job)
    dropped: set[str] = set()
    for members in bins.values():
        rows = sum(j.n for j in members)
        whole = rows - rows % request_rows
        if whole == 0 or whole == rows:
            continue
        for job in reversed(members):
            if rows == whole:
                break
            if job.deferred or rows - job.n < whole:
                continue
            rows -= job.n
            job.deferred = True
            dropped.add(job.job_id)
    return [j for j in jobs if j.job_id not in dropped] if dropped else jobs
