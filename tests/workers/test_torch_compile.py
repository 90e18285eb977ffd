"""`--compile`: the decision (pure), and the compiled torch forward on real tiny UNet and DiT experts, alone
and behind a worker on a real nats-server. This suite sets DDM_FLEET_COMPILE=off (tests/conftest.py), so
`auto` is off here; these tests ask for `on`."""

from __future__ import annotations

import json

import numpy as np
import pytest

from workers.backends.torch_compile import check_compile, choose_compile, find_compiler, resolve_compile

#: the tests that compile (all in this file) run on one pytest-xdist worker
#: one after another: the first builds the kernels, the rest find them in the suite's inductor cache
#: (tests/conftest.py), about a third of the CPU of a cold compile
COMPILES = pytest.mark.xdist_group("torch-compile")
#: the UNet every compiling test builds (`models.tiny.make_tiny_expert` keywords): inductor's C++ kernels do
#: not depend on the frozen weights, so one architecture means one set of kernels to build for the suite
#: (g++ is most of a cold compile's CPU); the weights, and so the graphs, stay each test's own
COMPILED_TINY = dict(widths=(8,), groups=4, null_label=True)
#: the seeds of the compiled experts' weights: inductor's freezing folds some weights into its kernels' code, so
#: other weights mean other kernels to build (another seed: two thirds of a cold compile's CPU again)
COMPILED_SEEDS = (3, 4)
#: what a second compiled expert's convolution weights are the first's times: the convolutions' weights go to
#: oneDNN as constant buffers, not into the kernels' code, so its kernels are the first's, built once
CONV_SCALE = 1.5


def _need_compiler() -> None:
    assert find_compiler() is not None, "no C++ compiler: `make test` installs g++ (the Makefile's cxx target)"


@pytest.mark.parametrize(
    "requested, kind, compiler, env, expected",
    [
        ("on", "cuda", None, "off", True),  # asked for wins over everything
        ("off", "cpu", "/usr/bin/g++", "on", False),
        ("auto", "cpu", "/usr/bin/g++", None, True),
        ("auto", "cpu", None, None, False),  # inductor writes C++: no compiler, no compile
        ("auto", "cuda", "/usr/bin/g++", None, False),  # not measured on GPUs: eager stays
        ("auto", "cpu", "/usr/bin/g++", "off", False),  # the host's meaning of auto (the test suite's)
        ("auto", "cuda", None, "on", True),
        ("auto", "cpu", "/usr/bin/g++", " ", True),  # an empty variable is unset
    ],
)
def test_choose_compile(requested, kind, compiler, env, expected):
    on, why = choose_compile(requested, device_kind=kind, compiler=compiler, env=env)
    assert on is expected and why


def test_the_reason_says_what_decided():
    assert "no C++ compiler" in choose_compile("auto", device_kind="cpu", compiler=None)[1]
    assert "DDM_FLEET_COMPILE=off" in choose_compile("auto", device_kind="cpu", compiler="g++", env="off")[1]


def test_check_compile_spellings_and_errors():
    assert check_compile(None) == "auto" and check_compile(True) == "on" and check_compile(False) == "off"
    assert check_compile(" ON ") == "on" and check_compile("0") == "off"
    with pytest.raises(ValueError, match="auto, on, off"):
        check_compile("fast")
    with pytest.raises(ValueError, match="unknown compile setting"):
        choose_compile("sometimes", device_kind="cpu", compiler="g++")


def test_the_suite_runs_auto_as_off():
    assert resolve_compile("auto", device="cpu") == (False, "auto: DDM_FLEET_COMPILE=off")


def test_worker_config_carries_compile():
    from workers.config import WorkerConfig

    cfg = WorkerConfig(compile="ON")
    assert cfg.compile == "on" and cfg.backend_options()["compile"] == "on"
    assert cfg.to_argv()[cfg.to_argv().index("--compile") + 1] == "on"
    assert "compile" not in WorkerConfig(backend="sim").backend_options()
    with pytest.raises(ValueError, match="compile"):
        WorkerConfig(compile="maybe")


