"""Expert worker discovery: what each expert worker on the bus says of itself, and the spec check of
workers that join after the coordinator started.

Every expert worker registers the NATS micro service `ddm-expert`; `WorkerDiscovery.refresh` gathers the
`$SRV.INFO` replies of a short window and learns from their metadata:

* `worker_dtypes`: worker id -> the dtype it computes in (`dtype`, or `precision` of older workers), what
  a job's `report_dtypes` answer names (`dtype(worker)`, which starts a discovery, at most every
  `DTYPE_REFRESH_S`, for a worker not known yet);
* `run_ahead_of`: expert -> the most steps every one of its workers runs ahead (`run_ahead`; an expert
  with a worker that does not say is absent: its requests never run ahead, coordinator/run_ahead.py);
* `guidance_of`: expert -> whether every one of its workers serves classifier-free guidance (`guidance`
  "true"; an older worker refuses `StepRequest.guidance`), for admitting guided jobs
  (`experts_without_guidance`);
* once the coordinator sets `fleet_spec`: each worker's advertised spec, checked
  (coordinator/fleet_spec.py `check_worker`). A worker that differs goes into `rejected_workers` (a
  warning naming it once, counted in `workers_rejected_total`); it is never addressed directly and its
  replies are refused. `on_checked(fenced, matching)` then tells the transport which experts have such a
  worker and which matching workers discovery found of each: the transport's legs fence those experts
  (coordinator/try_legs.py, `DispatchPolicy.fence`), so their requests go only to the matching workers'
  direct subjects, never to the queue group the odd worker shares (also with `dispatch="queue"`), unless
  no matching worker is known. The matching workers become known to the dispatch policy, and while these
  checks come in, its rule for unanswered tries holds (`DispatchPolicy.unanswered`: keep off the queue group).

Each discovery that gets through replaces these whole; a failed one (disconnected, closed) keeps the old.
The coordinator discovers every few seconds (`NatsTransport.refresh_workers`); the transport owns one
`WorkerDiscovery` and asks it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable

from bus.gather import gather_replies
from schemas.limits import MAX_RUN_AHEAD

from .fleet_spec import EXPERT_SERVICE, RejectedWorker, check_worker

log = logging.getLogger(__name__)

#: Fewest seconds between two discoveries started for an unknown worker's dtype (`WorkerDiscovery.dtype`).
DTYPE_REFRESH_S = 2.0


class WorkerDiscovery:
    """What the expert workers on the bus advertise (module docstring). on_checked(fenced experts, {expert:
    matching worker ids}) is called after every spec check, so that the transport steers fenced experts."""

    def __init__(self, nc, on_checked: Callable[[set[int], dict[int, list[str]]], None]):
        self.nc = nc
        self._on_checked = on_checked
        #: the fleet's model spec (set by the coordinator after its start check); None: workers unchecked
        self.fleet_spec = None
        self.worker_dtypes: dict[str, str] = {}
        self.run_ahead_of: dict[int, int] = {}
        self.guidance_of: dict[int, bool] = {}
        #: worker id -> RejectedWorker: on the bus at the last discovery, with a spec that differs from `fleet_spec`
        self.rejected_workers: dict[str, RejectedWorker] = {}
        self.workers_rejected_total = 0  # distinct workers ever rejected (each counted once)
        self._rejected_ever: set[str] = set()
        self._soon: asyncio.Task | None = None  # the discovery `refresh_soon` started
        self._started_at = float("-inf")  # monotonic time the last discovery started
        self._discovered_at = float("-inf")  # monotonic time the last discovery that got through ended

    def dtype(self, worker_id: str) -> str:
        """The dtype `worker_id` computes in ("float32", "bfloat16"), as its service metadata says; "" while
        unknown (a worker not discovered yet, whose discovery this starts, or one too old to say)."""
        got = self.worker_dtypes.get(worker_id)
        if got is None:
            self.refresh_soon()
            return ""
        return got

    def refresh_soon(self) -> None:
        """Start a discovery in the background, unless one is running or one started within DTYPE_REFRESH_S."""
        if self._soon is not None and not self._soon.done():
            return
        if time.monotonic() - self._started_at < DTYPE_REFRESH_S:
            return
        try:
            self._soon = asyncio.get_running_loop().create_task(self.refresh())
        except RuntimeError:  # no loop running (a synchronous caller): the next call on the loop will
            return

    async def refresh(self, window_s: float = 0.3) -> dict[str, str]:
        """Ask every expert worker for its service metadata (`$SRV.INFO.ddm-expert`, replies of `window_s`
        seconds), learn from it and check the workers' specs; returns `worker_dtypes`. Never raises: a
        failed discovery keeps what the last one learned."""
        self._started_at = time.monotonic()
        try:
            replies = await gather_replies(self.nc, f"$SRV.INFO.{EXPERT_SERVICE}", window=window_s)
        except Exception as err:  # disconnected, closed: try again later
            log.debug("worker dtype discovery failed: %r", err)
            return self.worker_dtypes
        infos = self._learn(replies)
        self._discovered_at = time.monotonic()
        if self.fleet_spec is not None:
            self._check_specs(infos)
        return self.worker_dtypes

    def _learn(self, replies: list[bytes]) -> list[dict]:
        """Replace what is known by what `replies` say; returns the decoded replies that name a worker."""
        found: dict[str, str] = {}
        ahead: dict[int, int] = {}
        guides: dict[int, bool] = {}
        infos = []
        for raw in replies:
            try:
                info = json.loads(raw)
                md = info.get("metadata")
            except (ValueError, AttributeError):
                continue
            if isinstance(md, dict) and isinstance(md.get("worker_id"), str):
                dtype = md.get("dtype", md.get("precision", ""))
                found[md["worker_id"][:128]] = dtype if isinstance(dtype, str) and dtype.isalnum() else ""
                infos.append(info)
                expert, steps = _small_int(md.get("expert")), _small_int(md.get("run_ahead"))
                if expert is not None:
                    ahead[expert] = min(ahead.get(expert, MAX_RUN_AHEAD), steps or 0)
                    guides[expert] = guides.get(expert, True) and md.get("guidance") == "true"
        self.worker_dtypes = found
        self.run_ahead_of = {k: n for k, n in ahead.items() if n > 0}
        self.guidance_of = guides
        return infos

    async def experts_without_guidance(self, max_age_s: float = DTYPE_REFRESH_S) -> list[int]:
        """The experts with a discovered worker that does not serve classifier-free guidance (no `guidance`
        in its service metadata: it would refuse `StepRequest.guidance`), after a discovery of its own when the
        last one to finish is older than `max_age_s` seconds (one still gathering answers does not count).
        Experts no worker was found of are not listed."""
        if time.monotonic() - self._discovered_at >= max_age_s:
            await self.refresh()
        return sorted(k for k, ok in self.guidance_of.items() if not ok)

    def _check_specs(self, infos: list[dict]) -> None:
        """Reject the discovered workers whose spec differs from the fleet's (a warning naming each the first
        time), and tell `on_checked` the experts with a rejected worker and the matching workers of each."""
        rejected: dict[str, RejectedWorker] = {}
        matching: dict[int, list[str]] = {}
        for info in infos:
            bad = check_worker(self.fleet_spec, info)
            md = info["metadata"]
            if bad is None:
                try:
                    matching.setdefault(int(md.get("expert", -1)), []).append(md["worker_id"][:128])
                except (TypeError, ValueError):
                    pass
                continue
            rejected[bad.worker_id] = bad
            if bad.worker_id not in self._rejected_ever:
                self._rejected_ever.add(bad.worker_id)
                self.workers_rejected_total += 1
                log.warning(
                    "not using %s: its model spec differs from the fleet's (%s); serving on with the matching workers",
                    bad.describe(),
                    bad.differs,
                )
        for gone in set(self.rejected_workers) - set(rejected):
            log.info("rejected worker %s is no longer on the bus", gone)
        self.rejected_workers = rejected
        self._on_checked({w.expert for w in rejected.values()}, matching)


def _small_int(value) -> int | None:
    """A service-metadata value that should be a small non-negative int ("16"), else None (never raises)."""
    text = str(value) if isinstance(value, (str, int)) and not isinstance(value, bool) else ""
    return int(text) if text.isascii() and text.isdigit() and len(text) <= 6 else None
