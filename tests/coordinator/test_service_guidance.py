"""Classifier-free guidance through a real fleet (nats-server, expert workers with a null label, the
coordinator): a guided job's images are the in-process sampler's bit for bit (Euler and Heun), alone and
beside an unguided job; running ahead does not change them; a fleet without a null label, or whose workers
do not serve guidance, refuses a guided job with `bad_request` and keeps serving. Scheduler bookkeeping
(job cost, job status, a restored job) is checked without a bus."""

from __future__ import annotations

import asyncio
import shutil

import msgpack
import numpy as np
import pytest

from client.jobs import fleet_status, run_job
from coordinator.local_fleet import LabelRouter, LocalFleet
from coordinator.scheduler import Rejected, Scheduler, SchedulerConfig, job_cost
from coordinator.service import Coordinator
from coordinator.snapshot import decode, encode
from coordinator.transport import NatsTransport
from evaluation.sample_inprocess import SampleConfig, _ddm_velocity, generate, initial_batch
from flow.solver import sample
from schemas import ErrorCode, JobRejected, JobRequest, StepReply, StepRequest, SubmitReply, pack, subjects, unpack
from tests.coordinator.helpers import JITTER, TINY_WIDTHS, run_ahead_discovered, start_workers, stop_workers

C2E = [0] * 5 + [1] * 5
U = -1
SCALE = 3.0


@pytest.fixture(scope="module")
def ddm(tmp_path_factory):
    """A tiny DDM directory whose experts have a null label (expert<k>, router, partition.json), with torch
    on one intra-op thread meanwhile (a shared small box)."""
    import torch

    from models.tiny import make_tiny_experts, make_tiny_router

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    ck = tmp_path_factory.mktemp("guided-ddm")
    make_tiny_experts(ck, 2, widths=TINY_WIDTHS, jitter=JITTER, groups=8, null_label=True)
    make_tiny_router(ck / "router", 2)
    shutil.copy("checkpoints/partition.json", ck / "partition.json")
    yield ck
    torch.set_num_threads(threads)


def _in_process(ddm, digits, seed: int, steps: int, solver: str, guidance: float, batch_quantum: int = 0) -> np.ndarray:
    """The in-process sampler's images of one job (`evaluation.sample_inprocess.generate`)."""
    images, _ = generate(
        SampleConfig("g", "ddm", "top1", guidance=guidance),
        digits=np.asarray(digits, np.int64),
        noise=initial_batch(len(digits), len(digits), seed),
        steps=steps,
        solver=solver,
        device="cpu",
        checkpoints=str(ddm),
        seed=seed,
        job_size=len(digits),
        dtype="float32",
        batch_quantum=batch_quantum,
    )
    return images


async def test_a_guided_job_alone_is_the_in_process_samplers_bit_for_bit(nats_url, ddm):
    """One job alone: each expert's worker forwards exactly the rows (and null twins) the in-process sampler
    forwards, in the same order and batch (torch on a CPU pads nothing), so the float32 images agree to the
    bit, with Euler and with Heun. Unguided and label-unknown rows are as without guidance."""
    digits = [1, 6, U, 3, 8]
    async with LocalFleet.from_dir(ddm, dtype="float32", nats_url=nats_url) as fleet:
        got = {}
        for solver in ("euler", "heun"):
            req = JobRequest(digits=digits, seed=11, steps=3, solver=solver, guidance_scale=SCALE)
            got[solver] = (await run_job(fleet.nc, req, timeout=120)).images
        plain = (await run_job(fleet.nc, JobRequest(digits=digits, seed=11, steps=3), timeout=120)).images
    for solver, images in got.items():
        want = _in_process(ddm, digits, 11, 3, solver, SCALE)
        np.testing.assert_array_equal(images, want, err_msg=solver)
    assert np.abs(got["euler"][[0, 1, 3, 4]] - plain[[0, 1, 3, 4]]).max() > 1e-3  # guidance changes the images
    np.testing.assert_allclose(got["euler"][2], plain[2], atol=1e-5)  # the label-unknown row is not guided
    np.testing.assert_array_equal(plain, _in_process(ddm, digits, 11, 3, "euler", 1.0))  # s = 1: as before


