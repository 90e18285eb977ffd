"""bus.connect against a real nats-server: connecting, the error when nobody answers, the reconnect
policy, the client inbox, and that credentials never reach an error message."""

from __future__ import annotations

import asyncio
import time

import pytest

from bus.connect import BusUnavailable, connect, drain_or_close, flushed
from bus.nats_server import NatsServer, free_port


async def test_connects_and_round_trips(nats_url):
    nc = await connect(nats_url, name="test-connect")
    try:
        assert nc.is_connected
        sub = await nc.subscribe("test.connect.echo")
        await nc.publish("test.connect.echo", b"hi")
        msg = await sub.next_msg(timeout=2)
        assert msg.data == b"hi"
    finally:
        await nc.close()


async def test_cluster_list_with_a_dead_node_still_connects(nats_url):
    dead = f"nats://127.0.0.1:{free_port()}"
    nc = await connect(
        f"{dead},{nats_url}",
        name="test-connect-list",
        first_connect_attempts=2,
        reconnect_wait_s=0.1,
        connect_timeout_s=1,
    )
    try:
        assert nc.is_connected
    finally:
        await nc.close()


@pytest.mark.parametrize("attempts", [1, 3])
async def test_dead_port_raises_bus_unavailable_within_the_bound(attempts):
    port = free_port()
    t0 = time.monotonic()
    with pytest.raises(BusUnavailable) as info:
        # the outer wait_for only guards the test against the old hang (nats-py retries 0 attempts forever)
        await asyncio.wait_for(
            connect(
                f"nats://127.0.0.1:{port}",
                name="test-dead",
                first_connect_attempts=attempts,
                reconnect_wait_s=0.2,
                connect_timeout_s=1,
            ),
            10,
        )
    elapsed = time.monotonic() - t0
    # refused at once: about (attempts - 1) waits, far below attempts * (connect_timeout + wait)
    assert elapsed < attempts * (1 + 0.2) + 0.5
    if attempts > 1:
        assert elapsed >= (attempts - 1) * 0.2 * 0.9  # it did retry, waiting between tries
    text = str(info.value)
    assert f"127.0.0.1:{port}" in text and "ddm-fleet up" in text and "--nats" in text
    assert isinstance(info.value, ConnectionError)  # callers that catch ConnectionError keep working


async def test_credentials_never_shown_in_the_error():
    port = free_port()
    url = f"nats://alice:Sw0rdf1sh-9@127.0.0.1:{port}"
    with pytest.raises(BusUnavailable) as info:
        await asyncio.wait_for(connect(url, name="test-creds", connect_timeout_s=1), 10)
    text = str(info.value)
    assert "Sw0rdf1sh-9" not in text and "alice" not in text
    assert f"nats://127.0.0.1:{port}" in text


async def test_refused_password_fails_at_once_with_a_credentials_hint():
    with NatsServer(extra_config='authorization { users = [ { user: "alice", password: "Rig4tOne" } ] }') as srv:
        url = f"nats://alice:Wr0ngOne@127.0.0.1:{srv.port}"
        t0 = time.monotonic()
        with pytest.raises(BusUnavailable) as info:
            await asyncio.wait_for(connect(url, name="test-auth", first_connect_attempts=5, reconnect_wait_s=1), 10)
        assert time.monotonic() - t0 < 1.0  # no retries against a refused password
        text = str(info.value)
        assert "credentials" in text and "Wr0ngOne" not in text
        nc = await connect(f"nats://alice:Rig4tOne@127.0.0.1:{srv.port}", name="test-auth-ok")
        assert nc.is_connected
        await nc.close()


async def test_inbox_prefix_and_pending_size_honoured(nats_url):
    nc = await connect(nats_url, name="test-inbox", inbox_prefix="_INBOX_alice", pending_size=1234567)
    responder = await connect(nats_url, name="test-responder")
    try:
        seen: list[str] = []

        async def answer(msg):
            seen.append(msg.reply)
            await msg.respond(b"pong")

        await responder.subscribe("test.connect.inbox", cb=answer)
        await flushed(responder)  # the server has the subscription (as coordinator.service before serving)
        reply = await nc.request("test.connect.inbox", b"ping", timeout=2)
        assert reply.data == b"pong"
        assert seen and seen[0].startswith("_INBOX_alice.")
        assert nc.new_inbox().startswith("_INBOX_alice.")
        assert nc._max_pending_size == 1234567  # nats-py keeps it only in this attribute
    finally:
        await nc.close()
        await responder.close()


