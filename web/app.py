"""The aiohttp application: page, websocket, fleet status.

    app = create_app(WebConfig(nats_url="nats://127.0.0.1:4222"))
    web.run_app(app, host="127.0.0.1", port=8080)

Routes:
    GET /             the page (web/static/index.html)
    GET /static/...   its JS and CSS (no build step)
    GET /ws           the websocket (protocol: web/protocol.py)
    GET /api/fleet    the latest fleet snapshot as JSON (web/fleet.py)
    GET /api/spec     the fleet's model spec as the page gets it (web/spec.py)
    GET /healthz      "ok" while the NATS connection is up

The server is just another bus client: one NATS connection (opened and drained in
`cleanup_ctx`), one fleet poller task (which also asks the coordinator for the fleet's model spec and
sends every socket a `spec` message when it changes), one `Session` per socket. Sockets are closed on
shutdown, which cancels their unfinished jobs.

Who may use it (web/guard.py): every request's Host and Origin are checked (421 / 403 otherwise),
every response carries CSP and frame headers, the websocket and /api/* need the token when one is
configured. Per client (its address, or behind `trusted_proxies` the X-Forwarded-For hop they name:
web/guard.py `client_key`) at most `max_sockets_per_client` sockets (429 otherwise) and
`max_jobs_per_client` unfinished jobs over them all (`overloaded` otherwise), its jobs tagged with a
session of its own (the coordinator shares rows fairly between sessions); per socket at
most `max_messages_per_second` messages (the socket is closed with 1008 beyond a burst of
`2 x` that) and `max_queued_messages` unsent control messages (closed with 1008: not reading).
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import WSCloseCode, WSMsgType, web

from bus import http_log
from client.jobs import client_connect_options, client_from_url
from schemas import MAX_JOB_IMAGES, MAX_JOB_STEPS, subjects
from schemas.spec import ModelSpec, legacy_spec

from .fleet import FleetMonitor
from .guard import (
    POLICY,
    REFUSALS,
    SUBPROTOCOL,
    AccessPolicy,
    LogLimiter,
    Network,
    RateLimit,
    add_security_headers,
    guard_middleware,
    offered_tokens,
    parse_trusted_proxies,
    refuse_log,
    request_client_key,
)
from .protocol import MAX_CLIENT_MESSAGE_BYTES
from .session import DEFAULT_PREVIEW_EVERY, MAX_JOBS_PER_SOCKET, MAX_QUEUED_MESSAGES, WEB_CLIENT, Session
from .spec import FleetSpec, fetch_spec, spec_message

log = logging.getLogger(__name__)

STATIC_DIR = Path(__file__).parent / "static"
#: Seconds a socket closed by the server (not reading, too many messages, no token) has to finish the
#: closing handshake before its connection is aborted.
CLOSE_TIMEOUT_S = 3.0
#: close_socket(code, reason): closes one socket, bounded in time (see `_closer`).
CloseSocket = Callable[[int, str], Awaitable[None]]


@dataclass(frozen=True)
class WebConfig:
    """nats_url: the bus.  fleet_interval: seconds between fleet snapshots.
    discovery_window: how long to collect $SRV replies.  submit_timeout: seconds to wait for
    the coordinator to accept a job.  max_jobs_per_socket: unfinished jobs per tab.
    unresponsive_after: a tab's job fails (`unavailable`) when the coordinator has answered nothing
    (no event, no status reply) for this many seconds, e.g. it is frozen; None = wait on.
    allow_origins / allow_hosts / token: see web/guard.py `AccessPolicy` (token None: none required).
    max_sockets_per_client: open sockets per client (web/guard.py `client_key`: its address, loopback as one,
    IPv6 by /64). trusted_proxies: addresses / networks of reverse proxies whose X-Forwarded-For names the
    client (default none: the peer is the client). max_messages_per_second: per socket.
    max_queued_messages: unsent control messages per socket before it is closed as not reading.
    preview_every: on a latent fleet (spec `space: latent`), jobs ask the coordinator for decoded preview
    frames every this many steps (and the last), which the page draws instead of latents.
    max_jobs_per_client: unfinished jobs per client (the same key as max_sockets_per_client) over all its
    sockets; each client's jobs also carry a session tag of their own, so the coordinator shares the
    viewer's quota fairly between them (web/session.py `user_session_tag`).
    heartbeat_s: the server pings each socket this often; one that does not answer within half of it
    is dropped (its connection aborted: nothing left to send to a client that stopped reading)."""

    nats_url: str = "nats://127.0.0.1:4222"
    fleet_interval: float = 2.0
    discovery_window: float = 0.3
    submit_timeout: float = 5.0
    max_jobs_per_socket: int = MAX_JOBS_PER_SOCKET
    unresponsive_after: float | None = 60.0
    allow_origins: tuple[str, ...] = ()
    allow_hosts: tuple[str, ...] = ()
    token: str | None = field(default=None, repr=False)
    max_sockets_per_client: int = 16
    max_messages_per_second: float = 20.0
    max_queued_messages: int = MAX_QUEUED_MESSAGES
    trusted_proxies: tuple[str, ...] = ()
    preview_every: int = DEFAULT_PREVIEW_EVERY
    heartbeat_s: float = 30.0
    max_jobs_per_client: int = 16

    def __post_init__(self) -> None:
        if not self.nats_url.startswith(("nats://", "tls://", "ws://", "wss://")):
            raise ValueError(f"nats_url {self.nats_url!r} must start with nats://, tls://, ws:// or wss://")
        for name in ("fleet_interval", "discovery_window", "submit_timeout", "heartbeat_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if self.max_jobs_per_socket < 1:
            raise ValueError(f"max_jobs_per_socket must be >= 1, got {self.max_jobs_per_socket}")
        if self.unresponsive_after is not None and not self.unresponsive_after > 0:
            raise ValueError(f"unresponsive_after must be > 0 or None, got {self.unresponsive_after!r}")
        for name in ("max_sockets_per_client", "max_queued_messages", "max_jobs_per_client"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if isinstance(self.preview_every, bool) or not 1 <= self.preview_every <= MAX_JOB_STEPS:
            raise ValueError(f"preview_every must be 1-{MAX_JOB_STEPS} steps, got {self.preview_every!r}")
        if not self.max_messages_per_second > 0:
            raise ValueError(f"max_messages_per_second must be > 0, got {self.max_messages_per_second!r}")
        object.__setattr__(self, "allow_origins", tuple(self.allow_origins))
        object.__setattr__(self, "allow_hosts", tuple(self.allow_hosts))
        object.__setattr__(self, "trusted_proxies", tuple(self.trusted_proxies))
        self.proxies()  # raises ValueError for a bad address or network
        self.policy()  # raises ValueError for a bad origin, host or token

    def proxies(self) -> tuple[Network, ...]:
        return parse_trusted_proxies(self.trusted_proxies)

    def policy(self) -> AccessPolicy:
        return AccessPolicy(allow_origins=self.allow_origins, allow_hosts=self.allow_hosts, token=self.token)


CONFIG = web.AppKey("ddm_config", WebConfig)
NATS = web.AppKey("ddm_nats", Any)
#: open sockets -> their close_socket(code, reason): a close bounded in time that aborts what it cannot close
SOCKETS = web.AppKey("ddm_sockets", weakref.WeakKeyDictionary)
SESSIONS = web.AppKey("ddm_sessions", weakref.WeakSet)
PER_CLIENT = web.AppKey("ddm_sockets_per_client", Counter)
PROXIES = web.AppKey("ddm_trusted_proxies", tuple)


@dataclass
class FleetView:
    """The latest fleet snapshot (mutable holder: app state itself is frozen once started)."""

    latest: dict


FLEET = web.AppKey("ddm_fleet", FleetView)


@dataclass
class SpecView:
    """The fleet's model spec as the viewer knows it: `known` once a coordinator has said (until then the
    MNIST fleet's, `legacy_spec()`); `message` is the page's `spec` message for it."""

    spec: ModelSpec
    known: bool = False
    default_guidance_scale: float | None = None  # what a job that names no scale gets, as the coordinator said

    @property
    def message(self) -> dict[str, Any]:
        return spec_message(self.spec, known=self.known, default_guidance_scale=self.default_guidance_scale)


SPEC = web.AppKey("ddm_spec", SpecView)


def create_app(config: WebConfig | None = None) -> web.Application:
    """App factory. Nothing connects until the app starts (cleanup_ctx)."""
    http_log.install()  # malformed requests: one summarised line per 10 s, not a traceback each
    app = web.Application(middlewares=[guard_middleware])
    app[CONFIG] = config or WebConfig()
    app[POLICY] = app[CONFIG].policy()
    app[REFUSALS] = LogLimiter()
    app[PER_CLIENT] = Counter()
    app[PROXIES] = app[CONFIG].proxies()
    app.on_response_prepare.append(add_security_headers)
    app[SOCKETS] = weakref.WeakKeyDictionary()
    app[SESSIONS] = weakref.WeakSet()
    app[FLEET] = FleetView({"type": "fleet", "experts": [], "services": [], "coordinator": None, "time": None})
    app[SPEC] = SpecView(legacy_spec())
    app.cleanup_ctx.append(_nats_ctx)
    app.cleanup_ctx.append(_fleet_ctx)
    app.on_shutdown.append(_close_sockets)
    app.router.add_get("/", index)
    app.router.add_get("/ws", websocket)
    app.router.add_get("/api/fleet", fleet_json)
    app.router.add_get("/api/spec", spec_json)
    app.router.add_get("/healthz", healthz)
    app.router.add_static("/static/", STATIC_DIR, name="static")
    return app


# ---------------------------------------------------------------- lifecycle


async def _nats_ctx(app: web.Application) -> AsyncIterator[None]:
    from bus.connect import BusUnavailable, connect

    url = app[CONFIG].nats_url

    async def on_error(err: Exception) -> None:
        log.warning("nats: %s", err)

    client = client_from_url(url)  # the NATS user owns the viewer's jobs; "web" on an open bus
    try:  # fail fast at start (3 tries), reconnect forever once up
        nc = await connect(
            url,
            name="ddm-web",
            reconnect="forever",
            first_connect_attempts=3,
            reconnect_wait_s=1,
            connect_timeout_s=3,
            error_cb=on_error,
            **client_connect_options(WEB_CLIENT if client == subjects.DEFAULT_CLIENT else client),
        )
    except (BusUnavailable, ValueError) as err:  # as RuntimeError, which `ddm-fleet web` reports plainly
        raise RuntimeError(str(err)) from None
    app[NATS] = nc
    yield
    from bus.connect import drain_or_close

    await drain_or_close(nc)


async def _fleet_ctx(app: web.Application) -> AsyncIterator[None]:
    cfg = app[CONFIG]
    monitor = FleetMonitor(app[NATS], window=cfg.discovery_window)

    async def poll() -> None:
        while True:
            snap, spec = await asyncio.gather(monitor.snapshot(), fetch_spec(app[NATS]), return_exceptions=True)
            if isinstance(snap, BaseException):  # bus hiccup: keep the last snapshot, try again
                log.warning("fleet snapshot failed: %s", snap)
            else:
                app[FLEET].latest = snap
                for session in list(app[SESSIONS]):
                    session.outbox.put_latest("__fleet__", snap)
            if isinstance(spec, BaseException):
                log.warning("asking the coordinator for the fleet's spec failed: %s", spec)
            elif spec is not None:
                _update_spec(app, spec)
            await asyncio.sleep(cfg.fleet_interval)

    task = asyncio.create_task(poll(), name="ddm-web-fleet")
    yield
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass


def _update_spec(app: web.Application, fleet: FleetSpec) -> None:
    """Keep the fleet's spec; when it changed (or became known), send every socket the `spec` message."""
    view = app[SPEC]
    spec, guidance = fleet
    if view.known and view.spec == spec and view.default_guidance_scale == guidance:
        return
    if view.spec != spec:
        log.info("the fleet's model spec: %s", spec.to_json())
    view.spec, view.known, view.default_guidance_scale = spec, True, guidance
    msg = view.message
    for session in list(app[SESSIONS]):
        session.outbox.put_latest("__spec__", msg)


