"""The pure scheduler: jobs in, batches out, events back. No I/O, no clocks of its own.

The engine loop is `schedule -> execute -> update` (as in vLLM):

    sched.submit(JobRequest, now, client) -> Admission   (raises Rejected when over the limits)
    batch = sched.schedule(now)                          admit queued jobs, expire deadlines;
                                                         a Batch of every active row, or None
    ... engine: router on batch.x/t/y, batch.route(w), expert calls, batch.record(...)
        or batch.mark_failed(k, reason, code) ...
    sched.update(batch, now)                             advance each row one solver stage;
                                                         fail jobs whose rows no expert served
    sched.pop_events()                                   FrameEvent / DoneEvent / FailedEvent

What callers may read: `active_rows`, `active_jobs`, `queued_jobs`, `active_job_ids()`,
`job_progress(job_id)`, `knows(job_id)`, `owner_of(job_id)`, `client_usage(client)`, `stats`
(counters) and `config`. The scheduler does no I/O and knows no NATS subjects: whoever publishes
(engine, service) names them.

Jobs that arrive mid-run join at the next `schedule`; finished jobs leave in `update`;
`cancel` frees a job's rows at once (a batch in flight simply skips them on update).

Fair sharing. Every job belongs to a `client` key given at submit ("anon" by default): a client
name, or "<client>/<session>" for one session of that client (the service's fairness key). Quotas
apply to the client (every session of it together: the part before "/") and to each session, so
that a client cannot multiply its share by naming a new session per job.
Limits (each refusal names the limit and its value; `Rejected.limit` is its config name):

* `max_rows` active rows in all, `max_queued_jobs` waiting jobs in all (`overloaded` beyond);
* `max_client_rows` active rows per client, all its sessions together (None: `max_rows`): a client
  at its quota waits in the queue (throttled), a job larger than the quota is refused `too_large`;
* `max_client_queued_jobs` waiting jobs per client, all its sessions together (`overloaded`
  beyond), so one client cannot fill the queue and starve the rest;
* `max_session_rows`, `max_session_queued_jobs`: the same per "<client>/<session>" key (None: the
  client's quota);
* `max_job_cost` row-evaluations per job (`too_large` beyond), see `job_cost`;
* `max_job_run_s` seconds a job may run once started (`deadline_exceeded` beyond).

Admission is fair across clients, then across the sessions of a client, and FIFO within a
session: when rows free up, the head job of the client with the fewest running rows is admitted
first (ties: round robin, the client admitted least recently goes first), and of that client's
sessions the one with the fewest running rows; a client or session at its row quota is skipped. A
job is admitted whole; if the chosen job does not fit the free rows, admission stops there (it
keeps its turn, so large jobs are not starved by small ones). A job starts at once when its rows
are free and no other client could take them. With one client this is today's FIFO queue.
"""

from __future__ import annotations

import secrets
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from flow.solver import euler_update
from schemas import UNCONDITIONAL, DoneEvent, ErrorCode, FailedEvent, FrameEvent, JobRequest
from schemas.tensor import frame_float16

from .batch import Batch
from .rows import RowGroup, draw_digits
from .snapshot import JobCheckpoint

MAX_NOTES = 50

#: Client key used when the caller names none (an open bus's anonymous clients share it).
DEFAULT_CLIENT = "anon"

#: Longest client key (the service builds "<client token>/<session>", 64 + 1 + 64 characters).
MAX_CLIENT_KEY_LEN = 129

#: Most clients whose last admission is remembered for the round robin (the least recently
#: served are forgotten first, which keeps their place: never served counts as longest ago).
MAX_TRACKED_CLIENTS = 4096

#: Velocity evaluations per solver step, by solver.
EVALS_PER_STEP = {"euler": 1, "heun": 2}


class Rejected(Exception):
    """A job the scheduler will not take. `code` is an ErrorCode, `reason` a sentence; `limit` names
    the SchedulerConfig limit that refused it (e.g. "max_client_queued_jobs"), or None."""

    def __init__(self, code: ErrorCode, reason: str, limit: str | None = None):
        super().__init__(reason)
        self.code = ErrorCode(code)
        self.reason = reason
        self.limit = limit


def experts_per_row(request: JobRequest, num_experts: int) -> int:
    """Experts evaluated for each row per evaluation: top1 1, topk min(k, K), full K, oracle 1."""
    if request.strategy == "full":
        return num_experts
    if request.strategy == "topk":
        return min(int(request.top_k), num_experts)
    return 1


def job_cost(request: JobRequest, num_experts: int) -> int:
    """Row-evaluations a job costs the fleet: images (guided ones twice: with their label and the null
    label, `JobRequest.n_guided`) x steps x evaluations per step (heun 2) x experts evaluated per row
    (`experts_per_row`)."""
    return (
        (request.n_images + request.n_guided)
        * int(request.steps)
        * EVALS_PER_STEP.get(request.solver, 1)
        * experts_per_row(request, num_experts)
    )


def _guided_note(request: JobRequest) -> str:
    """The words a cost message adds for the null-label twins of a guided job's rows; "" for other jobs."""
    return f" + {request.n_guided} null-label twins (guidance_scale {request.guidance:g})" if request.n_guided else ""


