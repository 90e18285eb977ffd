"""The errors an expert transport raises and the engine handles (transport.py, local_fleet.py -> engine.py).

Here, below both, so that a transport names them without importing the engine; `coordinator.engine`
re-exports them (`from coordinator.engine import ExpertUnavailable` still works).
"""

from __future__ import annotations

from schemas import ErrorCode


class ExpertUnavailable(Exception):
    """No worker of `expert` could produce this step's velocity. `code` says why, for the jobs
    that fail of it: `unavailable` (no responders, time-outs) or `bad_reply` (see BadExpertReply)."""

    code = ErrorCode.UNAVAILABLE

    def __init__(self, expert: int, reason: str):
        super().__init__(f"expert {expert}: {reason}")
        self.expert = expert
        self.reason = reason


class BadExpertReply(ExpertUnavailable):
    """The expert's workers answered, but never with a usable velocity (NaN/Inf, wrong shape or
    dtype, undecodable): a broken or hostile worker, not a missing one."""

    code = ErrorCode.BAD_REPLY