async def _close_sockets(app: web.Application) -> None:
    """Close every socket at once, each within CLOSE_TIMEOUT_S: a client that does not read cannot hold
    up the shutdown (what cannot be closed in time is aborted)."""
    closers = list(app[SOCKETS].values())
    await asyncio.gather(
        *(close(WSCloseCode.GOING_AWAY, "server shutdown") for close in closers), return_exceptions=True
    )


# ---------------------------------------------------------------- handlers


async def index(request: web.Request) -> web.FileResponse:
    return web.FileResponse(STATIC_DIR / "index.html", headers={"Cache-Control": "no-cache"})


async def healthz(request: web.Request) -> web.Response:
    nc = request.app[NATS]
    if nc.is_connected:
        return web.Response(text="ok")
    return web.Response(status=503, text="nats disconnected")


async def fleet_json(request: web.Request) -> web.Response:
    return web.json_response(request.app[FLEET].latest)


async def spec_json(request: web.Request) -> web.Response:
    return web.json_response(request.app[SPEC].message)


def hello_message(cfg: WebConfig) -> dict[str, Any]:
    return {
        "type": "hello",
        "max_images": MAX_JOB_IMAGES,
        "max_steps": MAX_JOB_STEPS,
        "max_jobs": cfg.max_jobs_per_socket,
        "strategies": ["top1", "topk", "full", "oracle", "sample"],
        "solvers": ["euler", "heun"],
        "preview_every": cfg.preview_every,
    }