def _passes_over(workers, rows: int) -> int:
    """Forward passes of more than `rows` real rows, over all `workers` (their batch-size histograms)."""
    hists = [w.metrics.snapshot()["batch_size"] for w in workers]
    return sum(h["count"] - h["buckets"][str(rows)] for h in hists)


async def test_batch_invariant_workers_give_guided_jobs_the_in_process_images_amid_other_jobs(nats_url, ddm):
    """Workers run with --batch-invariant (every forward a multiple of 16 rows): three jobs at once, one
    cohort, so their rows and null twins share the workers' forward passes in compositions no job alone
    has; each job's float32 images are still the in-process sampler's (batch-invariant too), computed for
    that job alone, bit for bit (Heun and Euler, two scales, an unguided job, a label-unknown row)."""
    jobs = [
        JobRequest(digits=[1, 6, U, 3, 8], seed=11, steps=3, solver="heun", guidance_scale=SCALE),
        JobRequest(digits=[2, 9, 0], seed=6, steps=3, guidance_scale=1.0),
        JobRequest(digits=[7, 7, 4, 5, 0, 1, 2], seed=7, steps=3, guidance_scale=1.5),
    ]
    options = {"coordinator_options": {"cohorts": 1}}
    async with LocalFleet.from_dir(ddm, dtype="float32", nats_url=nats_url, batch_quantum=16, **options) as fleet:
        alone = (await run_job(fleet.nc, jobs[0], timeout=120)).images
        assert _passes_over(fleet.workers, 8) == 0  # alone, no expert's pass held more than 8 rows
        together = await asyncio.gather(*(run_job(fleet.nc, job, timeout=120) for job in jobs))
        assert _passes_over(fleet.workers, 8) > 0  # together, the jobs' rows shared passes
    for job, got in zip(jobs, together):
        want = _in_process(ddm, job.digits, job.seed, 3, job.solver, job.guidance_scale, batch_quantum=16)
        np.testing.assert_array_equal(got.images, want, err_msg=f"seed {job.seed}")
    np.testing.assert_array_equal(together[0].images, alone)


async def test_a_job_without_a_scale_gets_the_fleets_default_and_an_explicit_one_turns_it_off(nats_url, ddm, tmp_path):
    """The router JSON names a default scale (`models.fleet_guidance`): a job that sets none is guided at it,
    exactly as one that asks for it; guidance_scale 1 runs unguided; --default-guidance overrides the JSON."""
    from models.fleet_guidance import fleet_default_guidance, set_default_guidance

    fleet_dir = tmp_path / "fleet"
    shutil.copytree(ddm, fleet_dir)
    set_default_guidance(fleet_dir / "router.json", SCALE, chosen_by="a test")
    assert fleet_default_guidance(fleet_dir / "router.safetensors") == SCALE
    digits = [2, 7, U]
    async with LocalFleet.from_dir(fleet_dir, dtype="float32", nats_url=nats_url) as fleet:
        assert fleet.coordinator.default_guidance == SCALE
        # what a client (the viewer) reads of it: with the spec only, where v1 clients never see it
        assert (await fleet_status(fleet.nc, spec=True)).default_guidance_scale == SCALE
        bare = await fleet.nc.request(subjects.FLEET_STATUS, b"", timeout=5)
        assert b"default_guidance_scale" not in bare.data
        unset = (await run_job(fleet.nc, JobRequest(digits=digits, seed=5, steps=2), timeout=120)).images
        asked = JobRequest(digits=digits, seed=5, steps=2, guidance_scale=SCALE)
        np.testing.assert_array_equal(unset, (await run_job(fleet.nc, asked, timeout=120)).images)
        off = JobRequest(digits=digits, seed=5, steps=2, guidance_scale=1.0)
        off_images = (await run_job(fleet.nc, off, timeout=120)).images
    np.testing.assert_array_equal(unset, _in_process(ddm, digits, 5, 2, "euler", SCALE))
    # off: the unguided images (to float rounding: this job's rows may reach the workers in other batches)
    np.testing.assert_allclose(off_images, _in_process(ddm, digits, 5, 2, "euler", 1.0), atol=1e-5)
    assert np.abs(off_images[:2] - unset[:2]).max() > 1e-3  # the labelled rows were guided, then not
    options = {"coordinator_options": {"default_guidance": 1.0}}  # the command line's --default-guidance 1
    async with LocalFleet.from_dir(fleet_dir, dtype="float32", nats_url=nats_url, **options) as fleet:
        assert fleet.coordinator.default_guidance == 1.0
        assert (await fleet_status(fleet.nc, spec=True)).default_guidance_scale == 1.0
        plain = (await run_job(fleet.nc, JobRequest(digits=digits, seed=5, steps=2), timeout=120)).images
    np.testing.assert_allclose(plain, off_images, atol=1e-5)


