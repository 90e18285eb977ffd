"""Network partitions between real hosts (network namespaces, tests.netns.harness), each test checking
the whole history of its jobs.

The fleet (tests.netns.fleet.Fleet): a 3-node NATS cluster with JetStream R3 on hosts n0 n1 n2, two
durable coordinators ca (connected to n0) and cb (n1), a sim worker of each expert on w0 (n0) and on
w1 (n1), the client on cl (n2). Links are cut at the switch (`ip link set <port> down`) or the switch
is split in two (each side on a bridge of its own), then healed.

Every test checks: every job submitted ends exactly once (one `done`, no `failed`), its images are
bit-identical to an undisturbed run of the same requests, and once a coordinator lost a job's lease
no frame of that job comes from it (the frames after a take-over are one publisher's: their steps
strictly increase up to the last, and nothing follows the `done`).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import numpy as np
import pytest

from schemas import JobRequest
from tests.coordinator.durable_procs import EventLog
from tests.coordinator.helpers import make_tiny_experts, make_tiny_router
from tests.netns.fleet import Fleet
from tests.waiting import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.procs, pytest.mark.bus, pytest.mark.timeout(480)]

#: lease of the durable jobs (s): above a JetStream R3 leader election after a lost node (4-9 s
#: would take jobs from a healthy owner in the minority-node test), below the jobs' length
LEASE_S = 4.0
#: sim expert latency per batch; STEPS steps: a job lasts 10 s or more, so it still runs after a take-over
BATCH_MS = 100.0
STEPS = 80


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("netns-models")
    return make_tiny_experts(d), make_tiny_router(d / "router")


@pytest.fixture
async def fleet(tmp_path, tiny_files):
    experts, router = tiny_files
    f = Fleet(tmp_path, experts, router, lease_s=LEASE_S, batch_ms=BATCH_MS)
    try:
        await f.start()
        yield f
    finally:
        f.errs = await f.close()


def round_jobs(tag: str, round_: int) -> list[JobRequest]:
    # top1 / oracle: bit-identical whatever else is batched beside them (see tests/coordinator/test_durable.py)
    kinds = [("top1", "euler"), ("top1", "heun"), ("oracle", "euler"), ("oracle", "heun")]
    return [
        JobRequest(
            job_id=f"{tag}-{round_}-{i}",
            digits=[(round_ + i) % 10, (3 + 7 * i) % 10],
            steps=STEPS,
            seed=3000 + 10 * round_ + i,
            strategy=s,
            solver=v,
        )
        for i, (s, v) in enumerate(kinds + kinds)
    ]


async def jobs_on_both(fleet: Fleet, log: EventLog, tag: str):
    """Submit rounds of 8 jobs until both coordinators own some; (requests, run_job futures)."""
    reqs, runs = [], []
    for round_ in range(6):
        batch = round_jobs(tag, round_)
        reqs += batch
        runs += [fleet.submit(r, log) for r in batch]
        ids = [r.job_id for r in reqs]

        async def all_owned(ids=ids):
            owners = await fleet.owners(ids)
            return owners if all(owners.values()) else None

        owners = await wait_until(all_owned, timeout=60, what="every job has a lease")
        if len(set(owners.values())) == 2:
            return reqs, runs
    raise AssertionError(f"every job went to one coordinator: {owners}")


async def mid_run(fleet: Fleet, log: EventLog, ids) -> tuple[str, list[str]]:
    """Once every job passed step 12 (its first checkpoint) or ended: the coordinator holding the
    most running jobs, and those jobs."""
    await wait_until(
        lambda: all(log.dones(j) or max(log.steps(j), default=0) >= 12 for j in ids),
        timeout=120,
        what="every job past step 12",
    )
    running = [j for j in ids if not log.dones(j)]
    owners = await fleet.owners(running)
    held = Counter(o for o in owners.values() if o)
    assert held, ("every job ended before the fault: make the jobs longer", log.events)
    victim = held.most_common(1)[0][0]
    return victim, [j for j in running if owners[j] == victim]


def longest_pause(log: EventLog, j: str, after: float = 0.0) -> float:
    ts = [t for t, _, _ in log.events.get(j, []) if t >= after]
    return max((b - a for a, b in zip(ts, ts[1:])), default=0.0)


def check_history(log: EventLog, ids, *, taken: dict[str, float] | None = None) -> None:
    """Exactly one `done` per job, last frame the last step, nothing after `done`; for a job taken
    over at time taken[j]: the frames after it strictly increase (one publisher)."""
    for j in ids:
        ev = log.events[j]
        kinds = [k for _, k, _ in ev]
        assert kinds.count("done") == 1 and "failed" not in kinds, f"{j}: {render(ev, ev[0][0])}"
        assert kinds[-1] == "done" and log.steps(j)[-1] == STEPS, f"{j}: {render(ev, ev[0][0])}"
        if taken and j in taken:
            after = [s for t, k, s in ev if k == "frame" and t > taken[j]]
            assert after and all(b > a for a, b in zip(after, after[1:])), f"{j}: {render(ev, taken[j])}"


def render(events, t0: float) -> str:
    """A job's history, compact: `step@seconds after t0` for frames, `kind@seconds` for the rest."""
    return " ".join(f"{k if s is None else s}@{t - t0:+.2f}" for t, k, s in events)


