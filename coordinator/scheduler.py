"""The pure scheduler: jobs in, batches out, events back. No I/O, no clocks of its own.

The engine loop is `schedule -> execute -> update` (as in vLLM):

    sched.submit(JobRequest, now, client) -> Admission   (raises Rejected when over the limits)
    batch = sched.schedule(now)                          admit queued jobs, expire deadlines;
                                                         a Batch of one cohort's rows, or None
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

The Scheduler composes its parts, each a module of its own (all pure):

* `coordinator.job_table`: the jobs held (waiting, running, in flight) and each client's usage;
* `coordinator.admission`: the limits and fair sharing across clients and sessions (`Rejected`,
  `job_cost`, which waiting job starts next);
* `coordinator.cohorts`: which running jobs ride in the next batch (cohorts, whole requests);
* `coordinator.restore`: a job to its snapshot (`checkpoint`) and back (`restore`);
* `coordinator.scheduler_config`: `SchedulerConfig`, the limits and shapes.

Here: intake (submit, cancel, fail, drop), deadlines, `schedule`, and `update` with the events it
emits. `Rejected`, `SchedulerConfig`, `job_cost`, `experts_per_row`, `EVALS_PER_STEP` and
`DEFAULT_CLIENT` are re-exported from here.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from flow.solver import euler_update
from schemas import UNCONDITIONAL, DoneEvent, ErrorCode, FailedEvent, FrameEvent, JobRequest
from schemas.tensor import frame_float16

from .admission import EVALS_PER_STEP as EVALS_PER_STEP
from .admission import MAX_CLIENT_KEY_LEN, Admission, FairShare, Rejected, check_limits
from .admission import experts_per_row as experts_per_row
from .admission import job_cost as job_cost
from .batch import Batch
from .cohorts import next_cohort
from .job_table import DEFAULT_CLIENT, MAX_NOTES, Job, JobTable
from .restore import checkpoint_of, restored_job, restored_rows
from .rows import RowGroup, draw_digits
from .scheduler_config import SchedulerConfig
from .snapshot import JobCheckpoint


def _with_guidance(progress: dict, request: JobRequest) -> dict:
    """`progress` (a job_progress dict) with the job's `guidance_scale` when it asked for one other than 1."""
    if request.guidance != 1.0:
        progress["guidance_scale"] = request.guidance
    return progress


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
        self._jobs = JobTable()
        self._fair = FairShare(config, self._jobs)
        self._seq = 0  # jobs taken (arrival order: ties in fair admission)
        self.stats = Stats()
        self._events: list = []

    # ------------------------------------------------------------ what callers may read
    @property
    def active_rows(self) -> int:
        """Rows (images) of the running jobs."""
        return self._jobs.active_rows

    @property
    def active_jobs(self) -> int:
        """Jobs running (in the batch of the next tick)."""
        return len(self._jobs.active)

    @property
    def queued_jobs(self) -> int:
        """Jobs waiting for rows (the queue depth)."""
        return len(self._jobs.queue)

    def active_job_ids(self) -> list[str]:
        """Ids of the running jobs, in the order they started."""
        return list(self._jobs.active)

    def queued_job_ids(self) -> list[str]:
        """Ids of the waiting jobs, in arrival order."""
        return [j.job_id for j in self._jobs.queue]

    def knows(self, job_id: str) -> bool:
        return self._jobs.knows(job_id)

    def owner_of(self, job_id: str) -> str | None:
        """The client key given when a queued or running job was submitted, else None."""
        job = self._jobs.find(job_id)
        return job.client if job is not None else None

    def client_usage(self, client: str) -> dict[str, int]:
        """{running_rows, queued_jobs} of one client ("c": all its sessions together) or one session
        ("c/s"); zeros for one with nothing here."""
        jobs = self._jobs
        return dict(running_rows=jobs.client_rows.get(client, 0), queued_jobs=jobs.client_queued.get(client, 0))

    def job_progress(self, job_id: str) -> dict | None:
        """{state: queued|running, step, steps, queue_position (1-based; 0 when running)} of a job
        this scheduler holds, else None (never had it, or it finished)."""
        job = self._jobs.active.get(job_id)
        if job is not None:
            out = dict(state="running", step=int(job.step), steps=int(job.request.steps), queue_position=0)
            if job.request.report_dtypes:
                out["expert_dtypes"] = self.expert_dtypes(job.group)
            return _with_guidance(out, job.request)
        for i, job in enumerate(self._jobs.queue):
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
        check_limits(cfg, request, client, "")
        if request.classes is not None and any(d >= cfg.num_classes for d in request.classes):
            raise Rejected(
                ErrorCode.BAD_REQUEST,
                f"{request.label_field} must be in [0, {cfg.num_classes}) (or {UNCONDITIONAL}: label unknown)",
            )
        job_id = job_id or request.job_id or secrets.token_hex(8)
        if self.knows(job_id):
            raise Rejected(ErrorCode.BAD_REQUEST, f"job id {job_id!r} is already in use")
        starts_now = self._fair.starts_now(client, n)
        if not starts_now:
            self._fair.check_may_wait(client, "")
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
        return self._enter(job, now, starts_now)

    def _enter(self, job: Job, now: float, starts_now: bool) -> Admission:
        """A job taken (submitted or restored): running now when `starts_now` (rows are free and nobody
        else could take them: in the next tick's batch), else at the back of the queue."""
        if starts_now:
            self._start(job, now)
        else:
            self._jobs.enqueue(job)
        return Admission(
            job_id=job.job_id, digits=job.digits, seed=job.seed, queue_position=0 if starts_now else self.queued_jobs
        )

    def cancel(self, job_id: str, now: float, reason: str = "cancelled by client") -> bool:
        """Drop a queued or running job now; emits FailedEvent(cancelled). False if unknown."""
        if self._jobs.remove(job_id) is None:
            return False
        self.stats.jobs_cancelled += 1
        self._events.append(FailedEvent(job_id=job_id, code=ErrorCode.CANCELLED, reason=reason))
        return True

    def fail(self, job_id: str, code: ErrorCode, reason: str) -> bool:
        """Fail a queued or running job (e.g. the engine hit an internal error)."""
        if self._jobs.remove(job_id) is None:
            return False
        self.stats.jobs_failed += 1
        self._events.append(FailedEvent(job_id=job_id, code=code, reason=reason))
        return True

    def fail_all(self, code: ErrorCode, reason: str) -> None:
        """Fail every running and queued job."""
        for job_id in [*self._jobs.active, *(j.job_id for j in self._jobs.queue)]:
            self.fail(job_id, code, reason)

    def fail_batch(self, batch: Batch, code: ErrorCode, reason: str) -> None:
        """Fail the jobs of `batch` that are still running (e.g. the tick that carried them broke), but
        not those it released (they took their step ahead of it: `Batch.released`)."""
        for gi, g in enumerate(batch.groups):
            if gi not in batch.released and self._jobs.running(g.job_id, g) is not None:
                self.fail(g.job_id, code, reason)

    def drop(self, job_id: str) -> bool:
        """Forget a queued or running job without any event (its client hears nothing from here):
        for a durable coordinator that lost the job to another one, or hands it over. False if unknown."""
        return self._jobs.remove(job_id) is not None

    # ------------------------------------------------------------ checkpoint / restore
    def checkpoint(self, job_id: str) -> JobCheckpoint | None:
        """A copy of a held job's state (`coordinator.snapshot.JobCheckpoint`, taken by
        `coordinator.restore.checkpoint_of`), or None if unknown. A running job's committed state is
        taken (a batch in flight has not touched it yet); a queued job's has `x = None`."""
        job = self._jobs.find(job_id)
        return None if job is None else checkpoint_of(job, running=job_id in self._jobs.active)

    def restore(self, cp: JobCheckpoint, now: float) -> Admission:
        """Take a job back from its checkpoint (taken here or by another coordinator) exactly where it
        was: it runs on from `cp.step` and ends with the same images as if it had never stopped.
        The admission limits apply as for a submit: it starts now if its rows are free, else waits in
        the queue (keeping its rows); raises Rejected (code, reason, limit) when it is too large for
        this coordinator, the queue is full, or the checkpoint does not fit this configuration
        (experts, image shape, job id in use; see `coordinator.restore`)."""
        client = cp.client
        if not isinstance(client, str) or not 1 <= len(client) <= MAX_CLIENT_KEY_LEN:
            raise Rejected(ErrorCode.BAD_REQUEST, f"restore: client key must be 1-{MAX_CLIENT_KEY_LEN} characters")
        if self.knows(cp.job_id):
            raise Rejected(ErrorCode.BAD_REQUEST, f"restore: job id {cp.job_id!r} is already in use here")
        group = restored_rows(cp, self.config)
        starts_now = self._fair.starts_now(client, cp.n)
        if not starts_now:
            self._fair.check_may_wait(client, "restore: ")
        self._seq += 1
        return self._enter(restored_job(cp, group, self._seq), now, starts_now)

    def pop_events(self) -> list:
        ev, self._events = self._events, []
        return ev

    @property
    def has_events(self) -> bool:
        """Whether events wait for `pop_events`."""
        return bool(self._events)

    # ------------------------------------------------------------ schedule
    @property
    def in_flight_rows(self) -> int:
        """Rows of the jobs whose batch is out (scheduled, not yet updated)."""
        return self._jobs.in_flight_rows

    def schedule(
        self,
        now: float,
        unavailable: frozenset[int] | set[int] = frozenset(),
        *,
        cohorts: int = 1,
        request_rows: int | None = None,
    ) -> Batch | None:
        """Expire deadlines and run times, admit queued jobs fairly (`coordinator.admission`),
        return a Batch of the active rows that are not already in a batch, or None.

        A job sits in at most one batch at a time (in flight from `schedule` until `update`, or
        `fail_batch`, `cancel`, `fail`). `cohorts=C`: the batch takes at most ceil(active rows / C)
        rows, so C batches can be out at once (1: every free job, the lock-step tick);
        `request_rows` R (None: off; only with C > 1): the youngest jobs that would only make up an
        expert's last partial request of R rows wait for the next batch. Which jobs, in which order:
        `coordinator.cohorts`."""
        self._expire(now)
        while job := self._fair.next_admission():
            if self.active_rows + job.n > self.config.max_rows:
                break  # it keeps its turn: admitted when enough rows are free
            self._jobs.dequeue(job)
            self._start(job, now)
        chosen = next_cohort(self._jobs, cohorts, request_rows)
        if not chosen:
            return None
        self._jobs.send(chosen)
        return Batch([job.group for job in chosen], self.config.num_experts, unavailable)

    def _expire(self, now: float) -> None:
        """Fail the jobs past their deadline, and the running ones past `max_job_run_s`."""
        cfg = self.config
        for job in [*self._jobs.active.values(), *self._jobs.queue]:
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
        self._jobs.activate(job)
        self._fair.admitted(job.client)

    # ------------------------------------------------------------ update
    def update(self, batch: Batch, now: float, *, part: bool = False) -> None:
        """Apply the batch's combined velocities: one solver stage per job, then emit events.
        `part`: the batch is some jobs of a tick's batch, updated ahead of the rest (the engine's
        early update): they stay in flight until the tick ends (`returned`), and the tick is counted
        once, by its last update. The groups a batch has released (`Batch.released`: updated ahead
        that way) are left alone.

        A job with rows that no expert served fails: with the code of an expert it wanted that
        answered only garbage (`bad_reply`, see `Batch.mark_failed`), else `unavailable`."""
        if not part:
            self.stats.ticks += 1
            self.returned(batch.groups)
        complete = batch.row_complete()
        u = batch.combined()
        used = batch.weights > 0
        experts = batch.experts_used()
        notes = batch.fallback_notes()
        weights32 = batch.router_w.astype(np.float32)
        euler = _EulerRows(batch, u)
        released = batch.released
        for gi, group in enumerate(batch.groups):
            if gi in released:
                continue
            job = self._jobs.running(group.job_id, group)
            if job is None:  # cancelled or failed meanwhile
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

    def returned(self, groups) -> None:
        """The jobs of these row groups may be scheduled again: their batch came back (a cancelled or
        failed job is gone already)."""
        for g in groups:
            if self._jobs.running(g.job_id, g) is not None:
                self._jobs.in_flight.discard(g.job_id)

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
            self._jobs.deactivate(job)
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


class _EulerRows:
    """The Euler update of every row of a batch in one pass, for the groups whose next stage is
    one (`RowGroup.euler_next`): x_next [R, C, H, W] float32 = euler_update(batch.x, dt per row, u),
    and, computed on first use, `finite` [R] (no NaN/Inf in the row) and `frame16` [R, C, H, W]
    (x_next clipped to +-6e4, float16: a frame's x). Rows of other groups hold values nobody
    reads. Elementwise, so each group's slice has the bits its own update would have given."""

    def __init__(self, batch: Batch, u: np.ndarray):
        skip = batch.released  # (groups that took their step ahead of the batch: not stepped here)
        dts = np.array(
            [g.dt if g.euler_next and gi not in skip else 0.0 for gi, g in enumerate(batch.groups)], np.float32
        )
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