class _SimExperts:
    """The sim backends of the DDM's experts in this process, as `evaluation.sample_inprocess._Experts`."""

    def __init__(self, ddm):
        from workers.backends import get_backend

        self.backends = []
        for k in range(2):
            be = get_backend("sim", preset="instant")
            be.load(ddm / f"expert{k}.safetensors")
            self.backends.append(be)

    def forward(self, k: int, x, t, y):
        return self.backends[k].forward(x, t, y)


def _sim_in_process(ddm, digits, seed: int, steps: int, guidance: float, trajectory: list | None = None) -> np.ndarray:
    """The in-process sampler's images (`_ddm_velocity`, top1, the label router) over sim experts; `trajectory`
    gets x after each step."""
    router = LabelRouter(C2E, 2)
    y = np.asarray(digits, np.int64)
    usage = np.zeros((len(y), 2))
    owner = np.asarray(C2E)[np.clip(y, 0, 9)]
    velocity = _ddm_velocity(_SimExperts(ddm), router, "top1", 2, owner, usage, guidance=guidance)
    keep = None if trajectory is None else (lambda i, x, t: trajectory.append(x.copy()))
    x = sample(velocity, initial_batch(len(y), len(y), seed), y, steps, method="euler", callback=keep)
    return np.clip(x, -1.0, 1.0).astype(np.float32)


async def test_a_guided_job_beside_an_unguided_one_keeps_its_images(nats_url, ddm):
    """Two jobs in the same batches (one cohort): the workers forward the unguided job's rows with the guided
    job's rows and twins. The sim backend computes each row alone (a convolution's last bits can depend
    on the batch), so both jobs' images are the in-process sampler's, each computed alone, bit for bit."""
    guided = JobRequest(digits=[2, 7, U, 4], seed=5, steps=4, guidance_scale=SCALE)
    plain = JobRequest(digits=[2, 9, 0], seed=6, steps=4)
    experts = [ddm / "expert0.safetensors", ddm / "expert1.safetensors"]
    async with LocalFleet(
        experts,
        LabelRouter(C2E, 2),
        num_experts=2,
        class_to_expert=C2E,
        nats_url=nats_url,
        backend="sim",
        coordinator_options={"cohorts": 1},
    ) as fleet:
        frames = []
        alone = await run_job(
            fleet.nc, guided, lambda ev: frames.append(ev) if ev.kind == "frame" else None, timeout=60
        )
        both = await asyncio.gather(run_job(fleet.nc, guided, timeout=60), run_job(fleet.nc, plain, timeout=60))
    np.testing.assert_array_equal(alone.images, _sim_in_process(ddm, guided.digits, 5, 4, SCALE))
    np.testing.assert_array_equal(both[0].images, alone.images)
    np.testing.assert_array_equal(both[1].images, _sim_in_process(ddm, plain.digits, 6, 4, 1.0))
    # the sim's exact velocities end every labelled row on its template either way; on the way guidance shows
    guided_path, plain_path = [], []
    _sim_in_process(ddm, guided.digits, 5, 4, SCALE, guided_path)
    _sim_in_process(ddm, guided.digits, 5, 4, 1.0, plain_path)
    np.testing.assert_array_equal(np.float16(frames[0].x), np.float16(guided_path[0]))  # frames travel in float16
    assert np.abs(guided_path[0][[0, 1, 3]] - plain_path[0][[0, 1, 3]]).max() > 0.1
    np.testing.assert_array_equal(guided_path[0][2], plain_path[0][2])  # the label-unknown row is not guided


