"""A coordinator's durable jobs (`--durable`): the loop that keeps its jobs' snapshots and leases in
JetStream (`coordinator.durable_store.JobStore`), takes over orphaned jobs, fences the jobs it lost, and
hands its jobs over on a clean exit.

Jobs are named here by the engine's internal id (the JetStream key); `coordinator.ledger` maps them
to (client, job id). Timing: leases are renewed and orphans looked for every `lease_s / 3` seconds;
snapshots are written on admission and every `checkpoint_every` solver steps.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict

from bus.cancel import cancel_and_wait, raise_if_cancelled
from schemas import ErrorCode, ProtocolError, subjects

from .durable_store import JobLost, JobStore
from .ledger import JobLedger
from .scheduler import Rejected
from .snapshot import bump_epoch
from .snapshot import decode as decode_snapshot
from .snapshot import encode as encode_snapshot

log = logging.getLogger(__name__)

#: Seconds `hand_over` waits for its loops to end once cancelled (a bus call in flight ends or times out).
HAND_OVER_WAIT_S = 5.0

#: Lost jobs remembered (publish nothing for them; status requests are left to their new owner).
MAX_FENCED = 4096


class DurableJobs:
    """The durable side of one coordinator run: `store` opened, then `start()` with its engine."""

    def __init__(self, store: JobStore, ledger: JobLedger, *, name: str, checkpoint_every: int, on_fence=None):
        self.store, self.ledger, self.name = store, ledger, name
        # called with the (client, job id) of jobs just fenced and whether this run's leases lapsed (it was
        # cut off or stalled; else another coordinator took them): the service takes their events its bus
        # connection has not sent yet back, after a lapse dropping the connection when bytes are held back
        # in the socket (bus.connect.discard_unsent: "none" | "recalled" | "dropped"), so that frames queued
        # behind a cut link or a freeze never reach a client after another coordinator took the jobs over
        self.on_fence = on_fence
        self.checkpoint_every = checkpoint_every
        self.engine = None
        self.wake = asyncio.Event()  # set by the scheduler when a snapshot is due, and by `op`
        self._ops: list[tuple[str, str]] = []  # ("adopt" | "release", internal id), in order
        self._task: asyncio.Task | None = None
        self._watch_task: asyncio.Task | None = None
        self._renew_task: asyncio.Task | None = None
        self._fenced: OrderedDict[str, None] = OrderedDict()  # internal ids lost to another coordinator
        self._fenced_names: OrderedDict[tuple[str, str], None] = OrderedDict()  # the same, (client, job id)
        # internal id -> (client, job id) of a held job whose end went out (the ledger let its name go):
        # until its lease is released, a fence must still take its unsent events back
        self._ending: dict[str, tuple[str, str]] = {}
        self.jobs_resumed = 0
        self._closing = False  # hand_over began: take no orphan and adopt no job any more
        self._previous_owner = ""  # the owner of the checkpoint `_bumped` rewrote last (for the log)

    @property
    def lease_s(self) -> float:
        return self.store.lease_s

    async def start(self, engine) -> None:
        """Resume the orphaned jobs (before serving status: a job of this name's previous run is never
        "unknown"), then run the loop."""
        self.engine = engine
        await self.resume_orphans()
        self._task = asyncio.create_task(self._loop(), name="coordinator-durable")
        self._watch_task = asyncio.create_task(self._watch(), name="coordinator-durable-watch")
        self._renew_task = asyncio.create_task(self._renewals(), name="coordinator-durable-renew")
        for task in (self._task, self._watch_task, self._renew_task):
            task.add_done_callback(self._loop_ended)

    def _loop_ended(self, task: asyncio.Task) -> None:
        """A loop of these runs until `hand_over`: one that ends before says so loudly (its jobs'
        snapshots or leases are no longer kept)."""
        if self._closing:
            return
        why = "cancelled" if task.cancelled() else repr(task.exception() or "returned")
        log.error(
            "durable jobs: %s ended before the hand-over (%s): jobs are no longer kept durable", task.get_name(), why
        )

    # ------------------------------------------------------------ called by the service
    def op(self, op: str, internal: str) -> None:
        """Queue a bucket write for the loop: "adopt" (a job admitted here) or "release"."""
        self._ops.append((op, internal))
        self.wake.set()

    def is_fenced(self, client: str, job_id: str) -> bool:
        """True if this run lost `client`'s job `job_id` to another coordinator (its answer counts)."""
        return (client, job_id) in self._fenced_names

    def before_publish(self, event) -> bool:
        """False if nothing may be published for this event's job (another coordinator may run it);
        queues the release of a finished job."""
        job_id = event.job_id
        if job_id in self._fenced:
            return False
        if self.store.holds(job_id) and self.store.expired():
            # this run could not renew its leases for lease_s (it was stopped, e.g. SIGSTOP, or cut
            # off): another coordinator may run the job already; publish nothing, let the lease lapse
            self.lapse()
            return False
        if event.kind in ("done", "failed"):
            name = self.ledger.name_of(job_id)
            if name is not None and self.store.holds(job_id):
                self._ending[job_id] = name
            self.op("release", job_id)
        return True

    # ------------------------------------------------------------ the loop
    def _encoded(self, internal: str) -> bytes | None:
        """The job's snapshot bytes now, or None if the scheduler no longer holds it."""
        cp = self.engine.scheduler.checkpoint(internal)
        if cp is None:
            return None
        return encode_snapshot(cp, owner=self.name, written_at=time.time(), epoch=self.ledger.epoch_of(internal))

    async def _loop(self) -> None:
        """Write snapshots (admission, every checkpoint_every steps), delete them when jobs end, and
        take over orphaned jobs every lease_s / 3. (Leases are renewed by `_renewals`, apart: a scan or
        a snapshot write that waits out bus timeouts must not let this run's leases lapse.)"""
        period = self.lease_s / 3
        next_scan = time.monotonic() + period
        while True:
            raise_if_cancelled()  # a cancel 3.11's wait_for (here or in nats-py) swallowed
            try:
                await asyncio.wait_for(self.wake.wait(), timeout=max(next_scan - time.monotonic(), 0.01))
            except TimeoutError:
                pass
            self.wake.clear()
            try:
                await self._round()
                now = time.monotonic()
                if now >= next_scan:
                    next_scan = now + period
                    await self.resume_orphans()
            except asyncio.CancelledError:
                raise
            except Exception:
                raise_if_cancelled()  # a cancel nats-py reported as a closed connection
                log.exception("durable jobs: a round of bucket writes failed")
                await asyncio.sleep(min(period, 1.0))

    async def _renewals(self) -> None:
        """Renew this run's leases every lease_s / 3, in a task of its own. In `_loop` with the scan for
        orphans and the snapshot writes, a round that waited out bus timeouts (after a dropped
        connection, each request in flight waits its full timeout) let the leases lapse, which could drop
        the connection again: on a loaded box leases lapsed over and over, with no fault at all."""
        period = self.lease_s / 3
        while True:
            raise_if_cancelled()
            await asyncio.sleep(period)
            try:
                await self.renew()
            except asyncio.CancelledError:
                raise
            except Exception:
                raise_if_cancelled()
                log.exception("durable jobs: a round of lease renewals failed")

    async def renew(self) -> None:
        """One renewal round: renew every lease; fence the jobs another coordinator took; and when the
        leases lapsed meanwhile (the round itself may have waited out bus timeouts on a cut link),
        `lapse`: whichever of this loop, `_watch` and `before_publish` sees the lapse first takes back
        the fenced jobs' unsent events (before, a lapse this loop saw first fenced the jobs but kept
        the frames queued behind a cut, which reached clients after a take-over)."""
        lost = [
            name
            for job_id in await self.store.renew()
            for name in self.fence(job_id, "another coordinator took over its lease")
        ]
        if self.store.expired():
            self.lapse(lost)
        else:
            self._take_back(lost, lapsed=False)

    def lapse(self, fenced: list[tuple[str, str]] = ()) -> None:
        """This run's leases could not be renewed for lease_s: fence every job it holds (others may run
        them already) and take back the events of those jobs (and of the `fenced` ones) not sent yet."""
        why = f"its lease could not be renewed for {self.lease_s:g} s"
        names = list(fenced)
        held = self.store.held
        # a finished job whose release is on its way (no longer held, its name let go by the ledger): its end
        # may be unsent still, and on a cut link the release never arrives
        for job_id in held + [j for j in self._ending if j not in held]:
            self.store.forget(job_id)
            names += self.fence(job_id, why)
        self._take_back(names, lapsed=True)

    async def _watch(self) -> None:
        """Every lease_s / 8: once this run's leases could not be renewed for lease_s, `lapse`. Apart
        from `_loop`, whose renewals may each wait out a bus timeout while a link is cut."""
        period = max(self.lease_s / 8, 0.05)
        while True:
            await asyncio.sleep(period)
            if self.store.expired():
                self.lapse()

    def _take_back(self, names: list[tuple[str, str]], *, lapsed: bool) -> None:
        """Have the unsent events of the jobs just fenced taken back (`on_fence`); after a lapse even
        with none named (what the socket holds back goes with the connection)."""
        if self.on_fence is None or not (names or lapsed):
            return
        try:
            done = self.on_fence(names, lapsed)
        except Exception as err:  # never let the fence fail on the way out
            log.warning("durable jobs: discarding the unsent messages failed: %r", err)
            return
        what = "leases lapsed" if lapsed else "jobs lost to another coordinator"
        if done == "dropped":
            log.warning("durable jobs: %s; dropped the bus connection with its unsent messages (reconnecting)", what)
        elif done == "recalled":
            log.warning("durable jobs: %s; took the fenced jobs' events not yet sent out of the bus connection", what)

    async def _round(self) -> None:
        ops, self._ops = self._ops, []
        store, sched = self.store, self.engine.scheduler
        for op, job_id in ops:
            try:
                if op == "adopt":
                    data = self._encoded(job_id)
                    if data is not None:
                        await store.adopt(job_id, data)
                elif store.holds(job_id):
                    await store.release(job_id)
            except Exception as err:  # e.g. the bucket is full: the job runs on, not durable
                log.warning("durable jobs: %s of job %s failed: %r", op, job_id, err)
            finally:
                if op == "release":
                    self._ending.pop(job_id, None)
        for job_id in sched.take_due():
            data = self._encoded(job_id) if store.holds(job_id) else None
            if data is None:
                continue
            try:
                await store.save(job_id, data)
            except JobLost as err:
                self._lost(job_id, str(err))
            except Exception as err:
                log.warning("durable jobs: checkpoint of job %s failed: %r", job_id, err)

    def fence(self, internal: str, why: str) -> list[tuple[str, str]]:
        """This run lost the job to another coordinator: forget it and publish nothing more for it;
        returns the (client, job id) names it went by: the ledger's (a live job), `_ending`'s (a finished
        one whose release is queued; the same internal id may be live again for another client)."""
        self.engine.scheduler.drop(internal)
        self._fenced[internal] = None
        names = list(dict.fromkeys(n for n in (self.ledger.forget(internal), self._ending.pop(internal, None)) if n))
        for name in names:
            self._fenced_names[name] = None
        for fenced in (self._fenced, self._fenced_names):
            while len(fenced) > MAX_FENCED:
                fenced.popitem(last=False)
        log.warning("job %s: %s; this coordinator stops publishing for it", internal, why)
        return names

    def _lost(self, internal: str, why: str) -> None:
        """Another coordinator holds the job now: fence it and take its unsent events back."""
        self._take_back(self.fence(internal, why), lapsed=False)

    def _unfence(self, internal: str, name: tuple[str, str]) -> None:
        self._fenced.pop(internal, None)
        self._fenced_names.pop(name, None)

    def _bumped(self, data: bytes) -> bytes:
        """A checkpoint as this run takes it over: its owner epoch one more (coordinator.snapshot.bump_epoch)."""
        new, _, previous = bump_epoch(data, owner=self.name, written_at=time.time())
        self._previous_owner = previous
        return new

    async def resume_orphans(self) -> int:
        """Take over and resume every snapshotted job nobody else owns (see coordinator.durable_store);
        returns how many were resumed."""
        sched, resumed = self.engine.scheduler, 0

        for job_id, owner_rev in await self.store.orphans():
            raise_if_cancelled()
            if self._closing:  # handing over (a loop that outlived its cancel must not take jobs now)
                break
            if sched.knows(job_id):
                continue
            self._previous_owner = ""
            data = await self.store.take(job_id, owner_rev, rewrite=self._bumped)
            if data is None:
                continue
            try:
                cp, rec = decode_snapshot(data)
                owner = cp.client.split("/", 1)[0]
                if cp.job_id != job_id or not subjects.is_token(owner):
                    raise ProtocolError(ErrorCode.BAD_REQUEST, f"checkpoint names job {cp.job_id!r} of {owner!r}")
                client_id = cp.request.job_id or cp.job_id  # the id its client knows it by
                if self.ledger.is_live(owner, client_id):
                    raise Rejected(ErrorCode.BAD_REQUEST, f"{owner!r} already runs a job {client_id!r} here")
                sched.restore(cp, self.engine.clock())
            except (ProtocolError, Rejected) as err:
                why = getattr(err, "reason", None) or getattr(err, "message", str(err))
                log.error("job %s: cannot resume its checkpoint here (%s); left for another coordinator", job_id, why)
                await self.store.release(job_id, keep_checkpoint=True)
                continue
            self._unfence(job_id, (owner, client_id))
            self.ledger.admit(
                job_id,
                owner,
                client_id,
                steps=int(cp.request.steps),
                step=int(cp.step),
                epoch=rec.epoch,  # one more than its previous owner's (the take wrote it: `_bumped`)
                report_epoch=cp.request.report_epoch,
                image_parts=cp.request.image_parts,
            )
            self.jobs_resumed += 1
            resumed += 1
            log.info(
                "job %s resumed at step %d/%d from the checkpoint of %s (owner epoch %d)",
                job_id,
                cp.step,
                cp.request.steps,
                self._previous_owner or "?",
                rec.epoch,
            )
        if resumed:
            self.engine.wake()  # wake idle engine lanes (submit does the same)
        return resumed

    async def hand_over(self) -> None:
        """Clean exit: write a last snapshot of every job this run owns, give up their leases and
        forget them (no `failed` event), so that its restart or another coordinator goes on with them."""
        self._closing = True
        tasks = [t for t in (self._task, self._watch_task, self._renew_task) if t is not None]
        for task in await cancel_and_wait(tasks, HAND_OVER_WAIT_S):
            log.warning("durable jobs: %s did not stop when cancelled; handing over anyway", task.get_name())
        for task in tasks:
            if task.done() and not task.cancelled() and task.exception() is not None:
                log.warning("durable jobs: %s had failed: %r", task.get_name(), task.exception())
        self._task = self._watch_task = self._renew_task = None
        if self.engine is None:
            return
        try:
            await self._round()
        except Exception as err:
            log.warning("durable jobs: last round failed: %r", err)
        handed = 0
        for job_id in self.store.held:
            data = self._encoded(job_id)
            try:
                if data is not None:
                    await self.store.save(job_id, data)
                await self.store.release(job_id, keep_checkpoint=data is not None)
            except JobLost as err:
                self._lost(job_id, str(err))
                continue
            except Exception as err:
                log.warning("durable jobs: handing over job %s failed: %r", job_id, err)
                continue
            self.engine.scheduler.drop(job_id)
            self.ledger.forget(job_id)
            handed += 1
        if handed:
            log.info("handed over %d durable jobs (checkpoints kept in JetStream)", handed)
