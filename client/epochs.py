"""The owner-epoch rule a client applies to one job's events (docs/PROTOCOL.md, section 9, "Owner epochs").

A job asked with `JobRequest.report_epoch` carries `epoch` on every event (and on `job_status`): a number
that strictly increases each time the job changes owner (0: not durable; 1: a durable job's first owner;
one more at each take-over). A coordinator that lost the job may still have events on their way (queued
in a NATS node's routes while it was cut off, say) that arrive after the new owner's. The rule: keep the
highest epoch seen for the job and drop every event of a lower one; an event without `epoch` counts as
epoch 0. So once a take-over's events have arrived, nothing of the old owner is delivered, its `done`
included. An epoch more than `MAX_EPOCH_JUMP` above the highest seen is no take-over (each adds one):
anyone may publish on an open bus, and one forged event of epoch 2^63-1 adopted would make every real
event after it look stale; such an event is ignored instead (counted in `implausible`, logged at most
every 10 s). Pure: no I/O.

    epochs = EpochFilter(job_id)
    if not epochs.admit(event):
        continue                     # stale: from an owner that lost the job (counted in epochs.dropped)
"""

from __future__ import annotations

import logging
from typing import Any

from bus.ratelimited_log import RateLimitedLog

log = logging.getLogger(__name__)

#: Most an event's (or a job_status') epoch may exceed the highest seen for its job and still be believed:
#: each take-over adds one, so a real jump is a few; a larger one is forged (or garbage) and is ignored.
MAX_EPOCH_JUMP = 1024

_IMPLAUSIBLE_LOG = RateLimitedLog(log)


def epoch_of(event: Any) -> int:
    """The owner epoch an event carries; 0 when it carries none (a job that is not durable, or a
    coordinator that does not report epochs)."""
    epoch = getattr(event, "epoch", None)
    return 0 if epoch is None else int(epoch)


class EpochFilter:
    """The highest owner epoch seen for one job, and the events dropped for carrying a lower one."""

    def __init__(self, job_id: str = ""):
        self.job_id = job_id
        self.highest = 0
        self.dropped = 0  # events of a lower epoch than one already seen
        self.dropped_kinds: dict[str, int] = {}  # the same, by event kind
        self.stale_statuses = 0  # job_status answers of a lower epoch, ignored
        self.implausible = 0  # events and job_status answers more than MAX_EPOCH_JUMP above `highest`, ignored

    def _implausible(self, epoch: int, what: str) -> bool:
        """True (counted, logged) when `epoch` jumps more than MAX_EPOCH_JUMP above the highest seen."""
        if epoch - self.highest <= MAX_EPOCH_JUMP:
            return False
        self.implausible += 1
        _IMPLAUSIBLE_LOG.warning(
            "job %s: ignored a %s of owner epoch %d: more than %d above the highest seen (%d), no take-over "
            "makes that (%d ignored so far)",
            self.job_id,
            what,
            epoch,
            MAX_EPOCH_JUMP,
            self.highest,
            self.implausible,
        )
        return True

    def admit(self, event: Any) -> bool:
        """True: deliver `event` (its epoch is the highest seen so far, which it may raise); False: it
        comes from an owner that has lost the job since (counted in `dropped`, logged at debug level), or
        its epoch is more than MAX_EPOCH_JUMP above the highest (counted in `implausible`, logged)."""
        epoch = epoch_of(event)
        if self._implausible(epoch, f"{getattr(event, 'kind', '?')} event"):
            return False
        if epoch < self.highest:
            self.dropped += 1
            kind = str(getattr(event, "kind", "?"))
            self.dropped_kinds[kind] = self.dropped_kinds.get(kind, 0) + 1
            log.debug(
                "job %s: dropped a stale %s of owner epoch %d (epoch %d seen; %d dropped so far)",
                self.job_id,
                kind,
                epoch,
                self.highest,
                self.dropped,
            )
            return False
        self.highest = epoch
        return True

    def owner_accepted(self, accepted: Any) -> None:
        """The submit reply (`JobAccepted`) names the first owner's epoch, as its `accepted` event does:
        events of a lower one are stale even before that event arrives."""
        self.highest = max(self.highest, epoch_of(accepted))

    def admit_status(self, status: Any) -> bool:
        """False when a `job_status` answer comes from an owner that has lost the job (its epoch is lower
        than the highest seen: never act on it); True otherwise, raising the highest epoch to its own (the
        coordinator that answers holds the job at that epoch, so anything older is stale). A status
        without `epoch` (an `unknown`, or a coordinator that does not report it) is always admitted and
        changes nothing. One more than MAX_EPOCH_JUMP above the highest is ignored (False; `implausible`)."""
        epoch = getattr(status, "epoch", None)
        if epoch is None:
            return True
        if self._implausible(int(epoch), "job_status"):
            return False
        if int(epoch) < self.highest:
            self.stale_statuses += 1
            log.debug(
                "job %s: ignored a job_status of owner epoch %d (epoch %d seen)", self.job_id, epoch, self.highest
            )
            return False
        self.highest = int(epoch)
        return True
