"""Shared fixtures. Tests that touch the bus use a real nats-server on a free port."""

from __future__ import annotations

import pytest

from infra.nats_server import NatsServer


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
