"""A held job <-> its `JobCheckpoint` (pure, no I/O): the copy `Scheduler.checkpoint` takes, and the
checks and the rebuilt job `Scheduler.restore` takes it back with.

A restore is exact: a started job's rows come back with their committed state (x, step, Heun's
stage and v0, evaluations, last router weights, usage), so the job runs on from `cp.step` and ends
with the same images as if it had never stopped (what the snapshot stores and why:
`coordinator.snapshot`). A checkpoint that does not fit this coordinator (rows of another shape,
another number of experts, an inconsistent solver state, labels out of range, a job over the
admission limits) is refused with `Rejected`, each reason starting "restore: ".
"""

from __future__ import annotations

import numpy as np

from schemas import ErrorCode

from .admission import Rejected, check_limits
from .job_table import MAX_NOTES, Job
from .rows import RowGroup
from .scheduler_config import SchedulerConfig
from .snapshot import JobCheckpoint


def checkpoint_of(job: Job, running: bool) -> JobCheckpoint:
    """A copy of `job`'s state. A running job's committed rows are taken (a batch in flight has not
    touched them yet); a waiting job's checkpoint has `x = None`."""
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
    if running and g is not None:
        cp.x = np.array(g.x, np.float32, copy=True)
        cp.step, cp.stage, cp.evals, cp.routed_at = int(g.step), int(g.stage), int(g.evals), int(g.routed_at)
        cp.v0 = None if g.v0 is None else np.array(g.v0, np.float32, copy=True)
        cp.usage = np.array(g.usage, np.int64, copy=True)
        cp.route_w = None if g.route_w is None else np.array(g.route_w, np.float64, copy=True)
        cp.oracle_expert = np.array(g.oracle_expert, np.int64, copy=True)
    return cp


def restored_rows(cp: JobCheckpoint, cfg: SchedulerConfig) -> RowGroup | None:
    """Check that `cp` fits this configuration and the admission limits (Rejected if not); the rows of a
    started job rebuilt exactly, or None for a job that had not started (it starts from its seed)."""
    req, n = cp.request, cp.n
    if n < 1 or n != req.n_images:
        raise Rejected(ErrorCode.BAD_REQUEST, f"restore: {n} digits for a job of {req.n_images} images")
    if any(not -1 <= int(d) < cfg.num_classes for d in cp.digits):  # -1: label unknown
        raise Rejected(ErrorCode.BAD_REQUEST, f"restore: digits must be in [0, {cfg.num_classes}) or -1")
    check_limits(cfg, req, cp.client, "restore: ")  # n == req.n_images, checked above
    if cp.x is None:
        return None
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
            f"restore: inconsistent solver state (step {cp.step} of {req.steps}, stage {cp.stage}, {req.solver})",
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
    return group


def restored_job(cp: JobCheckpoint, group: RowGroup | None, seq: int) -> Job:
    """The job of `cp` with its rows `group` (`restored_rows`), `seq` its place in arrival order here.
    Its deadline still counts from its first submit, a started job keeps its first start."""
    req = cp.request
    return Job(
        request=req,
        job_id=cp.job_id,
        digits=[int(d) for d in cp.digits],
        seed=int(cp.seed),
        submitted_at=float(cp.submitted_at),
        deadline=cp.submitted_at + req.deadline_s if req.deadline_s is not None else None,
        client=cp.client,
        seq=seq,
        group=group,
        step=int(cp.step) if group is not None else 0,
        started_at=cp.started_at if group is not None else None,
        notes=list(cp.notes)[:MAX_NOTES],
        pending_notes=list(cp.pending_notes),
    )