async def check_images(fleet: Fleet, reqs, got, tag: str) -> None:
    want = await asyncio.wait_for(fleet.reference_images(reqs, tag), 240)
    for g in got:
        w = want[g.job_id]
        assert np.array_equal(w.images, g.images), g.job_id
        assert np.array_equal(w.usage, g.usage) and w.digits == g.digits


def check_logs(errs: dict[str, bytes]) -> None:
    for name, err in errs.items():
        assert b"Traceback" not in err, (name, err[-3000:])


async def test_owner_host_cut_from_the_cluster_standby_takes_over_and_the_healed_owner_stays_silent(fleet):
    log = EventLog()
    reqs, runs = await jobs_on_both(fleet, log, "cut")
    ids = [r.job_id for r in reqs]
    victim, theirs = await mid_run(fleet, log, ids)
    survivor = "cb" if victim == "ca" else "ca"

    fleet.net.cut(fleet.host_of(victim))  # the owner's host loses its cable: alive, cut from everything
    cut_at = time.monotonic()

    async def taken():
        owners = await fleet.owners(theirs)
        return all(o == survivor or log.dones(j) for j, o in owners.items())

    await wait_until(taken, timeout=60, interval=0.1, what=f"{survivor} holds the jobs of the cut {victim}")
    taken_at = time.monotonic()
    theirs = [j for j in theirs if not log.dones(j)]
    assert theirs, "the cut owner's jobs all ended before the take-over: make them longer"
    # the survivor streams them; then the owner's cable goes back while they still run
    await wait_until(
        lambda: all(log.dones(j) or any(t > taken_at for t, _, _ in log.events[j]) for j in theirs),
        timeout=60,
        what="frames of the survivor",
    )
    fleet.net.heal(fleet.host_of(victim))
    healed_at = time.monotonic()
    got = await asyncio.wait_for(asyncio.gather(*runs), 300)  # 0 failed, 0 lost: run_job raises otherwise
    check_history(log, ids, taken={j: taken_at for j in theirs})
    pauses = [longest_pause(log, j, cut_at - 1) for j in theirs]
    print(
        f"\ncut {victim}'s host with {len(theirs)}/{len(ids)} running jobs its own: {survivor} held them "
        f"{taken_at - cut_at:.1f} s later (lease {LEASE_S:g} s); longest pause of a job {max(pauses):.1f} s; "
        f"healed {healed_at - cut_at:.1f} s after the cut; 0 lost, 0 failed, 1 done each"
    )
    await check_images(fleet, reqs, got, "cutref")
    errs = await fleet.close()
    check_logs(errs)
    for j in theirs:  # the healed owner saw it lost them, and said so
        assert f"job {j}: ".encode() in errs[victim] and b"stops publishing for it" in errs[victim], errs[victim][
            -3000:
        ]