def _with_guidance(progress: dict, request: JobRequest) -> dict:
    """`progress` (a job_progress dict) with the job's `guidance_scale` when it asked for one other than 1."""
    if request.guidance != 1.0:
        progress["guidance_scale"] = request.guidance
    return progress


@dataclass
class SchedulerConfig:
    """Limits and shapes. `class_to_expert[y]` is the partition owning class y (oracle).

    Per-client limits (see the module docstring): max_client_rows (None: max_rows; a client's
    sessions together), max_session_rows / max_session_queued_jobs (None: the client's),
    max_client_queued_jobs (clamped to max_queued_jobs), max_job_cost (row-evaluations, `job_cost`;
    None: no limit), max_job_run_s (seconds from start; None: no limit)."""

    num_experts: int
    max_rows: int = 1024
    max_queued_jobs: int = 256
    image_shape: tuple[int, int, int] = (1, 32, 32)
    num_classes: int = 10
    class_to_expert: Sequence[int] | None = None
    max_client_rows: int | None = None
    max_client_queued_jobs: int = 64
    max_job_cost: int | None = 256_000
    max_job_run_s: float | None = 600.0
    max_session_rows: int | None = None
    max_session_queued_jobs: int | None = None
    # latent fleet: a done event's `images` and `latents` are the final samples as they are (not
    # clipped); the coordinator's decode stage turns them into images
    latent: bool = False
    # pixel fleet: a done event's `images` are the final samples clipped to this (the spec's value_range)
    value_range: tuple[float, float] = (-1.0, 1.0)

    def __post_init__(self) -> None:
        if not isinstance(self.num_experts, int) or self.num_experts < 1:
            raise ValueError(f"num_experts must be a positive int, got {self.num_experts!r}")
        if self.max_rows < 1:
            raise ValueError(f"max_rows must be >= 1 (rows batched per tick), got {self.max_rows}")
        if self.max_queued_jobs < 1:
            raise ValueError(
                f"max_queued_jobs must be >= 1 (a new job waits in the queue until the next tick), "
                f"got {self.max_queued_jobs}"
            )
        if self.max_client_rows is not None and self.max_client_rows < 1:
            raise ValueError(
                f"max_client_rows must be >= 1 (rows one client may run at once) or None, got {self.max_client_rows}"
            )
        if self.max_client_queued_jobs < 1:
            raise ValueError(
                f"max_client_queued_jobs must be >= 1 (jobs one client may have waiting), "
                f"got {self.max_client_queued_jobs}"
            )
        for name in ("max_session_rows", "max_session_queued_jobs"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(
                    f"{name} must be >= 1 (per session of a client) or None (the client's quota), got {value}"
                )
        if self.max_job_cost is not None and self.max_job_cost < 1:
            raise ValueError(f"max_job_cost must be >= 1 row-evaluation or None, got {self.max_job_cost}")
        if self.max_job_run_s is not None and not self.max_job_run_s > 0:
            raise ValueError(f"max_job_run_s must be > 0 seconds or None, got {self.max_job_run_s}")
        if self.class_to_expert is not None:
            c2e = list(self.class_to_expert)
            if len(c2e) != self.num_classes or any(not (0 <= int(k) < self.num_experts) for k in c2e):
                raise ValueError(
                    f"class_to_expert must list one expert in [0, {self.num_experts}) for each of "
                    f"{self.num_classes} classes, got {c2e}"
                )
            self.class_to_expert = [int(k) for k in c2e]

    @property
    def client_rows(self) -> int:
        """Rows one client may run at once (max_client_rows, at most max_rows)."""
        return min(self.max_client_rows or self.max_rows, self.max_rows)

    @property
    def client_queued_jobs(self) -> int:
        """Jobs one client may have waiting (max_client_queued_jobs, at most max_queued_jobs)."""
        return min(self.max_client_queued_jobs, self.max_queued_jobs)

    @property
    def session_rows(self) -> int:
        """Rows one session of a client may run at once (max_session_rows, at most client_rows)."""
        return min(self.max_session_rows or self.client_rows, self.client_rows)

    @property
    def session_queued_jobs(self) -> int:
        """Jobs one session of a client may have waiting (max_session_queued_jobs, at most client_queued_jobs)."""
        return min(self.max_session_queued_jobs or self.client_queued_jobs, self.client_queued_jobs)


def owner_of_key(key: str) -> str:
    """The client of a fairness key: "c" for "c" and for "c/<session>"."""
    return key.split("/", 1)[0]


def _keys(key: str) -> tuple[str, ...]:
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
    deferred: bool = False  # left out of the last batch to keep expert requests whole (see schedule)

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


@dataclass(frozen=True)
class Admission:
    """A job the scheduler took: its id, labels, seed, and place in the queue (0 = running)."""

    job_id: str
    digits: list[int]
    seed: int
    queue_position: int


@dataclass
class Stats:
    """Counters since start (never reset)."""

    jobs_submitted: int = 0
    jobs_done: int = 0
    jobs_failed: int = 0
    jobs_cancelled: int = 0
    jobs_rejected: int = 0
    jobs_over_run_time: int = 0  # failed for running longer than max_job_run_s
    rejected_by_limit: dict[str, int] = field(default_factory=dict)  # config limit name -> refusals
    ticks: int = 0
    row_evals: int = 0  # velocity evaluations applied (one per row per tick)
    row_fallbacks: int = 0  # row evaluations whose experts differ from the all-experts-up choice
    images_done: int = 0


class Scheduler:
    def __init__(self, config: SchedulerConfig):
        self.config = config
        #: worker id -> the dtype it computes in ("" unknown); the engine sets its transport's
        self.dtype_of: Callable[[str], str] = lambda worker: ""
        self._queue: deque[Job] = deque()  # waiting jobs, in arrival order
        self._active: dict[str, Job] = {}
        # running rows / waiting jobs (no zero entries) of each client, all sessions together ("c"),
        # and of each session ("c/s")
        self._client_rows: dict[str, int] = {}
        self._client_queued: dict[str, int] = {}
        self._served: dict[str, int] = {}  # client or session -> admission count at its last admission (LRU order)
        self._seq = 0
        self._admissions = 0
        self._in_flight: set[str] = set()  # ids of running jobs whose batch has not come back (see schedule)
        self._active_rows = 0  # sum of n over self._active (kept by _start / _deactivate)
        self.stats = Stats()
        self._events: list = []

    # ------------------------------------------------------------ what callers may read
    @property
    def active_rows(self) -> int:
        """Rows (images) of the running jobs."""
        return self._active_rows

    @property
    def active_jobs(self) -> int:
        """Jobs running (in the batch of the next tick)."""
        return len(self._active)

    @property
    def queued_jobs(self) -> int:
        """Jobs waiting for rows (the queue depth)."""
        return len(self._queue)

    def active_job_ids(self) -> list[str]:
        """Ids of the running jobs, in the order they started."""
        return list(self._active)

    def queued_job_ids(self) -> list[str]:
        """Ids of the waiting jobs, in arrival order."""
        return [j.job_id for j in self._queue]

    def knows(self, job_id: str) -> bool:
        return job_id in self._active or any(j.job_id == job_id for j in self._queue)

    def owner_of(self, job_id: str) -> str | None:
        """The client key given when a queued or running job was submitted, else None."""
        job = self._active.get(job_id)
        if job is None:
            job = next((j for j in self._queue if j.job_id == job_id), None)
        return job.client if job is not None else None

    def client_usage(self, client: str) -> dict[str, int]:
        """{running_rows, queued_jobs} of one client ("c": all its sessions together) or one session
        ("c/s"); zeros for one with nothing here."""
        return dict(running_rows=self._client_rows.get(client, 0), queued_jobs=self._client_queued.get(client, 0))

    def job_progress(self, job_id: str) -> dict | None:
        """{state: queued|running, step, steps, queue_position (1-based; 0 when running)} of a job
        this scheduler holds, else None (never had it, or it finished)."""
        job = self._active.get(job_id)
        if job is not None:
            out = dict(state="running", step=int(job.step), steps=int(job.request.steps), queue_position=0)
            if job.request.report_dtypes:
                out["expert_dtypes"] = self.expert_dtypes(job.group)
            return _with_guidance(out, job.request)
        for i, job in enumerate(self._queue):
            if job.job_id == job_id:
                out = dict(state="queued", step=0, steps=int(job.request.steps), queue_position=i + 1)
                if job.request.report_dtypes:
                    out["expert_dtypes"] = [""] * self.config.num_experts
                return _with_guidance(out, job.request)
        return None

    def expert_dtypes(self, group: RowGroup | None) -> list[str] | None:
        """K entries: the dtypes the workers that computed each expert's rows of `group` compute in
        (`dtype_of`), sorted and comma-joined; "" where none did (or none says). None: not asked."""
        if group is None or group.answered is None:
            return None
        out = []
        for workers in group.answered:
            kinds = sorted({self.dtype_of(w) for w in workers} - {""})
            out.append(",".join(kinds))
        return out

    # ------------------------------------------------------------ intake
    def submit(
        self, request: JobRequest, now: float, client: str = DEFAULT_CLIENT, job_id: str | None = None
    ) -> Admission:
        """Queue a validated job for `client` (an opaque fairness key) under `job_id` (default: the
        request's, else a random one). Raises Rejected(code, reason, limit) if it cannot run here."""
        try:
            return self._submit(request, now, client, job_id)
        except Rejected as err:
            self.stats.jobs_rejected += 1
            if err.limit is not None:
                self.stats.rejected_by_limit[err.limit] = self.stats.rejected_by_limit.get(err.limit, 0) + 1
            raise

    def _submit(self, request: JobRequest, now: float, client: str, job_id: str | None = None) -> Admission:
        cfg = self.config
        if not isinstance(client, str) or not 1 <= len(client) <= MAX_CLIENT_KEY_LEN:
            raise Rejected(
                ErrorCode.BAD_REQUEST,
                f"client key must be a string of 1-{MAX_CLIENT_KEY_LEN} characters, got {client!r:.80}",
            )
        n = request.n_images
        self._check_limits(request, client, "")
        if request.classes is not None and any(d >= cfg.num_classes for d in request.classes):
            raise Rejected(
                ErrorCode.BAD_REQUEST,
                f"{request.label_field} must be in [0, {cfg.num_classes}) (or {UNCONDITIONAL}: label unknown)",
            )
        job_id = job_id or request.job_id or secrets.token_hex(8)
        if self.knows(job_id):
            raise Rejected(ErrorCode.BAD_REQUEST, f"job id {job_id!r} is already in use")
        starts_now = self._starts_now(client, n)
        if not starts_now:
            if len(self._queue) >= cfg.max_queued_jobs:
                raise Rejected(
                    ErrorCode.OVERLOADED,
                    f"{len(self._queue)} jobs already queued (limit {cfg.max_queued_jobs}); retry later",
                    "max_queued_jobs",
                )
            self._check_queue_quota(client, "")
        seed = int(request.seed) if request.seed is not None else secrets.randbits(63)
        digits = list(request.classes) if request.classes is not None else draw_digits(seed, n, cfg.num_classes)
        deadline = now + request.deadline_s if request.deadline_s is not None else None
        self._seq += 1
        job = Job(
            request=request,
            job_id=job_id,
            digits=digits,
            seed=seed,
            submitted_at=now,
            deadline=deadline,
            client=client,
            seq=self._seq,
        )
        self.stats.jobs_submitted += 1
        if starts_now:  # rows are free and nobody else could take them: active now, in the next tick's batch
            self._start(job, now)
        else:
            self._queue.append(job)
            self._count(self._client_queued, client, 1)
        return Admission(job_id=job_id, digits=digits, seed=seed, queue_position=0 if starts_now else len(self._queue))

    def _check_limits(self, request: JobRequest, client: str, prefix: str) -> None:
        """Raise Rejected if a job of `request` for key `client` can never run here, the admission
        limits a submit and a restore share: rows at once (coordinator, client, session), job cost,
        and a partition manifest for the oracle strategy. `prefix` starts each reason ("restore: ")."""
        cfg = self.config
        n = request.n_images
        if n > cfg.max_rows:
            raise Rejected(
                ErrorCode.TOO_LARGE,
                f"{prefix}job asks for {n} images but this coordinator runs at most {cfg.max_rows} rows at once",
                "max_rows",
            )
        if n > cfg.client_rows:
            raise Rejected(
                ErrorCode.TOO_LARGE,
                f"{prefix}client quota: job asks for {n} images but one client runs at most "
                f"{cfg.client_rows} rows at once (limit {cfg.client_rows})",
                "max_client_rows",
            )
        if n > cfg.session_rows and owner_of_key(client) != client:
            raise Rejected(
                ErrorCode.TOO_LARGE,
                f"{prefix}session quota: job asks for {n} images but one session runs at most "
                f"{cfg.session_rows} rows at once (limit {cfg.session_rows})",
                "max_session_rows",
            )
        if cfg.max_job_cost is not None:
            cost = job_cost(request, cfg.num_experts)
            if cost > cfg.max_job_cost:
                raise Rejected(
                    ErrorCode.TOO_LARGE,
                    (
                        f"{prefix}job cost {cost} row-evaluations ({n} images{_guided_note(request)} x "
                        f"{request.steps} steps x {EVALS_PER_STEP.get(request.solver, 1)} evaluations per step "
                        f"({request.solver}) x {experts_per_row(request, cfg.num_experts)} experts per row "
                        f"({request.strategy})) is over the limit of {cfg.max_job_cost} per job; "
                        "ask for fewer images or steps"
                    ),
                    "max_job_cost",
                )
        if request.strategy == "oracle" and cfg.class_to_expert is None:
            raise Rejected(
                ErrorCode.BAD_REQUEST, f"{prefix}oracle strategy needs a partition manifest; this coordinator has none"
            )

    def _check_queue_quota(self, client: str, prefix: str) -> None:
        """Raise Rejected(overloaded) if a job of key `client` may not wait: its client, or its
        session, has its quota of queued jobs."""
        cfg = self.config
        owner = owner_of_key(client)
        for key, limit, what, name in (
            (owner, cfg.client_queued_jobs, "client", "max_client_queued_jobs"),
            (client, cfg.session_queued_jobs, "session", "max_session_queued_jobs"),
        ):
            if what == "session" and key == owner:
                continue
            queued = self._client_queued.get(key, 0)
            if queued >= limit:
                raise Rejected(
                    ErrorCode.OVERLOADED,
                    (
                        f"{prefix}{what} quota: {queued} queued jobs (limit {limit}) and "
                        f"{self._client_rows.get(key, 0)} running rows; retry when one finishes"
                    ),
                    name,
                )

    def _count(self, counts: dict[str, int], client: str, delta: int) -> None:
        """Add `delta` to the counts of a key's client and session (dropping zeros)."""
        for key in _keys(client):
            left = counts.get(key, 0) + delta
            if left:
                counts[key] = left
            else:
                counts.pop(key, None)

    def _held(self, client: str, n: int) -> bool:
        """True if n more rows of key `client` would pass its client's or its session's row quota."""
        cfg = self.config
        owner = owner_of_key(client)
        if self._client_rows.get(owner, 0) + n > cfg.client_rows:
            return True
        return owner != client and self._client_rows.get(client, 0) + n > cfg.session_rows

    def _starts_now(self, client: str, n: int) -> bool:
        """A new job of `client` with n rows may start at once: its session (or client without one)
        has nothing waiting, it fits the free rows and the quotas, and every waiting job is held by
        its own quotas (so none of them could take these rows)."""
        cfg = self.config
        if self._client_queued.get(client, 0) or self.active_rows + n > cfg.max_rows:
            return False
        if self._held(client, n):
            return False
        return all(self._held(c, j.n) for c, j in self._heads().items())

    def _heads(self) -> dict[str, Job]:
        """{client: its longest-waiting job}, clients in the order their head jobs arrived."""
        heads: dict[str, Job] = {}
        for job in self._queue:
            heads.setdefault(job.client, job)
        return heads

    def _dequeue(self, job: Job) -> None:
        self._queue.remove(job)
        self._count(self._client_queued, job.client, -1)

    def _deactivate(self, job: Job) -> None:
        del self._active[job.job_id]
        self._active_rows -= job.n
        self._in_flight.discard(job.job_id)
        self._count(self._client_rows, job.client, -job.n)

    def _remove(self, job_id: str):
        """Take a job out of the active set or the queue; the job, or None if unknown."""
        job = self._active.get(job_id)
        if job is not None:
            self._deactivate(job)
            return job
        for j in self._queue:
            if j.job_id == job_id:
                self._dequeue(j)
                return j
        return None

    def cancel(self, job_id: str, now: float, reason: str = "cancelled by client") -> bool:
        """Drop a queued or running job now; emits FailedEvent(cancelled). False if unknown."""
        if self._remove(job_id) is None:
            return False
        self.stats.jobs_cancelled += 1
        self._events.append(FailedEvent(job_id=job_id, code=ErrorCode.CANCELLED, reason=reason))
        return True

    def fail(self, job_id: str, code: ErrorCode, reason: str) -> bool:
        """Fail a queued or running job (e.g. the engine hit an internal error)."""
        if self._remove(job_id) is None:
            return False
        self.stats.jobs_failed += 1
        self._events.append(FailedEvent(job_id=job_id, code=code, reason=reason))
        return True

    def fail_all(self, code: ErrorCode, reason: str) -> None:
        """Fail every running and queued job."""
        for job_id in [*self._active, *(j.job_id for j in self._queue)]:
            self.fail(job_id, code, reason)

    def fail_batch(self, batch: Batch, code: ErrorCode, reason: str) -> None:
        """Fail the jobs of `batch` that are still running (e.g. the tick that carried them broke)."""
        for g in batch.groups:
            job = self._active.get(g.job_id)
            if job is not None and job.group is g:
                self.fail(g.job_id, code, reason)

    def drop(self, job_id: str) -> bool:
        """Forget a queued or running job without any event (its client hears nothing from here):
        for a durable coordinator that lost the job to another one, or hands it over. False if unknown."""
        return self._remove(job_id) is not None

    # ------------------------------------------------------------ checkpoint / restore
    def checkpoint(self, job_id: str) -> JobCheckpoint | None:
        """A copy of a held job's state (`coordinator.snapshot.JobCheckpoint`), or None if unknown.
        A running job's committed state is taken (a batch in flight has not touched it yet); a
        queued job's has `x = None`."""
        job = self._active.get(job_id) or next((j for j in self._queue if j.job_id == job_id), None)
        if job is None:
            return None
        cp = JobCheckpoint(
            request=job.request,
            job_id=job.job_id,
            client=job.client,
            digits=list(job.digits),
            seed=int(job.seed),
            submitted_at=float(job.submitted_at),
            started_at=job.started_at,
            notes=list(job.notes),
            pending_notes=list(job.pending_notes),
        )
        g = job.group
        if job_id in self._active and g is not None:
            cp.x = np.array(g.x, np.float32, copy=True)
            cp.step, cp.stage, cp.evals, cp.routed_at = int(g.step), int(g.stage), int(g.evals), int(g.routed_at)
            cp.v0 = None if g.v0 is None else np.array(g.v0, np.float32, copy=True)
            cp.usage = np.array(g.usage, np.int64, copy=True)
            cp.route_w = None if g.route_w is None else np.array(g.route_w, np.float64, copy=True)
            cp.oracle_expert = np.array(g.oracle_expert, np.int64, copy=True)
        return cp

    def restore(self, cp: JobCheckpoint, now: float) -> Admission:
        """Take a job back from its checkpoint (taken here or by another coordinator) exactly where it
        was: it runs on from `cp.step` and ends with the same images as if it had never stopped.
        The admission limits apply as for a submit: it starts now if its rows are free, else waits in
        the queue (keeping its rows); raises Rejected (code, reason, limit) when it is too large for
        this coordinator, the queue is full, or the checkpoint does not fit this configuration
        (experts, image shape, job id in use)."""
        cfg, req, n = self.config, cp.request, cp.n
        client = cp.client
        if not isinstance(client, str) or not 1 <= len(client) <= MAX_CLIENT_KEY_LEN:
            raise Rejected(ErrorCode.BAD_REQUEST, f"restore: client key must be 1-{MAX_CLIENT_KEY_LEN} characters")
        if self.knows(cp.job_id):
            raise Rejected(ErrorCode.BAD_REQUEST, f"restore: job id {cp.job_id!r} is already in use here")
        if n < 1 or n != req.n_images:
            raise Rejected(ErrorCode.BAD_REQUEST, f"restore: {n} digits for a job of {req.n_images} images")
        if any(not -1 <= int(d) < cfg.num_classes for d in cp.digits):  # -1: label unknown
            raise Rejected(ErrorCode.BAD_REQUEST, f"restore: digits must be in [0, {cfg.num_classes}) or -1")
        self._check_limits(req, client, "restore: ")  # n == req.n_images, checked above
        group = None
        if cp.x is not None:
            shape = (n, *cfg.image_shape)
            if tuple(cp.x.shape) != shape:
                raise Rejected(
                    ErrorCode.BAD_REQUEST,
                    f"restore: checkpoint rows {list(cp.x.shape)} do not match this coordinator's {list(shape)}",
                )
            if cp.usage is None or cp.usage.shape != (n, cfg.num_experts):
                got = None if cp.usage is None else list(cp.usage.shape)
                raise Rejected(
                    ErrorCode.BAD_REQUEST,
                    f"restore: checkpoint usage {got} does not match {cfg.num_experts} experts here",
                )
            if (
                not 0 <= cp.step <= req.steps
                or (cp.stage == 1) != (cp.v0 is not None)
                or (cp.stage == 1 and req.solver != "heun")
            ):
                raise Rejected(
                    ErrorCode.BAD_REQUEST,
                    f"restore: inconsistent solver state (step {cp.step} of "
                    f"{req.steps}, stage {cp.stage}, {req.solver})",
                )
            c2e = cfg.class_to_expert
            oracle = (
                cp.oracle_expert
                if cp.oracle_expert is not None
                else np.array([c2e[y] if c2e is not None and y >= 0 else -1 for y in cp.digits], np.int64)
            )
            group = RowGroup(
                job_id=cp.job_id,
                y=np.asarray(cp.digits, np.int64),
                x=np.array(cp.x, np.float32),
                steps=req.steps,
                solver=req.solver,
                strategy=req.strategy,
                top_k=req.top_k,
                oracle_expert=oracle,
                num_experts=cfg.num_experts,
                step=int(cp.step),
                stage=int(cp.stage),
                v0=None if cp.v0 is None else np.array(cp.v0, np.float32),
                evals=int(cp.evals),
                route_w=None if cp.route_w is None else np.array(cp.route_w, np.float64),
                routed_at=int(cp.routed_at),
                seed=int(cp.seed),
                guidance=req.guidance,  # the request is in the checkpoint: a take-over keeps it
            )
            group.usage = np.array(cp.usage, np.int64)
        starts_now = self._starts_now(client, n)
        if not starts_now:
            if len(self._queue) >= cfg.max_queued_jobs:
                raise Rejected(
                    ErrorCode.OVERLOADED,
                    f"restore: {len(self._queue)} jobs already queued (limit {cfg.max_queued_jobs})",
                    "max_queued_jobs",
                )
            self._check_queue_quota(client, "restore: ")
        deadline = cp.submitted_at + req.deadline_s if req.deadline_s is not None else None
        self._seq += 1
        job = Job(
            request=req,
            job_id=cp.job_id,
            digits=[int(d) for d in cp.digits],
            seed=int(cp.seed),
            submitted_at=float(cp.submitted_at),
            deadline=deadline,
            client=client,
            seq=self._seq,
            group=group,
            step=int(cp.step) if group is not None else 0,
            started_at=cp.started_at if group is not None else None,
            notes=list(cp.notes)[:MAX_NOTES],
            pending_notes=list(cp.pending_notes),
        )
        if starts_now:
            self._start(job, now)
        else:
            self._queue.append(job)
            self._count(self._client_queued, client, 1)
        return Admission(
            job_id=job.job_id, digits=job.digits, seed=job.seed, queue_position=0 if starts_now else len(self._queue)
        )

    def pop_events(self) -> list:
        ev, self._events = self._events, []
        return ev

    # ------------------------------------------------------------ schedule
    @property
    def in_flight_rows(self) -> int:
        """Rows of the jobs whose batch is out (scheduled, not yet updated)."""
        return sum(self._active[j].n for j in self._in_flight)

    def schedule(
        self,
        now: float,
        unavailable: frozenset[int] | set[int] = frozenset(),
        *,
        cohorts: int = 1,
        request_rows: int | None = None,
    ) -> Batch | None:
        """Expire deadlines and run times, admit queued jobs fairly (see the module docstring),
        return a Batch of the active rows that are not already in a batch, or None.

        Cohorts (no lock-step): a job sits in at most one batch at a time; it is "in flight" from
        `schedule` until `update` (or `fail_batch`, `cancel`, `fail`) and the next `schedule`
        leaves it out. With `cohorts=C` a batch takes free jobs, least recently scheduled first (so
        the oldest first, then round robin), up to ceil(active rows / C) rows (at least one job), so
        C batches can be out at once: while one
        cohort waits on the experts, the others are routed and updated. `cohorts=1` takes every
        free job (with one batch out at a time: the lock-step tick). Which batch a job rides in
        never changes its result (every per-row operation is elementwise).

        Whole requests (`request_rows` R, the rows of one expert request; None: off; only with C > 1,
        where a held-back job rides in the next lane's batch instead of waiting a round trip): an expert's
        rows go out in requests of at most R rows, and on a device whose forward costs about the
        same for a partial batch as for a full one the last, partial request of each expert wastes
        most of a forward. So when the batch holds at least R rows expected for an expert (by
        `Job.expected_expert`), its youngest jobs that would only make up that expert's partial
        request wait for the next batch, where they go first. A job is never deferred twice in a
        row, and the jobs a batch leaves out go to the front of the next one (least recently scheduled
        first), so a held-back job waits a batch or two, not more."""
        cfg = self.config
        for job in [*self._active.values(), *self._queue]:
            if job.deadline is not None and now > job.deadline:
                self.fail(
                    job.job_id,
                    ErrorCode.DEADLINE_EXCEEDED,
                    f"job did not finish within its deadline of {job.request.deadline_s:g} s",
                )
            elif (
                cfg.max_job_run_s is not None
                and job.started_at is not None
                and now - job.started_at > cfg.max_job_run_s
            ):
                self.stats.jobs_over_run_time += 1
                self.fail(
                    job.job_id,
                    ErrorCode.DEADLINE_EXCEEDED,
                    f"job ran longer than this coordinator's maximum run time of {cfg.max_job_run_s:g} s "
                    f"per job (max_job_run_s); ask for fewer images or steps",
                )
        rows_in_use = self.active_rows
        while job := self._next_admission():
            if rows_in_use + job.n > cfg.max_rows:
                break  # it keeps its turn: admitted when enough rows are free
            self._dequeue(job)
            self._start(job, now)
            rows_in_use += job.n
        if cohorts < 1:
            raise ValueError(f"cohorts must be >= 1, got {cohorts}")
        if request_rows is not None and request_rows < 1:
            raise ValueError(f"request_rows must be >= 1 or None, got {request_rows}")
        cap = -(-rows_in_use // cohorts)
        chosen, rows = [], 0
        for job_id, job in self._active.items():
            if job_id in self._in_flight:
                continue
            if chosen and rows + job.n > cap:
                break
            chosen.append(job)
            rows += job.n
        if not chosen:
            return None
        if request_rows is not None and cohorts > 1 and len(chosen) > 1:
            chosen = _whole_requests(chosen, request_rows)
        for job in chosen:
            job.deferred = False
            self._active[job.job_id] = self._active.pop(job.job_id)  # to the back: least recently scheduled first
        self._in_flight.update(job.job_id for job in chosen)
        return Batch([job.group for job in chosen], self.config.num_experts, unavailable)

    def _start(self, job: Job, now: float) -> None:
        req, cfg = job.request, self.config
        c2e = cfg.class_to_expert
        if job.group is None:  # (a restored job brings its rows: see restore)
            job.group = RowGroup.from_seed(
                job.job_id,
                job.seed,
                job.digits,
                cfg.image_shape,
                steps=req.steps,
                solver=req.solver,
                strategy=req.strategy,
                top_k=req.top_k,
                num_experts=cfg.num_experts,
                oracle_expert=np.array([c2e[y] if c2e is not None and y >= 0 else -1 for y in job.digits], np.int64),
                guidance=req.guidance,
            )
        if req.report_dtypes and job.group.answered is None:
            job.group.answered = [set() for _ in range(cfg.num_experts)]
        if job.started_at is None:  # (a restored job keeps its first start)
            job.started_at = now
        self._active[job.job_id] = job
        self._active_rows += job.n
        self._count(self._client_rows, job.client, job.n)
        self._admissions += 1
        for key in _keys(job.client):
            self._served.pop(key, None)
            self._served[key] = self._admissions
        while len(self._served) > MAX_TRACKED_CLIENTS:
            del self._served[next(iter(self._served))]

    def _next_admission(self) -> Job | None:
        """The waiting job to admit next: the head job of the client with the fewest running rows
        (ties: the client admitted least recently), of that client's sessions the one with the
        fewest running rows (ties: least recently admitted, then the job that waited longest),
        skipping clients and sessions at their row quota; None if none."""
        best: tuple[int, int, int, int, int] | None = None
        pick = None
        for client, job in self._heads().items():
            if self._held(client, job.n):
                continue
            owner = owner_of_key(client)
            key = (
                self._client_rows.get(owner, 0),
                self._served.get(owner, -1),
                self._client_rows.get(client, 0),
                self._served.get(client, -1),
                job.seq,
            )
            if best is None or key < best:
                best, pick = key, job
        return pick

    # ------------------------------------------------------------ update
    def update(self, batch: Batch, now: float) -> None:
        """Apply the batch's combined velocities: one solver stage per job, then emit events.

        A job with rows that no expert served fails: with the code of an expert it wanted that
        answered only garbage (`bad_reply`, see `Batch.mark_failed`), else `unavailable`."""
        self.stats.ticks += 1
        for g in batch.groups:  # these jobs may be scheduled again (a cancelled job is gone already)
            job = self._active.get(g.job_id)
            if job is not None and job.group is g:
                self._in_flight.discard(g.job_id)
        complete = batch.row_complete()
        u = batch.combined()
        used = batch.weights > 0
        experts = batch.experts_used()
        notes = batch.fallback_notes()
        weights32 = batch.router_w.astype(np.float32)
        euler = _EulerRows(batch, u)
        for gi, group in enumerate(batch.groups):
            job = self._active.get(group.job_id)
            if job is None or job.group is not group:  # cancelled or failed meanwhile
                continue
            rows = batch.group_rows(gi)
            row_notes = [notes[i] for i in range(rows.start, rows.stop) if i in notes] if notes else []
            self.stats.row_fallbacks += len(row_notes)
            if not complete[rows].all():
                self._fail_unserved(job, batch, rows, row_notes)
                continue
            job.pending_notes.extend(row_notes)
            if group.answered is not None and batch.workers:
                for k in np.nonzero(used[rows].any(axis=0))[0]:
                    group.answered[k].update(batch.workers.get(int(k), ()))
            group.usage += used[rows]
            group.last_weights = weights32[rows]
            group.last_experts = experts[rows]
            self.stats.row_evals += group.n
            if group.euler_next:
                if group.advance(u[rows], x_next=euler.x_next[rows]):
                    self._after_step(job, now, euler, rows)
            elif group.advance(u[rows]):
                self._after_step(job, now)

    def _fail_unserved(self, job: Job, batch: Batch, rows: slice, row_notes: list[str]) -> None:
        """Fail a job with rows left without a velocity this tick. If an expert failed with a code
        other than `unavailable` (bad replies), say so: `unavailable` would hide a broken worker."""
        bad = {k: c for k, c in batch.failed_codes.items() if c != ErrorCode.UNAVAILABLE}
        if bad:
            wanted = np.nonzero((batch.ideal[rows] > 0).any(axis=0))[0]
            k = ([int(k) for k in wanted if int(k) in bad] or sorted(bad))[0]
            self.fail(
                job.job_id,
                bad[k],
                f"expert {k} never sent a usable velocity for a step "
                f"({batch.failed_reasons.get(k, 'bad reply')}) and no other expert could take its rows",
            )
            return
        reasons = "; ".join(f"expert {k}: {r}" for k, r in batch.failed_reasons.items())
        why = row_notes[0] if row_notes else "no expert could serve the step"
        self.fail(
            job.job_id,
            ErrorCode.UNAVAILABLE,
            f"no expert could serve a step ({why}){'; ' + reasons if reasons else ''}",
        )

    def _after_step(self, job: Job, now: float, euler: _EulerRows | None = None, rows: slice | None = None) -> None:
        """A job completed a solver step: check it, emit its frame and, at the end, its images.
        `euler` / `rows`: the batch-wide Euler update the job's new x came from (its finite check
        and float16 frame are taken from there, computed once for the whole batch)."""
        g = job.group
        if not (euler.finite[rows].all() if euler is not None else np.isfinite(g.x).all()):
            self.fail(job.job_id, ErrorCode.NON_FINITE, f"samples became NaN/Inf at step {g.step}")
            return
        job.step = g.step
        req = job.request
        notes, job.pending_notes = job.pending_notes, []
        room = MAX_NOTES - len(job.notes)
        job.notes.extend(notes[: max(room, 0)])
        if req.stream and (job.step % req.frame_every == 0 or g.done):
            self._events.append(
                FrameEvent.trusted(  # built here to the schema: see FrameEvent.trusted
                    job_id=job.job_id,
                    step=job.step,
                    steps=req.steps,
                    t=g.t,
                    x=euler.frame16[rows] if euler is not None else frame_float16(g.x),
                    experts=g.last_experts.tolist(),
                    weights=g.last_weights,
                    notes=notes,
                    x1=(frame_float16(g.x + (1.0 - g.t) * g.last_u) if req.frame_x1 and g.last_u is not None else None),
                )
            )
        if g.done:
            self._deactivate(job)
            self.stats.jobs_done += 1
            self.stats.images_done += job.n
            lo, hi = self.config.value_range
            final = g.x.astype(np.float32) if self.config.latent else np.clip(g.x, lo, hi).astype(np.float32)
            self._events.append(
                DoneEvent(
                    job_id=job.job_id,
                    images=final,
                    latents=final if self.config.latent else None,
                    **{req.label_field: job.digits},
                    usage=(g.usage / max(g.evals, 1)).astype(np.float32),
                    steps=req.steps,
                    strategy=req.strategy,
                    elapsed_s=max(now - job.submitted_at, 0.0),
                    notes=job.notes,
                    expert_dtypes=self.expert_dtypes(g),
                )
            )


def _whole_requests(jobs: list[Job], request_rows: int) -> list[Job]:
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


class _EulerRows:
    """The Euler update of every row of a batch in one pass, for the groups whose next stage is
    one (`RowGroup.euler_next`): x_next [R, C, H, W] float32 = euler_update(batch.x, dt per row, u),
    and, computed on first use, `finite` [R] (no NaN/Inf in the row) and `frame16` [R, C, H, W]
    (x_next clipped to +-6e4, float16: a frame's x). Rows of other groups hold values nobody
    reads. Elementwise, so each group's slice has the bits its own update would have given."""

    def __init__(self, batch: Batch, u: np.ndarray):
        groups = batch.groups
        dts = np.array([g.dt if g.euler_next else 0.0 for g in groups], np.float32)
        self.x_next = euler_update(batch.x, np.repeat(dts, np.diff(batch.bounds)), u)
        self._finite: np.ndarray | None = None
        self._frame16: np.ndarray | None = None

    @property
    def finite(self) -> np.ndarray:
        if self._finite is None:
            self._finite = np.isfinite(self.x_next).reshape(len(self.x_next), -1).all(axis=1)
        return self._finite

    @property
    def frame16(self) -> np.ndarray:
        if self._frame16 is None:
            self._frame16 = frame_float16(self.x_next)
        return self._frame16