async def websocket(request: web.Request) -> web.StreamResponse:
    app = request.app
    cfg = app[CONFIG]
    client = request_client_key(request, app[PROXIES])
    per_client = app[PER_CLIENT]
    if per_client[client] >= cfg.max_sockets_per_client:
        refuse_log(
            request,
            "refused a websocket from %s: it has %d open (limit %d)",
            client,
            per_client[client],
            cfg.max_sockets_per_client,
        )
        return web.Response(
            status=429,
            text=f"refused: {per_client[client]} sockets open from {client} (limit {cfg.max_sockets_per_client})\n",
        )
    per_client[client] += 1
    try:
        return await _serve_socket(request, cfg, client)
    finally:
        per_client[client] -= 1
        if per_client[client] <= 0:
            del per_client[client]


def _abort(request: web.Request) -> None:
    """Drop the connection at once (RST): unsent data is discarded, the socket and its buffers freed."""
    transport = request.transport
    if transport is not None:
        transport.abort()


async def _serve_socket(request: web.Request, cfg: WebConfig, client: str) -> web.WebSocketResponse:
    """One websocket from accept to close: the token check, then a `Session` fed by the socket's messages
    while its sender task writes to the socket, and the teardown that frees both."""
    app = request.app
    ws = web.WebSocketResponse(
        heartbeat=cfg.heartbeat_s, max_msg_size=MAX_CLIENT_MESSAGE_BYTES, protocols=(SUBPROTOCOL,)
    )
    await ws.prepare(request)
    close_socket = _closer(request, ws)
    if not app[POLICY].token_ok(offered_tokens(request)):
        refuse_log(
            request,
            "refused a websocket from %s: missing or wrong token (Origin %r)",
            request.remote,
            (request.headers.get("Origin") or "")[:100],
        )
        await close_socket(
            WSCloseCode.POLICY_VIOLATION,
            "token required: open the viewer with #token=<token> (see ddm-fleet web --help)",
        )
        return ws
    app[SOCKETS][ws] = close_socket
    session = _open_session(app, cfg, ws, client, close_socket)
    sender = asyncio.create_task(session.run_sender(), name="ddm-web-sender")
    try:
        await _read_socket(request, ws, session, cfg, close_socket)
    finally:
        await _end_session(request, ws, session, sender)
    return ws


