"""Who may use the viewer (web/guard.py): Host / Origin checks, the token, security headers, per-client
socket caps. Pure units, then the real app on a real port (aiohttp test server) with a real nats-server."""

from __future__ import annotations

import asyncio
import logging

import aiohttp
import pytest
from aiohttp import WSMsgType

from web.app import WebConfig, create_app
from web.guard import AccessPolicy, RateLimit, check_token, served_names, split_host, split_origin

TOKEN = "t0ken-for-the-tests-0123456789"


# ---------------------------------------------------------------- units


def test_split_host_and_origin():
    assert split_host("Example.COM:8080") == ("example.com", 8080)
    assert split_host("[::1]:80") == ("[::1]", 80) and split_host("[::1]") == ("[::1]", None)
    for bad in ("", "a b", "x:0", "x:99999", "x:y", "user@x", "[::1", "[::1]x", "x/y"):
        assert split_host(bad) is None, bad
    assert split_origin("https://Viewer.example.com") == ("https", "viewer.example.com", 443)
    assert split_origin("http://127.0.0.1:8080") == ("http", "127.0.0.1", 8080)
    for bad in ("null", "file://", "ftp://x", "http://x/path", "chrome-extension://abc"):
        assert split_origin(bad) is None, bad


def test_served_names_of_loopback_and_other_addresses():
    assert served_names(("127.0.0.1", 8080)) == ({"127.0.0.1", "localhost", "[::1]"}, 8080)
    assert served_names(("::1", 81, 0, 0)) == ({"[::1]", "localhost", "127.0.0.1"}, 81)
    assert served_names(("10.1.2.3", 8080)) == ({"10.1.2.3"}, 8080)
    assert served_names(("::ffff:10.1.2.3", 8080, 0, 0)) == ({"[::ffff:10.1.2.3]", "10.1.2.3"}, 8080)
    assert "localhost" in served_names(("::ffff:127.0.0.1", 8080, 0, 0))[0]
    assert served_names(None) == (set(), None)


def test_policy_host_and_origin_rules():
    p = AccessPolicy(allow_origins=("https://viewer.example.com",), allow_hosts=("viewer.example.com", "proxy:9000"))
    lo = ("127.0.0.1", 8080)
    assert p.host_refusal("127.0.0.1:8080", lo) is None and p.host_refusal("localhost:8080", lo) is None
    assert p.host_refusal("[::1]:8080", lo) is None
    assert "evil.example" in p.host_refusal("evil.example", lo)
    assert p.host_refusal("127.0.0.1:9999", lo) is not None  # another port is another site
    assert p.host_refusal("viewer.example.com", lo) is None and p.host_refusal("viewer.example.com:443", lo) is None
    assert p.host_refusal("proxy:9000", lo) is None and p.host_refusal("proxy:9001", lo) is not None
    assert p.host_refusal(None, lo) == "no Host header"
    # Origin: the page's own (same host and port as the checked Host), an allow-listed one, or none at all
    assert p.origin_refusal(None, "127.0.0.1:8080") is None
    assert p.origin_refusal("http://127.0.0.1:8080", "127.0.0.1:8080") is None
    assert p.origin_refusal("https://viewer.example.com", "127.0.0.1:8080") is None
    assert p.origin_refusal("https://viewer.example.com", "viewer.example.com") is None
    for bad in ("http://evil.example", "http://127.0.0.1:3000", "null", "http://localhost:8080"):
        assert "not allowed" in p.origin_refusal(bad, "127.0.0.1:8080"), bad


def test_policy_refuses_bad_configuration():
    with pytest.raises(ValueError, match="--allow-origin 'viewer.example.com' is not an origin"):
        AccessPolicy(allow_origins=("viewer.example.com",))
    with pytest.raises(ValueError, match="--allow-origin 'https://x.example/app' is not an origin"):
        AccessPolicy(allow_origins=("https://x.example/app",))
    with pytest.raises(ValueError, match="--allow-host 'a b' is not a host"):
        AccessPolicy(allow_hosts=("a b",))
    with pytest.raises(ValueError, match="16-256 characters"):
        check_token("short")
    with pytest.raises(ValueError, match="16-256 characters"):
        check_token("has spaces in the middle of it")
    assert check_token(f"  {TOKEN}\n") == TOKEN


def test_token_compare():
    assert AccessPolicy().token_ok([])
    p = AccessPolicy(token=TOKEN)
    assert p.token_ok(["nope", TOKEN]) and not p.token_ok([]) and not p.token_ok([TOKEN[:-1], TOKEN + "x"])


def test_rate_limit_allows_a_burst_then_the_rate():
    r = RateLimit(10, burst=5)
    assert [r.allow() for _ in range(7)] == [True] * 5 + [False] * 2
    with pytest.raises(ValueError):
        RateLimit(0, 1)


# ---------------------------------------------------------------- the real app


@pytest.fixture
async def viewer(aiohttp_client, nats_url):
    async def make(**kw):
        return await aiohttp_client(
            create_app(WebConfig(nats_url=nats_url, fleet_interval=0.3, discovery_window=0.1, **kw))
        )

    return make


def _hostport(client) -> str:
    return f"127.0.0.1:{client.port}"


