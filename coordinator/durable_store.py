"""The JetStream store of durable jobs: running jobs' checkpoints in a NATS JetStream KV bucket, so that
a job outlives its coordinator (see docs/COORDINATOR.md, "Durable jobs (JetStream)"; the loop that uses
this store is coordinator.durable_jobs). Off unless `Coordinator(durable=True)` / `ddm-fleet coordinator
--durable`.

Two buckets (created on first use, history 1):

* `ddm_jobs`        key <job id> -> a `job_checkpoint` message (coordinator.snapshot), written on
                    admission, every `checkpoint_every` solver steps, and on a clean shutdown;
                    deleted when the job ends (done, failed, cancelled). Bucket TTL `jobs_ttl_s`,
                    size bound `jobs_max_bytes`.
* `ddm_job_owners`  key <job id> -> {"name", "instance"} of the coordinator running the job: its
                    lease. Bucket TTL `lease_s`: the owner rewrites it every lease_s / 3, so a dead
                    owner's entry vanishes within lease_s.

Every write is revision-checked (`kv.update(key, value, last=revision)`): a coordinator takes a
job over only with a create (no owner entry) or an update of the revision it read, so two
coordinators cannot both take it; the taker then rewrites the checkpoint, which moves its
revision. A coordinator whose lease renewal or checkpoint write fails with a wrong revision has
lost the job (`JobLost`) and must stop publishing for it (fencing); one that could not renew its
leases for lease_s (a partition, a stall, SIGSTOP) drops every durable job itself, and checks
`expired()` before each event it publishes, so it sends nothing once others may own its jobs.
The owners bucket's TTL is the lease: set by the coordinator that created the bucket, and
adopted (with a warning) by one asking for another lease_s.

Replication: `replicas` (`--js-replicas`, default 1) is the number of copies of each bucket kept
on the servers of a JetStream cluster; with 3 (R3, infra/nats/cluster.conf) a job's checkpoint and
lease survive the loss of any one NATS node (a write needs 2 of the 3). Like the TTL it is fixed by
the coordinator that creates a bucket; a bucket that exists with other settings is used as it is.
A single server has only R1.

Counters (exported on /metrics by coordinator.metrics, read at scrape time): `writes` and
`bytes_written` (checkpoint writes and their bytes), `takeovers` (jobs this run took from another
run: a dead or stalled owner's, or its own previous run's), `leases_lost` (jobs this run lost:
another coordinator took them, or it could not renew their leases in time).

A coordinator restarted under the same `--name` takes back its previous run's jobs at once
(same name, another instance); a coordinator of another name takes a job once its owner's lease
has expired.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from schemas import ProtocolError

from .config import DEFAULT_CHECKPOINT_EVERY, DEFAULT_LEASE_S  # noqa: F401 (re-exported)
from .scheduler import Scheduler, SchedulerConfig
from .snapshot import MAX_CHECKPOINT_BYTES

log = logging.getLogger(__name__)

JOBS_BUCKET = "ddm_jobs"
OWNERS_BUCKET = "ddm_job_owners"

# DEFAULT_CHECKPOINT_EVERY: solver steps between two snapshot writes of a job (see docs/COORDINATOR.md
# for the cost); DEFAULT_LEASE_S: seconds an owner's lease lives without renewal (renewed every third of it)
#: Seconds a checkpoint lives without being rewritten (a job runs at most max_job_run_s).
DEFAULT_JOBS_TTL_S = 3600.0
#: Bytes the checkpoint bucket may hold (writes beyond are refused: those jobs are not durable).
DEFAULT_JOBS_MAX_BYTES = 1024 * 1024 * 1024
#: Tries at creating a bucket (0.5 s apart) while the JetStream cluster refuses it (peers still joining).
BUCKET_ATTEMPTS = 10
#: JetStream's error code for "stream name already in use with a different configuration".
STREAM_NAME_IN_USE = 10058
#: ... for "no suitable peers for placement" (a cluster whose peers are still joining; or too few).
NO_SUITABLE_PEERS = 10005


class JetStreamUnavailable(RuntimeError):
    """The NATS server has no JetStream (or this account may not use it)."""


class JobLost(Exception):
    """Another coordinator took the job (a wrong-revision error): stop publishing for it."""

    def __init__(self, job_id: str, why: str):
        super().__init__(f"job {job_id}: {why}")
        self.job_id = job_id


class CheckpointingScheduler(Scheduler):
    """A Scheduler that notes the jobs due for a checkpoint: those whose solver step just reached a
    multiple of `every` (read and cleared by the durable writer through `take_due`). Pure."""

    def __init__(self, config: SchedulerConfig, every: int, on_due: Any = None):
        super().__init__(config)
        if not isinstance(every, int) or every < 1:
            raise ValueError(f"checkpoint_every must be an int >= 1 (solver steps), got {every!r}")
        self.every = every
        self.on_due = on_due
        self._due: set[str] = set()

    def update(self, batch, now: float, *, part: bool = False) -> None:
        before = [(g, g.step) for g in batch.groups]
        super().update(batch, now, part=part)
        for g, step in before:
            if g.step != step and g.step % self.every == 0 and not g.done and self.knows(g.job_id):
                self._due.add(g.job_id)
        if self._due and self.on_due is not None:
            self.on_due()

    def take_due(self) -> list[str]:
        due, self._due = sorted(self._due), set()
        return due


async def jetstream_available(nc) -> str | None:
    """None if the server offers JetStream to this connection, else why not (a sentence)."""
    import nats.errors
    import nats.js.errors

    try:
        await nc.jetstream().account_info()
    except nats.errors.NoRespondersError:
        return "the NATS server has no JetStream (start it with `jetstream: enabled` or `-js`)"
    except (nats.errors.TimeoutError, nats.js.errors.Error) as err:
        return f"JetStream is not usable on this server: {type(err).__name__}: {err}"
    return None


class JobStore:
    """The two KV buckets, seen by one coordinator run (`name`, `instance`). Remembers the
    revisions it wrote, so each of its writes is checked against them."""

    def __init__(
        self,
        nc,
        name: str,
        instance: str,
        *,
        lease_s: float = DEFAULT_LEASE_S,
        jobs_ttl_s: float = DEFAULT_JOBS_TTL_S,
        jobs_max_bytes: int = DEFAULT_JOBS_MAX_BYTES,
        replicas: int = 1,
    ):
        if not lease_s > 0:
            raise ValueError(f"lease_s must be > 0 seconds, got {lease_s}")
        if not isinstance(replicas, int) or not 1 <= replicas <= 5:
            raise ValueError(f"replicas must be an int 1-5 (JetStream's limit), got {replicas!r}")
        self.replicas = replicas
        self.nc, self.name, self.instance = nc, name, instance
        self.lease_s, self.jobs_ttl_s, self.jobs_max_bytes = float(lease_s), float(jobs_ttl_s), int(jobs_max_bytes)
        self.jobs = self.owners = None
        self._cp_rev: dict[str, int] = {}  # job id -> revision of our last checkpoint write
        self._lease_rev: dict[str, int] = {}  # job id -> revision of our lease
        self._lease_at: dict[str, float] = {}  # job id -> when our lease's last successful write was sent
        self.last_renewed = time.monotonic()
        self.writes = 0  # checkpoint writes (admission, periodic, take-over, hand-over)
        self.bytes_written = 0
        self.takeovers = 0  # jobs taken from another run (take())
        self.leases_lost = 0  # jobs lost to another coordinator or to an expired lease (forget())

    @property
    def held(self) -> list[str]:
        """Ids of the jobs this run owns."""
        return list(self._lease_rev)

    def holds(self, job_id: str) -> bool:
        return job_id in self._lease_rev

    async def open(self) -> JobStore:
        """Create (or bind) both buckets; raises JetStreamUnavailable with the reason."""
        why = await jetstream_available(self.nc)
        if why is not None:
            raise JetStreamUnavailable(why)
        js = self.nc.jetstream()
        self.jobs = await self._bucket(
            js,
            JOBS_BUCKET,
            ttl=self.jobs_ttl_s,
            max_bytes=self.jobs_max_bytes,
            max_value_size=MAX_CHECKPOINT_BYTES,
            replicas=self.replicas,
        )
        self.owners = await self._bucket(
            js, OWNERS_BUCKET, ttl=self.lease_s, max_bytes=64 * 1024 * 1024, replicas=self.replicas
        )
        # a lease lives as long as the bucket's TTL, set by the coordinator that created the bucket:
        # renew (and judge expiry) by that, or leases would lapse between renewals
        ttl = (await self.owners.status()).ttl
        if ttl and abs(ttl - self.lease_s) > 1e-3:
            log.warning(
                "KV bucket %s keeps leases %g s (set by the coordinator that created it), not %g s: using %g s",
                OWNERS_BUCKET,
                ttl,
                self.lease_s,
                ttl,
            )
            self.lease_s = float(ttl)
        return self

    @staticmethod
    async def _bucket(js, bucket: str, attempts: int = BUCKET_ATTEMPTS, **cfg):
        """Create the bucket, or bind it if it exists with other settings (another release, another
        --lease-s or --js-replicas: used as it is). "No suitable peers for placement" (a JetStream
        cluster whose peers are not all up yet) and 503s are retried `attempts` times, 0.5 s apart;
        every refusal ends as JetStreamUnavailable with the server's reason."""
        import asyncio

        import nats.errors
        import nats.js.errors

        for attempt in range(1, attempts + 1):
            try:
                return await js.create_key_value(bucket=bucket, history=1, **cfg)
            except nats.js.errors.APIError as err:
                if err.err_code == STREAM_NAME_IN_USE:
                    log.warning("KV bucket %s exists with other settings; using it as it is", bucket)
                    return await js.key_value(bucket)
                if attempt == attempts or not (err.err_code == NO_SUITABLE_PEERS or err.code == 503):
                    raise JetStreamUnavailable(
                        f"cannot create the KV bucket {bucket} with {cfg.get('replicas', 1)} replica(s): "
                        f"{err.description or err} (--js-replicas must not exceed the JetStream servers of the "
                        f"cluster, all of them up; a single server takes 1)"
                    ) from None
                log.warning("creating KV bucket %s: %s; retrying", bucket, err.description or err)
                await asyncio.sleep(0.5)
            except (TimeoutError, nats.errors.TimeoutError) as err:  # a cluster electing its leader
                if attempt == attempts:
                    raise JetStreamUnavailable(
                        f"cannot create the KV bucket {bucket}: JetStream did not answer ({type(err).__name__}; "
                        "a cluster still electing a leader, or a server without -js)"
                    ) from None
                log.warning("creating KV bucket %s: no answer; retrying", bucket)
                await asyncio.sleep(0.5)

    def _lease(self) -> bytes:
        return json.dumps({"name": self.name, "instance": self.instance}).encode()

    # ------------------------------------------------------------ this run's jobs
    async def adopt(self, job_id: str, checkpoint: bytes) -> bool:
        """Own a job just admitted here: create its lease and write its first checkpoint. False if
        another coordinator already holds a job of that id (then it is not durable here)."""
        import nats.js.errors

        sent = time.monotonic()
        try:
            self._lease_rev[job_id] = await self.owners.create(job_id, self._lease())
            self._lease_at[job_id] = sent
        except nats.js.errors.KeyWrongLastSequenceError:
            log.warning("job %s: another coordinator holds a durable job of that id; not durable here", job_id)
            return False
        self._cp_rev[job_id] = await self._write(job_id, checkpoint, last=None)
        return True

    async def _write(self, job_id: str, data: bytes, last: int | None) -> int:
        rev = await (self.jobs.put(job_id, data) if last is None else self.jobs.update(job_id, data, last=last))
        self.writes += 1
        self.bytes_written += len(data)
        return rev

    async def save(self, job_id: str, checkpoint: bytes) -> None:
        """Rewrite a held job's checkpoint; raises JobLost if someone else wrote it since."""
        import nats.js.errors

        if job_id not in self._lease_rev:
            return
        try:
            self._cp_rev[job_id] = await self._write(job_id, checkpoint, last=self._cp_rev.get(job_id))
        except nats.js.errors.KeyWrongLastSequenceError:
            self.forget(job_id)
            raise JobLost(job_id, "its checkpoint was written by another coordinator") from None

    async def renew(self) -> list[str]:
        """Renew every lease; returns the ids of the jobs lost (wrong revision, or the lease expired).
        Other errors (timeouts) leave the lease as it is; see `expired`."""
        import asyncio

        import nats.errors
        import nats.js.errors

        # the leases written below expire lease_s after their write, so count from before it
        lost, ok, started = [], True, time.monotonic()

        async def one(job_id: str, rev: int) -> None:
            nonlocal ok
            try:
                new_rev = await self.owners.update(job_id, self._lease(), last=rev)
                if self._lease_rev.get(job_id) == rev:  # (dropped or taken again meanwhile: not ours to set)
                    self._lease_rev[job_id] = new_rev
                    self._lease_at[job_id] = started
            except nats.js.errors.KeyWrongLastSequenceError:
                if self._lease_rev.get(job_id) == rev:
                    self.forget(job_id)
                    lost.append(job_id)
            except (nats.errors.Error, OSError) as err:
                ok = False
                log.warning("renewing the lease of job %s failed: %r", job_id, err)

        # all at once: a round lasts one round trip (or one timeout), not one per job
        await asyncio.gather(*(one(job_id, rev) for job_id, rev in list(self._lease_rev.items())))
        if ok:  # every lease held at `started` was renewed; one taken since is younger than `started`
            self.last_renewed = max(self.last_renewed, started)
        return lost

    def expired(self) -> bool:
        """True when the leases could not be renewed for lease_s: others may have taken the jobs
        (e.g. this process was stopped, SIGSTOP, longer than that). Checked before every event a
        durable coordinator publishes, so a process that wakes up publishes nothing stale."""
        # each lease expires lease_s after its own last write: a lease written after a lapse (a job adopted or
        # taken back) is fresh however long ago the other leases were renewed, and one not renewed is not
        now = time.monotonic()
        return any(now - at > self.lease_s for at in self._lease_at.values())

    async def release(self, job_id: str, *, keep_checkpoint: bool = False) -> None:
        """Give a held job up: delete its checkpoint (unless keep_checkpoint: a hand-over) and its
        lease, each only at the revision this run wrote (never a newer owner's)."""
        cp_rev, lease_rev = self._cp_rev.pop(job_id, None), self._lease_rev.pop(job_id, None)
        self._lease_at.pop(job_id, None)
        try:
            if not keep_checkpoint and cp_rev is not None:
                await self.jobs.delete(job_id, last=cp_rev)
            if lease_rev is not None:
                await self.owners.delete(job_id, last=lease_rev)
        except Exception as err:  # a newer owner's revision, or the bus: nothing of ours to clean
            log.info("releasing job %s: %r", job_id, err)

    def forget(self, job_id: str) -> None:
        """This run lost a held job (another coordinator took it, or its lease lapsed): drop it here
        without touching the buckets (counted in `leases_lost`)."""
        self._cp_rev.pop(job_id, None)
        self._lease_at.pop(job_id, None)
        if self._lease_rev.pop(job_id, None) is not None:
            self.leases_lost += 1

    # ------------------------------------------------------------ other runs' jobs
    async def orphans(self) -> list[tuple[str, int | None]]:
        """(job id, owner revision or None) of the checkpoints this run may take: no live lease, or
        a lease of this coordinator's name from another run (a restart of this coordinator). A bus
        error (a timeout while a JetStream cluster elects a leader) is one warning and an empty or
        shorter list: the next scan, lease_s / 3 later, tries again."""
        import nats.errors
        import nats.js.errors

        from bus.kv_keys import live_keys

        try:
            keys = await live_keys(self.nc.jetstream(), JOBS_BUCKET)  # not KeyValue.keys(): it can list part
        except (nats.errors.Error, OSError) as err:
            log.warning(
                "listing the checkpoints in %s failed (%s: %s); trying again at the next scan",
                JOBS_BUCKET,
                type(err).__name__,
                err,
            )
            return []
        found = []
        for job_id in keys:
            if job_id in self._lease_rev:
                continue
            try:
                entry = await self.owners.get(job_id)
            except nats.js.errors.KeyNotFoundError:
                found.append((job_id, None))
                continue
            except (nats.errors.Error, OSError) as err:
                log.warning("reading the lease of job %s failed (%s: %s)", job_id, type(err).__name__, err)
                continue
            try:
                lease = json.loads(bytes(entry.value or b"{}"))
            except ValueError:
                lease = {}
            if lease.get("name") == self.name and lease.get("instance") != self.instance:
                found.append((job_id, entry.revision))
        return found

    async def take(self, job_id: str, owner_rev: int | None, rewrite=None) -> bytes | None:
        """Take a job over (revision-checked) and return its checkpoint bytes; None if another
        coordinator was first or the checkpoint is gone. The checkpoint is rewritten at once (as
        `rewrite(bytes)` makes it: the service bumps its owner epoch, coordinator.snapshot.bump_epoch),
        so its previous owner's next write fails (fencing), and the next taker reads the new epoch. A
        bus error (timeout) also gives None, with a warning: a lease that was written all the same
        expires, and the job is taken later. A checkpoint `rewrite` refuses (ProtocolError) is left
        where it is, for another coordinator."""
        import nats.errors
        import nats.js.errors

        sent = time.monotonic()
        try:
            if owner_rev is None:
                rev = await self.owners.create(job_id, self._lease())
            else:
                rev = await self.owners.update(job_id, self._lease(), last=owner_rev)
        except nats.js.errors.KeyWrongLastSequenceError:
            return None
        except (nats.errors.Error, OSError) as err:
            log.warning("taking job %s failed (%s: %s); trying again at the next scan", job_id, type(err).__name__, err)
            return None
        self._lease_rev[job_id] = rev
        self._lease_at[job_id] = sent
        try:
            entry = await self.jobs.get(job_id)
            data = bytes(entry.value) if rewrite is None else rewrite(bytes(entry.value))
            self._cp_rev[job_id] = await self._write(job_id, data, last=entry.revision)
        except ProtocolError as err:
            log.error(
                "job %s: its checkpoint cannot be taken over here (%s); left for another coordinator", job_id, err
            )
            await self.release(job_id, keep_checkpoint=True)
            return None
        except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyWrongLastSequenceError):
            await self.release(job_id, keep_checkpoint=True)
            return None
        except (nats.errors.Error, OSError) as err:
            log.warning(
                "taking job %s: its checkpoint could not be read or rewritten (%s: %s)", job_id, type(err).__name__, err
            )
            await self.release(job_id, keep_checkpoint=True)
            return None
        self.takeovers += 1
        return data