async def test_running_ahead_guided_gives_the_same_images(nats_url, nc, ddm):
    """A lone guided job run ahead: the worker steps with the guided velocity, so the images are those of
    the same job asked step by step, bit for bit, and the streamed steps were used."""
    ws = await start_workers(nats_url, [ddm / "expert0.safetensors", ddm / "expert1.safetensors"], dtype="float32")
    job = JobRequest(digits=[3, U, 8], seed=9, steps=8, guidance_scale=SCALE)
    out = {}
    try:
        for ahead in (0, 4):
            async with Coordinator(
                LabelRouter(C2E, 2), num_experts=2, class_to_expert=C2E, nats_url=nats_url, run_ahead=ahead
            ) as coord:
                if ahead:
                    await run_ahead_discovered(coord.transport, {0: 16, 1: 16})
                out[ahead] = (await run_job(nc, job, timeout=120)).images, coord.engine.ahead
    finally:
        await stop_workers(ws)
    (plain, off), (ahead, on) = out[0], out[4]
    assert off.runs == 0 and on.runs >= 1 and on.rows_taken >= 1, on
    np.testing.assert_array_equal(ahead, plain)


async def _submit_raw(nc, fields: dict):
    data = msgpack.packb({"v": 1, "kind": "job_request", **fields}, use_bin_type=True)
    msg = await nc.request(subjects.jobs_submit("anon"), data, timeout=10)
    return unpack(msg.data, SubmitReply)


async def test_a_fleet_without_a_null_label_refuses_guided_jobs(nats_url, nc, experts):
    ws = await start_workers(nats_url, experts, dtype="float32")
    try:
        async with Coordinator(LabelRouter(C2E, 2), num_experts=2, class_to_expert=C2E, nats_url=nats_url):
            for _ in range(2):  # the second answer comes from the cached probe
                reply = await _submit_raw(nc, {"digits": [3, 7], "seed": 1, "steps": 2, "guidance_scale": 2.0})
                assert isinstance(reply, JobRejected) and reply.code == ErrorCode.BAD_REQUEST, reply
                assert "guidance_scale 2" in reply.reason and "null label" in reply.reason
                assert "--label-dropout" in reply.reason and "guidance_scale 1" in reply.reason
            done = await run_job(nc, JobRequest(digits=[3, 7], seed=1, steps=2), timeout=60)  # still serving
            assert done.images.shape == (2, 1, 32, 32)
    finally:
        await stop_workers(ws)


async def test_workers_that_do_not_serve_guidance_make_a_guided_job_refused(nats_url, nc, ddm):
    """A worker that does not advertise `guidance` (an older release: it would refuse the field) makes the
    coordinator refuse a guided job at admission, never run it unguided; unguided jobs still run."""
    from workers.service import ExpertWorker

    class OlderWorker(ExpertWorker):
        def metadata(self) -> dict[str, str]:
            meta = super().metadata()
            meta.pop("guidance")
            return meta

    ws = [
        await ExpertWorker(0, ddm / "expert0.safetensors", "sim", nats_url=nats_url, sim_preset="instant").__aenter__(),
        await OlderWorker(1, ddm / "expert1.safetensors", "sim", nats_url=nats_url, sim_preset="instant").__aenter__(),
    ]
    try:
        async with Coordinator(LabelRouter(C2E, 2), num_experts=2, class_to_expert=C2E, nats_url=nats_url) as coord:
            reply = await _submit_raw(nc, {"digits": [3, 7], "seed": 1, "steps": 2, "guidance_scale": 1.5})
            assert isinstance(reply, JobRejected) and reply.code == ErrorCode.BAD_REQUEST, reply
            assert "expert 1" in reply.reason and "upgrade the workers" in reply.reason, reply.reason
            assert coord.transport.guidance_of == {0: True, 1: False}
            done = await run_job(nc, JobRequest(digits=[3, 7], seed=1, steps=2), timeout=60)
            assert done.images.shape == (2, 1, 32, 32)
    finally:
        await stop_workers(ws)