def _inputs(b: int, shape, num_classes: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((b, *shape)).astype(np.float32)
    t = rng.uniform(0, 1, b).astype(np.float32)
    y = rng.integers(0, num_classes, b).astype(np.int64)
    return x, t, y


@pytest.fixture(scope="module")
def compiled_unet(tmp_path_factory):
    """(compiled, eager) torch backends of one tiny UNet expert (float32, one thread), the compiled one
    warmed up at 1, 2 and 4 rows (its two graphs: a batch of 1, and the dynamic one). Shared by the
    tests that need a compiled UNet: each compile of it costs 7-20 CPU-s of dynamo and inductor."""
    _need_compiler()
    from models.tiny import make_tiny_expert
    from workers.backends import get_backend

    ckpt = make_tiny_expert(tmp_path_factory.mktemp("compiled") / "e0", seed=COMPILED_SEEDS[0], **COMPILED_TINY)
    eager = get_backend("torch", dtype="float32", threads=1, compile="off")
    compiled = get_backend("torch", dtype="float32", threads=1, compile="on")
    for be in (eager, compiled):
        be.load(ckpt)
    compiled.warmup([1, 2, 4])
    return compiled, eager


def _scaled_convolutions(ckpt, path, expert_id: int):
    """A second expert of `ckpt`'s architecture: its weights, the convolutions' times CONV_SCALE."""
    from models.checkpoint import load_checkpoint, save_checkpoint

    meta, state = load_checkpoint(ckpt)
    convs = [k for k, v in state.items() if k.endswith(".weight") and np.ndim(v) == 4]
    assert len(convs) >= 5, sorted(state)
    state = {k: np.asarray(v) * CONV_SCALE if k in convs else v for k, v in state.items()}
    return save_checkpoint(path, state, {**meta, "expert_id": expert_id})


def _check_compiled_forward(compiled, eager, batches=(1, 3, 7, 4)) -> None:
    """float32: the compiled graph computes the same velocities as eager (fused kernels round differently,
    so within 1e-4 of velocities ~1), for a batch of 1 and for batch sizes the warm-up never saw (one
    dynamic graph: no compile per size); the backend says it is compiled. A null-label model takes y = -1."""
    import torch._dynamo

    assert compiled.describe()["compiled"] == "true" and eager.describe()["compiled"] == "false"
    assert compiled.compile_reason == "asked for" and not compiled.channels_last
    torch._dynamo.utils.counters.clear()
    shape = compiled.input_shape
    for b in batches:
        x, t, y = _inputs(b, shape, compiled.num_classes, seed=b)
        if compiled.null_label:
            y[0] = -1
        np.testing.assert_allclose(compiled.forward(x, t, y), eager.forward(x, t, y), atol=1e-4, rtol=1e-4)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 0  # 3 and 7 rows: no new compile


@pytest.mark.slow
@COMPILES
def test_compiled_unet_forward_matches_eager_at_every_batch(compiled_unet):
    _check_compiled_forward(*compiled_unet)


@pytest.mark.slow
@COMPILES
def test_compiled_dit_forward_matches_eager_at_every_batch_above_one(tmp_path):
    """The DiT's dynamic graph (the batch of 1 takes the same path as the UNet's: the test above)."""
    _need_compiler()
    from models.tiny import make_tiny_dit
    from workers.backends import get_backend

    ckpt = make_tiny_dit(tmp_path / "e0", seed=3)
    eager = get_backend("torch", dtype="float32", threads=1, compile="off")
    compiled = get_backend("torch", dtype="float32", threads=1, compile="on")
    for be in (eager, compiled):
        be.load(ckpt)
    compiled.warmup([2, 4])
    _check_compiled_forward(compiled, eager, batches=(3, 7, 4))


@pytest.mark.slow
@COMPILES
async def test_a_compiled_worker_serves_and_says_so(nats_url, nc, compiled_unet):
    """A worker serving a compiled expert behind NATS (`ddm-fleet worker --compile on` hands the setting to
    the backend: test_worker_config_carries_compile): advertises compiled, answers 5 rows with the eager
    model's velocity (float32, within the fused kernels' rounding)."""
    from schemas import StepReply, StepRequest, StepResult, pack, subjects, unpack
    from workers.service import SERVICE_NAME, ExpertWorker

    compiled, eager = compiled_unet
    async with ExpertWorker(0, backend=compiled, nats_url=nats_url, buckets=(2, 4, 8), dtype="float32") as w:
        info = json.loads((await nc.request(f"$SRV.INFO.{SERVICE_NAME}.{w.service_id}", b"", timeout=5)).data)
        assert info["metadata"]["compiled"] == "true" and info["metadata"]["dtype"] == "float32"
        x, t, y = _inputs(5, (1, 32, 32), 10, seed=9)
        req = StepRequest(expert=0, x_t=x, t=t, y=y, row_ids=[f"r{i}" for i in range(5)], request_id="c1")
        msg = await nc.request(subjects.expert_velocity(0), pack(req), timeout=30)
        reply = unpack(msg.data, StepResult)
        assert isinstance(reply, StepReply), reply
        np.testing.assert_allclose(reply.velocity, eager.forward(x, t, y), atol=1e-4, rtol=1e-4)


@pytest.mark.slow
@COMPILES
def test_many_compiled_experts_in_one_process_each_keep_their_weights(tmp_path, monkeypatch, compiled_unet):
    """An in-process fleet or a bench compiles several experts of one architecture: each gets its own graph
    (its frozen weights, never another's), and none is left to run eager when they outnumber dynamo's
    recompile limit (8 by default, two graphs per expert). Set to 1 here, below the two graphs the first
    expert (the shared compiled UNet) already holds: the second expert's backend raises it again. The second
    expert differs from the first in its convolutions' weights, which stay constants beside the kernels' code:
    its graph is built on the first's kernels, with its own weights (were they the first's, its velocity would
    be the first expert's)."""
    import torch._dynamo
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from models.tiny import make_tiny_expert
    from models.unet_torch import UNet
    from workers.backends import get_backend

    def graphs() -> int:  # compiled entries dynamo holds for the UNet's forward, every instance's
        return len(_debug_get_cache_entry_list(UNet.forward.__code__))

    assert graphs() >= 2  # the shared expert's: a batch of 1, and the dynamic one
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 1)
    first = make_tiny_expert(tmp_path / "e0", seed=COMPILED_SEEDS[0], **COMPILED_TINY)  # the shared expert's
    ckpt = _scaled_convolutions(first, tmp_path / "e1", expert_id=1)
    second = [get_backend("torch", dtype="float32", threads=1, compile=c) for c in ("on", "off")]
    for be in second:
        be.load(ckpt)
    experts = [compiled_unet, second]
    assert torch._dynamo.config.recompile_limit >= 64
    before = graphs()
    x, t, y = _inputs(3, (1, 32, 32), 10, seed=3)
    eager = [e.forward(x, t, y) for _, e in experts]
    for k, (compiled, _) in enumerate(experts):
        np.testing.assert_allclose(compiled.forward(x, t, y), eager[k], atol=1e-4, rtol=1e-4)
        assert np.abs(eager[k] - eager[(k + 1) % 2]).max() > 0.1  # the experts do differ
    assert graphs() - before == 1  # the second expert got a graph of its own: it does not run eager
