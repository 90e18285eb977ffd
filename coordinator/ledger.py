"""The coordinator's job ledger: which client owns which job, how far each live job got, and the
terminal events of the jobs that finished recently (for status requests that missed them).

Job ids are per client: a job is named by (client token, job id), so two clients may both run a job
"abc", and a client learns nothing of another's ids. The engine and the scheduler know each job by
an *internal* id: the client's own id when no other job holds it (the usual case), else a fresh
random one; events leave the coordinator under the client's id (`JobLedger.name_of`).

Bounds: the finished cache keeps at most `keep_finished` events, `keep_finished_bytes` bytes (images
and usage arrays + 256 bytes each) and `keep_finished_s` seconds; the live maps hold live jobs only.
"""

from __future__ import annotations

import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

#: (client token, the client's job id)
JobName = tuple[str, str]


class JobLedger:
    """Owners, progress and recently finished jobs, keyed by (client, job id)."""

    def __init__(
        self, *, keep_finished: int = 256, keep_finished_bytes: int = 64 << 20, keep_finished_s: float = 600.0
    ):
        self.keep_finished, self.keep_finished_bytes, self.keep_finished_s = (
            keep_finished,
            keep_finished_bytes,
            keep_finished_s,
        )
        self._live: dict[JobName, str] = {}  # (client, job id) -> internal id
        self._names: dict[str, JobName] = {}  # internal id -> (client, job id)
        self._progress: dict[str, tuple[int, int]] = {}  # internal id -> (step, steps) last known
        # internal id -> the job's owner epoch here (0: not durable; 1: a durable job's first owner; one
        # more at each take-over), and whether its events carry it (JobRequest.report_epoch)
        self._epochs: dict[str, tuple[int, bool]] = {}
        self._in_parts: set[str] = set()  # internal ids of the live jobs that take a `done` in parts
        # (client, job id) -> (monotonic t, terminal event (client's job id), bytes, (step, steps) reached,
        # whether its `done` may go out in parts)
        self._finished: OrderedDict[JobName, tuple[float, Any, int, tuple[int, int], bool]] = OrderedDict()
        self._finished_bytes = 0

    # ------------------------------------------------------------ live jobs
    def internal_id_for(self, client: str, job_id: str | None, taken: Callable[[str], bool]) -> str | None:
        """The internal id for a new job of `client` asking for `job_id` (None: let the scheduler draw
        one): `job_id` itself unless `taken(job_id)` (another client's job holds it), then a fresh one."""
        if job_id is None or not taken(job_id):
            return job_id
        while True:
            fresh = secrets.token_hex(8)
            if not taken(fresh):
                return fresh

    def is_live(self, client: str, job_id: str) -> bool:
        return (client, job_id) in self._live

    def admit(
        self,
        internal: str,
        client: str,
        job_id: str,
        steps: int,
        step: int = 0,
        *,
        epoch: int = 0,
        report_epoch: bool = False,
        image_parts: bool = False,
    ) -> None:
        """Record a job just admitted (or resumed at `step`), held here at owner `epoch`; with
        `report_epoch` its events carry it (`stamp`); with `image_parts` its `done` may go out in parts
        (`in_parts`)."""
        self._live[(client, job_id)] = internal
        self._names[internal] = (client, job_id)
        self._progress[internal] = (int(step), int(steps))
        self._epochs[internal] = (int(epoch), bool(report_epoch))
        if image_parts:
            self._in_parts.add(internal)

    def in_parts(self, client: str, job_id: str) -> bool:
        """Whether `client`'s live or recently finished job `job_id` asked for its `done` in parts when it is
        too large for one message (JobRequest.image_parts)."""
        internal = self._live.get((client, job_id))
        if internal is not None:
            return internal in self._in_parts
        item = self._finished.get((client, job_id))
        return bool(item and item[4])

    def epoch_of(self, internal: str) -> int:
        """The owner epoch this coordinator holds a live job at (0 for a job it does not know)."""
        return self._epochs.get(internal, (0, False))[0]

    def stamp(self, internal: str, event):
        """`event` with the job's `epoch` set, when the job asked for it (JobRequest.report_epoch);
        else `event` itself."""
        epoch, report = self._epochs.get(internal, (0, False))
        if not report or getattr(event, "epoch", None) == epoch:
            return event
        return event.model_copy(update={"epoch": epoch})

    def internal(self, client: str, job_id: str) -> str | None:
        """The internal id of `client`'s live job `job_id`, or None."""
        return self._live.get((client, job_id))

    def find(self, job_id: str, client: str | None = None) -> str | None:
        """The internal id of a live job: `client`'s `job_id`; without `client` (in-process callers),
        the job whose internal or client id is `job_id`."""
        if client is not None:
            return self.internal(client, job_id)
        if job_id in self._names:
            return job_id
        return next((i for (c, j), i in self._live.items() if j == job_id), None)

    def name_of(self, internal: str) -> JobName | None:
        """(client, job id) of a live job known by `internal`, else None."""
        return self._names.get(internal)

    def note_progress(self, internal: str, step: int, steps: int) -> None:
        if internal in self._progress:
            self._progress[internal] = (int(step), int(steps))

    def progress(self, internal: str) -> tuple[int, int] | None:
        """(step, steps) last known of a live job, else None."""
        return self._progress.get(internal)

    def forget(self, internal: str) -> JobName | None:
        """Drop a live job without a terminal event (fenced, handed over); returns its name."""
        self._progress.pop(internal, None)
        return self._unlink(internal)

    def _unlink(self, internal: str) -> JobName | None:
        self._epochs.pop(internal, None)
        self._in_parts.discard(internal)
        name = self._names.pop(internal, None)
        if name is not None and self._live.get(name) == internal:
            del self._live[name]
        return name

    def prune(self, still_known: Callable[[str], bool], keep: str, limit: int) -> None:
        """Should a job ever leave without a terminal event, drop the live entries the scheduler no
        longer knows once the maps outgrow `limit` (never `keep`, the job just admitted)."""
        if len(self._names) > limit:
            for stale in [i for i in self._names if i != keep and not still_known(i)]:
                self.forget(stale)

    def live_count(self) -> int:
        return len(self._names)

    # ------------------------------------------------------------ finished jobs
    def remember(self, internal: str, event) -> JobName | None:
        """Keep a terminal event (its job id already the client's) for status requests, with the
        (step, steps) the job reached: all of them for `done`; for `failed` the last step known."""
        in_parts = internal in self._in_parts
        name = self._unlink(internal)
        if name is None:
            return None
        old = self._finished.pop(name, None)
        if old is not None:
            self._finished_bytes -= old[2]
        arrays = (getattr(event, f, None) for f in ("images", "usage", "latents"))
        size = sum(int(a.nbytes) for a in arrays if a is not None) + 256
        reached = self._progress.pop(internal, None)
        if event.kind == "done":
            reached = (int(event.steps), int(event.steps))
        self._finished[name] = (time.monotonic(), event, size, reached or (0, 0), in_parts)
        self._finished_bytes += size
        self._forget_old()
        return name

    def _forget_old(self) -> None:
        now = time.monotonic()
        while self._finished:
            t, _, size, _, _ = next(iter(self._finished.values()))
            if (
                len(self._finished) <= self.keep_finished
                and self._finished_bytes <= self.keep_finished_bytes
                and now - t <= self.keep_finished_s
            ):
                break
            self._finished.popitem(last=False)
            self._finished_bytes -= size

    def finished(self, client: str, job_id: str) -> tuple[Any, tuple[int, int]] | None:
        """(terminal event, (step, steps) reached) of `client`'s recently finished job, else None."""
        self._forget_old()
        item = self._finished.get((client, job_id))
        return (item[1], item[3]) if item else None

    def find_finished(self, job_id: str, client: str | None = None) -> tuple[JobName, Any, tuple[int, int]] | None:
        """Like `finished`; without `client`, any client's finished job `job_id` (the newest)."""
        self._forget_old()
        if client is not None:
            item = self._finished.get((client, job_id))
            return ((client, job_id), item[1], item[3]) if item else None
        for name in reversed(self._finished):
            if name[1] == job_id:
                item = self._finished[name]
                return name, item[1], item[3]
        return None
