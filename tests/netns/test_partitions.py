"""Network partitions between real hosts (network namespaces, tests.netns.harness), each test checking
the whole history of its jobs.

The fleet (tests.netns.fleet.Fleet): a 3-node NATS cluster with JetStream R3 on hosts n0 n1 n2, two
durable coordinators ca (connected to n0) and cb (n1), a sim worker of each expert on w0 (n0) and on
w1 (n1), the client on cl (n1; n2 serves JetStream and routes only). Links are cut at the switch
(`ip link set <port> down`) or the switch is split in two (each side on a bridge of its own), then healed.
The module's tests share one fleet, one test after another: each starts once the last fault is healed, the
mesh and JetStream whole again and no job held (`Fleet.settle`), so each also checks that the fleet serves
on after the faults before it.

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
#: sim expert latency per batch; STEPS steps: a job lasts several leases, so it still runs after a take-over
BATCH_MS = 50.0
STEPS = 80


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("netns-models")
    return make_tiny_experts(d), make_tiny_router(d / "router")


@pytest.fixture(scope="module")
async def shared_fleet(tmp_path_factory, tiny_files):
    """One fleet for the module's tests, one after another: each fault is healed before the next test,
    which must find the fleet serving again (starting 9 processes and a JetStream cluster per test
    cost more than the tests' own work)."""
    experts, router = tiny_files
    f = Fleet(tmp_path_factory.mktemp("netns-fleet"), experts, router, lease_s=LEASE_S, batch_ms=BATCH_MS)
    try:
        await f.start()
        yield f
    finally:
        errs = await f.close()
    check_logs(errs)


@pytest.fixture
async def fleet(shared_fleet):
    """The module's fleet, whole again (`Fleet.settle`), its coordinators' logs read from here on."""
    await shared_fleet.settle()
    return shared_fleet


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


def n_resumed(fleet: Fleet) -> int:
    """Resumptions from a checkpoint (take-overs) in every coordinator's log, this test's."""
    return sum(map(len, resumes_of(fleet).values()))


def longest_pause(log: EventLog, j: str, after: float = 0.0) -> float:
    ts = [t for t, _, _ in log.events.get(j, []) if t >= after]
    return max((b - a for a, b in zip(ts, ts[1:])), default=0.0)


def resumes_of(fleet: Fleet) -> dict[str, list[int]]:
    """job id -> the steps it was resumed at from a checkpoint (a take-over), from every coordinator's log
    since this test began."""
    import re

    out: dict[str, list[int]] = {}
    for err in fleet.logs().values():
        for j, step in re.findall(rb"job (\S+) resumed at step (\d+)/", err):
            out.setdefault(j.decode(), []).append(int(step))
    return out


def check_history(
    log: EventLog,
    ids,
    resumes: dict[str, list[int]],
    *,
    taken: dict[str, tuple[float, float]] | None = None,
    complete: bool = True,
) -> int:
    """The whole history of each job as its client accepted it (run_job drops the events of a lower
    owner epoch than one it has seen: client.epochs), and returns how many it dropped so.

    Exactly one `done`, last, of the highest epoch; no `failed`; the last frame is the last step (unless
    `complete=False`: a client that was away misses frames). Every event carries an epoch and they never
    go down; within one epoch (one owner) frames strictly increase. Frames strictly increase except
    where a coordinator resumed the job from a checkpoint (resumes[j], from the logs): there they go
    back to that checkpoint's next step, once per resumption. A frame of a coordinator that lost the job,
    arriving before any of the new owner's, breaks this. For a job cut from its owner at taken[j][0] and
    taken over at taken[j][1] (seen by the test), no frame after the take-over comes from the owner it had
    at the cut (its epoch then): later take-overs (a job may change owner again after a heal) may follow."""
    for j in ids:
        ev = log.events[j]
        epochs = log.epochs[j]
        where = f"{j} (resumed at {resumes.get(j, [])}; epochs {sorted(set(epochs))}): {render(ev, ev[0][0])}"
        kinds = [k for _, k, _ in ev]
        assert kinds.count("done") == 1 and "failed" not in kinds, where
        steps = log.steps(j)
        assert kinds[-1] == "done" and (steps[-1] == STEPS or not complete), where
        assert None not in epochs and epochs == sorted(epochs) and epochs[-1] == max(epochs), where
        frames = [(e, s) for (_, k, s), e in zip(ev, epochs) if k == "frame"]
        for (ea, a), (eb, b) in zip(frames, frames[1:]):
            assert eb > ea or b > a, f"two frames of one owner (epoch {ea}) out of order: {where}"
        left = list(resumes.get(j, []))
        for a, b in zip(steps, steps[1:]):
            if b <= a:
                assert b - 1 in left, where  # a rewind that no resumption explains
                left.remove(b - 1)
        if taken and j in taken:
            cut, took = taken[j]
            lost = ([e for (t, _, _), e in zip(ev, epochs) if t <= cut] or [0])[-1]
            after = [e for (t, k, _), e in zip(ev, epochs) if k == "frame" and t > took]
            assert after and min(after) > lost, f"a frame of the cut-off owner (epoch {lost}) after it: {where}"
    return log.n_stale(ids)


def render(events, t0: float) -> str:
    """A job's history, compact: `step@seconds after t0` for frames, `kind@seconds` for the rest."""
    return " ".join(f"{k if s is None else s}@{t - t0:+.2f}" for t, k, s in events)


#: the undisturbed run's `done` of each request already run by a test of this module, by what decides its
#: images (not its job id): the tests submit the same rounds of requests under their own ids
_UNDISTURBED: dict[tuple, object] = {}


def _image_key(req: JobRequest) -> tuple:
    return (tuple(req.digits), req.seed, req.steps, req.strategy, req.solver, req.guidance_scale)


async def check_images(fleet: Fleet, reqs, got, tag: str) -> None:
    """Each `done` in `got` holds the images, usage and digits of the same request run undisturbed
    (`Fleet.reference_images`, run once per distinct request in this module)."""
    missing = [r for r in reqs if _image_key(r) not in _UNDISTURBED]
    if missing:
        ran = await asyncio.wait_for(fleet.reference_images(missing, tag), 240)
        _UNDISTURBED.update({_image_key(r): ran[r.job_id] for r in missing})
    want = {r.job_id: _UNDISTURBED[_image_key(r)] for r in reqs}
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
        owners = await fleet.owners_now(theirs)
        return owners is not None and all(o == survivor or log.dones(j) for j, o in owners.items())

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
    stale = check_history(log, ids, resumes_of(fleet), taken={j: (cut_at, taken_at) for j in theirs})
    pauses = [longest_pause(log, j, cut_at - 1) for j in theirs]
    print(
        f"\ncut {victim}'s host with {len(theirs)}/{len(ids)} running jobs its own: {survivor} held them "
        f"{taken_at - cut_at:.1f} s later (lease {LEASE_S:g} s); longest pause of a job {max(pauses):.1f} s; "
        f"healed {healed_at - cut_at:.1f} s after the cut; 0 lost, 0 failed, 1 done each; "
        f"{stale} stale-epoch events dropped by the client"
    )
    await check_images(fleet, reqs, got, "cutref")
    errs = fleet.logs()
    check_logs(errs)
    err = errs[victim]
    for j in theirs:  # the healed owner saw it lost them, and said so
        assert f"job {j}: ".encode() in err and b"stops publishing for it" in err, err[-3000:]
    # ... and dropped what it had queued behind the cut (frames a client would get after the take-over)
    assert b"leases lapsed; dropped the bus connection with its unsent messages" in err, err[-3000:]


async def test_worker_host_cut_mid_batch_its_requests_go_to_the_other_host(fleet):
    log = EventLog()
    reqs, runs = await jobs_on_both(fleet, log, "wcut")
    ids = [r.job_id for r in reqs]
    await mid_run(fleet, log, ids)
    running = [j for j in ids if not log.dones(j)]
    fleet.net.cut("w0")  # both experts' workers on w0 hold requests of this tick
    cut_at = time.monotonic()
    got = await asyncio.wait_for(asyncio.gather(*runs), 300)
    stale = check_history(log, ids, resumes_of(fleet))
    pauses = [longest_pause(log, j, cut_at - 1) for j in running]
    print(
        f"\ncut worker host w0 with {len(running)}/{len(ids)} jobs running: all done "
        f"{max(log.events[j][-1][0] for j in ids) - cut_at:.1f} s later; longest pause of a job {max(pauses):.1f} s "
        f"(hedging; step timeout 5 s); resumed {n_resumed(fleet)}; 0 lost, 0 failed, 1 done each; "
        f"{stale} stale-epoch events dropped by the client"
    )
    await check_images(fleet, reqs, got, "wcutref")
    check_logs(fleet.logs())


async def test_client_cut_and_healed_recovers_its_jobs_by_status(fleet):
    # the client pings every 0.5 s: it sees the dead link, reconnects once healed, and what was published
    # meanwhile (frames, `done`s) is gone with the old connection; it must ask for its jobs' status
    pings = await fleet.cl.run(_set_pings(fleet.client_nc, 0.5, 3))
    try:
        log = EventLog()
        reqs, runs = await jobs_on_both(fleet, log, "ccut")
        ids = [r.job_id for r in reqs]
        await mid_run(fleet, log, ids)
        fleet.net.cut("cl")
        cut_at = time.monotonic()
        # the jobs run on while the client is away: wait until both coordinators have finished them
        await wait_until(lambda: fleet.none_held(ids), timeout=120, interval=0.2, what="every job finished")
        fleet.net.heal("cl")
        healed_at = time.monotonic()
        got = await asyncio.wait_for(asyncio.gather(*runs), 300)
        done_while_away = [j for j in ids if max(log.steps(j)) < STEPS]  # its last frames and `done` were lost
        stale = check_history(log, ids, resumes_of(fleet), complete=False)
        print(
            f"\ncut the client's host for {healed_at - cut_at:.1f} s (every job finished meanwhile); "
            f"{len(done_while_away)}/{len(ids)} jobs recovered by status after the heal, last `done` "
            f"{max(log.events[j][-1][0] for j in ids) - healed_at:.1f} s after it; 0 lost, 0 failed, 1 done each; "
            f"{stale} stale-epoch events dropped by the client"
        )
        assert done_while_away, "no job lost its `done` with the cut: cut longer"
        await check_images(fleet, reqs, got, "ccutref")
        check_logs(fleet.logs())
    finally:  # the tests after this one share the client: its usual pings again
        await fleet.cl.run(_set_pings(fleet.client_nc, *pings))


async def _set_pings(nc, interval: float, outstanding: int) -> tuple[float, int]:
    """The client connection pings every `interval` s and gives up after `outstanding` unanswered; returns
    the settings it had."""
    was = (nc.options["ping_interval"], nc.options["max_outstanding_pings"])
    nc.options["ping_interval"] = interval
    nc.options["max_outstanding_pings"] = outstanding
    nc._ping_interval_task.cancel()
    nc._ping_interval_task = asyncio.ensure_future(nc._ping_interval())
    return was


async def test_split_brain_owner_cut_from_the_jetstream_majority_still_reaching_its_workers(fleet):
    log = EventLog()
    reqs, runs = await jobs_on_both(fleet, log, "split")
    ids = [r.job_id for r in reqs]
    # ca's jobs past their first checkpoint (waiting for every job's, ca's could all end first)
    mine = [j for j, o in (await fleet.owners(ids)).items() if o == "ca"]
    await wait_until(
        lambda: all(log.dones(j) or max(log.steps(j), default=0) >= 12 for j in mine),
        timeout=120,
        what="ca's jobs past step 12",
    )
    running = [j for j in ids if not log.dones(j)]
    theirs = [j for j, o in (await fleet.owners(running)).items() if o == "ca"]
    assert theirs, "ca owns no running job: make the jobs longer"
    # ca keeps n0 and the workers on w0; n0 is cut from n1 and n2 (JetStream's majority) and the rest
    fleet.net.partition(["ca", "n0", "w0"], ["cb", "n1", "n2", "w1", "cl", "obs"])
    cut_at = time.monotonic()

    async def taken():
        owners = await fleet.owners_now(theirs)
        return owners is not None and all(o == "cb" or log.dones(j) for j, o in owners.items())

    await wait_until(taken, timeout=60, interval=0.1, what="cb holds the jobs of ca, cut off with n0")
    taken_at = time.monotonic()
    await wait_until(
        lambda: all(log.dones(j) or any(t > taken_at for t, _, _ in log.events[j]) for j in theirs),
        timeout=60,
        what="frames of cb",
    )
    fleet.net.heal_all()
    healed_at = time.monotonic()
    got = await asyncio.wait_for(asyncio.gather(*runs), 300)
    stale = check_history(log, ids, resumes_of(fleet), taken={j: (cut_at, taken_at) for j in theirs})
    pauses = [longest_pause(log, j, cut_at - 1) for j in theirs]
    print(
        f"\nsplit {{ca, n0, w0}} from the rest with {len(theirs)}/{len(ids)} running jobs ca's: cb held them "
        f"{taken_at - cut_at:.1f} s later (lease {LEASE_S:g} s); longest pause {max(pauses):.1f} s; healed "
        f"{healed_at - cut_at:.1f} s after the split; 0 lost, 0 failed, 1 done each; "
        f"{stale} stale-epoch events dropped by the client"
    )
    await check_images(fleet, reqs, got, "splitref")
    errs = fleet.logs()
    check_logs(errs)
    for j in theirs:
        assert f"job {j}: ".encode() in errs["ca"] and b"stops publishing for it" in errs["ca"], errs["ca"][-3000:]


async def test_minority_nats_node_cut_then_healed_rejoins_and_no_job_ends_twice(fleet):
    log = EventLog()
    reqs, runs = await jobs_on_both(fleet, log, "ncut")
    ids = [r.job_id for r in reqs]
    await mid_run(fleet, log, ids)
    streams = ("KV_ddm_jobs", "KV_ddm_job_owners")
    leaders = {s: await asyncio.to_thread(fleet.cluster.stream_leader, "n1", s) for s in streams}
    fleet.net.cut("n2")  # routes and JetStream only: n0 and n1 keep the quorum
    cut_at = time.monotonic()
    await asyncio.sleep(2 * LEASE_S)
    fleet.net.heal("n2")
    healed_at = time.monotonic()
    got = await asyncio.wait_for(asyncio.gather(*runs), 300)
    stale = check_history(log, ids, resumes_of(fleet))
    # n2 is back in the mesh and a current JetStream peer
    await asyncio.to_thread(fleet.cluster.wait_formed, 60)
    await asyncio.to_thread(fleet.cluster.wait_jetstream, 60)
    pauses = [longest_pause(log, j, cut_at - 1) for j in ids]
    print(
        f"\ncut NATS node n2 (leader of {[s for s, h in leaders.items() if h == 'n2'] or 'no bucket'}) for "
        f"{healed_at - cut_at:.1f} s: longest pause of a job {max(pauses):.1f} s; resumed {n_resumed(fleet)}; "
        "n2 rejoined (routes, JetStream peer current); 0 lost, 0 failed, 1 done each; "
        f"{stale} stale-epoch events dropped by the client"
    )
    await check_images(fleet, reqs, got, "ncutref")
    check_logs(fleet.logs())


async def test_flapping_owner_link_within_a_lease(fleet):
    log = EventLog()
    reqs, runs = await jobs_on_both(fleet, log, "flap")
    ids = [r.job_id for r in reqs]
    victim, theirs = await mid_run(fleet, log, ids)
    host = fleet.host_of(victim)
    cut_at = time.monotonic()
    for _ in range(4):  # each cut shorter than the lease, four of them within two leases
        fleet.net.cut(host)
        await asyncio.sleep(LEASE_S / 4)
        fleet.net.heal(host)
        await asyncio.sleep(LEASE_S / 4)
    got = await asyncio.wait_for(asyncio.gather(*runs), 300)
    stale = check_history(log, ids, resumes_of(fleet))
    pauses = [longest_pause(log, j, cut_at - 1) for j in theirs]
    print(
        f"\nflapped {victim}'s link 4 times ({LEASE_S / 4:g} s down, {LEASE_S / 4:g} s up) with {len(theirs)} running "
        f"jobs its own: longest pause {max(pauses):.1f} s; resumed {n_resumed(fleet)}; "
        "0 lost, 0 failed, 1 done each; "
        f"{stale} stale-epoch events dropped by the client"
    )
    await check_images(fleet, reqs, got, "flapref")
    check_logs(fleet.logs())
