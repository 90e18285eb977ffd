"""The scheduler's batch-wide update (one Euler pass, finite check and float16 frames for a whole
batch) gives each job exactly the bits its own row-group update would, for any mix of solvers,
steps and strategies; the router's forward keeps its thread setting to the calling thread, and a loaded
router runs a frozen trace with the eager network's bits."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from coordinator.rows import RowGroup, step_dts
from coordinator.scheduler import Scheduler, SchedulerConfig
from flow.solver import step_dt, time_grid
from schemas import DoneEvent, FrameEvent, JobRequest, pack, unpack

SHAPE = (1, 4, 4)


def _velocity(x: np.ndarray, t: np.ndarray, y: np.ndarray) -> np.ndarray:
    """A row-wise velocity [n, C, H, W] float32 that depends on x, t and y."""
    return (np.sin(3 * x) * (1.5 - t[:, None, None, None]) + 0.1 * y[:, None, None, None]).astype(np.float32)


def _jobs() -> list[JobRequest]:
    rng = np.random.default_rng(11)
    out = []
    for i in range(14):
        out.append(
            JobRequest(
                job_id=f"j{i}",
                digits=[int(d) for d in rng.integers(0, 10, size=int(rng.integers(1, 4)))],
                steps=int(rng.integers(2, 7)),
                seed=40 + i,
                solver="heun" if i % 3 == 0 else "euler",
                strategy=("top1", "full", "oracle")[i % 3],
                stream=i % 2 == 0,
                frame_x1=i % 4 == 0,
            )
        )
    return out


def _run(cohorts: int) -> tuple[dict[str, np.ndarray], dict[str, list[bytes]]]:
    """Every job to the end through the scheduler: final images and packed frames per job."""
    s = Scheduler(SchedulerConfig(num_experts=2, image_shape=SHAPE, class_to_expert=[0] * 5 + [1] * 5))
    for j in _jobs():
        s.submit(j, 0.0)
    done: dict[str, np.ndarray] = {}
    frames: dict[str, list[bytes]] = {}
    while (batch := s.schedule(0.0, cohorts=cohorts)) is not None:
        w = np.stack([0.7 - 0.4 * (batch.y % 2), 0.3 + 0.4 * (batch.y % 2)], axis=1)
        batch.route(w)
        while reqs := batch.requests():
            for k, idx in reqs.items():
                batch.record(k, idx, _velocity(batch.x[idx], batch.t[idx], batch.y[idx]) * (1 + k))
        s.update(batch, 0.0)
        for ev in s.pop_events():
            if isinstance(ev, FrameEvent):
                frames.setdefault(ev.job_id, []).append(pack(ev))
            elif isinstance(ev, DoneEvent):
                done[ev.job_id] = ev.images
    return done, frames


def _reference() -> dict[str, np.ndarray]:
    """The same jobs, each RowGroup stepped on its own (RowGroup.advance without x_next)."""
    from coordinator import strategies

    out = {}
    c2e = np.array([0] * 5 + [1] * 5)
    for j in _jobs():
        digits = list(j.digits)
        g = RowGroup.from_seed(
            j.job_id,
            j.seed,
            digits,
            SHAPE,
            steps=j.steps,
            solver=j.solver,
            strategy=j.strategy,
            num_experts=2,
            oracle_expert=c2e[digits],
        )
        while not g.done:
            x, t = g.eval_point()
            y = g.y
            tt = np.full(len(y), t, np.float32)
            w = np.stack([0.7 - 0.4 * (y % 2), 0.3 + 0.4 * (y % 2)], axis=1).astype(np.float64)
            sel = strategies.select(j.strategy, w, np.ones(2, bool), top_k=np.full(len(y), 2), owner=g.oracle_expert)
            u = np.zeros(x.shape, np.float32)
            for k in range(2):
                if sel[:, k].any():
                    u += _velocity(x, tt, y) * (1 + k) * sel[:, k, None, None, None].astype(np.float32)
            g.advance(u)
        out[j.job_id] = np.clip(g.x, -1.0, 1.0).astype(np.float32)
    return out


def test_batch_wide_update_matches_each_group_stepped_alone_bit_for_bit():
    ref = _reference()
    for cohorts in (1, 3):
        done, frames = _run(cohorts)
        assert set(done) == set(ref)
        for job_id, images in ref.items():
            assert np.array_equal(done[job_id], images), (cohorts, job_id)
    # the frames (float16 slices of one batch-wide array) decode as FrameEvents, the same bytes at any cohorts
    _, f1 = _run(1)
    _, f3 = _run(3)
    assert f1 == f3 and f1
    for packed in f1.values():
        evs = [unpack(b, FrameEvent) for b in packed]
        assert [e.step for e in evs] == list(range(1, len(evs) + 1))
        assert all(e.x.dtype == np.float16 and e.x.shape[1:] == SHAPE for e in evs)


def test_step_dts_are_the_per_step_dt_values():
    for steps in (1, 5, 40, 333):
        grid = time_grid(steps)
        dts = step_dts(steps)
        assert dts.dtype == np.float32 and not dts.flags.writeable
        assert np.array_equal(dts, [step_dt(grid[i], grid[i + 1]) for i in range(steps)])


def test_x_next_is_refused_for_a_heun_group():
    g = RowGroup.from_seed("h", 1, [3], SHAPE, steps=4, solver="heun")
    with pytest.raises(ValueError, match="Euler"):
        g.advance(np.zeros((1, *SHAPE), np.float32), x_next=np.zeros((1, *SHAPE), np.float32))


def test_router_threads_apply_to_its_own_call_only(tmp_path):
    """The router runs on ROUTER_THREADS threads, set in the calling thread for the call only: a shared
    executor thread that next runs an in-process expert gets its own setting back."""
    import torch

    from models.router import Router
    from models.tiny import make_tiny_router

    router = Router.load(make_tiny_router(tmp_path / "router", 2, seed=0))
    assert router.threads == 1
    before = torch.get_num_threads()
    seen = {}
    net_forward = router.net.forward

    def spy(*a, **kw):
        seen.setdefault("during", torch.get_num_threads())
        return net_forward(*a, **kw)

    router.traced = False  # the eager net, so the spy sees the call
    router.net.forward = spy

    def call():
        torch.set_num_threads(2)
        router.weights(np.zeros((3, 1, 32, 32), np.float32), np.full(3, 0.5, np.float32), np.array([1, 2, -1]))
        seen["after"] = torch.get_num_threads()

    th = threading.Thread(target=call)
    th.start()
    th.join()
    assert seen["during"] == 1 and seen["after"] == 2
    assert torch.get_num_threads() == before  # this thread keeps its own setting
    with pytest.raises(ValueError, match="threads"):
        Router(router.net, threads=0)


def test_a_loaded_router_runs_traced_with_the_eager_networks_bits(tmp_path):
    from models.router import Router
    from models.tiny import make_tiny_router

    loaded = Router.load(make_tiny_router(tmp_path / "router", 3, seed=4))
    eager = Router(loaded.net)
    assert loaded.traced and not eager.traced
    rng = np.random.default_rng(2)
    for b in (1, 7, 64, 65, 130, 192, 200):
        x = rng.standard_normal((b, 1, 32, 32)).astype(np.float32)
        t = rng.uniform(0, 1, b).astype(np.float32)
        y = rng.integers(-1, 10, b)
        assert np.array_equal(loaded.logits(x, t, y), eager.logits(x, t, y)), b
    assert loaded._graph is not None and loaded._graph is not False  # the trace was built and is in use


def test_a_traced_router_runs_every_chunk_in_one_call_from_python(tmp_path):
    """The chunk loop lives in the TorchScript graph: a 10-chunk batch costs the calling thread the
    same Python work (function calls seen by a profiler) as a 1-row one. Each call into torch from
    Python, and each tensor freed there, lets go of the GIL and must win it back; beside a busy event
    loop every such hand-back can wait a switch interval (5 ms), so a router whose Python work grew
    with the chunks stalled on the coordinator's loop (see models/router.py ROUTER_TRACED)."""
    import gc
    import sys

    from models.router import Router
    from models.tiny import make_tiny_router

    router = Router.load(make_tiny_router(tmp_path / "router", 2, seed=1))
    rng = np.random.default_rng(3)

    def python_calls(b: int) -> int:
        x = rng.standard_normal((b, 1, 32, 32)).astype(np.float32)
        t, y = rng.uniform(0, 1, b).astype(np.float32), rng.integers(-1, 10, b)
        router.logits(x, t, y)  # the graph is built at the first call
        seen = []
        sys.setprofile(lambda frame, event, arg: seen.append(event) if event in ("call", "c_call") else None)
        try:
            out = router.logits(x, t, y)
        finally:
            sys.setprofile(None)
        assert out.shape == (b, 2)
        return len(seen)

    gc.disable()  # no collection (and its finalizers) inside the counted calls
    try:
        one, many = python_calls(1), python_calls(10 * router.chunk_rows)
    finally:
        gc.enable()
    assert one == many, (one, many)
    eager = Router(router.net)  # the Python loop the graph replaces does grow with the chunks
    x = rng.standard_normal((10 * router.chunk_rows, 1, 32, 32)).astype(np.float32)
    t, y = rng.uniform(0, 1, len(x)).astype(np.float32), rng.integers(-1, 10, len(x))
    assert np.array_equal(router.logits(x, t, y), eager.logits(x, t, y))


