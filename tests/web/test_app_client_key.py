"""Per-client socket limits are keyed on the client, not on what a client may choose: all loopback
addresses are one machine, and behind a trusted reverse proxy the client is the X-Forwarded-For hop
that proxy reported (a client's own X-Forwarded-For entries do not count). Real app on a real port."""

from __future__ import annotations

import aiohttp
import pytest

from web.app import PER_CLIENT, WebConfig, create_app
from web.guard import address_key, client_key, parse_address, parse_trusted_proxies

LIMIT = 2


async def viewer(aiohttp_client, nats_url, **kw):
    app = create_app(WebConfig(nats_url=nats_url, max_sockets_per_client=LIMIT, **kw))
    return app, await aiohttp_client(app)


async def open_ws(client, xff: str | None = None, session: aiohttp.ClientSession | None = None):
    """A websocket, or the refusal's HTTP status."""
    headers = {"X-Forwarded-For": xff} if xff is not None else {}
    try:
        if session is None:
            return await client.ws_connect("/ws", headers=headers)
        return await session.ws_connect(client.make_url("/ws"), headers=headers)
    except aiohttp.WSServerHandshakeError as err:
        return err.status


async def test_behind_a_trusted_proxy_each_forwarded_client_has_its_own_limit(aiohttp_client, nats_url):
    app, client = await viewer(aiohttp_client, nats_url, trusted_proxies=("127.0.0.1",))
    alice = [await open_ws(client, "203.0.113.7") for _ in range(LIMIT)]
    assert all(not isinstance(ws, int) for ws in alice), alice
    assert await open_ws(client, "203.0.113.7") == 429
    # a client writing its own X-Forwarded-For gets the proxy's entry appended: still alice
    assert await open_ws(client, "198.51.100.77, 203.0.113.7") == 429
    bob = await open_ws(client, "198.51.100.9")  # another user behind the same proxy is not locked out
    assert not isinstance(bob, int), bob
    assert app[PER_CLIENT] == {"203.0.113.7": LIMIT, "198.51.100.9": 1}
    for ws in [*alice, bob]:
        await ws.close()


async def test_without_trusted_proxies_x_forwarded_for_is_ignored(aiohttp_client, nats_url):
    app, client = await viewer(aiohttp_client, nats_url)
    sockets = [await open_ws(client, f"192.0.2.{i}") for i in range(LIMIT)]
    assert all(not isinstance(ws, int) for ws in sockets), sockets
    assert await open_ws(client, "192.0.2.99") == 429
    assert app[PER_CLIENT] == {"loopback": LIMIT}
    for ws in sockets:
        await ws.close()


async def test_other_loopback_addresses_share_the_limit(aiohttp_client, nats_url):
    """127.0.0.2 is the same machine as 127.0.0.1: it does not get a limit of its own."""
    app, client = await viewer(aiohttp_client, nats_url)
    sockets = [await open_ws(client) for _ in range(LIMIT)]
    assert all(not isinstance(ws, int) for ws in sockets), sockets
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(local_addr=("127.0.0.2", 0))) as other:
        assert await open_ws(client, session=other) == 429
    for ws in sockets:
        await ws.close()


@pytest.mark.parametrize(
    "peer, xff, trusted, want",
    [
        ("203.0.113.5", [], (), "203.0.113.5"),
        ("203.0.113.5", ["198.51.100.1"], (), "203.0.113.5"),  # no trusted proxy: header ignored
        ("10.0.0.2", ["198.51.100.1"], ("10.0.0.0/8",), "198.51.100.1"),
        ("10.0.0.2", ["1.1.1.1, 198.51.100.1, 10.0.0.3"], ("10.0.0.0/8",), "198.51.100.1"),
        ("10.0.0.2", ["1.1.1.1", "198.51.100.1"], ("10.0.0.0/8",), "198.51.100.1"),  # two headers: joined
        ("10.0.0.2", ["10.0.0.9, 10.0.0.3"], ("10.0.0.0/8",), "10.0.0.9"),  # all trusted: the left-most
        ("10.0.0.2", [], ("10.0.0.0/8",), "10.0.0.2"),
        ("10.0.0.2", ["garbage, 10.0.0.3"], ("10.0.0.0/8",), "10.0.0.3"),  # malformed: the hop that saw it
        ("203.0.113.5", ["198.51.100.1"], ("10.0.0.0/8",), "203.0.113.5"),  # peer not trusted: itself
        ("10.0.0.2", ["[2001:db8::1]:443"], ("10.0.0.0/8",), "2001:db8::/64"),
        ("10.0.0.2", ["198.51.100.1:5000"], ("10.0.0.0/8",), "198.51.100.1"),
        ("::ffff:203.0.113.5", [], (), "203.0.113.5"),
        ("2001:db8:1:2:3:4:5:6", [], (), "2001:db8:1:2::/64"),
        ("127.0.0.2", [], (), "loopback"),
        ("::1", [], (), "loopback"),
        (None, [], (), "?"),
    ],
)
def test_client_key(peer, xff, trusted, want):
    assert client_key(peer, xff, parse_trusted_proxies(trusted)) == want


def test_bad_trusted_proxy_is_refused_with_an_example():
    with pytest.raises(ValueError, match="--trusted-proxy 'nope' is not an address or network"):
        WebConfig(trusted_proxies=("nope",))
    assert parse_address("nonsense") is None and address_key(parse_address("192.0.2.1")) == "192.0.2.1"
