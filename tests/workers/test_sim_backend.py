"""The simulated expert (`--backend sim`): latency model, deterministic velocity, real wire work."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import numpy as np
import pytest

from schemas import (
    DoneEvent,
    ErrorCode,
    ErrorReply,
    JobRequest,
    StepReply,
    StepRequest,
    StepResult,
    encode_tensor,
    pack,
    subjects,
    unpack,
)
from workers.backends import BackendError, get_backend
from workers.backends.sim_backend import PRESETS, SimBackend, sim_template

ROOT = Path(__file__).resolve().parents[2]
C2E = [0] * 5 + [1] * 5


@pytest.fixture(scope="module")
def sim_experts(tmp_path_factory) -> list[str]:
    """Two tiny expert checkpoints (ids 0 and 1): the sim backend reads only their config and id."""
    from models.tiny import make_tiny_experts

    return [str(p) for p in make_tiny_experts(tmp_path_factory.mktemp("sim-experts"), 2)]


def _sim(checkpoint: str, **opts) -> SimBackend:
    be = get_backend("sim", **opts)
    be.load(checkpoint)
    return be


def _inputs(n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    return (
        rng.standard_normal((n, 1, 32, 32)).astype(np.float32),
        rng.uniform(0, 1, n).astype(np.float32),
        rng.integers(0, 10, n).astype(np.int64),
    )


# ------------------------------------------------------------------------------------------ options


def test_cli_preset_choices_match_the_backend():
    from benchmarks.worker import SIM_PRESETS as BENCH
    from infra.cmd_worker import SIM_PRESETS as WORKER

    assert set(WORKER) == set(BENCH) == set(PRESETS)
    assert PRESETS["instant"] == (0.0, 0.0)


def test_presets_reproduce_the_h200_table_within_15_percent():
    """docs/DEPLOYMENT.md, H200, in-process rows/s for buckets 1, 8, 64, 256."""
    table = {"h200-torch": (294, 2318, 18140, 52811), "h200-jax": (456, 3351, 19875, 39784)}
    for preset, rates in table.items():
        be = SimBackend(preset=preset)
        for bucket, rate in zip((1, 8, 64, 256), rates):
            assert abs(bucket / be.latency_s(bucket) / rate - 1) < 0.15, (preset, bucket)


def test_overrides_and_bad_options():
    be = SimBackend(preset="h200-jax", row_ms=1.0)
    assert (be.batch_ms, be.row_ms) == (PRESETS["h200-jax"][0], 1.0)
    assert be.device == "sim:h200-jax" and be.name == "sim"
    assert SimBackend().preset == "h200-torch"
    with pytest.raises(BackendError, match="unknown preset"):
        get_backend("sim", preset="h100")
    with pytest.raises(BackendError, match="batch_ms"):
        get_backend("sim", batch_ms=-1)
    with pytest.raises(BackendError, match="row_ms"):
        get_backend("sim", row_ms=float("nan"))
    with pytest.raises(BackendError, match="load"):
        SimBackend().forward(*_inputs(1))


@pytest.mark.procs
def test_imports_numpy_only():
    code = (
        "import sys; import workers.backends.sim_backend; "
        "bad = [m for m in ('torch', 'jax', 'flax', 'torch_xla') if m in sys.modules]; print(bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


# ------------------------------------------------------------------------------------------ latency


def test_a_batch_takes_batch_ms_plus_row_ms_per_row(sim_experts):
    be = _sim(sim_experts[0], batch_ms=30.0, row_ms=0.5)
    took = {}
    for n in (4, 200):
        x, t, y = _inputs(n)
        start = time.perf_counter()
        be.forward(x, t, y)
        took[n] = time.perf_counter() - start
    # 32 ms and 130 ms: never faster (it sleeps), and loosely bounded above for a busy machine
    assert 0.032 <= took[4] < 0.032 + 0.5
    assert 0.130 <= took[200] < 0.130 + 0.5
    assert took[200] - took[4] > 0.05


def test_warm_up_records_the_latency_model_without_waiting_it_out(sim_experts):
    """A slow sim is ready at once: its warm-up computes each bucket but does not sleep (4 buckets at
    1.5 s would wait 6-12 s), and records the modelled cost the batcher plans with; forwards still wait."""
    be = _sim(sim_experts[0], batch_ms=1500.0, row_ms=1.0)
    start = time.perf_counter()
    be.warmup([1, 16, 256, 512])
    assert time.perf_counter() - start < 1.0
    assert be.warmup_s == pytest.approx({1: 1.501, 16: 1.516, 256: 1.756, 512: 2.012}, abs=0.05)
    x, t, y = _inputs(2)
    start = time.perf_counter()
    be.forward(x, t, y)
    assert time.perf_counter() - start >= 1.502


def test_instant_preset_is_fast(sim_experts):
    be = _sim(sim_experts[0], preset="instant")
    x, t, y = _inputs(64)
    start = time.perf_counter()
    for _ in range(10):
        be.forward(x, t, y)
    assert time.perf_counter() - start < 1.0


# ------------------------------------------------------------------------------------------ velocity


def test_velocity_is_deterministic_and_independent_of_the_batch(sim_experts):
    be = _sim(sim_experts[0], preset="instant")
    x, t, y = _inputs(16, seed=3)
    full = be.forward(x, t, y)
    assert full.shape == (16, 1, 32, 32) and full.dtype == np.float32 and full.flags.c_contiguous
    np.testing.assert_array_equal(be.forward(x, t, y), full)
    np.testing.assert_array_equal(_sim(sim_experts[0], preset="instant").forward(x, t, y), full)
    for i in (0, 7, 15):  # a row alone, and inside a different batch, gives the same bits
        np.testing.assert_array_equal(be.forward(x[i : i + 1], t[i : i + 1], y[i : i + 1])[0], full[i])
    xo, to, yo = _inputs(5, seed=9)
    mixed = be.forward(np.concatenate([xo, x[3:4]]), np.concatenate([to, t[3:4]]), np.concatenate([yo, y[3:4]]))
    np.testing.assert_array_equal(mixed[-1], full[3])


def test_velocity_depends_on_x_t_y_and_expert(sim_experts):
    e0, e1 = (_sim(p, preset="instant") for p in sim_experts)
    assert (e0.expert, e1.expert) == (0, 1)
    x, t, y = _inputs(1)
    base = e0.forward(x, t, y)
    assert not np.allclose(e0.forward(x + 0.5, t, y), base)
    assert not np.allclose(e0.forward(x, t * 0.5, y), base)
    assert not np.allclose(e0.forward(x, t, (y + 1) % 10), base)
    assert not np.allclose(e1.forward(x, t, y), base)
    # the documented formula
    expected = (sim_template(0, int(y[0]), 10, (1, 32, 32)) - x[0]) / (1 - t[0])
    np.testing.assert_allclose(base[0], expected, rtol=1e-5, atol=1e-5)


def test_euler_from_noise_lands_on_the_class_template(sim_experts):
    be = _sim(sim_experts[1], preset="instant")
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 1, 32, 32)).astype(np.float32)
    y = np.array([0, 4, 9], np.int64)
    steps = 5
    for i in range(steps):
        t = np.full(3, i / steps, np.float32)
        x = x + (1 / steps) * be.forward(x, t, y)
    for row, label in enumerate(y):
        template = sim_template(1, int(label), 10, (1, 32, 32))
        np.testing.assert_allclose(x[row], template, atol=1e-4)
        assert template.min() < -0.9 and template.max() > 0.9
    assert not np.allclose(sim_template(0, 4, 10, (1, 32, 32)), sim_template(1, 4, 10, (1, 32, 32)))
    assert not np.allclose(sim_template(0, 4, 10, (1, 32, 32)), sim_template(0, 5, 10, (1, 32, 32)))
    # t = 1 (a finished row) stays finite
    assert np.isfinite(be.forward(x, np.ones(3, np.float32), y)).all()


# ------------------------------------------------------------------------------------------ over NATS


def _raw(**overrides) -> bytes:
    msg = {
        "v": 1,
        "kind": "step_request",
        "expert": 0,
        "x_t": encode_tensor(np.zeros((2, 1, 32, 32), np.float32)),
        "t": encode_tensor(np.full(2, 0.5, np.float32)),
        "y": encode_tensor(np.zeros(2, np.int64)),
        "row_ids": [],
        "deadline": None,
        "request_id": "bad-1",
    }
    msg.update(overrides)
    return msgpack.packb(msg, use_bin_type=True)


async def test_sim_worker_serves_and_refuses_bad_input(nats_url, nc, sim_experts):
    from workers.service import ExpertWorker

    async with ExpertWorker(
        0,
        sim_experts[0],
        "sim",
        nats_url=nats_url,
        buckets=(1, 4, 16),
        backend_options={"batch_ms": 5.0, "row_ms": 0.1},
    ) as worker:
        assert worker.metadata()["backend"] == "sim"
        x, t, y = _inputs(3, seed=5)
        msg = await nc.request(subjects.expert_velocity(0), pack(StepRequest(expert=0, x_t=x, t=t, y=y)), timeout=10)
        reply = unpack(msg.data, StepResult)
        assert isinstance(reply, StepReply), reply
        assert reply.backend == "sim" and reply.device == "sim:h200-torch" and reply.batch_rows == 4
        np.testing.assert_array_equal(reply.velocity, worker.backend.forward(x, t, y))
        assert reply.compute_ms >= 5.0 + 0.1 * 4 - 0.5  # padded to bucket 4: the latency model ran
        nan = np.zeros((2, 1, 32, 32), np.float32)
        nan[0, 0, 1, 1] = np.nan
        cases = {
            b"\xc1 not msgpack": ErrorCode.BAD_REQUEST,
            _raw(expert=1): ErrorCode.UNKNOWN_EXPERT,
            _raw(x_t=encode_tensor(np.zeros((2, 1, 16, 16), np.float32))): ErrorCode.BAD_SHAPE,
            _raw(x_t=encode_tensor(np.zeros((2, 1, 32, 32), np.int32))): ErrorCode.BAD_DTYPE,
            _raw(x_t=encode_tensor(nan)): ErrorCode.NON_FINITE,
            _raw(y=encode_tensor(np.array([0, 10], np.int64))): ErrorCode.BAD_REQUEST,
            _raw(t=encode_tensor(np.array([0.5, 1.5], np.float32))): ErrorCode.BAD_REQUEST,
        }
        for data, code in cases.items():
            bad = unpack((await nc.request(subjects.expert_velocity(0), data, timeout=10)).data, StepResult)
            assert isinstance(bad, ErrorReply) and bad.code == code, (data[:20], bad)


async def test_a_job_runs_through_two_sim_experts_and_converges(nats_url, nc, sim_experts):
    from client.jobs import run_job
    from coordinator.local_fleet import LabelRouter
    from coordinator.service import Coordinator
    from workers.service import ExpertWorker

    workers = [
        ExpertWorker(k, path, "sim", nats_url=nats_url, buckets=(1, 4, 16, 64), backend_options={"preset": "h200-jax"})
        for k, path in enumerate(sim_experts)
    ]
    for w in workers:
        await w.start()
    try:
        async with Coordinator(
            LabelRouter(C2E, 2), num_experts=2, class_to_expert=C2E, nats_url=nats_url, step_timeout=10
        ):
            jobs = [
                JobRequest(digits=[3, 7], steps=4, seed=11, strategy="top1", solver="euler"),
                JobRequest(digits=[7], steps=4, seed=12, strategy="top1", solver="euler"),
                JobRequest(digits=[1, 2, 8], steps=3, seed=13, strategy="top1", solver="heun"),
            ]
            crowd = await asyncio.wait_for(asyncio.gather(*(run_job(nc, j) for j in jobs)), 120)
            solo = await asyncio.wait_for(run_job(nc, jobs[0]), 60)
    finally:
        for w in workers:
            await w.stop()
    for job, done in zip(jobs, crowd):
        assert isinstance(done, DoneEvent) and done.digits == job.digits
        for img, d in zip(done.images, job.digits):
            mine, other = sim_template(C2E[d], d, 10, (1, 32, 32)), sim_template(1 - C2E[d], d, 10, (1, 32, 32))
            if job.solver == "euler":  # Euler lands exactly on its expert's template
                np.testing.assert_allclose(img, mine, atol=2e-3)
            else:  # Heun's last corrector sees v(T, 1) = 0: it stops short, but near its own template
                assert np.abs(img - mine).mean() < min(0.25, np.abs(img - other).mean())
                assert np.corrcoef(img.ravel(), mine.ravel())[0, 1] > 0.8
    np.testing.assert_allclose(crowd[0].images, solo.images, atol=1e-6)
    assert sum(w.metrics.replies for w in workers) > 0 and all(w.metrics.replies > 0 for w in workers)


@pytest.mark.procs
async def test_worker_cli_with_the_sim_backend(nats_url, nc, sim_experts):
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "infra.cli",
        "worker",
        "--expert",
        "1",
        "--checkpoint",
        sim_experts[1],
        "--nats",
        nats_url,
        "--backend",
        "sim",
        "--sim-preset",
        "instant",
        "--sim-batch-ms",
        "2",
        "--buckets",
        "1,8",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=ROOT,
    )
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), 120)
        assert line.startswith(b"ready:") and b"backend=sim" in line and b"device=sim:instant" in line, (
            line,
            (await proc.stderr.read())[-2000:],
        )
        x, t, y = _inputs(5, seed=2)
        msg = await nc.request(subjects.expert_velocity(1), pack(StepRequest(expert=1, x_t=x, t=t, y=y)), timeout=10)
        reply = unpack(msg.data, StepResult)
        assert isinstance(reply, StepReply) and reply.batch_rows == 8
        np.testing.assert_array_equal(reply.velocity, _sim(sim_experts[1], preset="instant").forward(x, t, y))
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 60) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


@pytest.mark.procs
def test_sim_flags_need_the_sim_backend(sim_experts):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "infra.cli",
            "worker",
            "--expert",
            "0",
            "--checkpoint",
            sim_experts[0],
            "--sim-preset",
            "h200-jax",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and "need --backend sim" in out.stderr


def test_up_and_bench_accept_the_sim_backend():
    import argparse

    from benchmarks import worker as bench
    from infra import cmd_up

    p = argparse.ArgumentParser()
    cmd_up.add_arguments(p)
    assert p.parse_args(["--backend-0", "sim"]).backend_0 == "sim"
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    args = p.parse_args(["--backend", "sim", "--sim-preset", "h200-jax", "--sim-row-ms", "0.5"])
    assert (args.backend, args.sim_preset, args.sim_batch_ms, args.sim_row_ms) == ("sim", "h200-jax", None, 0.5)
