"""Faults with real processes: nothing is lost silently.

One nats-server of this module's own (it gets restarted) and two `ddm-fleet worker` processes
(tiny random experts 0 and 1) serve every test. Each fault ends, for every job in flight, in its
images or in a JobFailed with a meaningful code, within a bounded time:

* nats-server restart mid-run: every job completes, with the images of an undisturbed run;
* rogue workers (a raw nats-py responder in an expert's queue group answering NaN or the wrong
  shape): the coordinator refuses those replies, retries, falls back, and fails a job with
  `bad_reply` only when no expert is left; NaN never reaches a client;
* `ddm-fleet coordinator` SIGTERM: `unavailable` / "coordinator shutting down" at once;
* `ddm-fleet coordinator` kill -9: its clients learn that the job is lost, while it is down
  (no coordinator) and at once when it is back (a restarted coordinator does not know the job);
* `ddm-fleet coordinator` SIGSTOP (frozen, still connected): its clients give up after
  `unresponsive_after` seconds without an event or a status reply.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import signal
import sys
import time
from pathlib import Path

import msgpack
import numpy as np
import pytest

from bus.connect import flushed
from bus.nats_server import NatsServer
from client.jobs import JobFailed, job_status, run_job
from coordinator.local_fleet import LabelRouter
from coordinator.service import Coordinator, wait_for_experts
from schemas import (
    DoneEvent,
    ErrorCode,
    FrameEvent,
    JobAccepted,
    JobRequest,
    StepRequest,
    encode_tensor,
    subjects,
    unpack,
)
from tests.coordinator.helpers import make_tiny_fleet_experts, make_tiny_router

pytestmark = pytest.mark.bus

C2E = [0] * 5 + [1] * 5
DDM = Path(sys.executable).with_name("ddm-fleet")
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
PARTITION = str(Path(__file__).resolve().parents[2] / "checkpoints" / "partition.json")  # classes 0-4 | 5-9


class Proc:
    """A `ddm-fleet ...` child process: stdout read up to its "ready" line, stderr to a log file."""

    def __init__(self, name: str, args: list[str], log_dir: Path):
        self.name, self.args = name, [str(a) for a in args]
        self.log_path = log_dir / f"{name}.log"
        self.p: asyncio.subprocess.Process | None = None

    async def start(self, timeout: float = 180.0) -> Proc:
        with open(self.log_path, "ab") as log:
            self.p = await asyncio.create_subprocess_exec(
                str(DDM), *self.args, stdout=asyncio.subprocess.PIPE, stderr=log, env=ENV
            )
        line = await asyncio.wait_for(self.p.stdout.readline(), timeout)
        assert line.startswith(b"ready"), f"{self.name} did not start: {line!r}\n{self.log()}"
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    async def stop(self) -> None:
        if self.p is not None and self.p.returncode is None:
            self.p.kill()
            await self.p.wait()


@pytest.fixture(scope="module")
def files(tmp_path_factory, request):
    """Two tiny experts (UNets, unless a test parametrizes the architecture: `files` "unet" / "dit"), a router."""
    arch = getattr(request, "param", "unet")
    d = tmp_path_factory.mktemp(f"faults-{arch}")
    return {"experts": make_tiny_fleet_experts(d, arch), "router": make_tiny_router(d / "router"), "logs": d}


@pytest.fixture(scope="module")
def server():
    with NatsServer() as srv:
        yield srv


@pytest.fixture(scope="module")
async def workers(server, files):
    ws = [
        Proc(
            f"worker{k}",
            [
                "worker",
                "--expert",
                k,
                "--checkpoint",
                path,
                "--nats",
                server.url,
                "--buckets",
                "1,2,4,8,16",
                "--threads",
                "1",
                "--dtype",
                "float32",  # the tests compare images of reruns batched differently: float32 keeps them to 2e-4
            ],
            files["logs"],
        )
        for k, path in enumerate(files["experts"])
    ]
    try:
        await asyncio.gather(*(w.start() for w in ws))
        yield ws
    finally:
        for w in ws:
            await w.stop()


async def connect(url: str, name: str, **kw):
    import nats

    async def quiet(err):  # reconnect attempts during an outage are expected here
        pass

    return await nats.connect(url, name=name, max_reconnect_attempts=-1, error_cb=quiet, **kw)


async def settle(nc) -> None:
    """Return once the server has every SUB / UNSUB this connection sent before (nats-py's flush()
    writes its PING ahead of them): a request through the same buffer that only `nc` answers."""
    inbox = nc.new_inbox()

    async def pong(msg):
        await msg.respond(b"")

    sub = await nc.subscribe(inbox, cb=pong)
    await nc.request(inbox, b"", timeout=10)
    await sub.unsubscribe()


async def start_job(nc, request: JobRequest, on=None, **kw) -> asyncio.Task:
    """run_job as a task, returned once the coordinator accepted the job (so jobs queue in order)."""
    accepted = asyncio.Event()

    def on_event(ev):
        if isinstance(ev, JobAccepted):
            accepted.set()
        if on is not None:
            on(ev)

    task = asyncio.create_task(run_job(nc, request, on_event, **kw))
    waiter = asyncio.create_task(accepted.wait())
    await asyncio.wait({task, waiter}, timeout=30, return_when=asyncio.FIRST_COMPLETED)
    waiter.cancel()
    if task.done():
        task.result()  # raises why it was refused
    assert accepted.is_set(), f"job {request.job_id} not accepted within 30 s"
    return task


def finite_images(done: DoneEvent, n: int) -> bool:
    return done.images.shape == (n, 1, 32, 32) and bool(np.isfinite(done.images).all())


# ---------------------------------------------------------------- 1. nats-server restart


@pytest.mark.slow  # 5-40 s: fleet processes through an outage / restart / freeze
@pytest.mark.procs
async def test_nats_server_restart_mid_run_loses_no_job(server, workers):
    """Promise: jobs in flight (running or queued) across a NATS restart complete, exactly as if
    nothing had happened: coordinator, workers and clients reconnect, the lost expert call is
    retried, and a `done` published while a client was still away is published again when it asks."""
    client = await connect(server.url, "client", reconnect_time_wait=0.5)
    late = await connect(server.url, "late-client", reconnect_time_wait=4)  # comes back after the others
    try:
        await wait_for_experts(client, 2, timeout=60)
        async with Coordinator(
            LabelRouter(C2E, 2),
            num_experts=2,
            nats_url=server.url,
            max_rows=8,
            step_timeout=2,
            retries=3,
            name="restart-coordinator",
        ) as coord:
            streaming = [JobRequest(job_id=f"restart{i}", digits=[i, 9 - i], steps=40, seed=i) for i in range(3)]
            quiet = JobRequest(job_id="restart-quiet", digits=[7], steps=16, seed=11, stream=False)  # 7 rows run
            queued = JobRequest(job_id="restart-queued", digits=[1, 2, 3, 4], steps=8, seed=12)  # waits for rows
            frames = {j.job_id: asyncio.Event() for j in streaming}

            def on(ev):
                if isinstance(ev, FrameEvent) and ev.step >= 2:
                    frames[ev.job_id].set()

            tasks = [await start_job(client, j, on, probe_every=1.0, lost_after=30) for j in streaming]
            tasks.append(await start_job(late, quiet, probe_every=1.0, lost_after=30))
            tasks.append(await start_job(client, queued, probe_every=1.0, lost_after=30))
            await asyncio.wait_for(asyncio.gather(*(f.wait() for f in frames.values())), 60)
            assert coord.engine.job_state("restart-queued")["state"] == "queued"
            assert not any(t.done() for t in tasks)

            # down for longer than a step's time-out: the expert request in flight is certainly lost
            await asyncio.to_thread(server.stop)
            await asyncio.sleep(3.0)  # the outage itself
            await asyncio.to_thread(server.start)  # same port: everyone reconnects
            done = await asyncio.wait_for(asyncio.gather(*tasks), 90)

            assert client.stats["reconnects"] >= 1 and late.stats["reconnects"] >= 1
            assert coord.nc.stats["reconnects"] >= 1
            assert coord.transport.retried >= 1  # the step whose call was lost was sent again
            jobs = [*streaming, quiet, queued]
            for j, d in zip(jobs, done):
                assert finite_images(d, len(j.digits)), j.job_id
                assert not d.notes, (j.job_id, d.notes)  # no expert was given up for lost
            # the same jobs on an undisturbed fleet give the same images: no step lost or applied twice
            again = await asyncio.gather(
                *(run_job(client, j.model_copy(update={"job_id": j.job_id + "-again"})) for j in jobs)
            )
            for j, d, a in zip(jobs, done, again):
                np.testing.assert_allclose(d.images, a.images, atol=2e-4, err_msg=j.job_id)

            # a client that missed a job's end (it was away) gets it by asking: the coordinator publishes it again
            sub = await late.subscribe(subjects.job_events("anon", "restart-quiet"))
            await flushed(late)
            st = await job_status(late, "restart-quiet")
            assert (st.state, st.step, st.steps) == ("done", 16, 16)
            again_done = unpack((await sub.next_msg(timeout=10)).data, DoneEvent)
            np.testing.assert_array_equal(again_done.images, done[3].images)
            assert (await job_status(late, "never-submitted")).state == "unknown"
    finally:
        await client.close()
        await late.close()


# ---------------------------------------------------------------- 2. rogue workers


def rogue_answer(mode: str, expert: int, worker_id: str):
    """A well-formed step_reply whose velocity is NaN or of the wrong shape (raw msgpack: our own
    schemas would refuse to build it)."""

    async def answer(msg):
        req = unpack(msg.data, StepRequest)
        b = req.x_t.shape[0]
        if mode == "nan":
            v = np.full(req.x_t.shape, np.nan, np.float32)
        elif mode == "shape":
            v = np.zeros((b, 1, 16, 16), np.float32)
        else:  # float64 values that overflow float32
            v = np.full(req.x_t.shape, 1e300, np.float64)
        body = {
            "v": 1,
            "kind": "step_reply",
            "expert": expert,
            "velocity": encode_tensor(v),
            "row_ids": list(req.row_ids),
            "backend": "rogue",
            "worker_id": worker_id,
        }
        await msg.respond(msgpack.packb(body, use_bin_type=True))

    return answer


async def add_rogue(nc, expert: int, mode: str, worker_id: str):
    sub = await nc.subscribe(
        subjects.expert_velocity(expert),
        queue=subjects.expert_queue_group(expert),
        cb=rogue_answer(mode, expert, worker_id),
    )
    await settle(nc)
    return sub


@pytest.mark.procs
@pytest.mark.parametrize("files", ["unet", "dit"], indirect=True)  # the same promise from a DiT fleet
async def test_rogue_workers_are_refused_logged_and_never_reach_the_images(server, workers, caplog):
    """Promise: a reply with NaN / the wrong shape is a failed try: retried (the queue group picks
    again), logged with the worker id it claims; an expert with only a rogue is fallen back from."""
    caplog.set_level(logging.WARNING, logger="coordinator.transport")
    client = await connect(server.url, "client")
    rogues_nc = await connect(server.url, "rogues")
    try:
        await wait_for_experts(client, 2, timeout=60)
        c2e = [0] * 5 + [1] * 3 + [2] * 2  # expert 2 (digits 8, 9) has no real worker
        # dispatch="queue": every try goes to the queue group, so a rogue next to a real worker is picked
        # about every second try. (With direct dispatch the coordinator learns the real worker from its
        # first good reply and reaches the rogue only on exploration tries: CI once saw rogue-shape-1
        # never picked in a whole run.) 16 steps: >= 16 tries per expert, a rogue missed ~1 run in 65,000.
        # 40 bad-reply retries: a call to expert 0 / 1 gives up only after 41 rogue picks in a row (2^-41;
        # with 12, CI once saw expert 0 given up after 13, and a row that fell back from expert 2 then
        # went to expert 1 instead of 0, which no note names: the images differed from the clean run).
        async with Coordinator(
            LabelRouter(c2e, 3),
            num_experts=3,
            class_to_expert=c2e,
            nats_url=server.url,
            step_timeout=5,
            bad_reply_retries=40,
            dispatch="queue",
            name="rogue-coordinator",
        ) as coord:
            rogues = [
                await add_rogue(rogues_nc, 0, "nan", "rogue-nan-0"),  # next to real worker 0
                await add_rogue(rogues_nc, 1, "shape", "rogue-shape-1"),  # next to real worker 1
                await add_rogue(rogues_nc, 2, "overflow", "rogue-f64-2"),
            ]  # instead of any worker
            jobs = [
                JobRequest(job_id=f"rogue{i}", digits=[i, 5 + i, 8 + i % 2], steps=16, seed=20 + i, strategy=s)
                for i, s in enumerate(["top1", "full", "oracle"])
            ]
            seen_frames = []
            done = await asyncio.wait_for(asyncio.gather(*(run_job(client, j, seen_frames.append) for j in jobs)), 90)
            tr = coord.transport
            assert tr.bad_replies >= 3 and {"rogue-nan-0", "rogue-shape-1", "rogue-f64-2"} <= set(tr.bad_workers)
            logged = "\n".join(r.getMessage() for r in caplog.records)
            for worker_id, why in (
                ("rogue-nan-0", "non_finite"),
                ("rogue-shape-1", "shape"),
                ("rogue-f64-2", "NaN/Inf"),
            ):
                assert re.search(rf"bad reply to request \S+ from worker {worker_id}: .*{why}", logged), worker_id
            for ev in seen_frames:
                if isinstance(ev, FrameEvent):
                    assert np.isfinite(ev.x.astype(np.float32)).all()
            for j, d in zip(jobs, done):
                assert finite_images(d, 3), j.job_id
                assert any("expert 2" in n and "bad reply from worker rogue-f64-2" in n for n in d.notes), d.notes

            for sub in rogues:
                await sub.unsubscribe()
            await settle(rogues_nc)
            # without the rogues (expert 2 now has no responders: same fallback) the images are the same,
            # so every step used real velocities only
            clean = await asyncio.gather(
                *(run_job(client, j.model_copy(update={"job_id": j.job_id + "-clean"})) for j in jobs)
            )

            def gave_up(k: int) -> float:
                return coord.metrics.sample("ddm_coordinator_expert_errors_total", expert=str(k), code="bad_reply")

            assert gave_up(2) > 0 and gave_up(0) == gave_up(1) == 0  # 0 / 1: always retried past their rogues
            for j, d, c in zip(jobs, done, clean):
                assert {int(k) for n in d.notes for k in re.findall(r"expert (\d+)", n)} == {2}, d.notes
                np.testing.assert_allclose(d.images, c.images, atol=2e-4, err_msg=j.job_id)
    finally:
        await client.close()
        await rogues_nc.close()


async def test_an_expert_that_only_answers_garbage_fails_its_jobs_clearly(files):
    """Promise: when no expert is left that answers usably, the job fails with `bad_reply`."""
    with NatsServer() as srv:
        client = await connect(srv.url, "client")
        rogues_nc = await connect(srv.url, "rogues")
        try:
            async with Coordinator(
                LabelRouter([0] * 10, 1), num_experts=1, nats_url=srv.url, step_timeout=5, name="garbage-coordinator"
            ) as coord:
                for mode, why in (("nan", "non_finite"), ("shape", "velocity shape [2, 1, 16, 16]")):
                    sub = await add_rogue(rogues_nc, 0, mode, f"rogue-{mode}")
                    with pytest.raises(JobFailed) as err:
                        await asyncio.wait_for(run_job(client, JobRequest(digits=[3, 4], steps=4)), 30)
                    assert err.value.code == ErrorCode.BAD_REPLY
                    assert f"bad reply from worker rogue-{mode}" in err.value.reason and why in err.value.reason
                    await sub.unsubscribe()
                assert coord.status().jobs_failed == 2 and coord.transport.bad_replies == 2 * 5
        finally:
            await client.close()
            await rogues_nc.close()


# ---------------------------------------------------------------- 3. coordinator stop / crash


def coordinator_args(files, server, name: str) -> tuple[str, list]:
    return name, [
        "coordinator",
        "--router",
        files["router"],
        "--partition",
        PARTITION,
        "--nats",
        server.url,
        "--max-rows",
        "4",
        "--step-timeout-s",
        "5",
    ]


@pytest.mark.procs
async def test_coordinator_sigterm_fails_its_jobs_at_once(server, workers, files):
    """Promise: SIGTERM -> every queued and running job gets failed/unavailable "coordinator shutting down"."""
    client = await connect(server.url, "client")
    coord = Proc(*coordinator_args(files, server, "coordinator-term"), files["logs"])
    try:
        await wait_for_experts(client, 2, timeout=60)
        await coord.start()
        running, queued = asyncio.Event(), asyncio.Event()

        def on(ev):
            if isinstance(ev, FrameEvent) and ev.step >= 2:
                running.set()
            if isinstance(ev, JobAccepted) and ev.queue_position > 0:
                queued.set()

        jobs = [
            JobRequest(job_id="term-running", digits=[1, 6], steps=1000, seed=1),
            JobRequest(job_id="term-queued", digits=[2, 3, 7], steps=10, seed=2),
        ]
        tasks = [await start_job(client, j, on, probe_every=60, lost_after=120) for j in jobs]
        await asyncio.wait_for(asyncio.gather(running.wait(), queued.wait()), 60)
        coord.p.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        for res in await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 30):
            assert isinstance(res, JobFailed), res
            assert res.code == ErrorCode.UNAVAILABLE and "coordinator shutting down" in res.reason
        assert time.monotonic() - t0 < 15
        assert await asyncio.wait_for(coord.p.wait(), 60) == 0, coord.log()
    finally:
        await coord.stop()
        await client.close()


@pytest.mark.slow  # 5-40 s: fleet processes through an outage / restart / freeze
@pytest.mark.procs
async def test_coordinator_crash_and_restart_tells_the_clients(server, workers, files, aiohttp_client):
    """Promise: after kill -9 no client waits on: with no coordinator, run_job fails after lost_after;
    a restarted coordinator answers "unknown", and running and queued jobs fail at once; a browser
    tab's job is shown as failed."""
    from web.app import WebConfig, create_app

    client = await connect(server.url, "client")
    first = Proc(*coordinator_args(files, server, "coordinator-crash"), files["logs"])
    second = Proc(*coordinator_args(files, server, "coordinator-restarted"), files["logs"])
    try:
        await wait_for_experts(client, 2, timeout=60)
        await first.start()
        running = {"crash-a": asyncio.Event(), "crash-b": asyncio.Event()}
        queued = asyncio.Event()

        def on(ev):
            if isinstance(ev, FrameEvent) and ev.step >= 2:
                running[ev.job_id].set()
            if isinstance(ev, JobAccepted) and ev.queue_position > 0:
                queued.set()

        impatient = await start_job(
            client, JobRequest(job_id="crash-a", digits=[0, 5], steps=1000), on, probe_every=0.5, lost_after=3
        )
        patient = [
            await start_job(client, j, on, probe_every=1.0, lost_after=120)
            for j in (
                JobRequest(job_id="crash-b", digits=[4, 9], steps=1000),
                JobRequest(job_id="crash-queued", digits=[1, 2, 3], steps=10),
            )
        ]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in running.values()), queued.wait()), 60)
        web = await aiohttp_client(create_app(WebConfig(nats_url=server.url, fleet_interval=5.0)))
        tab = await web.ws_connect("/ws")
        await tab.send_json({"type": "generate", "digits": "7", "steps": 20, "ref": "tab-job"})
        while (msg := await tab.receive_json(timeout=30))["type"] != "accepted":
            assert msg["type"] in ("hello", "fleet", "spec"), msg
        tab_job = msg["job_id"]

        first.p.kill()  # kill -9: no FailedEvent is ever sent
        t0 = time.monotonic()
        with pytest.raises(JobFailed) as err:
            await asyncio.wait_for(impatient, 30)
        assert err.value.code == ErrorCode.UNAVAILABLE and "no coordinator has been connected" in err.value.reason
        assert 3 <= time.monotonic() - t0 < 20
        assert not any(t.done() for t in patient)  # lost_after=120: still waiting

        await second.start()
        t1 = time.monotonic()
        for res in await asyncio.wait_for(asyncio.gather(*patient, return_exceptions=True), 30):
            assert isinstance(res, JobFailed), res
            assert res.code == ErrorCode.UNAVAILABLE and "coordinator lost the job (restarted?)" in res.reason
        assert time.monotonic() - t1 < 15
        # the tab (the web session probes its silent jobs too) shows its job as failed
        while (msg := await tab.receive_json(timeout=30))["type"] != "failed":
            assert msg["type"] in ("fleet", "frame", "spec"), msg
        assert msg["job_id"] == tab_job and msg["code"] == "unavailable"
        assert "coordinator lost the job" in msg["reason"]
        await tab.close()
        done = await run_job(client, JobRequest(digits=[3, 8], steps=3, seed=5), timeout=60)  # and it serves again
        assert finite_images(done, 2)
    finally:
        await first.stop()
        await second.stop()
        await client.close()