@pytest.mark.parametrize("broken", ["script", "trace"])
def test_a_router_whose_graph_cannot_be_built_falls_back_with_the_same_bits(tmp_path, monkeypatch, caplog, broken):
    """No scripted chunk loop (a torch that cannot compile it): the frozen trace, looped in Python;
    no trace at all: the eager network. Either way the same logits, and a warning that says which."""
    import torch

    import models.router as router_mod
    from models.router import Router
    from models.tiny import make_tiny_router

    def cannot(*a, **kw):
        raise RuntimeError(f"no {broken} here")

    monkeypatch.setattr(torch.jit, "script", cannot)
    if broken == "trace":
        monkeypatch.setattr(torch.jit, "trace", cannot)
    router = Router.load(make_tiny_router(tmp_path / "router", 2, seed=5))
    eager = Router(router.net)
    rng = np.random.default_rng(6)
    for b in (1, 64, 65, 200):
        x = rng.standard_normal((b, 1, 32, 32)).astype(np.float32)
        t, y = rng.uniform(0, 1, b).astype(np.float32), rng.integers(-1, 10, b)
        assert np.array_equal(router.logits(x, t, y), eager.logits(x, t, y)), b
    if broken == "script":
        assert not isinstance(router._graph, torch.jit.ScriptModule)  # the chunk loop runs in Python
        assert isinstance(router._graph, router_mod._chunked_class())
        assert isinstance(router._graph.net, torch.jit.ScriptModule)  # the frozen trace
        assert "scripting the chunk loop failed" in caplog.text and "looping in Python" in caplog.text
    else:
        assert router._graph is False
        assert "tracing failed" in caplog.text and "running it eagerly" in caplog.text
