"""Expert velocity calls over NATS: one batched StepRequest per expert per tick.

`NatsTransport.velocity(expert, x [n, C, H, W], t [n], y [n], row_ids)` splits batches over
`MAX_STEP_ROWS` into concurrent requests, retries a request that times out or gets a
transient error (the queue group hands the retry to another worker of the expert), and
raises `ExpertUnavailable` when the expert has no responders at all, or every try failed.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time

import numpy as np

from schemas import ErrorCode, ErrorReply, ProtocolError, StepReply, StepRequest, StepResult, pack, subjects, unpack
from schemas.limits import MAX_STEP_ROWS

from .engine import ExpertUnavailable

log = logging.getLogger(__name__)

#: Error codes worth a retry on another worker; anything else means our request is bad.
TRANSIENT = {ErrorCode.OVERLOADED, ErrorCode.DEADLINE_EXCEEDED, ErrorCode.UNAVAILABLE, ErrorCode.INTERNAL}


class NatsTransport:
    """Request/reply to `schemas.subjects.expert_velocity(k)`.

    step_timeout: seconds to wait for one reply; retries: extra tries after a timeout or a
    transient error reply; max_rows: rows per request (<= MAX_STEP_ROWS)."""

    def __init__(self, nc, *, step_timeout: float = 10.0, retries: int = 2, max_rows: int = MAX_STEP_ROWS):
        if step_timeout <= 0:
            raise ValueError(f"step_timeout must be > 0 seconds, got {step_timeout}")
        if retries < 0:
            raise ValueError(f"retries must be >= 0, got {retries}")
        if not 1 <= max_rows <= MAX_STEP_ROWS:
            raise ValueError(f"max_rows must be in [1, {MAX_STEP_ROWS}], got {max_rows}")
        self.nc = nc
        self.step_timeout = step_timeout
        self.retries = retries
        self.max_rows = max_rows
        self._ids = itertools.count()
        self.retried = 0  # requests that needed another try (for status / tests)

    async def velocity(self, expert: int, x: np.ndarray, t: np.ndarray, y: np.ndarray,
                       row_ids: list[str]) -> np.ndarray:
        n = len(x)
        if n <= self.max_rows:
            return await self._request(expert, x, t, y, row_ids)
        parts = [slice(i, i + self.max_rows) for i in range(0, n, self.max_rows)]
        outs = await asyncio.gather(*(self._request(expert, x[s], t[s], y[s], row_ids[s]) for s in parts))
        return np.concatenate(outs, axis=0)

    async def _request(self, expert: int, x, t, y, row_ids) -> np.ndarray:
        import nats.errors

        subject = subjects.expert_velocity(expert)
        last = "no attempt"
        for attempt in range(self.retries + 1):
            if attempt:
                self.retried += 1
            req = StepRequest(expert=expert, x_t=np.ascontiguousarray(x, np.float32), t=t.astype(np.float32),
                              y=y.astype(np.int64), row_ids=list(row_ids),
                              deadline=time.time() + self.step_timeout, request_id=f"s{next(self._ids)}")
            try:
                msg = await self.nc.request(subject, pack(req), timeout=self.step_timeout)
            except nats.errors.NoRespondersError:
                raise ExpertUnavailable(expert, "has no responders") from None
            except (nats.errors.TimeoutError, asyncio.TimeoutError):
                last = f"timed out after {self.step_timeout:g} s"
                log.warning("expert %d: request %s %s (try %d/%d)", expert, req.request_id, last, attempt + 1, self.retries + 1)
                continue
            try:
                reply = unpack(msg.data, StepResult)
            except ProtocolError as err:
                last = f"undecodable reply ({err.code.value}: {err.message})"
                continue
            if isinstance(reply, ErrorReply):
                last = f"error reply {reply.code.value}: {reply.message}"
                if reply.code in TRANSIENT:
                    continue
                raise ExpertUnavailable(expert, last)
            assert isinstance(reply, StepReply)
            if reply.row_ids and reply.row_ids != list(row_ids):
                last = "reply row_ids do not match the request"
                continue
            if reply.velocity.shape != x.shape:
                last = f"reply velocity shape {list(reply.velocity.shape)} != request {list(x.shape)}"
                continue
            return reply.velocity
        raise ExpertUnavailable(expert, f"no usable reply after {self.retries + 1} tries (last: {last})")
