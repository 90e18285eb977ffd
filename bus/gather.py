"""Scatter-gather on NATS: one request, every reply that arrives within a window.

A plain request keeps only the first reply; discovery (`$SRV.INFO`, `$SRV.STATS` of every worker)
needs them all. Used by the web page's fleet panel and by the coordinator's spec check at start.
Bounded: at most `MAX_DISCOVERY_REPLIES` replies, each at most `MAX_REPLY_BYTES` (bigger ones are
skipped) and `MAX_DISCOVERY_BYTES` in all (the subscription's pending limits drop the rest).
Replies come on a fresh `bus.inbox.discovery_inbox` (`<inbox prefix>.d.<128 random bits>`): the
workers that see it learn nothing about the connection's other reply subjects.
"""

from __future__ import annotations

import logging
import time

from .cancel import raise_if_cancelled
from .inbox import discovery_inbox

log = logging.getLogger(__name__)

#: Replies kept per discovery request; a service's INFO / STATS reply is ~1 KiB.
MAX_DISCOVERY_REPLIES = 256
MAX_REPLY_BYTES = 64 * 1024
MAX_DISCOVERY_BYTES = 4 * 1024 * 1024


async def gather_replies(
    nc,
    subject: str,
    *,
    window: float = 0.3,
    max_replies: int = MAX_DISCOVERY_REPLIES,
    payload: bytes = b"",
    max_reply_bytes: int = MAX_REPLY_BYTES,
    max_bytes: int = MAX_DISCOVERY_BYTES,
) -> list[bytes]:
    """Publish one request on `subject` and collect the replies of `window` seconds: at most
    `max_replies` of at most `max_reply_bytes` each (larger ones skipped), `max_bytes` in all."""
    inbox = discovery_inbox(nc)
    replies: list[bytes] = []
    total = 0
    sub = await nc.subscribe(inbox, max_msgs=max_replies, pending_msgs_limit=max_replies, pending_bytes_limit=max_bytes)
    try:
        await nc.publish(subject, payload, reply=inbox)  # no flush(): see Session.close
        deadline = time.monotonic() + window
        while len(replies) < max_replies:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                msg = await sub.next_msg(timeout=left)
            except Exception:  # nats TimeoutError: window over
                raise_if_cancelled()  # nats-py reads a cancel on a closed connection as ConnectionClosedError
                break
            if len(msg.data) > max_reply_bytes:
                log.info("skipping a %d-byte reply on %s (limit %d)", len(msg.data), subject, max_reply_bytes)
                continue
            total += len(msg.data)
            if total > max_bytes:
                break
            replies.append(msg.data)
    finally:
        try:
            await sub.unsubscribe()
        except Exception:
            pass
    return replies
