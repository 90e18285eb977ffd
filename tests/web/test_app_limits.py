"""Bounds of the viewer under hostile clients: a ping flood, a client that never reads, a huge
`digits` string, oversized and numerous discovery replies. Real app on a real port, real nats-server."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from aiohttp import WSMsgType

from schemas import MAX_JOB_IMAGES
from tests.waiting import wait_until
from web.app import PER_CLIENT, SESSIONS, WebConfig, create_app
from web.fleet import MAX_REPLY_BYTES, gather_replies
from web.protocol import BadInput, parse_client_message, parse_digits
from web.session import Outbox


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS in /proc/self/status")


async def viewer(aiohttp_client, nats_url, **kw):
    app = create_app(WebConfig(nats_url=nats_url, fleet_interval=0.3, discovery_window=0.1, **kw))
    return app, await aiohttp_client(app)


async def flood_pings(app, ws, seconds: float) -> tuple[int, int, int]:
    """Send pings for `seconds` (never reading). Returns (sent, most items queued for the socket,
    most control messages queued) as seen in the app's sessions while it ran."""
    sent = most_items = most_msgs = 0
    end = time.monotonic() + seconds
    try:
        while time.monotonic() < end and not ws.closed:
            await ws.send_str('{"type": "ping", "ref": %d}' % sent)
            sent += 1
            if sent % 200 == 0:
                await asyncio.sleep(0)  # let the server run
                for s in list(app[SESSIONS]):
                    most_items = max(most_items, len(s.outbox))
                    most_msgs = max(most_msgs, s.outbox.queued_messages)
    except (ConnectionError, RuntimeError):  # the server closed the socket under us
        pass
    return sent, most_items, most_msgs


async def read_until_close(ws, timeout=30.0):
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    seen = []
    while True:
        msg = await ws.receive(timeout=max(0.01, end - loop.time()))
        if msg.type != WSMsgType.TEXT:
            return msg, seen
        seen.append(json.loads(msg.data)["type"])


async def test_ping_flood_is_closed_by_the_message_rate_cap(aiohttp_client, nats_url):
    app, client = await viewer(aiohttp_client, nats_url)  # default: 20 messages/s, bursts of 40
    ws = await client.ws_connect("/ws")
    sent, most_items, most_msgs = await flood_pings(app, ws, 3.0)
    msg, _ = await read_until_close(ws)
    assert msg.type == WSMsgType.CLOSE and msg.data == 1008, msg
    assert "too many messages: over 20 per second" in msg.extra
    assert most_items <= 4 and most_msgs <= 2, (sent, most_items, most_msgs)
    await asyncio.sleep(0.2)
    assert not app[SESSIONS], "the flooding socket's session is still there"


async def test_ping_flood_without_a_rate_cap_keeps_memory_bounded(aiohttp_client, nats_url):
    """Pongs coalesce: however fast a client pings without reading, one pong waits for it.
    (Before: 780,899 queued pongs, 72 -> 366 MiB in 8 s.)"""
    app, client = await viewer(aiohttp_client, nats_url, max_messages_per_second=1e9)
    ws = await client.ws_connect("/ws")
    before = rss_mib()
    sent, most_items, most_msgs = await flood_pings(app, ws, 4.0)
    grown = rss_mib() - before
    assert sent > 20_000, f"only {sent} pings sent: the flood proves nothing"
    assert most_items <= 4 and most_msgs <= 2, (sent, most_items, most_msgs)
    assert grown < 48, f"RSS grew {grown:.0f} MiB during a flood of {sent} pings"
    # the socket still works: the client reads, gets (coalesced) pongs, and the hello it never read
    seen = []
    while "pong" not in seen:
        seen.append((await ws.receive_json(timeout=10))["type"])
    assert "hello" in seen and seen.count("pong") < sent / 10, seen[:20]
    await ws.close()


async def test_a_client_that_never_reads_is_closed(aiohttp_client, nats_url):
    """Control messages (here: errors for bad input) are never dropped, so past the cap the socket closes."""
    app, client = await viewer(aiohttp_client, nats_url, max_messages_per_second=1e9, max_queued_messages=100)
    ws = await client.ws_connect("/ws")
    # bad input is answered with an error: read the first one before the flood (during the flood a busy box may
    # not write any before the queue overflows and the socket is closed)
    await ws.send_str('{"type": "nope"}')
    seen = []
    while "error" not in seen:
        seen.append((await ws.receive_json(timeout=10))["type"])
    most = 0
    try:
        for i in range(200_000):
            await ws.send_str('{"type": "nope"}')
            if i % 200 == 0:
                await asyncio.sleep(0)
                most = max([most] + [s.outbox.queued_messages for s in app[SESSIONS]])
                if ws.closed or not app[SESSIONS]:
                    break
    except (ConnectionError, RuntimeError):
        pass
    assert most <= 100
    msg, later = await read_until_close(ws)
    assert msg.type == WSMsgType.CLOSE and msg.data == 1008, msg
    assert msg.extra == "not reading: over 100 messages waiting for this socket"
    assert "error" in seen and set(later) <= {"error", "hello", "spec"}, later[:20]


