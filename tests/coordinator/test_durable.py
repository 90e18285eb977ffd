"""Durable jobs (coordinator.durable_store, `ddm-fleet coordinator --durable`): a real nats-server with
JetStream, a real coordinator process killed with SIGKILL mid-run, its restart under the same
name resumes every job from its JetStream checkpoint, and the waiting clients get images
bit-identical to an undisturbed run. Two durable coordinators on one bus: when the owner of jobs
is SIGKILLed, or SIGSTOPped past its lease and then SIGCONTed, the other takes the jobs over, each
client gets exactly one `done` with bit-identical images, and a woken owner publishes nothing for
the jobs it lost."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys

import numpy as np
import pytest

from bus.connect import flushed
from bus.nats_server import NatsServer
from client.jobs import run_job
from schemas import FrameEvent, JobRequest
from tests.coordinator.durable_procs import (
    EventLog,
    owners_of,
    reference_images,
    sim_workers,
    start_coordinator,
    stop,
    wait_checkpoints,
    wait_no_checkpoints,
)
from tests.coordinator.helpers import make_tiny_experts, make_tiny_router
from tests.waiting import wait_until

pytestmark = pytest.mark.bus


@pytest.fixture(scope="module")
def js_server(tmp_path_factory):
    store = tmp_path_factory.mktemp("jetstream")
    with NatsServer(extra_config=f'jetstream {{ store_dir: "{store}" }}') as srv:
        yield srv


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("durable-models")
    return make_tiny_experts(d), make_tiny_router(d / "router")


def jobs(tag: str) -> list[JobRequest]:
    # top1 / oracle: the tiny torch router's weights differ in the last bit with the rows batched beside
    # them, so `full` / `topk` images are bit-identical only when the batches are (pure test: test_checkpoint)
    kinds = [("top1", "euler"), ("top1", "heun"), ("oracle", "euler"), ("oracle", "heun")]
    return [
        JobRequest(job_id=f"{tag}-{i}", digits=[1 + i, 8 - i], steps=60, seed=900 + i, strategy=s, solver=v)
        for i, (s, v) in enumerate(kinds)
    ]


@pytest.mark.procs
async def test_durable_needs_jetstream_and_says_so(nats_url, tiny_files):
    _, router = tiny_files
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "infra.cli",
        "coordinator",
        "--router",
        str(router),
        "--partition",
        "checkpoints/partition.json",
        "--nats",
        nats_url,
        "--metrics-port",
        "0",
        "--durable",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode == 2, out + err
    assert b"--durable needs NATS JetStream" in err and b"Traceback" not in err


@pytest.mark.procs
async def test_kill9_mid_run_then_restart_resumes_every_job_bit_identical(js_server, tiny_files):
    import nats

    experts, router = tiny_files
    url = js_server.url
    nc = await nats.connect(url, name="pytest-durable")
    ws = await sim_workers(url, experts)
    procs = []
    try:
        proc, head = await start_coordinator(url, router, "--durable", "--checkpoint-every", "10", "--name", "dur")
        procs.append(proc)
        assert b"durable jobs: on" in head and b"checkpoint every 10 steps" in head
        want = await asyncio.gather(*(run_job(nc, r, timeout=120) for r in jobs("ref")))
        await wait_no_checkpoints(nc, timeout=10)  # the reference runs left none: the count below is the kill run's

        steps: dict[str, list[int]] = {}

        def seen(ev):
            if isinstance(ev, FrameEvent):
                steps.setdefault(ev.job_id, []).append(ev.step)

        runs = [
            asyncio.ensure_future(run_job(nc, r, seen, timeout=180, lost_after=120, probe_every=1.0))
            for r in jobs("kill")
        ]
        # mid-run: every job past its first periodic checkpoint, none finished
        await wait_until(
            lambda: len(steps) == 4 and min(max(s) for s in steps.values()) >= 12,
            timeout=60,
            what="every job past step 12",
        )
        assert max(max(s) for s in steps.values()) < 60
        await wait_checkpoints(nc, 4, timeout=30)  # what the restart can resume is what reached the server
        proc.kill()  # SIGKILL: no hand-over, no last checkpoint
        await proc.wait()
        at_kill = {j: max(s) for j, s in steps.items()}
        proc2, head2 = await start_coordinator(url, router, "--durable", "--checkpoint-every", "10", "--name", "dur")
        procs.append(proc2)
        if b"resumed 4 jobs" not in head2:  # say why: both runs' logs
            logs = [(await stop(p))[-6000:].decode(errors="replace") for p in procs]
            raise AssertionError(f"{head2!r}\n--- the killed run:\n{logs[0]}\n--- the restart:\n{logs[1]}")
        got = await asyncio.wait_for(asyncio.gather(*runs), 180)
        for w, g in zip(want, got):
            assert np.array_equal(w.images, g.images), g.job_id
            assert np.array_equal(w.usage, g.usage) and w.digits == g.digits
        for j, s in steps.items():  # frames paused, then went on from the last checkpoint (a multiple of 10)
            after = s[s.index(at_kill[j]) + 1 :] if at_kill[j] in s else []
            assert s[-1] == 60 and (not after or after[0] <= at_kill[j] + 1), (j, s)
        await wait_no_checkpoints(nc, timeout=10)
    finally:
        for p in procs:
            await stop(p)
        for w in ws:
            await w.stop()
        await nc.drain()


# ---------------------------------------------------------------- two durable coordinators on one bus
LEASE_S = 2.0
#: a dead owner's jobs are taken within lease_s (its lease's TTL) + lease_s / 3 (the survivor's scan
#: period) + a restore; 5 x lease_s leaves room for a loaded test box
TAKEOVER_BOUND_S = 5 * LEASE_S
#: sim expert latency per batch: a 60-step job lasts 4-8 s, so every job is still running when the
#: last one submitted passed step 12 (the first checkpoint) and the owner is killed / stopped
PAIR_BATCH_MS = 60.0


@pytest.fixture
def js_bus(tmp_path):
    """A fresh JetStream server per test: the owners bucket's TTL is the first coordinator's --lease-s."""
    with NatsServer(extra_config=f'jetstream {{ store_dir: "{tmp_path / "js"}" }}') as srv:
        yield srv


def pair_jobs(tag: str, round_: int) -> list[JobRequest]:
    kinds = [("top1", "euler"), ("top1", "heun"), ("oracle", "euler"), ("oracle", "heun")]
    return [
        JobRequest(
            job_id=f"{tag}-{round_}-{i}",
            digits=[(round_ + i) % 10, (7 + 3 * i) % 10],
            steps=60,
            seed=1000 + 10 * round_ + i,
            strategy=s,
            solver=v,
        )
        for i, (s, v) in enumerate(kinds + kinds)
    ]


async def two_coordinators_with_jobs(nc, url, router, log: EventLog, procs: list, tag: str):
    """Start durable coordinators "dura" and "durb" (lease LEASE_S, checkpoint every 10 steps) and
    submit rounds of 8 jobs (at once, so that they progress together) until each owns some;
    returns (requests, run_job futures, owner map)."""
    for name in ("dura", "durb"):
        proc, head = await start_coordinator(
            url, router, "--durable", "--checkpoint-every", "10", "--lease-s", str(LEASE_S), "--name", name
        )
        assert b"durable jobs: on" in head, head
        procs.append(proc)
    reqs, runs = [], []
    for round_ in range(6):
        batch = pair_jobs(tag, round_)
        reqs += batch
        runs += [
            asyncio.ensure_future(run_job(nc, r, log, timeout=120, probe_every=1.0, on_stale=log.stale)) for r in batch
        ]
        ids = [r.job_id for r in reqs]
        owners = await wait_until(lambda ids=ids: _all_owned(nc, ids), timeout=20, what="every job has a lease")
        # a lease is written before the submit's answer is sent: a fault between the two would leave a
        # submit unanswered, which is not what these tests are about
        await wait_until(
            lambda ids=ids: all(any(k == "accepted" for _, k, _ in log.events.get(j, ())) for j in ids),
            timeout=20,
            what="every submit answered",
        )
        if len(set(owners.values())) == 2:
            return reqs, runs, owners
    raise AssertionError(f"the queue group gave every job to one coordinator: {owners}")


async def mid_run_victim(nc, log: EventLog, ids) -> tuple[str, str, list[str]]:
    """Once every job passed step 12 (its first checkpoint) or ended: the coordinator holding the
    most running jobs, the other one, and the running jobs it holds. (Jobs progress at different
    rates on the two coordinators, so some may be done already.)"""
    from collections import Counter

    await wait_until(
        lambda: all(log.dones(j) or max(log.steps(j), default=0) >= 12 for j in ids),
        timeout=60,
        what="every job past step 12",
    )
    running = [j for j in ids if not log.dones(j)]
    owners = await owners_of(nc, running)
    held = Counter(o for o in owners.values() if o)
    assert held, ("every job ended before the fault: make the jobs longer", log.events)
    victim = held.most_common(1)[0][0]
    return victim, ("durb" if victim == "dura" else "dura"), [j for j in running if owners[j] == victim]


async def _taken(nc, log: EventLog, ids, name) -> bool:
    """Every job of ids is held by coordinator `name` or ended (a done raced the fault)."""
    return all(o == name or log.dones(j) for j, o in (await owners_of(nc, ids)).items())


async def _all_owned(nc, ids):
    owners = await owners_of(nc, ids)
    return owners if all(owners.values()) else None


@contextlib.asynccontextmanager
async def durable_pair(js_bus, tiny_files, tag: str):
    """Two durable coordinators and one sim worker per expert on the JetStream bus, with seeded jobs
    running on both: yields (nc, procs [dura, durb], log, reqs, runs, the victim's name, the survivor's
    name, the victim's job ids); stops everything after."""
    import nats

    experts, router = tiny_files
    url = js_bus.url
    nc = await nats.connect(url, name=f"pytest-durable-{tag}")
    ws = await sim_workers(url, experts, batch_ms=PAIR_BATCH_MS)
    procs: list = []
    log = EventLog()
    failed = True
    try:
        reqs, runs, _ = await two_coordinators_with_jobs(nc, url, router, log, procs, tag)
        victim_name, survivor_name, theirs = await mid_run_victim(nc, log, [r.job_id for r in reqs])
        yield nc, procs, log, reqs, runs, victim_name, survivor_name, theirs
        failed = False
    finally:
        for name, p in zip(("dura", "durb"), procs):
            err = await stop(p)
            if failed:  # what the coordinators logged, for a failure seen only in CI
                print(
                    f"\n--- {name} stderr (last 40 lines) ---\n"
                    + "\n".join(err.decode(errors="replace").splitlines()[-40:])
                )
        for w in ws:
            await w.stop()
        await nc.drain()


@pytest.mark.slow
@pytest.mark.procs
async def test_kill9_one_of_two_durable_coordinators_survivor_takes_over(js_bus, tiny_files):
    import time

    async with durable_pair(js_bus, tiny_files, "pk") as (
        nc,
        procs,
        log,
        reqs,
        runs,
        victim_name,
        survivor_name,
        theirs,
    ):
        ids = [r.job_id for r in reqs]
        victim = procs[0] if victim_name == "dura" else procs[1]
        victim.kill()  # SIGKILL: no hand-over
        killed_at = time.monotonic()
        await victim.wait()
        await wait_until(
            lambda: _taken(nc, log, theirs, survivor_name),
            timeout=30,
            interval=0.05,
            what=f"{survivor_name} holds the jobs of {victim_name}",
        )
        takeover_s = time.monotonic() - killed_at
        print(
            f"\ntake-over of {len(theirs)}/{len(ids)} jobs after kill -9 of {victim_name}: {takeover_s:.2f} s "
            f"(lease {LEASE_S:g} s)"
        )
        assert takeover_s < TAKEOVER_BOUND_S, takeover_s
        # the same requests, undisturbed, beside them (top1 / oracle images do not depend on the batch)
        want_f = asyncio.ensure_future(reference_images(nc, reqs, "pkref"))
        got = await asyncio.wait_for(asyncio.gather(*runs), 120)  # 0 failed, 0 lost: run_job raises otherwise
        want = await asyncio.wait_for(want_f, 120)
        for g in got:
            w = want[g.job_id]
            assert np.array_equal(w.images, g.images), g.job_id
            assert np.array_equal(w.usage, g.usage) and w.digits == g.digits
        for j in ids:
            assert log.dones(j) == 1 and log.steps(j)[-1] == 60, (j, log.events[j])


@pytest.mark.slow
@pytest.mark.procs
async def test_sigstopped_owner_loses_its_jobs_and_publishes_nothing_for_them_after_sigcont(js_bus, tiny_files):
    import signal
    import time

    victim = None
    async with durable_pair(js_bus, tiny_files, "ps") as (
        nc,
        procs,
        log,
        reqs,
        runs,
        victim_name,
        survivor_name,
        theirs,
    ):
        try:
            ids = [r.job_id for r in reqs]
            victim = procs[0] if victim_name == "dura" else procs[1]
            os.kill(victim.pid, signal.SIGSTOP)  # frozen mid-run: its leases lapse, its frames stop
            stopped_at = time.monotonic()
            await wait_until(
                lambda: _taken(nc, log, theirs, survivor_name),
                timeout=30,
                interval=0.05,
                what=f"{survivor_name} holds the jobs of the stopped {victim_name}",
            )
            taken_at = time.monotonic()
            # (a done that raced the SIGSTOP: its job ended on the old owner)
            theirs = [j for j in theirs if not any(k == "done" and t < taken_at for t, k, _ in log.events[j])]
            print(
                f"\ntake-over of {len(theirs)}/{len(ids)} jobs from SIGSTOPped {victim_name}: "
                f"{taken_at - stopped_at:.2f} s (lease {LEASE_S:g} s)"
            )
            assert taken_at - stopped_at < TAKEOVER_BOUND_S
            # the survivor streams them; wake the old owner while they still run
            assert theirs, "the stopped owner's jobs all ended before it was stopped"
            await wait_until(
                lambda: all(any(t > taken_at for t, _, _ in log.events[j]) for j in theirs),
                timeout=20,
                what="frames of the survivor",
            )
            assert any(log.dones(j) == 0 for j in theirs), "the jobs ended before SIGCONT: make them longer"
            os.kill(victim.pid, signal.SIGCONT)
            victim = None
            # undisturbed reference runs beside them; the woken coordinator takes its share of them
            want_f = asyncio.ensure_future(reference_images(nc, reqs, "psref"))
            got = await asyncio.wait_for(asyncio.gather(*runs), 120)  # 0 failed, 0 lost
            want = await asyncio.wait_for(want_f, 120)
            for g in got:
                assert np.array_equal(want[g.job_id].images, g.images), g.job_id
            for j in ids:
                assert log.dones(j) == 1, (j, log.events[j])
            for j in theirs:  # from the take-over on, one publisher: steps strictly increase up to the end
                after = [s for t, k, s in log.events[j] if k == "frame" and t > taken_at]
                assert after and after[-1] == 60 and all(b > a for a, b in zip(after, after[1:])), (j, after)
                done_at = next(t for t, k, _ in log.events[j] if k == "done")
                assert all(t <= done_at for t, _, _ in log.events[j]), (j, log.events[j])
            err = await stop(procs[0] if victim_name == "dura" else procs[1])
            for j in theirs:  # it woke up, saw it lost them, and said so
                assert f"job {j}: ".encode() in err and b"stops publishing for it" in err, err[-3000:]
        finally:
            if victim is not None:  # never leave a stopped process behind
                os.kill(victim.pid, signal.SIGCONT)


@pytest.mark.slow
@pytest.mark.procs
async def test_a_stale_epoch_frame_and_done_after_a_take_over_never_reach_the_client(js_bus, tiny_files):
    """Owner epochs: the survivor takes the killed owner's jobs over at epoch 2 (the first owner's was 1);
    a frame and a `done` of epoch 1 arriving after that (as a cut-off owner's would, from a NATS node's
    routes) are dropped by the client. A client without the rule (the raw subscriber here, which takes
    the first `done` as the result) would have taken the stale `done`'s wrong images."""
    import time

    import nats

    from schemas import DoneEvent, JobEvent, pack, subjects, unpack

    async with durable_pair(js_bus, tiny_files, "ep") as (nc, procs, log, reqs, runs, victim_name, survivor, theirs):
        ids = [r.job_id for r in reqs]
        victim = procs[0] if victim_name == "dura" else procs[1]
        victim.kill()  # SIGKILL: its jobs are taken over at the next epoch
        await victim.wait()
        await wait_until(lambda: _taken(nc, log, theirs, survivor), timeout=30, interval=0.05, what="take-over")
        # every job of the victim still running has streamed frames of the new owner (epoch 2)
        await wait_until(
            lambda: all(log.dones(j) or 2 in log.epochs[j] for j in theirs), timeout=30, what="frames of epoch 2"
        )
        raw: dict[str, list] = {}  # every event on the wire, decoded, as a client without the rule reads them
        spy = await nats.connect(js_bus.url, name="pytest-epoch-spy")
        try:

            async def record(msg):
                ev = unpack(msg.data, JobEvent)
                raw.setdefault(ev.job_id, []).append(ev)

            live = [j for j in theirs if not log.dones(j)]
            assert live, "the taken-over jobs all ended before the injection: make them longer"
            subs = [await spy.subscribe(subjects.job_events("anon", j), cb=record) for j in live]
            await flushed(spy)
            injected_at = time.monotonic()
            for j in live:  # what the old owner would publish: its next frame, then a `done` of other images
                last = log.steps(j)[-1]
                stale_frame = FrameEvent.trusted(
                    job_id=j,
                    step=min(last + 1, 60),
                    steps=60,
                    t=min(last + 1, 60) / 60,
                    x=np.zeros((2, 1, 32, 32), np.float16),
                    experts=[0, 0],
                    weights=np.ones((2, 2), np.float32),
                    notes=[],
                ).model_copy(update={"epoch": 1})
                digits = next(r.digits for r in reqs if r.job_id == j)
                stale_done = DoneEvent(
                    job_id=j,
                    images=np.zeros((2, 1, 32, 32), np.float32),
                    digits=digits,
                    usage=np.ones((2, 2), np.float32),
                    steps=60,
                    strategy="top1",
                    elapsed_s=1.0,
                    epoch=1,
                )
                await spy.publish(subjects.job_events("anon", j), pack(stale_frame))
                await spy.publish(subjects.job_events("anon", j), pack(stale_done))
            await spy.flush()
            want_f = asyncio.ensure_future(reference_images(nc, reqs, "epref"))
            got = await asyncio.wait_for(asyncio.gather(*runs), 120)  # 0 failed, 0 lost
            want = await asyncio.wait_for(want_f, 120)
            for sub in subs:
                await sub.unsubscribe()
        finally:
            await spy.close()
        for g in got:  # the stale `done` (zeros) never became a result
            assert np.array_equal(want[g.job_id].images, g.images), g.job_id
        for j in ids:
            assert log.dones(j) == 1, (j, log.events[j])
            seen = [e for e in log.epochs[j] if e is not None]
            assert len(seen) == len(log.epochs[j]) and seen == sorted(seen), (j, log.epochs[j])  # never back
        dropped = {j: [(k, e) for _, k, _, e in log.stale_events.get(j, [])] for j in live}
        # each job still running when the events went out dropped both (a job whose real `done` came
        # first had unsubscribed: it never read them)
        ended_first = [j for j in live if next(t for t, k, _ in log.events[j] if k == "done") <= injected_at]
        for j in live:
            if j not in ended_first:
                assert dropped[j] == [("frame", 1), ("done", 1)], (j, dropped[j], log.events[j])
        assert log.n_stale(live) >= 2, dropped
        # ... while on the wire the stale `done` came first: a client taking the first `done` took zeros
        fooled = [j for j in live if next(e for e in raw[j] if isinstance(e, DoneEvent)).epoch == 1]
        assert fooled and all(j not in ended_first for j in fooled), raw.keys()
        print(
            f"\ntook over {len(theirs)} jobs at epoch 2; injected an epoch-1 frame and done into {len(live)} running "
            f"ones: {log.n_stale(live)} dropped by the client, {len(fooled)} would have fooled a client "
            "taking the first done"
        )


async def test_lease_follows_the_owners_bucket_ttl_set_by_the_first_coordinator(js_bus):
    """The owners bucket's TTL is fixed when it is created; a coordinator asking another --lease-s
    renews by the bucket's (else its leases would lapse between renewals, or be judged too late)."""
    import nats

    from coordinator.durable_store import JobStore

    nc = await nats.connect(js_bus.url)
    try:
        first = await JobStore(nc, "a", "run-a", lease_s=LEASE_S).open()
        second = await JobStore(nc, "b", "run-b", lease_s=6.0).open()
        assert first.lease_s == LEASE_S and second.lease_s == LEASE_S
        assert (await second.owners.status()).ttl == LEASE_S
    finally:
        await nc.drain()