@pytest.mark.slow  # 5-40 s: fleet processes through an outage / restart / freeze
@pytest.mark.procs
async def test_frozen_coordinator_fails_its_jobs_after_unresponsive_after(server, workers, files, aiohttp_client):
    """Promise: a coordinator that stays connected but answers nothing (SIGSTOP) does not keep its
    clients forever: once neither an event nor a status reply has come for `unresponsive_after`
    seconds, queued and running jobs fail with `unavailable` "the coordinator has not answered";
    while it is alive, a queued job silent for longer than that keeps waiting (its probes are answered).
    A browser tab's job is shown as failed the same way."""
    from web.app import WebConfig, create_app

    unresponsive_after = 3.0
    client = await connect(server.url, "client")
    coord = Proc(*coordinator_args(files, server, "coordinator-frozen"), files["logs"])
    try:
        await wait_for_experts(client, 2, timeout=60)
        await coord.start()
        running, queued, silent_long = asyncio.Event(), asyncio.Event(), asyncio.Event()
        silent_since: list[float] = []  # when "frozen-queued" was accepted into the queue
        silent_started: list[str] = []  # its first frame, were it to start

        def on(ev):
            if isinstance(ev, FrameEvent) and ev.job_id == "frozen-queued":
                silent_started.append(ev.job_id)
            if isinstance(ev, FrameEvent) and ev.step >= 2:
                running.set()
                if silent_since and not silent_started and time.monotonic() - silent_since[0] >= 2 * unresponsive_after:
                    silent_long.set()  # the queued job has been silent that long, coordinator alive
            if isinstance(ev, JobAccepted) and ev.queue_position > 0 and ev.job_id == "frozen-queued":
                silent_since.append(time.monotonic())
                queued.set()

        # Rows: 2 run; 3 + 3 wait in turn (--max-rows 4, FIFO); the short job waits behind both long ones.
        # A 1000-step job takes ~5 s on an idle box, so "frozen-queued" stays silent for ~3 such runs,
        # well over 2 * unresponsive_after, however fast the box; the test SIGSTOPs long before they end.
        jobs = [
            JobRequest(job_id="frozen-running", digits=[1, 6], steps=1000, seed=1),
            JobRequest(job_id="frozen-queued-long1", digits=[2, 3, 7], steps=1000, seed=3),
            JobRequest(job_id="frozen-queued-long2", digits=[4, 5, 8], steps=1000, seed=4),
            JobRequest(job_id="frozen-queued", digits=[2, 3, 7], steps=10, seed=2),
        ]
        tasks = [
            await start_job(client, j, on, probe_every=0.5, lost_after=120, unresponsive_after=unresponsive_after)
            for j in jobs
        ]
        ready = asyncio.ensure_future(asyncio.gather(running.wait(), queued.wait(), silent_long.wait()))
        await asyncio.wait([ready, tasks[-1]], timeout=90, return_when=asyncio.FIRST_COMPLETED)  # fail fast
        if not ready.done():
            ready.cancel()
            raise AssertionError(
                f"running={running.is_set()} queued={queued.is_set()} silent_long="
                f"{silent_long.is_set()} (queued job started: {bool(silent_started)}); "
                f"ended: {[j.job_id for j, t in zip(jobs, tasks) if t.done()]}"
            )
        assert not tasks[-1].done() and not silent_started  # silent, still queued, not given up on
        web = await aiohttp_client(
            create_app(WebConfig(nats_url=server.url, fleet_interval=5.0, unresponsive_after=unresponsive_after))
        )
        tab = await web.ws_connect("/ws")
        await tab.send_json({"type": "generate", "digits": "7", "steps": 1000, "ref": "tab-job"})
        while (msg := await tab.receive_json(timeout=30))["type"] != "accepted":
            assert msg["type"] in ("hello", "fleet", "spec"), msg
        tab_job = msg["job_id"]

        coord.p.send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 60)
        # long jobs ahead of the one in flight at the SIGSTOP have finished; the rest fail
        failed = {j.job_id: res for j, res in zip(jobs, results) if not isinstance(res, DoneEvent)}
        assert "frozen-queued" in failed and len(failed) >= 2, list(failed)  # the queued one and a running one
        for res in failed.values():
            assert isinstance(res, JobFailed), res
            assert res.code == ErrorCode.UNAVAILABLE, res
            assert f"the coordinator has not answered for {unresponsive_after:g} s" in res.reason, res.reason
        # counted from the last answer: a frame or a status reply at most probe_every before the SIGSTOP
        assert unresponsive_after - 1 <= time.monotonic() - t0 < unresponsive_after + 15
        while (msg := await tab.receive_json(timeout=30))["type"] != "failed":
            assert msg["type"] in ("fleet", "frame", "spec"), msg
        assert msg["job_id"] == tab_job and msg["code"] == "unavailable", msg
        assert f"the coordinator has not answered for {unresponsive_after:g} s" in msg["reason"], msg
        await tab.close()

        # woken up, it reads the cancels the clients left and stops cleanly
        coord.p.send_signal(signal.SIGCONT)
        coord.p.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(coord.p.wait(), 60) == 0, coord.log()
    finally:
        if coord.p is not None and coord.p.returncode is None:
            coord.p.send_signal(signal.SIGCONT)
            coord.p.terminate()
            try:
                await asyncio.wait_for(coord.p.wait(), 30)
            except TimeoutError:
                await coord.stop()
        await client.close()