def test_outbox_overflow_closes_it_and_keeps_latest_items_bounded():
    calls = []
    box = Outbox(3, on_overflow=lambda: calls.append(1))
    for i in range(50):
        box.put_latest("job", i)  # frames of one job: one slot
        box.put_latest("__pong__", {"type": "pong"})
    assert len(box) == 2 and box.queued_messages == 0
    for i in range(3):
        box.put({"type": "error", "n": i})
    assert not box.closed and box.queued_messages == 3
    box.put({"type": "error", "n": 3})
    assert box.closed and box.overflowed and calls == [1] and len(box) == 0
    box.put({"type": "error"})
    assert calls == [1]  # once
    with pytest.raises(ValueError):
        Outbox(0)


def test_a_huge_digits_string_is_refused_before_it_is_split():
    huge = ",".join(["7"] * (128 * 1024))  # 256 KiB, the largest frame the socket accepts
    t0 = time.perf_counter()
    for _ in range(20):
        with pytest.raises(BadInput, match=f"far too long; the limit is {MAX_JOB_IMAGES} images"):
            parse_digits(huge)
    per_call = (time.perf_counter() - t0) / 20
    assert per_call < 0.002, f"{per_call * 1e3:.1f} ms per refusal (a split costs ~45 ms)"
    with pytest.raises(BadInput, match=f"{MAX_JOB_IMAGES + 1} images requested; the limit is {MAX_JOB_IMAGES}"):
        parse_client_message(json.dumps({"type": "generate", "digits": [1] * (MAX_JOB_IMAGES + 1)}))
    assert parse_digits(" , ".join(["1"] * MAX_JOB_IMAGES)) == [1] * MAX_JOB_IMAGES  # the limit itself still parses


def test_unknown_field_error_is_short_however_many_fields_come():
    msg = {"type": "generate", "digits": "1", **{f"field{i}" + "x" * 500: 1 for i in range(300)}}
    with pytest.raises(BadInput) as err:
        parse_client_message(json.dumps(msg))
    assert "unknown field(s) in generate" in err.value.message and "(and 292 more)" in err.value.message
    assert len(err.value.message) < 1000


async def test_discovery_replies_are_bounded_in_count_and_size(nc):
    async def answer(msg):
        await nc.publish(msg.reply, b"x" * (MAX_REPLY_BYTES + 1))  # too big: skipped
        for i in range(30):
            await nc.publish(msg.reply, json.dumps({"id": f"s{i}"}).encode())

    sub = await nc.subscribe("ddm.test.discovery", cb=answer)
    try:
        got = await gather_replies(nc, "ddm.test.discovery", window=1.0, max_replies=10)
        assert len(got) == 9 and all(len(r) < 100 for r in got)  # 10 received, the oversized one skipped
        got = await gather_replies(nc, "ddm.test.discovery", window=1.0, max_replies=100, max_bytes=5 * 12)
        assert 1 <= len(got) <= 5 and sum(map(len, got)) <= 60
    finally:
        await sub.unsubscribe()


def established_from(port: int) -> int:
    """Server-side TCP connections in ESTABLISHED state on local `port` (this host's /proc/net/tcp*)."""
    n = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f)
                for line in f:
                    fields = line.split()
                    if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "01":
                        n += 1
        except FileNotFoundError:
            pass
    return n


def _frame(text: str) -> bytes:
    """One masked websocket text frame (mask key 0: the payload goes as is), as a client sends it."""
    data = text.encode()
    n = len(data)
    head = bytes([0x81]) + (bytes([0x80 | n]) if n < 126 else bytes([0x80 | 126]) + n.to_bytes(2, "big"))
    return head + b"\0\0\0\0" + data


async def raw_socket_that_never_reads(port: int):
    """A TCP connection that upgrades to the viewer's websocket and never reads a byte (tiny receive
    buffer), like a slow or hostile client; returns the socket (non-blocking)."""
    import base64
    import os
    import socket

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    await loop.sock_connect(sock, ("127.0.0.1", port))
    key = base64.b64encode(os.urandom(16)).decode()
    await loop.sock_sendall(
        sock,
        (
            f"GET /ws HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Protocol: ddm.v1\r\n\r\n"
        ).encode(),
    )
    return sock


