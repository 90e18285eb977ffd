"""Reply subjects nobody can guess, and discovery replies kept apart from everything else.

nats-py draws its inboxes (`nc.new_inbox()`, and the tokens of `nc.request`) from one NUID per
connection: a fixed random prefix plus a counter with a fixed step. Whoever sees two of them (every
worker sees the reply subject of each `$SRV.INFO` / `$SRV.STATS` request it answers) can predict
the next ones and answer requests it was never sent. So:

    inbox = private_inbox(nc)          # "<inbox prefix>.<128 random bits>": a status probe, a submit
    inbox = discovery_inbox(nc)        # "<inbox prefix>.d.<128 random bits>": $SRV.* discovery only
    msg = await private_request(nc, subject, payload, timeout=1.0)   # one reply on a private inbox

Each call draws fresh bits from `secrets`: one inbox tells nothing about another. Discovery replies
come from every worker (leaf hosts included) and land under `<prefix>.d.>`; the shipped NATS
permissions let leaf links publish only there among the client users' inboxes
(infra/nats/permissions.conf), so a worker host cannot reach a probe's or a submit's reply subject.
"""

from __future__ import annotations

import secrets

#: The token after the inbox prefix that marks discovery inboxes: `_INBOX_<client>.d.<random>`.
DISCOVERY = "d"

#: The status header of the server's reply to a request nobody subscribes to.
NO_RESPONDERS = "503"


def _prefix(nc) -> str:
    prefix = getattr(nc, "_inbox_prefix", None)
    if isinstance(prefix, (bytes, bytearray)):
        return bytes(prefix).decode()
    return str(prefix) if prefix else "_INBOX"


def request_inbox_prefix(nc) -> str | None:
    """The prefix every `nc.request` reply subject starts with (`<inbox prefix>.<random>.`, one per
    connection, set at its first request); None before that. nats-py has no public name for it."""
    prefix = getattr(nc, "_resp_sub_prefix", None)
    if isinstance(prefix, (bytes, bytearray)):
        return bytes(prefix).decode()
    return str(prefix) if prefix else None


def private_inbox(nc) -> str:
    """A reply subject for one request: the connection's inbox prefix and 128 random bits."""
    return f"{_prefix(nc)}.{secrets.token_hex(16)}"


def discovery_inbox(nc) -> str:
    """A reply subject for one discovery request (`$SRV.*`, answered by every worker):
    `<inbox prefix>.d.<128 random bits>`."""
    return f"{_prefix(nc)}.{DISCOVERY}.{secrets.token_hex(16)}"


async def private_request(nc, subject: str, payload: bytes = b"", *, timeout: float = 1.0):
    """Like `nc.request`, but on a fresh `private_inbox` of its own (subscribed for this request only,
    at most one message). Raises nats.errors.NoRespondersError / TimeoutError like `nc.request`."""
    import nats.errors

    inbox = private_inbox(nc)
    sub = await nc.subscribe(inbox, max_msgs=1)
    try:
        await nc.publish(subject, payload, reply=inbox)
        msg = await sub.next_msg(timeout=timeout)
    finally:
        try:
            await sub.unsubscribe()
        except Exception:  # already gone (max_msgs reached, connection closed)
            pass
    if msg.headers and msg.headers.get("Status") == NO_RESPONDERS:
        raise nats.errors.NoRespondersError
    return msg


async def respond(msg, data: bytes, headers: dict[str, str] | None = None) -> None:
    """Answer `msg` on its reply subject with `data` and exactly `headers` (None: none). nats-py's
    `Msg.respond` sends the request's own headers back with the reply; the answer's headers are ours."""
    msg.headers = dict(headers) if headers else None
    await msg.respond(data)