def _closer(request: web.Request, ws: web.WebSocketResponse) -> CloseSocket:
    """The socket's close_socket(code, reason), also kept in app[SOCKETS] for the shutdown."""

    async def close_socket(code: int, reason: str) -> None:
        """Close with a reason; a client that does not read cannot stall it: unless the closing handshake
        finishes within CLOSE_TIMEOUT_S, the connection is aborted (RST: its socket and buffers freed).
        Also when the close is cancelled half-way (the handler ended meanwhile)."""
        closed = False
        try:
            closed = await asyncio.wait_for(ws.close(code=code, message=reason.encode()[:120]), CLOSE_TIMEOUT_S)
        except (TimeoutError, ConnectionError, RuntimeError):
            pass
        finally:
            if not closed:
                _abort(request)

    return close_socket


def _open_session(
    app: web.Application,
    cfg: WebConfig,
    ws: web.WebSocketResponse,
    client: str,
    close_socket: CloseSocket,
) -> Session:
    """The socket's session, registered with the app (fleet and spec updates reach it), its first messages
    queued: hello, the fleet's spec, and the latest fleet snapshot if there is one yet."""
    session = Session(
        app[NATS],
        ws.send_json,
        submit_timeout=cfg.submit_timeout,
        max_jobs=cfg.max_jobs_per_socket,
        unresponsive_after=cfg.unresponsive_after,
        max_queued=cfg.max_queued_messages,
        close_socket=close_socket,
        spec=lambda: app[SPEC].spec,
        preview_every=cfg.preview_every,
        user=client,
        user_jobs=lambda: sum(len(s.jobs) for s in app[SESSIONS] if s.user == client),
        max_user_jobs=cfg.max_jobs_per_client,
    )
    app[SESSIONS].add(session)
    session.outbox.put(hello_message(cfg))
    session.outbox.put_latest("__spec__", app[SPEC].message)
    if app[FLEET].latest.get("time") is not None:
        session.outbox.put_latest("__fleet__", app[FLEET].latest)
    return session