def test_scheduler_counts_twins_reports_the_scale_and_restores_it():
    cfg = SchedulerConfig(num_experts=2, image_shape=(1, 32, 32), max_job_cost=60)
    guided = JobRequest(digits=[1, U, 2], steps=5, seed=3, guidance_scale=2.0)
    assert job_cost(guided, 2) == (3 + 2) * 5 and job_cost(guided.model_copy(update={"guidance_scale": 1.0}), 2) == 15
    sched = Scheduler(cfg)
    with pytest.raises(Rejected) as err:  # 4 images + 4 twins x 8 steps = 64 > 60
        sched.submit(JobRequest(count=4, steps=8, guidance_scale=2.0), now=0.0)
    assert err.value.code == ErrorCode.TOO_LARGE and "4 null-label twins" in err.value.reason
    accepted = sched.submit(guided, now=0.0)
    plain = sched.submit(JobRequest(digits=[4], steps=5, seed=4), now=0.0)
    assert sched.job_progress(accepted.job_id)["guidance_scale"] == 2.0
    assert "guidance_scale" not in sched.job_progress(plain.job_id)
    batch = sched.schedule(0.0)
    np.testing.assert_array_equal(batch.guidance, np.array([2.0, 2.0, 2.0, 1.0], np.float32))
    assert batch.guidance.dtype == np.float32
    # a durable take-over: the checkpoint holds the request, so the restored rows are guided as before
    cp = sched.checkpoint(accepted.job_id)
    other = Scheduler(cfg)
    other.restore(decode(encode(cp))[0], now=1.0)
    assert other.job_progress(accepted.job_id)["guidance_scale"] == 2.0
    np.testing.assert_array_equal(other.schedule(1.0).guidance, np.full(3, 2.0, np.float32))


async def test_the_transport_sends_guidance_only_for_guided_rows_in_half_size_requests(nc):
    """`guidance` travels only in a request with a row at a scale other than 1 (older workers refuse the key),
    and a guided call holds half the rows per request (the worker computes each guided row twice)."""
    expert = 43  # a subject no other test serves
    seen: list[StepRequest] = []

    async def answer(msg):
        req = unpack(msg.data, StepRequest)
        seen.append(req)
        await msg.respond(pack(StepReply(expert=expert, velocity=-np.asarray(req.x_t), row_ids=req.row_ids)))

    sub = await nc.subscribe(subjects.expert_velocity(expert), cb=answer)
    try:
        tr = NatsTransport(nc, max_rows=4)
        x = np.arange(6 * 16, dtype=np.float32).reshape(6, 1, 4, 4)
        t, y, ids = np.full(6, 0.5, np.float32), np.arange(6, dtype=np.int64), [f"r{i}" for i in range(6)]
        np.testing.assert_array_equal(await tr.velocity(expert, x, t, y, ids), -x)
        np.testing.assert_array_equal(await tr.velocity(expert, x, t, y, ids, guidance=np.ones(6, np.float32)), -x)
        assert [len(r.row_ids) for r in seen] == [4, 2, 4, 2] and all(r.guidance is None for r in seen)
        seen.clear()
        scale = np.array([1, 1, 2, 2, 1, 1], np.float32)
        np.testing.assert_array_equal(await tr.velocity(expert, x, t, y, ids, guidance=scale), -x)
        parts = sorted(seen, key=lambda r: r.row_ids[0])
        assert [r.row_ids for r in parts] == [["r0", "r1"], ["r2", "r3"], ["r4", "r5"]]
        assert parts[0].guidance is None and parts[2].guidance is None  # no guided row: the field is left out
        np.testing.assert_array_equal(parts[1].guidance, [2.0, 2.0])
        assert parts[1].guidance.dtype == np.float32
    finally:
        await sub.unsubscribe()