@pytest.mark.parametrize("reconnect, attempts, allowed", [("forever", -1, True), (4, 4, True), (0, None, False)])
async def test_reconnect_policy_set_after_the_first_connection(nats_url, reconnect, attempts, allowed):
    nc = await connect(nats_url, name="test-policy", reconnect=reconnect, first_connect_attempts=2)
    try:
        assert nc.options["allow_reconnect"] is allowed
        if attempts is not None:
            assert nc.options["max_reconnect_attempts"] == attempts
    finally:
        await nc.close()


async def test_reconnects_forever_after_a_server_restart():
    port = free_port()
    srv = NatsServer(port=port).start()
    reconnected = asyncio.Event()

    async def on_reconnect():
        reconnected.set()

    nc = await connect(srv.url, name="test-restart", reconnect_wait_s=0.1, reconnected_cb=on_reconnect)
    try:
        srv.stop()
        await asyncio.sleep(0.5)  # several failed reconnects: a bounded policy of 0 or 1 would give up
        srv = NatsServer(port=port).start()
        await asyncio.wait_for(reconnected.wait(), 10)
        assert nc.is_connected
    finally:
        await nc.close()
        srv.stop()


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(reconnect=-1),
        dict(reconnect="always"),
        dict(first_connect_attempts=0),
        dict(max_reconnect_attempts=3),
        dict(connect_timeout_s=0),
    ],
)
async def test_bad_arguments_are_value_errors(nats_url, kwargs):
    with pytest.raises(ValueError):
        await connect(nats_url, name="test-bad", **kwargs)


def test_without_credentials_for_logs():
    from bus.connect import without_credentials

    assert without_credentials("nats://bob:Pw9x@a:4222, nats://b:4222") == "nats://a:4222,nats://b:4222"
    assert without_credentials(["tok3n@h:1"]) == "h:1"


def test_redacted_keeps_the_user_and_hides_every_secret_of_a_server_list():
    from bus.connect import redacted

    assert (
        redacted("nats://web:s3cret@h1:4222,nats://web:s3cret@h2:4222")
        == "nats://web:***@h1:4222,nats://web:***@h2:4222"
    )
    assert redacted("nats://tok3n@h:4222") == "nats://***@h:4222"
    assert redacted(["nats://h:4222", "tls://u:p%40ss@h:4443"]) == "nats://h:4222,tls://u:***@h:4443"
    assert redacted("u:pw@h:4222") == "u:***@h:4222"  # no scheme


@pytest.mark.bus
async def test_discard_unsent_keeps_a_connection_with_nothing_queued(nc):
    """A coordinator whose leases lapsed drops its connection only for what it still has queued (frames that
    could arrive after a take-over); an idle, flushed connection stays up, and so do its subscriptions, so
    a request it is receiving at that moment is not lost with it."""
    import asyncio

    from bus.connect import discard_unsent, held_back

    got = []

    async def on_msg(msg):
        got.append(msg.data)

    sub = await nc.subscribe("ddm.test.idle", cb=on_msg)
    await flushed(nc)
    transport = nc._transport._io_writer.transport
    sock = transport.get_extra_info("socket")
    for _ in range(100):  # sent bytes count until the server's TCP acknowledges them (a delayed ACK: ms)
        if held_back(transport, sock) is False:
            break
        await asyncio.sleep(0.01)
    assert held_back(transport, sock) is False and not nc._pending  # nothing queued anywhere
    assert discard_unsent(nc) == "none" and nc.is_connected
    await nc.publish("ddm.test.idle", b"still here")
    await nc.flush()
    for _ in range(50):
        if got:
            break
        await asyncio.sleep(0.02)
    assert got == [b"still here"]
    await sub.unsubscribe()


