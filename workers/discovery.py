"""The worker's `nats.micro` service, answering discovery (`$SRV.PING/INFO/STATS`) only on inboxes.

nats.micro answers a discovery request on whatever reply subject it names. Any user allowed to
publish `$SRV.…` (clients ask discovery too) could then make every worker publish its INFO or STATS
document onto a subject of its choosing, e.g. another client's `ddm.v1.c.<client>.jobs.<id>.events`,
under the worker's `allow_responses` right. `InboxOnlyService` drops such a request instead (the
rule the expert endpoints and the coordinator keep: replies go only to `_INBOX.…` /
`_INBOX_<client>.…`) and tells `on_drop` about it.
"""

from __future__ import annotations

from collections.abc import Callable

from nats.micro import ServiceConfig
from nats.micro.service import Service

from schemas import subjects


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
