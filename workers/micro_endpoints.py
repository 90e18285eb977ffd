"""What a worker needs of `nats.micro` and nats-py beyond their public API, each in one small function.

nats-py 2.x offers no public way to reach a micro endpoint's subscription (`Service.add_endpoint`
returns None and `Service.stop` unsubscribes every endpoint itself), nor to send an UNSUB without
also discarding the messages already received (`Subscription.unsubscribe` drops them; `drain`
writes its UNSUB after its flush PING, see `stop_endpoints`), nor a request's reply subject
(`nats.micro.Request` exposes subject, headers and data only). A new nats-py that changes these
internals breaks here and nowhere else.
"""

from __future__ import annotations

import logging
from typing import Any

from bus.connect import flushed

log = logging.getLogger(__name__)


def reply_subject(req: Any) -> str | None:
    """The reply subject of a `nats.micro.Request` (private: `Request._msg`)."""
    return req._msg.reply


def endpoint_subscriptions(service: Any) -> list:
    """The subscriptions of a micro service's endpoints, last added first (private: `Service._endpoints`,
    `Endpoint._subscription`)."""
    return [
        sub
        for ep in reversed(list(getattr(service, "_endpoints", [])))
        if (sub := getattr(ep, "_subscription", None)) is not None
    ]


def forget_endpoints(service: Any) -> None:
    """Make `service.stop()` leave the endpoints alone: after `stop_endpoints` drained them, micro would
    unsubscribe them again and fail (private: `Service._endpoints`)."""
    service._endpoints = []


async def send_unsubscribe(nc: Any, sub: Any) -> None:
    """Queue the UNSUB of `sub` on `nc`, keeping what it has received (private: `Client._send_unsubscribe`,
    `Subscription._id`)."""
    await nc._send_unsubscribe(sub._id)


async def stop_endpoints(service: Any, nc: Any) -> None:
    """Stop a micro service's endpoints taking requests, keeping those already received: each endpoint
    subscription is drained (its callbacks still get what has arrived), the last added first, and the
    service then forgets them (`forget_endpoints`); its discovery subscriptions are `service.stop()`'s.

    The server must have every UNSUB before the drains: nats-py's `Subscription.drain()` queues its UNSUB
    in the write buffer but writes its flush PING straight to the socket, so its PONG can come back before
    the server has the UNSUB, and a request the server still routes here afterwards is dropped with the
    subscription (the sender times out). So every UNSUB goes first, in one write, then two round trips
    (the second PING follows them); drain() then only answers what has arrived. Best effort: on any error
    the drains go on as before."""
    subs = endpoint_subscriptions(service)
    try:
        for sub in subs:
            await send_unsubscribe(nc, sub)
        await flushed(nc, timeout=5)
    except Exception as err:
        log.warning("unsubscribing the endpoints before draining them failed: %s", err)
    for sub in subs:
        try:
            await sub.drain()
        except Exception as err:
            log.warning("draining the endpoint subscription failed: %s", err)
    forget_endpoints(service)
