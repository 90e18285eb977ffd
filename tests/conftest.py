"""Shared fixtures. Tests that touch the bus use a real nats-server on a free port."""

from __future__ import annotations

import os

import pytest

from bus.nats_server import NatsServer

# What `--compile auto` means in this suite (workers.backends.torch_compile): off, so that the hundreds
# of torch workers the tests start (and their subprocesses, which inherit it) do not each spend 20-40 s
# compiling. The compiled path has its own tests (tests/workers/test_torch_compile.py) that ask for it.
os.environ["DDM_FLEET_COMPILE"] = "off"

# tests/xla/ needs torch_xla (.venv-xla): run by `make test-xla`, not collected by a plain `pytest`.
collect_ignore = ["xla"]

# Tiers (markers registered in pyproject.toml; `make test-fast` deselects bus, procs, browser and slow).
# A test that uses one of these fixtures, directly or through another fixture, gets the marker here;
# tests that start their own nats-server or processes carry `bus` / `procs` themselves (pytestmark or
# a decorator in their file).
FIXTURE_MARKERS = {"nats_server": "bus", "browser": "browser"}


def pytest_collection_modifyitems(items):
    for item in items:
        for fixture, marker in FIXTURE_MARKERS.items():
            if fixture in getattr(item, "fixturenames", ()):
                item.add_marker(marker)


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
