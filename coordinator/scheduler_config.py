"""`SchedulerConfig`: the scheduler's limits and shapes, checked once (pure, no I/O).

Its own module, below the parts of the scheduler that read it (`admission`, `restore`) and the
scheduler itself; `coordinator.scheduler` re-exports it. What each limit means and how admission
applies it: the `coordinator.admission` docstring.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass
class SchedulerConfig:
    """Limits and shapes. `class_to_expert[y]` is the partition owning class y (oracle).

    Per-client limits (see `coordinator.admission`): max_client_rows (None: max_rows; a client's
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
