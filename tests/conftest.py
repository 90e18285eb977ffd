"""Shared fixtures. Tests that touch the bus use a real nats-server on a free port.

The suite runs side by side on pytest-xdist workers (`make test`: `-n`, `--dist loadgroup`); what that needs
is set up here: one intra-op thread per test process, one torch.compile cache for every process of every run,
the tests that share a module's fixtures kept on one worker, and the long tests handed out first.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from bus.nats_server import NatsServer
from tests.ordering import UNKNOWN_LONG_S, UNKNOWN_S, load_durations, longest_first

# What `--compile auto` means in this suite (workers.backends.torch_compile): off, so that the hundreds
# of torch workers the tests start (and their subprocesses, which inherit it) do not each spend 20-40 s
# compiling. The compiled path has its own tests (tests/workers/test_torch_compile.py) that ask for it.
os.environ["DDM_FLEET_COMPILE"] = "off"

# Side by side, the workers already fill the cores: an intra-op thread pool per process would only spin
# against the others (OpenMP threads busy-wait). Children (workers, coordinators) inherit it; a test that
# wants more threads sets them itself. Set before anything imports torch.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

# One torch.compile (inductor) cache for the suite, in the venv: every test process and its children
# share it, and a later run of the suite reuses it. The compiled experts' graphs are frozen with oneDNN
# weights, which inductor's FX graph cache cannot hold (it bypasses them: "mkldnn tensors unpickleable");
# what it keeps is the generated C++ and its builds, about two thirds of a cold compile's CPU.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(sys.prefix) / "cache" / "torchinductor"))

# JAX's persistent compilation cache, in the venv too: a later run of the suite finds its XLA compiles
# there (tests/evaluation/test_classifier_jax.py and tests/training/test_train_jax.py: 82 CPU-s on a
# fresh venv, 48 on the second run; within one run the test processes compile different programs, so a
# fresh clone gains nothing). Every compile is cached (the default keeps only those over 1 s); a size
# limit turns on the cache's file lock, so that a process never reads an entry another is still writing.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(Path(sys.prefix) / "cache" / "jax"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(2 << 30))

# Bytecode is written (into the git-ignored __pycache__ folders) even where PYTHONDONTWRITEBYTECODE is set,
# as in many container images: otherwise each test process rewrites the asserts of all ~280 test modules
# again (7 of a worker's 14 CPU-seconds of collection) and every process a test starts compiles the
# sources again. Children inherit the cleared variable.
if os.environ.pop("PYTHONDONTWRITEBYTECODE", None):
    sys.dont_write_bytecode = False

# wall and CPU seconds per marker tier, printed at the end of a run (tests/timing_report.py)
pytest_plugins = ["tests.timing_report"]

# tests/xla/ needs torch_xla (.venv-xla): run by `make test-xla`, not collected by a plain `pytest`.
collect_ignore = ["xla"]

# Tiers (markers registered in pyproject.toml; `make test-fast` deselects bus, procs, browser and slow).
# A test that uses one of these fixtures, directly or through another fixture, gets the marker here;
# tests that start their own nats-server or processes carry `bus` / `procs` themselves (pytestmark or
# a decorator in their file).
FIXTURE_MARKERS = {"nats_server": "bus", "browser": "browser"}


#: markers of the tests that count as long when tests/durations.json does not know them (tests.ordering)
FIRST = ("slow", "train")


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the xdist_group markers
def pytest_collection_modifyitems(config, items):
    for item in items:
        for fixture, marker in FIXTURE_MARKERS.items():
            if fixture in getattr(item, "fixturenames", ()):
                item.add_marker(marker)
        group = _shared_fixture_group(item)
        if group and item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(group))
    if config.getoption("numprocesses", None) or hasattr(config, "workerinput"):
        # Side by side, a long unit started last is the run's tail: hand the longest out first
        # (tests/ordering.py; every worker computes the same order, as pytest-xdist requires)
        items[:] = longest_first(items, unit=_work_unit, seconds=_seconds_of(load_durations()))


def _work_unit(item) -> str:
    """What pytest-xdist hands out as one piece: the test's xdist group, or the test alone."""
    mark = item.get_closest_marker("xdist_group")
    if mark is not None:
        return "@" + str(mark.kwargs.get("name", mark.args[0] if mark.args else ""))
    return item.nodeid


def _seconds_of(walls: dict[str, float]):
    def seconds(item) -> float:
        known = walls.get(item.nodeid)
        if known is not None:
            return known
        return UNKNOWN_LONG_S if any(item.get_closest_marker(m) for m in FIRST) else UNKNOWN_S

    return seconds


def _shared_fixture_group(item) -> str | None:
    """The xdist group of a test that uses a module- or class-scoped fixture: its module (its class). Such a
    fixture (a fleet, a trained model, a cluster) is made once per process that runs the module's tests, so
    they go to one worker, one after another, instead of each worker making its own. Session fixtures are
    per worker whatever the grouping."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return None
    scopes = {d.scope for defs in info.name2fixturedefs.values() for d in defs}
    if "module" in scopes or "package" in scopes:
        return item.nodeid.split("::")[0]
    if "class" in scopes and item.cls is not None:
        return item.nodeid.rsplit("::", 1)[0].split("[")[0]
    return None


@pytest.fixture(scope="session")
def nats_server():
    """One real nats-server for the whole test session."""
    with NatsServer() as srv:
        yield srv


@pytest.fixture(scope="session")
def nats_url(nats_server) -> str:
    return nats_server.url


@pytest.fixture
async def nc(nats_url):
    """A connected nats-py client, closed after the test."""
    import nats

    conn = await nats.connect(nats_url, name="pytest")
    yield conn
    await conn.drain()


@pytest.fixture(scope="session")
def tiny_expert_checkpoint(tmp_path_factory) -> str:
    """A tiny random-init expert UNet (widths 8,16) from `models.tiny`; expert_id 0, seed 1234.

    Returns the .safetensors path. Real model code, tiny enough for fast serving tests.
    """
    from models.tiny import make_tiny_expert

    return str(make_tiny_expert(tmp_path_factory.mktemp("tiny-expert") / "expert0", expert_id=0, seed=1234))