async def _read_socket(
    request: web.Request,
    ws: web.WebSocketResponse,
    session: Session,
    cfg: WebConfig,
    close_socket: CloseSocket,
) -> None:
    """Hand the socket's text messages to the session until it closes; one sending faster than
    `max_messages_per_second` (beyond a burst of twice that) is closed with 1008."""
    rate = RateLimit(cfg.max_messages_per_second, burst=max(1, int(2 * cfg.max_messages_per_second)))
    async for msg in ws:
        if msg.type in (WSMsgType.TEXT, WSMsgType.BINARY) and not rate.allow():
            reason = f"too many messages: over {cfg.max_messages_per_second:g} per second"
            log.warning("closing the websocket of %s: %s", request.remote, reason)
            await close_socket(WSCloseCode.POLICY_VIOLATION, reason)
            return
        if msg.type == WSMsgType.TEXT:
            session.handle(msg.data)
        elif msg.type == WSMsgType.BINARY:
            session.error("send JSON text frames, not binary")
        elif msg.type == WSMsgType.ERROR:
            log.info("websocket error: %s", ws.exception())
            return


async def _end_session(request: web.Request, ws: web.WebSocketResponse, session: Session, sender: asyncio.Task) -> None:
    """Socket gone: cancel the session's jobs, let its sender finish (2 s at most), and free the connection
    and the socket's slot in the app."""
    app = request.app
    app[SESSIONS].discard(session)
    await session.close()
    try:
        await asyncio.wait_for(sender, timeout=2)
    except (TimeoutError, asyncio.CancelledError):
        sender.cancel()
    if session.closer is not None:  # closed as not reading: its connection is gone before its slot is freed
        await asyncio.wait([session.closer], timeout=CLOSE_TIMEOUT_S + 1)
    if ws.close_code == WSCloseCode.ABNORMAL_CLOSURE or ws.exception() is not None:
        # dropped without a closing handshake (no PONG in time, a broken frame, the peer gone): aiohttp
        # only close()s the transport, which waits for ever to flush to a peer that stopped reading
        _abort(request)
    app[SOCKETS].pop(ws, None)
