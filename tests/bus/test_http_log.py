"""Malformed HTTP requests cannot fill a log: one summarised line (no traceback) per 10 s, whatever
their number, from the web viewer and from the coordinator's / workers' /metrics server. Real servers on
real ports, raw sockets."""

from __future__ import annotations

import asyncio
import logging

from bus import http_log
from bus.http_log import MalformedRequestLog
from web.app import WebConfig, create_app

BAD = [
    b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: x\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nBad Header\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
]


async def send_raw(port: int, payload: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(payload)
        await writer.drain()
        return await asyncio.wait_for(reader.read(4096), 5)
    finally:
        writer.close()


async def flood(port: int, caplog) -> list[logging.LogRecord]:
    """60 malformed requests; every one answered 400. Returns the aiohttp.server lines they made."""
    for f in logging.getLogger(http_log.LOGGER).filters:  # the server installed it (the process's one):
        if isinstance(f, MalformedRequestLog):  # a period begun by another test ends here
            f.reset()
    caplog.clear()
    answers = [await send_raw(port, BAD[i % len(BAD)]) for i in range(60)]
    assert all(a.startswith(b"HTTP/1.") and b" 400 " in a.split(b"\r\n", 1)[0] for a in answers), answers[:3]
    return [r for r in caplog.records if r.name == "aiohttp.server" and r.levelno >= logging.WARNING]


async def test_malformed_requests_are_logged_once_per_period_without_a_traceback(aiohttp_client, nats_url, caplog):
    caplog.set_level(logging.DEBUG, logger="aiohttp.server")
    client = await aiohttp_client(create_app(WebConfig(nats_url=nats_url)))
    lines = await flood(client.port, caplog)
    assert len(lines) == 1, [r.getMessage()[:120] for r in lines[:5]]
    assert lines[0].exc_info is None and lines[0].exc_text is None
    assert lines[0].getMessage().startswith("malformed HTTP request from 127.0.0.1: "), lines[0].getMessage()
    assert "Traceback" not in caplog.text
    assert (await client.get("/healthz")).status in (200, 503)  # the server still serves


async def test_the_metrics_server_logs_malformed_requests_the_same_way(caplog):
    from prometheus_client import CollectorRegistry

    from workers.metrics_http import bound_port, serve_metrics

    caplog.set_level(logging.DEBUG, logger="aiohttp.server")
    runner = await serve_metrics(CollectorRegistry(), 0)
    try:
        lines = await flood(bound_port(runner), caplog)
        assert len(lines) == 1 and lines[0].exc_info is None, [r.getMessage()[:120] for r in lines[:5]]
        assert lines[0].getMessage().startswith("malformed HTTP request from 127.0.0.1: ")
    finally:
        await runner.cleanup()


def test_the_next_line_counts_what_was_held_back():
    now = [0.0]
    f = MalformedRequestLog(every_s=10.0, clock=lambda: now[0])
    from aiohttp.http_exceptions import BadHttpMessage

    def record() -> logging.LogRecord:
        try:
            raise BadHttpMessage("Invalid character in Content-Length:\n\n  b'x'")
        except BadHttpMessage as err:
            exc = (type(err), err, err.__traceback__)
        return logging.LogRecord("aiohttp.server", logging.ERROR, __file__, 1, "Error %s", ("192.0.2.1",), exc)

    first = record()
    assert f.filter(first) and first.getMessage() == (
        "malformed HTTP request from 192.0.2.1: Invalid character in Content-Length"
    )
    assert [f.filter(record()) for _ in range(5)] == [False] * 5
    now[0] = 10.0
    later = record()
    assert f.filter(later) and later.getMessage().endswith("(5 more since the last such line)")
    assert f.total == 7
    other = logging.LogRecord("aiohttp.server", logging.ERROR, __file__, 1, "Unhandled exception", (), None)
    assert f.filter(other) and other.levelno == logging.ERROR  # not a malformed request: untouched
