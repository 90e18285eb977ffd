"""Admission (pure, no I/O): which jobs a scheduler takes, and in which order waiting jobs start.

* `Rejected`, the refusal a submit or a restore raises, naming the `SchedulerConfig` limit;
* `job_cost` (with `experts_per_row`, `EVALS_PER_STEP`), the row-evaluations a job costs;
* `check_limits`, the limits a job can never pass here (rows at once, job cost, oracle without a
  partition), the same for a submit and a restore;
* `FairShare`, the quotas and the fair order over a `JobTable`: may a job wait, may it start at
  once, which waiting job goes next (the rules below);
* `Admission`, what the caller of a submit or a restore gets back.

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

from dataclasses import dataclass

from schemas import ErrorCode, JobRequest
from schemas.limits import MAX_PAYLOAD_BYTES

from .done_parts import PART_MARGIN_BYTES
from .job_table import Job, JobTable, owner_of_key, usage_keys
from .scheduler_config import SchedulerConfig

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


@dataclass(frozen=True)
class Admission:
    """A job the scheduler took: its id, labels, seed, and place in the queue (0 = running)."""

    job_id: str
    digits: list[int]
    seed: int
    queue_position: int


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


def check_limits(cfg: SchedulerConfig, request: JobRequest, client: str, prefix: str) -> None:
    """Raise Rejected if a job of `request` for key `client` can never run here, the admission
    limits a submit and a restore share: rows at once (coordinator, client, session), job cost,
    and a partition manifest for the oracle strategy. `prefix` starts each reason ("restore: ")."""
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


class FairShare:
    """The row and queue quotas of clients and sessions over a `JobTable`, and the fair order in
    which waiting jobs start. It reads the table's usage counts and remembers, per client and
    session, when it was last admitted (`admitted`), for the round robin."""

    def __init__(self, config: SchedulerConfig, jobs: JobTable):
        self.config = config
        self.jobs = jobs
        self._served: dict[str, int] = {}  # client or session -> admission count at its last admission (LRU order)
        self._admissions = 0

    def check_may_wait(self, client: str, prefix: str) -> None:
        """Raise Rejected(overloaded) if a job of key `client` may not wait: the queue is full, or its
        client, or its session, has its quota of queued jobs. `prefix` starts each reason
        ("restore: "; a full queue's reason then does not say "retry later": the durable take-over
        that restores leaves the job for another coordinator)."""
        cfg, jobs = self.config, self.jobs
        if len(jobs.queue) >= cfg.max_queued_jobs:
            raise Rejected(
                ErrorCode.OVERLOADED,
                f"{prefix}{len(jobs.queue)} jobs already queued (limit {cfg.max_queued_jobs})"
                + ("" if prefix else "; retry later"),
                "max_queued_jobs",
            )
        owner = owner_of_key(client)
        for key, limit, what, name in (
            (owner, cfg.client_queued_jobs, "client", "max_client_queued_jobs"),
            (client, cfg.session_queued_jobs, "session", "max_session_queued_jobs"),
        ):
            if what == "session" and key == owner:
                continue
            queued = jobs.client_queued.get(key, 0)
            if queued >= limit:
                raise Rejected(
                    ErrorCode.OVERLOADED,
                    (
                        f"{prefix}{what} quota: {queued} queued jobs (limit {limit}) and "
                        f"{jobs.client_rows.get(key, 0)} running rows; retry when one finishes"
                    ),
                    name,
                )

    def held(self, client: str, n: int) -> bool:
        """True if n more rows of key `client` would pass its client's or its session's row quota."""
        cfg, rows = self.config, self.jobs.client_rows
        owner = owner_of_key(client)
        if rows.get(owner, 0) + n > cfg.client_rows:
            return True
        return owner != client and rows.get(client, 0) + n > cfg.session_rows

    def starts_now(self, client: str, n: int) -> bool:
        """A new job of `client` with n rows may start at once: its session (or client without one)
        has nothing waiting, it fits the free rows and the quotas, and every waiting job is held by
        its own quotas (so none of them could take these rows)."""
        jobs = self.jobs
        if jobs.client_queued.get(client, 0) or jobs.active_rows + n > self.config.max_rows:
            return False
        if self.held(client, n):
            return False
        return all(self.held(c, j.n) for c, j in jobs.heads().items())

    def next_admission(self) -> Job | None:
        """The waiting job to admit next: the head job of the client with the fewest running rows
        (ties: the client admitted least recently), of that client's sessions the one with the
        fewest running rows (ties: least recently admitted, then the job that waited longest),
        skipping clients and sessions at their row quota; None if none."""
        rows = self.jobs.client_rows
        best: tuple[int, int, int, int, int] | None = None
        pick = None
        for client, job in self.jobs.heads().items():
            if self.held(client, job.n):
                continue
            owner = owner_of_key(client)
            key = (
                rows.get(owner, 0),
                self._served.get(owner, -1),
                rows.get(client, 0),
                self._served.get(client, -1),
                job.seq,
            )
            if best is None or key < best:
                best, pick = key, job
        return pick

    def admitted(self, client: str) -> None:
        """A job of key `client` started: its client and session go to the back of the round robin."""
        self._admissions += 1
        for key in usage_keys(client):
            self._served.pop(key, None)
            self._served[key] = self._admissions
        while len(self._served) > MAX_TRACKED_CLIENTS:
            del self._served[next(iter(self._served))]


# ---------------------------------------------------------------- events that fit a message

#: Bytes an event spends beside its tensors (map keys, job id, labels, experts, notes, epoch): a generous
#: bound for 256 images (their labels and expert ids take a few bytes each).
EVENT_OVERHEAD_BYTES = 64 * 1024


def largest_event(
    request: JobRequest,
    sample_shape: tuple[int, ...],
    image_shape: tuple[int, ...] | None,
    num_experts: int,
    latent: bool,
    limit: int = MAX_PAYLOAD_BYTES,
) -> tuple[str, int]:
    """(kind, bytes) of the largest event a job of `request` publishes, an upper bound of its packed size:
    a `frame` (x float16, x1 float16 when asked, the router weights, a latent fleet's decoded preview float16
    when asked) or the `done` (images float32, a latent fleet's latents float32 when asked, the usage).
    `image_shape`: the images clients get (a pixel fleet's samples; a latent fleet's decoded images, None
    while no decoder has said: then the parts made of them are left out). A job that takes its `done` in
    parts (`image_parts`) sends it whole when it fits a message of `limit` bytes, else in parts: then the larger
    of a `done_part` of one image (or one latent: kind "done_part") and the `done` that counts them counts."""
    n, k = request.n_images, num_experts
    sample = _elements(sample_shape)
    image = _elements(image_shape) if image_shape is not None else 0
    per_row_weights = 8 * k  # float64 at most
    latents = 4 * sample if latent and request.return_latents else 0
    frame = 0
    if request.stream:
        frame = n * (2 * sample * (2 if request.frame_x1 else 1) + per_row_weights)
        if latent and request.preview_every is not None:
            frame += n * 2 * image
    done = n * (4 * image + per_row_weights + latents)
    result = ("done", done + EVENT_OVERHEAD_BYTES)
    if request.image_parts and result[1] > limit:  # in parts
        counted = ("done", n * per_row_weights + EVENT_OVERHEAD_BYTES)  # the done that counts its parts
        part = ("done_part", max(4 * image, latents) + PART_MARGIN_BYTES)  # a part holds one image at least
        result = max(counted, part, key=lambda e: e[1])
    return max(("frame", frame + EVENT_OVERHEAD_BYTES), result, key=lambda e: e[1])


def check_event_sizes(
    request: JobRequest,
    sample_shape: tuple[int, ...],
    image_shape: tuple[int, ...] | None,
    num_experts: int,
    latent: bool,
    limit: int,
) -> None:
    """Rejected (`too_large`, naming the limit) when an event of the job could not be published in one
    message of `limit` bytes (docs/PROTOCOL.md section 8): refused at submit, never failed at its end. A
    `done` too large is no refusal for a job that takes it in parts (`image_parts`), unless one image alone
    is too large."""
    kind, size = largest_event(request, sample_shape, image_shape, num_experts, latent, limit)
    if size <= limit:
        return
    shape = "x".join(map(str, image_shape if kind != "frame" and image_shape else sample_shape))
    if kind == "done_part":
        raise Rejected(
            ErrorCode.TOO_LARGE,
            f"one image of {shape} is {(size - PART_MARGIN_BYTES) / 2**20:.1f} MiB: even alone it does not fit "
            f"the {limit / 2**20:g} MiB message limit",
            "max_message_bytes",
        )
    per_image = -(-(size - EVENT_OVERHEAD_BYTES) // request.n_images)  # every part of the bound grows with n
    most = max(0, (limit - EVENT_OVERHEAD_BYTES) // per_image)
    raise Rejected(
        ErrorCode.TOO_LARGE,
        f"this job's {kind} event would be {size / 2**20:.1f} MiB ({request.n_images} images of {shape}) "
        f"over the {limit / 2**20:g} MiB message limit; ask for at most {most} images"
        + (" (or leave out frame_x1 / previews, or stream false)" if kind == "frame" else "")
        + ("" if kind == "frame" or request.image_parts else ", or set image_parts to receive the images in parts"),
        "max_message_bytes",
    )


def _elements(shape) -> int:
    out = 1
    for d in shape:
        out *= int(d)
    return out