@pytest.mark.bus
async def test_discard_unsent_recalls_the_chosen_buffered_publishes_and_keeps_the_connection(nc, nats_url):
    """A coordinator frozen (SIGSTOP) past its leases wakes with its last frames still in nats-py's buffer:
    the publishes on the subjects it names (its fenced jobs' events) are taken back, nothing else (an
    answer it owes, a SUB). The connection stays (no reconnect), so what it receives meanwhile is not lost."""
    from functools import partial

    import nats

    from bus.connect import discard_unsent
    from tests.waiting import wait_until

    fenced, kept, later = [], [], []

    async def on_ask(msg):
        await msg.respond(b"answer")

    other = await nats.connect(nats_url, name="test-recall-watcher")
    try:
        await other.subscribe("ddm.test.fenced", cb=partial(_append, fenced))
        await other.subscribe("ddm.test.kept", cb=partial(_append, kept))
        await flushed(other)
        await nc.subscribe("ddm.test.ask", cb=on_ask)
        await flushed(nc)
        # no await that yields between these: nats-py's flusher has not run, they are only in its buffer
        await nc.publish("ddm.test.fenced", b"late frame 1")
        await nc.publish("ddm.test.kept", b"an answer")
        sub = await nc.subscribe("ddm.test.later", cb=partial(_append, later))
        await nc.publish("ddm.test.fenced", b"late frame 2")
        assert discard_unsent(nc, lambda subject: subject == b"ddm.test.fenced") == "recalled"
        assert [c.split(b" ", 2)[:2] for c in nc._pending] == [[b"PUB", b"ddm.test.kept"], [b"SUB", b"ddm.test.later"]]
        assert discard_unsent(nc, lambda subject: subject == b"ddm.test.fenced") == "none"  # nothing more
        assert (await other.request("ddm.test.ask", b"?", timeout=5)).data == b"answer"
        await nc.publish("ddm.test.fenced", b"after")
        await flushed(nc)
        await other.publish("ddm.test.later", b"via the kept SUB")
        await flushed(other)
        await wait_until(lambda: fenced and kept and later, timeout=5, what="the three messages")
        # what nc sent reaches `other` in order: "after" came first, the recalled frames never will
        assert fenced == [b"after"] and kept == [b"an answer"] and later == [b"via the kept SUB"]
        assert nc.is_connected and nc.stats["reconnects"] == 0
        await sub.unsubscribe()
    finally:
        await other.close()


async def _append(into: list, msg) -> None:
    into.append(msg.data)


async def test_flushed_round_trips_after_every_command_the_connection_had_buffered(nc):
    """nats-py writes a flush's PING straight to the socket, ahead of a SUB still in its write buffer, so
    one flush() can return before the server has the subscription; `flushed` ends with a PING written
    after the SUB (what goes onto the socket is recorded in order)."""
    transport = nc._transport
    wire: list[bytes] = []
    write, writelines = transport.write, transport.writelines

    def record(data):
        wire.append(bytes(data))
        return write(data)

    def record_lines(lines):
        lines = list(lines)
        wire.extend(bytes(b) for b in lines)
        return writelines(lines)

    transport.write, transport.writelines = record, record_lines
    try:
        sub = await nc.subscribe("ddm.test.flushed")
        await flushed(nc)
    finally:
        transport.write, transport.writelines = write, writelines
    sent = b"".join(wire)
    assert sent.find(b"SUB ddm.test.flushed") >= 0, sent
    assert sent.rfind(b"PING") > sent.find(b"SUB ddm.test.flushed"), sent
    await sub.unsubscribe()


async def test_drain_or_close_delivers_what_was_published_and_closes(nats_url):
    nc = await connect(nats_url, name="test-drain")
    listener = await connect(nats_url, name="test-drain-listener")
    try:
        sub = await listener.subscribe("test.drain.out")
        await flushed(listener)
        for i in range(100):
            await nc.publish("test.drain.out", str(i).encode())
        assert await drain_or_close(nc) is True
        assert nc.is_closed
        # every message arrives (a loaded box may hold one up for seconds: the bound only ends a wait for a lost one)
        got = [(await sub.next_msg(timeout=15)).data for _ in range(100)]
        assert got == [str(i).encode() for i in range(100)]
    finally:
        await listener.close()


async def test_drain_or_close_closes_a_connection_whose_handler_never_returns(nats_url, caplog):
    """nats-py's drain waits 30 s by default for a subscription whose handler is stuck; a stopping process
    must not: the connection is closed after the bound, with a warning, and nothing raises."""
    nc = await connect(nats_url, name="test-drain-stuck")
    entered = asyncio.Event()

    async def stuck(msg):
        entered.set()
        await asyncio.Event().wait()

    await nc.subscribe("test.drain.stuck", cb=stuck)
    await nc.publish("test.drain.stuck", b"x")
    await asyncio.wait_for(entered.wait(), 5)
    t0 = time.monotonic()
    with caplog.at_level("WARNING", logger="ddm.bus"):
        ok = await drain_or_close(nc, timeout_s=0.5)
    took = time.monotonic() - t0
    assert ok is False and nc.is_closed
    assert 0.4 <= took < 5.0, took  # 30 s with nats-py's default
    assert any("not drained within 0.5 s" in r.getMessage() for r in caplog.records), caplog.text