async def test_sockets_closed_for_not_reading_are_aborted_and_free_their_address(aiohttp_client, nats_url):
    """A client that never reads (not even the close) cannot keep connections past the per-address
    limit: each socket the server closes as not reading is aborted once the close has had its time, so
    the server holds no connection for it and its kernel buffers are freed."""
    from web.app import CLOSE_TIMEOUT_S

    app, client = await viewer(
        aiohttp_client, nats_url, max_messages_per_second=1e9, max_queued_messages=200, max_sockets_per_client=2
    )
    port = client.port
    assert established_from(port) == 0
    loop = asyncio.get_running_loop()
    # each frame is answered with a ~500-byte error (8 unknown fields, named): what the client never reads
    fields = ", ".join(f'"f{i:02d}{"x" * 37}": 1' for i in range(8))
    junk = _frame('{"type": "generate", %s}' % fields) * 10
    sockets = []
    try:
        for _ in range(4):  # twice the limit, one after the other
            sock = await raw_socket_that_never_reads(port)
            sockets.append(sock)
            await wait_until(lambda: len(app[SESSIONS]) == 1, timeout=10, what="the socket's session")
            end = loop.time() + 30
            while app[SESSIONS] and loop.time() < end:  # until the server's buffers are full and it gives up
                try:  # paced: the answers fill the kernel's buffers before the outbox overflows
                    await asyncio.wait_for(loop.sock_sendall(sock, junk), 0.5)
                    await asyncio.sleep(0.002)
                except (TimeoutError, ConnectionError):
                    await asyncio.sleep(0.1)  # the server stopped reading us (closing) or cut us off
            await wait_until(lambda: not app[PER_CLIENT], timeout=CLOSE_TIMEOUT_S + 10, what="the handler to end")
            assert established_from(port) == 0, "its slot was freed while its connection stays open"
        # the server's side of every one of them is gone (the client never read a byte of the close)
        await wait_until(
            lambda: established_from(port) == 0, timeout=CLOSE_TIMEOUT_S + 5, what="no server connections left"
        )
    finally:
        for sock in sockets:
            sock.close()


async def test_a_socket_dropped_for_no_pong_is_aborted_not_left_flushing(aiohttp_client, nats_url):
    """A client that stops reading and answering pings, with the server's answers backed up behind full
    kernel buffers: the heartbeat drops it, and its connection is aborted, not close()d (a close waits
    for ever to flush to a peer that does not read: one address held 40 connections past its limit of
    16 that way, with their send buffers)."""
    app, client = await viewer(
        aiohttp_client, nats_url, max_messages_per_second=1e9, max_queued_messages=10**6, heartbeat_s=1.0
    )
    port = client.port
    loop = asyncio.get_running_loop()
    fields = ", ".join(f'"f{i:02d}{"x" * 37}": 1' for i in range(8))
    junk = _frame('{"type": "generate", %s}' % fields) * 10
    sock = await raw_socket_that_never_reads(port)
    try:
        await wait_until(lambda: len(app[SESSIONS]) == 1, timeout=10, what="the socket's session")
        session = next(iter(app[SESSIONS]))
        while session.outbox.queued_messages < 100 and app[SESSIONS]:  # the sender is stuck on full buffers
            try:
                await asyncio.wait_for(loop.sock_sendall(sock, junk), 0.5)
                await asyncio.sleep(0.002)
            except (TimeoutError, ConnectionError):
                break
        await wait_until(lambda: not app[PER_CLIENT], timeout=15, what="the heartbeat to drop the socket")
        await wait_until(lambda: established_from(port) == 0, timeout=5, what="its connection aborted")
    finally:
        sock.close()


async def test_clients_that_never_read_do_not_hold_up_the_shutdown(nats_url):
    """Every socket is closed at once at shutdown, each within CLOSE_TIMEOUT_S: clients that never read
    a byte, whose connections are full (the close frame cannot even be written), cost one close
    time-out, not a wait for ever."""
    from aiohttp.test_utils import TestServer

    from web.app import CLOSE_TIMEOUT_S

    server = TestServer(
        create_app(WebConfig(nats_url=nats_url, max_messages_per_second=1e9, max_queued_messages=10**6))
    )
    await server.start_server()
    app = server.app
    loop = asyncio.get_running_loop()
    fields = ", ".join(f'"f{i:02d}{"x" * 37}": 1' for i in range(8))
    junk = _frame('{"type": "generate", %s}' % fields) * 10
    sockets = []
    try:
        for n in range(1, 3):
            sock = await raw_socket_that_never_reads(server.port)
            sockets.append(sock)
            await wait_until(lambda n=n: len(app[SESSIONS]) == n, timeout=10, what="the socket's session")
            # until its answers back up behind full kernel buffers (the sender is stuck)
            while max(s.outbox.queued_messages for s in app[SESSIONS]) < 100:
                await asyncio.wait_for(loop.sock_sendall(sock, junk), 5)
                await asyncio.sleep(0.002)
        start = loop.time()
        await asyncio.wait_for(server.close(), 60)
        took = loop.time() - start
        assert took < 2 * CLOSE_TIMEOUT_S + 2, f"shutdown took {took:.1f} s"
        assert not app[SESSIONS]
    finally:
        for sock in sockets:
            sock.close()
