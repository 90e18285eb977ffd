"""One way to open a NATS connection, for every ddm-fleet process.

Every process (worker, coordinator, web, generate, benches, fuzzers, `up`) calls `connect`, so server
lists, reconnect policy, the reply inbox of a client namespace and the error a user sees when no server
answers are decided once, here. Two reconnect policies cover every process:

* ``reconnect="forever"`` (services: workers, coordinator, web once started): keep reconnecting after
  a server goes away, one second apart;
* ``reconnect=N`` (short-lived clients: `generate`, `eval`, benches): give up after N tries.

``first_connect_attempts`` bounds only the first connection, so a command started with a wrong URL fails
within seconds with `BusUnavailable` instead of retrying forever.
"""

from __future__ import annotations

import logging
from typing import Any, Awaitable, Callable, Literal

from bus.nats_server import nats_servers
from bus.ratelimited_log import RateLimitedLog

log = logging.getLogger("ddm.bus")

#: nats-py's default client-side buffer for a subscription's pending messages is 64 MiB; processes that
#: receive large batches (the coordinator) say so explicitly with `pending_size`.
DEFAULT_CONNECT_TIMEOUT_S = 5.0


class BusUnavailable(ConnectionError):
    """No NATS server answered at the URL(s) given; the message says which and what to do."""


def _default_error_cb(name: str) -> Callable[[Exception], Awaitable[None]]:
    limited = RateLimitedLog(log, every_s=10.0)

    async def on_error(err: Exception) -> None:
        limited.warning("%s: NATS connection error: %s", name, err)

    return on_error


async def connect(urls: str | list[str], *, name: str,
                  reconnect: Literal["forever"] | int = "forever",
                  reconnect_wait_s: float = 1.0,
                  first_connect_attempts: int = 1,
                  connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
                  inbox_prefix: str | None = None,
                  pending_size: int | None = None,
                  error_cb: Callable[[Exception], Awaitable[None]] | None = None,
                  **options: Any):
    """Connect to NATS at `urls` (one URL, a comma-separated list of a cluster's nodes, or a list;
    see `bus.nats_server.nats_servers`) as connection `name`.

    `reconnect`: "forever", or the number of reconnect attempts after the connection is lost.
    `first_connect_attempts`: tries for the first connection before `BusUnavailable` is raised.
    `inbox_prefix`: the reply inbox prefix of a client namespace (`schemas.subjects.inbox_prefix`).
    `pending_size`: the client-side buffer for pending messages, bytes (nats-py's default otherwise).
    `error_cb`: connection errors (default: a rate-limited warning on the `ddm.bus` logger).
    Other keyword arguments go to `nats.connect` unchanged.

    Raises ValueError for a malformed URL or a shipped example password, BusUnavailable when no
    server answers."""
    import nats

    servers = nats_servers(urls)
    if reconnect != "forever" and (not isinstance(reconnect, int) or reconnect < 0):
        raise ValueError(f"reconnect must be 'forever' or a count >= 0, got {reconnect!r}")
    if first_connect_attempts < 1:
        raise ValueError(f"first_connect_attempts must be >= 1, got {first_connect_attempts}")
    kwargs: dict[str, Any] = dict(
        servers=servers, name=name, connect_timeout=connect_timeout_s, allow_reconnect=True,
        # nats-py applies max_reconnect_attempts to the first connect too: bound it there, then widen.
        max_reconnect_attempts=first_connect_attempts - 1, reconnect_time_wait=reconnect_wait_s,
        error_cb=error_cb or _default_error_cb(name),
    )
    if inbox_prefix is not None:
        kwargs["inbox_prefix"] = inbox_prefix
    if pending_size is not None:
        kwargs["pending_size"] = pending_size
    kwargs.update(options)
    try:
        nc = await nats.connect(**kwargs)
    except Exception as err:  # nats-py raises NoServersError, OSError, TimeoutError ... by cause
        shown = ", ".join(_without_credentials(s) for s in servers)
        raise BusUnavailable(f"cannot connect to NATS at {shown}: {err or type(err).__name__}. Is a nats-server "
                             "running (`ddm-fleet up` starts one)? Pass another with --nats or $NATS_URL.") from err
    nc.options["max_reconnect_attempts"] = -1 if reconnect == "forever" else reconnect
    return nc


def _without_credentials(url: str) -> str:
    """`url` with any user:password@ or token@ removed, for messages."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url.rsplit("@", 1)[-1]
    return f"{scheme}://{rest.rsplit('@', 1)[-1]}"