async def test_drain_or_close_on_a_connection_whose_server_is_gone():
    with NatsServer() as srv:
        nc = await connect(srv.url, name="test-drain-gone", reconnect=1, reconnect_wait_s=0.2)
        await nc.subscribe("test.drain.gone")
    # the server has stopped: the drain cannot flush; the connection ends closed, quickly, without raising
    t0 = time.monotonic()
    await drain_or_close(nc, timeout_s=1.0)
    assert nc.is_closed
    assert time.monotonic() - t0 < 10.0


async def test_drain_or_close_on_a_closed_connection_is_a_no_op(nats_url):
    nc = await connect(nats_url, name="test-drain-closed")
    await nc.close()
    assert await drain_or_close(nc) is True
    assert await drain_or_close(None) is True


class _Transport:
    """What `held_back` and the drop read of an asyncio transport: nothing in its own buffer here."""

    def __init__(self):
        self.aborted = False

    def get_write_buffer_size(self):
        return 0

    def is_closing(self):
        return self.aborted

    def abort(self):
        self.aborted = True


def _tcp_pair():
    import socket

    srv = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(srv.getsockname())
    peer, _ = srv.accept()
    srv.close()
    return client, peer


def test_held_back_tells_a_peer_that_stopped_taking_bytes_from_one_that_took_them():
    """Real loopback sockets: bytes the peer's window keeps in the kernel's queue are held back (they would
    go out later), and a second look that sees nothing acknowledged since drops the connection; once the
    peer took everything, nothing is held back and the second look keeps the connection."""
    from types import SimpleNamespace

    from bus.connect import _acked_and_rto, _drop_if_stalled, held_back

    client, peer = _tcp_pair()
    try:
        assert held_back(_Transport(), client) is False  # nothing written
        client.setblocking(False)
        sent = 0
        try:
            while True:
                sent += client.send(b"x" * 65536)
        except BlockingIOError:
            pass  # the peer reads nothing: its window and our send queue are full
        assert held_back(_Transport(), client) is True
        acked, rto_s = _acked_and_rto(client)
        for _ in range(100):  # the ACK of the last segment may come a moment late; then nothing moves
            time.sleep(0.01)
            if _acked_and_rto(client)[0] == acked:
                break
            acked = _acked_and_rto(client)[0]
        assert 0 < rto_s < 5
        nc = SimpleNamespace(_pending=[b"PUB x 1\r\na\r\n"], _pending_data_size=11)
        stalled = _Transport()
        assert _drop_if_stalled(nc, stalled, client, acked) is True
        assert stalled.aborted and nc._pending == [] and nc._pending_data_size == 0

        peer.setblocking(False)
        got, deadline = 0, time.monotonic() + 10
        while got < sent and time.monotonic() < deadline:  # the peer takes every byte: the link acknowledges
            try:
                data = peer.recv(1 << 20)
            except BlockingIOError:
                time.sleep(0.005)
                continue
            if not data:
                break
            got += len(data)
        assert got == sent
        for _ in range(200):
            if held_back(_Transport(), client) is False:
                break
            time.sleep(0.005)
        assert held_back(_Transport(), client) is False
        kept = _Transport()
        assert _drop_if_stalled(nc, kept, client, acked) is False and not kept.aborted
    finally:
        client.close()
        peer.close()


@pytest.mark.bus
async def test_bytes_only_unacknowledged_get_a_second_look_an_rto_later(nc, monkeypatch):
    """Where the socket holds bytes that are sent and only wait for their ACK (`held_back` None), the
    connection stays and `_drop_if_stalled` is called once, at least 0.25 s later, with this connection's
    socket and the bytes acknowledged then; over a working link it keeps the connection."""
    import bus.connect as connect

    looks = []
    real = connect._drop_if_stalled

    def second_look(nc_, transport, sock, acked):
        looks.append((time.monotonic(), sock, acked))
        return real(nc_, transport, sock, acked)

    monkeypatch.setattr(connect, "held_back", lambda transport, sock: None)
    monkeypatch.setattr(connect, "_drop_if_stalled", second_look)
    await flushed(nc)
    transport = nc._transport._io_writer.transport
    sock = transport.get_extra_info("socket")
    asked = time.monotonic()
    assert connect.discard_unsent(nc, lambda subject: True) == "none"
    for _ in range(200):
        if looks:
            break
        await asyncio.sleep(0.01)
    assert len(looks) == 1
    at, seen_sock, acked = looks[0]
    assert at - asked >= 0.25 and seen_sock is sock and acked == connect._acked_and_rto(sock)[0]
    assert nc.is_connected and nc.stats["reconnects"] == 0
