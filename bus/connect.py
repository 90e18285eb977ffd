"""One way to open a NATS connection, for every ddm-fleet process.

Every process (worker, coordinator, web, generate, benches, fuzzers, `up`) calls `connect`, so server
lists, reconnect policy, the reply inbox of a client namespace and the error a user sees when no server
answers are decided once, here. Two reconnect policies cover every process:

* ``reconnect="forever"`` (services: workers, coordinator, web once started): keep reconnecting after
  a server goes away, one second apart;
* ``reconnect=N`` (short-lived clients: `generate`, `eval`, benches): give up after N tries.

``first_connect_attempts`` bounds only the first connection, so a command started with a wrong URL fails
within seconds with `BusUnavailable` instead of retrying forever. The first connection's attempts are
counted here rather than left to nats-py's ``max_reconnect_attempts``, which cannot say "once" (0 there
means "forever", and N means N + 1 tries per server); a wall-clock bound backs the count up.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Literal

from bus.nats_server import nats_servers
from bus.ratelimited_log import RateLimitedLog

log = logging.getLogger("ddm.bus")

#: Seconds one connection attempt may take (TCP connect and the server's INFO).
DEFAULT_CONNECT_TIMEOUT_S = 5.0


class BusUnavailable(ConnectionError):
    """No NATS server answered at the URL(s) given (or it refused the credentials); the message says
    which servers (without credentials), the last error, and what to do."""


class _GiveUp(Exception):
    """Raised from the error callback to stop nats-py's first-connect loop once the attempts are spent
    (deliberately not an OSError / nats error, which nats-py would catch and retry)."""


def _default_error_cb(name: str) -> Callable[[Exception], Awaitable[None]]:
    limited = RateLimitedLog(log, every_s=10.0)

    async def on_error(err: Exception) -> None:
        limited.warning("%s: NATS connection error: %s", name, err)

    return on_error


class _FirstConnect:
    """The error callback handed to nats-py: during the first connection it counts failed attempts
    (nats-py reports each one here) and gives up after `limit`; once connected it forwards to `then`."""

    def __init__(self, limit: int, then: Callable[[Exception], Awaitable[None]]):
        self.limit, self.then = limit, then
        self.failures = 0
        self.last: Exception | None = None
        self.auth_error: Exception | None = None  # the server refused the credentials (kept: a reset may follow)
        self.connected = False

    async def on_error(self, err: Exception) -> None:  # a coroutine function, as nats-py requires
        if self.connected:
            await self.then(err)
            return
        self.failures += 1
        self.last = err
        if _is_auth_error(err):
            self.auth_error = err
        log.debug("NATS connect attempt %d/%d failed: %s", self.failures, self.limit, err)
        if self.failures >= self.limit or self.auth_error is not None:  # a refused password will not get better
            raise _GiveUp


def _is_auth_error(err: BaseException) -> bool:
    import nats.errors

    return isinstance(err, nats.errors.AuthorizationError) or "authorization violation" in str(err).lower()


async def connect(
    urls: str | list[str],
    *,
    name: str,
    reconnect: Literal["forever"] | int = "forever",
    reconnect_wait_s: float = 1.0,
    first_connect_attempts: int = 1,
    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
    inbox_prefix: str | None = None,
    pending_size: int | None = None,
    error_cb: Callable[[Exception], Awaitable[None]] | None = None,
    **options: Any,
):
    """Connect to NATS at `urls` (one URL, a comma-separated list of a cluster's nodes, or a list;
    see `bus.nats_server.nats_servers`) as connection `name`; returns the connected `nats.NATS` client.

    `reconnect`: "forever", or the number of reconnect attempts per server after the connection is lost
    (0: none; the connection closes when the server goes away).
    `reconnect_wait_s`: seconds between attempts at one server (first connection and reconnects).
    `first_connect_attempts`: rounds over the server list for the first connection before
    `BusUnavailable` is raised; it is raised within about
    `first_connect_attempts * len(servers) * (connect_timeout_s + reconnect_wait_s)` seconds, at once when
    the server refuses the credentials.
    `connect_timeout_s`: seconds one attempt may take (TCP connect and the server's INFO).
    `inbox_prefix`: the reply inbox prefix of a client namespace (`schemas.subjects.inbox_prefix`).
    `pending_size`: bytes of outgoing messages nats-py buffers before it flushes, and may hold while
    reconnecting (publishing more then raises OutboundBufferLimitError); nats-py's 2 MiB otherwise.
    `error_cb`: connection errors once connected (default: a rate-limited warning on the `ddm.bus`
    logger); errors of the first connection go into `BusUnavailable` instead.
    Other keyword arguments (`disconnected_cb`, `reconnected_cb`, ...) go to `nats.connect` unchanged.

    Raises ValueError for a malformed URL, a shipped example password or a bad argument,
    BusUnavailable when no server answers."""
    import nats
    import nats.errors

    servers = nats_servers(urls)
    if reconnect != "forever" and (isinstance(reconnect, bool) or not isinstance(reconnect, int) or reconnect < 0):
        raise ValueError(f"reconnect must be 'forever' or a count >= 0, got {reconnect!r}")
    if (
        isinstance(first_connect_attempts, bool)
        or not isinstance(first_connect_attempts, int)
        or first_connect_attempts < 1
    ):
        raise ValueError(f"first_connect_attempts must be an integer >= 1, got {first_connect_attempts!r}")
    if connect_timeout_s <= 0 or reconnect_wait_s < 0:
        raise ValueError(
            f"connect_timeout_s must be > 0 and reconnect_wait_s >= 0, got {connect_timeout_s} and {reconnect_wait_s}"
        )
    for key in ("servers", "allow_reconnect", "max_reconnect_attempts", "reconnect_time_wait", "connect_timeout"):
        if key in options:
            raise ValueError(
                f"connect(): pass the reconnect policy as reconnect= / first_connect_attempts= / "
                f"reconnect_wait_s= / connect_timeout_s=, not {key}="
            )
    attempts = _FirstConnect(first_connect_attempts * len(servers), error_cb or _default_error_cb(name))
    kwargs: dict[str, Any] = dict(
        servers=servers,
        name=name,
        connect_timeout=connect_timeout_s,
        allow_reconnect=True,
        # -1: nats-py keeps trying; `attempts` stops it (see the module docstring)
        max_reconnect_attempts=-1,
        reconnect_time_wait=reconnect_wait_s,
        error_cb=attempts.on_error,
    )
    if inbox_prefix is not None:
        kwargs["inbox_prefix"] = inbox_prefix
    if pending_size is not None:
        kwargs["pending_size"] = pending_size
    kwargs.update(options)
    bound_s = first_connect_attempts * len(servers) * (connect_timeout_s + reconnect_wait_s) + connect_timeout_s
    nc = nats.NATS()
    try:
        await asyncio.wait_for(nc.connect(**kwargs), bound_s)
    except BaseException as err:
        try:
            await nc.close()
        except Exception:  # never connected: nothing more to release
            pass
        if isinstance(err, _GiveUp):
            why = _describe(attempts.auth_error or attempts.last)
        elif isinstance(err, asyncio.TimeoutError):  # before OSError: TimeoutError is one
            why = f"no answer within {bound_s:.0f} s" + (f" ({_describe(attempts.last)})" if attempts.last else "")
        elif isinstance(err, (OSError, nats.errors.Error)):
            why = _describe(err)
        else:  # a programming error (a bad callback, ...) or a cancellation: not the bus's fault
            raise
        auth = attempts.auth_error is not None or _is_auth_error(attempts.last or err)
        raise BusUnavailable(_message(servers, why, auth=auth)) from None  # no chained error: it may hold the URL
    attempts.connected = True
    if reconnect == "forever":
        nc.options["max_reconnect_attempts"] = -1
    elif reconnect == 0:
        nc.options["allow_reconnect"] = False  # nats-py reads max_reconnect_attempts=0 as "forever"
    else:
        nc.options["max_reconnect_attempts"] = reconnect
    return nc


#: Seconds a stopping process waits for its connection to drain (subscriptions answered, what it published
#: flushed) before closing it anyway: within `ddm-fleet up`'s stop timeout, unlike nats-py's 30 s.
DRAIN_TIMEOUT_S = 5.0


async def flushed(nc, timeout: float = 10.0) -> None:
    """Return once the server has every command `nc` wrote before the call (its SUBs and PUBs): a
    subscription made before `await flushed(nc)` receives what any connection publishes after it.

    One `nc.flush()` does not promise that: nats-py writes the flush's PING straight to the socket,
    possibly ahead of commands still in its write buffer, so the PONG can come back before the server
    has read them (a SUB then misses what another connection publishes next; seen on a loaded box). By
    the time that PONG is back the flusher task has written the buffer, so a second round trip does.
    Raises what `nc.flush` raises (nats.errors.TimeoutError after `timeout` s per round trip)."""
    await nc.flush(timeout=timeout)
    await nc.flush(timeout=timeout)


async def drain_or_close(nc, timeout_s: float = DRAIN_TIMEOUT_S) -> bool:
    """Drain `nc` (its subscriptions' messages handled, what it published flushed), or close it after
    about `timeout_s` seconds if that does not finish (a handler that never returns, a server that went
    away): a stopping process neither waits on the bus for long nor dies of it. Returns True when the
    connection drained, False when it had to be closed (a warning says why); never raises but for a
    cancel."""
    import nats.errors

    if nc is None or nc.is_closed:
        return True
    # nats-py's own bound on the subscriptions' drain (a timeout there goes to error_cb, then it flushes and
    # closes); ours below is longer, so a cancel from it lands in that flush or close, which let it through
    # (one landing in the subscriptions' wait is swallowed by nats-py and would not bound anything)
    nc.options["drain_timeout"] = min(float(nc.options.get("drain_timeout", timeout_s)), timeout_s)
    timed_out = []  # nats-py reports its drain timeout only to error_cb
    error_cb = getattr(nc, "_error_cb", None)

    async def note(err: Exception) -> None:
        if isinstance(err, nats.errors.DrainTimeoutError):
            timed_out.append(err)
        elif error_cb is not None:
            await error_cb(err)

    if error_cb is not None:
        nc._error_cb = note
    why = ""
    try:
        await asyncio.wait_for(nc.drain(), timeout_s + 2.0)
        if nc.is_closed and not timed_out:
            return True
        why = (
            f"subscriptions not drained within {timeout_s:g} s: a handler busy or messages unread"
            if timed_out
            else "it did not close"
        )
    except Exception as err:  # reconnecting, the server gone, a flush without its PONG, our bound (TimeoutError)
        why = f"{type(err).__name__}: {err}" if str(err) else f"not done within {timeout_s + 2.0:g} s"
    finally:
        if error_cb is not None:
            nc._error_cb = error_cb
    log.warning("NATS connection %s: draining failed (%s); closing it", nc.options.get("name") or "", why)
    try:
        await asyncio.wait_for(nc.close(), 2.0)
    except Exception as err:
        log.debug("closing after a failed drain: %r", err)
    return False


def discard_unsent(
    nc, recall: Callable[[bytes], bool] | None = None, *, drop: bool = True
) -> Literal["none", "recalled", "dropped"]:
    """Make sure the messages `nc` has not sent yet that `recall(subject)` selects (default: every one)
    never reach the server later. For a process that must not have some of its recent messages delivered
    late: a coordinator cut off from the bus (or frozen) whose leases lapsed, whose frames of the jobs it
    lost, queued behind the cut, would otherwise reach clients once the link heals, after another
    coordinator took those jobs over. Returns what it did:

    - "recalled": the selected PUBs were taken out of nats-py's own buffer (a frozen process wakes up
      with the frames of its last moment there; a reconnecting connection holds what was published
      meanwhile), and nothing is held back in the socket (bytes on their way over a link that acknowledges
      arrive whatever is done now): the connection stays, with its other messages
      (answers to requests, its SUBs) and whatever it is receiving (a submit arriving at that moment).
    - "none": as "recalled", with nothing selected to take out.
    - "dropped": bytes are held back where they cannot be taken back nor told apart (`held_back`:
      asyncio's write buffer, or the kernel's queue behind a closed window or a link that stopped
      acknowledging): the socket is dropped at once with all of it and with everything in
      nats-py's buffer (SO_LINGER 0: closing resets the connection instead of delivering the queue
      later); nats-py reconnects as after any lost connection (subscriptions are renewed). What the
      socket was receiving is lost with it.

    Bytes only unacknowledged, on a link that shows no trouble (`held_back` None), get a second look an
    RTO later (at least 0.25 s): if the server acknowledged nothing meanwhile, the connection is dropped
    then, as for "dropped" (logged; the call has returned "recalled" or "none").

    `drop=False`: only take the selected PUBs out of nats-py's buffer, never drop the connection (for a
    link known to work: what is in the socket arrives in moments)."""
    import struct

    removed = _recall_buffered(nc, recall)
    if not drop:
        return "recalled" if removed else "none"
    writer = getattr(getattr(nc, "_transport", None), "_io_writer", None)
    transport = getattr(writer, "transport", None)
    if transport is None or transport.is_closing():
        return "recalled" if removed else "none"
    sock = transport.get_extra_info("socket")
    verdict = held_back(transport, sock)
    if verdict is None:  # unacknowledged, the link showing no trouble yet: look again after its RTO
        try:
            acked, rto_s = _acked_and_rto(sock)
        except (OSError, ValueError, struct.error):
            verdict = True  # cannot look again: as if held back
        else:
            asyncio.get_running_loop().call_later(max(rto_s, 0.25), _drop_if_stalled, nc, transport, sock, acked)
    if not verdict:
        return "recalled" if removed else "none"
    _drop(nc, transport, sock)
    return "dropped"


def _drop(nc, transport, sock) -> None:
    """Reset the connection at once (SO_LINGER 0), with everything it holds unsent."""
    import socket
    import struct

    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError as err:  # already closed underneath: nothing left to deliver
            log.debug("SO_LINGER on a closing socket: %r", err)
    nc._pending = []
    nc._pending_data_size = 0
    transport.abort()


def _drop_if_stalled(nc, transport, sock, acked: int) -> bool:
    """`discard_unsent`'s second look, an RTO after bytes were seen unacknowledged on a link that showed
    no trouble: when the server acknowledged nothing since (`acked` bytes then) and bytes are still
    outstanding, the link stopped acknowledging (what it holds would arrive late): drop the connection.
    Returns whether it did."""
    if transport.is_closing():
        return False
    try:
        outstanding = _ioctl_int(sock, _TIOCOUTQ)
        stalled = outstanding > 0 and _acked_and_rto(sock)[0] == acked
    except (OSError, ValueError, AttributeError):
        return False  # the socket is gone: nothing left in it to deliver
    if not stalled:
        return False
    log.warning("bus connection: %d bytes unacknowledged for an RTO after a lapse; dropping it", outstanding)
    _drop(nc, transport, sock)
    return True


def _acked_and_rto(sock) -> tuple[int, float]:
    """(bytes the peer acknowledged so far, the retransmission time-out in seconds), from TCP_INFO."""
    import socket
    import struct

    info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 128)
    return struct.unpack_from("Q", info, 120)[0], struct.unpack_from("I", info, 8)[0] / 1e6


def _recall_buffered(nc, recall: Callable[[bytes], bool] | None) -> int:
    """Take the PUB / HPUB commands whose subject `recall` selects (None: all) out of nats-py's buffer of
    commands not yet written (each entry one whole command, its payload included); returns how many."""
    pending = getattr(nc, "_pending", None)
    if not pending:
        return 0
    kept = [
        cmd
        for cmd in pending
        if not (cmd.startswith((b"PUB ", b"HPUB ")) and (recall is None or recall(bytes(cmd.split(b" ", 2)[1]))))
    ]
    nc._pending = kept
    nc._pending_data_size = sum(len(cmd) for cmd in kept)
    return len(pending) - len(kept)


#: Linux ioctls on a TCP socket: bytes queued and not yet acknowledged; bytes queued and not yet sent.
_SIOCOUTQNSD = 0x894B
try:
    from termios import TIOCOUTQ as _TIOCOUTQ
except ImportError:  # no termios: Linux's value
    _TIOCOUTQ = 0x5411


def held_back(transport, sock) -> bool | None:
    """Whether bytes written to this connection are held back where they could reach the server late:
    True when they are in asyncio's write buffer, in the kernel's queue not yet sent (SIOCOUTQNSD: a
    closed window, a cut link), or sent and unacknowledged on a link that is retransmitting (TCP_INFO: an
    RTO fired, the peer stopped acknowledging); False when nothing is outstanding. None when bytes are
    sent and only unacknowledged on a link that shows no trouble yet: a delayed ACK (they are at the
    server already, and dropping the connection would not stop them), or a link that has just stopped
    acknowledging; only a second look after the RTO tells them apart (`discard_unsent` takes it). A socket
    the kernel cannot describe counts as holding back what it has queued."""
    import socket
    import struct

    if transport.get_write_buffer_size():
        return True
    if sock is None:
        return False
    try:
        if _ioctl_int(sock, _SIOCOUTQNSD):
            return True
        if not _ioctl_int(sock, _TIOCOUTQ):
            return False
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 128)
        _state, _ca_state, retransmits, probes, backoff = struct.unpack("5B", info[:5])
        if len(info) < 128:
            return True  # too old a kernel for the second look: as if held back
        return True if retransmits or probes or backoff else None
    except (OSError, ValueError, AttributeError, struct.error):
        try:
            return bool(_ioctl_int(sock, _TIOCOUTQ))
        except (OSError, ValueError, AttributeError):
            return True


def _ioctl_int(sock, request: int) -> int:
    import fcntl
    import struct

    return struct.unpack("i", fcntl.ioctl(sock.fileno(), request, b"\0\0\0\0"))[0]


def _describe(err: BaseException | None) -> str:
    return str(err) or type(err).__name__


def _message(servers: list[str], why: str, *, auth: bool) -> str:
    shown = ", ".join(_without_credentials(s) for s in servers)
    why = _scrub(why, servers)
    if auth:
        hint = "The server refused the credentials: check the user and password in --nats / $NATS_URL."
    else:
        hint = "Is a nats-server running (`ddm-fleet up` starts one)? Pass another with --nats or $NATS_URL."
    return f"cannot connect to NATS at {shown}: {why}. {hint}"


def _scrub(text: str, servers: list[str]) -> str:
    """`text` with any password or token of `servers` replaced by ***."""
    from urllib.parse import unquote, urlsplit

    for url in servers:
        netloc = urlsplit(url).netloc
        if "@" not in netloc:
            continue
        user, _, password = netloc.rsplit("@", 1)[0].partition(":")
        for secret in {password, unquote(password)} if password else {user, unquote(user)}:
            if secret:
                text = text.replace(secret, "***")
    return text


def without_credentials(urls: str | list[str]) -> str:
    """`urls` (one URL, a comma-separated list, or a list) with every user:password@ or token@ removed,
    for messages and logs."""
    items = urls.split(",") if isinstance(urls, str) else list(urls)
    return ",".join(_without_credentials(u.strip()) for u in items)


def redacted(urls: str | list[str]) -> str:
    """`urls` (one URL, a comma-separated list, or a list) for logs: each user:password@ as
    user:***@ and each token@ (or nkey seed) as ***@, so a log says which user connected and never
    the secret, e.g. "nats://web:***@10.0.0.5:4222,nats://web:***@10.0.0.6:4222"."""
    items = urls.split(",") if isinstance(urls, str) else list(urls)
    return ",".join(_redacted(u.strip()) for u in items)


def _redacted(url: str) -> str:
    scheme, sep, rest = url.partition("://")
    if not sep:  # host:port without a scheme (nats_servers adds nats://)
        scheme, rest = "", url
    creds, at, host = rest.rpartition("@")
    if not at:
        return url
    user, colon, _ = creds.partition(":")
    return f"{scheme}{sep}{user}:***@{host}" if colon else f"{scheme}{sep}***@{host}"


def _without_credentials(url: str) -> str:
    """`url` with any user:password@ or token@ removed, for messages."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url.rsplit("@", 1)[-1]
    return f"{scheme}://{rest.rsplit('@', 1)[-1]}"