async def test_every_response_carries_csp_and_frame_headers(viewer):
    client = await viewer()
    for path in ("/", "/static/app.js", "/api/fleet", "/healthz", "/nope"):
        r = await client.get(path)
        csp = r.headers.get("Content-Security-Policy", "")
        assert "default-src 'self'" in csp and "frame-ancestors 'none'" in csp, (path, csp)
        assert f"connect-src 'self' ws://{_hostport(client)} wss://{_hostport(client)}" in csp
        assert "script-src 'self'" in csp and "unsafe-inline" not in csp
        assert r.headers["X-Frame-Options"] == "DENY" and r.headers["X-Content-Type-Options"] == "nosniff"
        assert r.headers["Referrer-Policy"] == "no-referrer"
    # the refusal itself has them too
    r = await client.get("/api/fleet", headers={"Host": "evil.example"})
    assert r.headers["X-Frame-Options"] == "DENY" and "connect-src 'self';" in r.headers["Content-Security-Policy"]


async def test_page_has_no_inline_script_or_style(viewer):
    import re

    html = await (await (await viewer()).get("/")).text()
    assert not re.search(r"<script(?![^>]*\bsrc=)[^>]*>", html), "inline <script> (CSP blocks it)"
    assert "<style" not in html and " style=" not in html and not re.search(r"\son[a-z]+=", html)


async def test_dns_rebinding_host_is_refused(viewer, caplog):
    caplog.set_level(logging.WARNING, logger="web.guard")
    client = await viewer()
    r = await client.get("/api/fleet", headers={"Host": "evil.example"})
    assert r.status == 421 and "Host 'evil.example' is not this viewer's address" in await r.text()
    assert any("evil.example" in rec.getMessage() for rec in caplog.records)
    for path in ("/", "/ws", "/healthz"):
        assert (await client.get(path, headers={"Host": f"evil.example:{client.port}"})).status == 421
    for host in (_hostport(client), f"localhost:{client.port}"):
        r = await client.get("/api/fleet", headers={"Host": host})
        assert r.status == 200 and (await r.json())["type"] == "fleet"


async def test_allow_host_for_a_reverse_proxy(viewer):
    client = await viewer(allow_hosts=("viewer.example.com",), allow_origins=("https://viewer.example.com",))
    r = await client.get("/api/fleet", headers={"Host": "viewer.example.com"})
    assert r.status == 200
    ws = await client.ws_connect("/ws", headers={"Host": "viewer.example.com", "Origin": "https://viewer.example.com"})
    assert (await ws.receive_json(timeout=10))["type"] == "hello"
    await ws.close()


async def test_cross_origin_websocket_is_refused_with_403(viewer, caplog):
    caplog.set_level(logging.WARNING, logger="web.guard")
    client = await viewer()
    with pytest.raises(aiohttp.WSServerHandshakeError) as err:
        await client.ws_connect("/ws", headers={"Origin": "http://evil.example"})
    assert err.value.status == 403
    r = await client.get(
        "/ws",
        headers={
            "Origin": "http://evil.example",
            "Connection": "Upgrade",
            "Upgrade": "websocket",
            "Sec-WebSocket-Version": "13",
            "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ==",
        },
    )
    assert r.status == 403 and "Origin 'http://evil.example' is not allowed" in await r.text()
    assert any("http://evil.example" in rec.getMessage() for rec in caplog.records)
    # the page's own origin works
    ws = await client.ws_connect("/ws", headers={"Origin": f"http://{_hostport(client)}"})
    assert (await ws.receive_json(timeout=10))["type"] == "hello"
    await ws.close()


async def test_token_required_for_socket_and_api(viewer):
    client = await viewer(token=TOKEN)
    assert (await client.get("/")).status == 200  # the page holds no data
    assert (await client.get("/api/fleet")).status == 401
    assert (await client.get("/api/fleet", headers={"Authorization": "Bearer wrong-token-0123456789"})).status == 401
    assert (await client.get("/api/fleet", headers={"Authorization": f"Bearer {TOKEN}"})).status == 200
    for protocols in (("ddm.v1",), ("ddm.v1", "ddm-token.wrong-token-0123456789")):
        ws = await client.ws_connect("/ws", protocols=protocols)
        msg = await ws.receive(timeout=10)
        assert msg.type == WSMsgType.CLOSE and msg.data == 1008 and msg.extra.startswith("token required"), msg
    ws = await client.ws_connect("/ws", protocols=("ddm.v1", f"ddm-token.{TOKEN}"))
    assert ws.protocol == "ddm.v1"
    assert (await ws.receive_json(timeout=10))["type"] == "hello"
    await ws.close()


async def test_sockets_per_client_address_are_capped(viewer):
    client = await viewer(max_sockets_per_client=3)
    socks = [await client.ws_connect("/ws") for _ in range(3)]
    with pytest.raises(aiohttp.WSServerHandshakeError) as err:
        await client.ws_connect("/ws")
    assert err.value.status == 429
    await socks[0].close()
    for _ in range(50):  # the server notices the close, then a slot is free again
        try:
            socks[0] = await client.ws_connect("/ws")
            break
        except aiohttp.WSServerHandshakeError:
            await asyncio.sleep(0.05)
    else:
        pytest.fail("the freed slot was never reusable")
    for s in socks:
        await s.close()
