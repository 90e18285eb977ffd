"""The worker's `nats.micro` service, answering discovery (`$SRV.PING/INFO/STATS`) only on inboxes.

nats.micro answers a discovery request on whatever reply subject it names. Any user allowed to
publish `$SRV.…` (clients ask discovery too) could then make every worker publish its INFO or STATS
document onto a subject of its choosing, e.g. another client's `ddm.v1.c.<client>.jobs.<id>.events`,
under the worker's `allow_responses` right. `InboxOnlyService` drops such a request instead (the
rule the expert endpoints and the coordinator keep: replies go only to `_INBOX.…` /
`_INBOX_<client>.…`) and tells `on_drop` about it.

`InboxGuard` is that rule for every server here (expert workers, decoders): it says whether a reply
subject may be answered, and counts and logs (at most every `DROP_LOG_EVERY_S` seconds) the requests
dropped for it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from nats.micro import ServiceConfig
from nats.micro.service import Service

from bus.ratelimited_log import RateLimitedLog
from schemas import subjects

#: Seconds between two log lines about dropped requests (reply subject outside `_INBOX`).
DROP_LOG_EVERY_S = 10.0


class InboxGuard:
    """The reply-subject rule of a worker's endpoints and its discovery: replies go only to `_INBOX.…` /
    `_INBOX_<client>.…` (`schemas.subjects.is_reply_inbox`). A request naming any other reply subject
    (e.g. another client's job events) is dropped unanswered: counted in `dropped`, told to `on_drop`
    (a metric) and logged, at most one line per `every_s` seconds (`bus.ratelimited_log`).

        guard = InboxGuard(log, "decode request")
        if not guard.allows(msg.reply):
            return                       # dropped (counted, logged)
    """

    def __init__(
        self,
        logger: logging.Logger,
        what: str = "request",
        *,
        on_drop: Callable[[], None] | None = None,
        every_s: float = DROP_LOG_EVERY_S,
    ):
        self.what, self.on_drop = what, on_drop
        self.dropped = 0
        self._log = RateLimitedLog(logger, every_s=every_s)

    def allows(self, reply_to: str | None) -> bool:
        """True if `reply_to` may be answered; else the request is dropped (`drop`) and False."""
        if subjects.is_reply_inbox(reply_to or ""):
            return True
        self.drop(reply_to or "")
        return False

    def drop(self, reply_to: str) -> None:
        """Count and (rate-limited) log one request dropped for its reply subject."""
        self.dropped += 1
        if self.on_drop is not None:
            self.on_drop()
        self._log.warning(
            "dropped a %s with reply subject %r: replies go only to %s.* / %s_<client>.* (%d dropped so far)",
            self.what,
            str(reply_to)[:200],
            subjects.INBOX,
            subjects.INBOX,
            self.dropped,
        )


class InboxOnlyService(Service):
    """A `nats.micro.Service` whose discovery replies go only to `_INBOX` reply subjects."""

    def __init__(self, nc, config: ServiceConfig, on_drop: Callable[[str], None]):
        super().__init__(nc, config)
        self._on_drop = on_drop

    def _to_inbox(self, msg) -> bool:
        if subjects.is_reply_inbox(msg.reply or ""):
            return True
        self._on_drop(msg.reply or "")
        return False

    async def _handle_ping_request(self, msg) -> None:
        if self._to_inbox(msg):
            await super()._handle_ping_request(msg)

    async def _handle_info_request(self, msg) -> None:
        if self._to_inbox(msg):
            await super()._handle_info_request(msg)

    async def _handle_stats_request(self, msg) -> None:
        if self._to_inbox(msg):
            await super()._handle_stats_request(msg)


async def add_inbox_only_service(nc, on_drop: Callable[[str], None], **config) -> InboxOnlyService:
    """`nats.micro.add_service`, with discovery answered only on inboxes (see the module docstring)."""
    service = InboxOnlyService(nc, ServiceConfig(**config), on_drop)
    await service.start()
    return service
