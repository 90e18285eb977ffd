"""Null-label probes: may a job with label-unknown rows (digit -1), or a guided one, run on this fleet?

A worker whose expert has no null label refuses a whole step request that carries y = -1, which
would fail the step for every job sharing that request, so such rows must not reach it. Each expert
is probed with a one-row y = -1 step (`probe_step`) at most once per NULL_LABEL_TTL_S seconds.

Classifier-free guidance (`JobRequest.guidance_scale` other than 1) evaluates every labelled row with
the null label too, so a guided job needs the same: every expert with a null label. It also needs
workers that serve `StepRequest.guidance` (older ones refuse the key): the transport learns which do
from their service metadata (`NatsTransport.experts_without_guidance`), and such a job is refused
(`bad_request`) while one does not, never run unguided.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from schemas import ErrorCode, JobRequest, pack, subjects, unpack

from .scheduler import Rejected

log = logging.getLogger(__name__)

#: Seconds a coordinator trusts what a probe told it about an expert's null label; then it asks
#: again, so a redeployed expert is seen.
NULL_LABEL_TTL_S = 30.0
#: Longest wait for one expert's answer to that probe (at most the step timeout).
NULL_LABEL_PROBE_S = 2.0
#: Seconds an unclear probe (no answer, timeout, another error) is remembered as "unknown" before
#: the expert is asked again: submits are handled one at a time, so a stream of unconditional
#: submits to a stalled expert must not each wait NULL_LABEL_PROBE_S.
NULL_LABEL_UNKNOWN_TTL_S = 5.0


def probe_step(expert: int, y: int = 0, image_shape: tuple[int, ...] = (1, 32, 32), row_id: str = "") -> bytes:
    """A packed one-row StepRequest for `expert` (zeros at t = 0, label `y`, row id `row_id`): asks a
    worker whether it serves (readiness) or whether it serves that label (the null-label check)."""
    import numpy as np

    from schemas import StepRequest

    return pack(
        StepRequest(
            expert=expert,
            x_t=np.zeros((1, *image_shape), np.float32),
            t=np.zeros(1, np.float32),
            y=np.full(1, y, np.int64),
            row_ids=[row_id] if row_id else [],
        )
    )


class NullLabelProbes:
    """What each expert's workers said about the null label, asked over `nc` and kept a while.

    `known[k]`: (True | False | None (unknown), the worker's refusal message, monotonic expiry)."""

    def __init__(
        self,
        nc: Any,
        num_experts: int,
        image_shape: tuple[int, int, int],
        step_timeout: float,
        transport: Any = None,
    ):
        """`transport`: what tells which experts' workers serve guidance (`experts_without_guidance`); None
        (or a transport that cannot tell, like the in-process one): not checked."""
        self.nc, self.num_experts, self.image_shape = nc, num_experts, image_shape
        self.transport = transport
        self.timeout = min(step_timeout, NULL_LABEL_PROBE_S)
        self.known: dict[int, tuple[bool | None, str, float]] = {}
        self.bad_replies = 0  # probe replies that answer another request, or not as a step reply should

    async def check(self, request: JobRequest) -> None:
        """Admission of a job with unconditional rows or classifier-free guidance: raise
        Rejected(bad_request) when some expert's workers have no null label, or (guided) do not serve
        guidance. Experts are probed concurrently; one that does not answer, or answers anything but a
        step or `bad_request`, is not held against the job (its rows go to the others as usual), and is
        asked again only after NULL_LABEL_UNKNOWN_TTL_S."""
        if not (request.n_unconditional or request.n_guided) or self.nc is None:
            return
        now = time.monotonic()
        stale = [k for k in range(self.num_experts) if k not in self.known or self.known[k][2] <= now]
        if stale:
            found = await asyncio.gather(*(self.probe(k) for k in stale))
            for k, got in zip(stale, found):
                if got is None:  # unknown: not held against the job, asked again after a short while
                    self.known[k] = (None, "", time.monotonic() + NULL_LABEL_UNKNOWN_TTL_S)
                else:
                    self.known[k] = (got[0], got[1], time.monotonic() + NULL_LABEL_TTL_S)
        lacking = sorted(k for k, (has, _, _) in self.known.items() if has is False)
        if lacking and not request.n_unconditional:  # a guided job with every label known
            raise Rejected(
                ErrorCode.BAD_REQUEST,
                (
                    f"guidance_scale {request.guidance:g} (classifier-free guidance) evaluates each image "
                    f"with the null label too, but expert{'s' * (len(lacking) > 1)} {', '.join(map(str, lacking))} "
                    f"of this fleet {'have' if len(lacking) > 1 else 'has'} no null label (its worker said: "
                    f"{self.known[lacking[0]][1]}): send guidance_scale 1, or serve experts trained with "
                    "train-expert --label-dropout > 0"
                ),
            )
        if lacking:
            raise Rejected(
                ErrorCode.BAD_REQUEST,
                (
                    f"{request.n_unconditional} of {request.n_images} digits are -1 (label unknown), but expert"
                    f"{'s' * (len(lacking) > 1)} {', '.join(map(str, lacking))} of this fleet "
                    f"{'have' if len(lacking) > 1 else 'has'} no null label (its worker said: "
                    f"{self.known[lacking[0]][1]}): ask for digits 0-9, or serve experts trained with "
                    "train-expert --label-dropout > 0"
                ),
            )
        if request.n_guided:
            await self._check_guidance(request)

    async def _check_guidance(self, request: JobRequest) -> None:
        """Rejected(bad_request) when a discovered worker of some expert does not serve guidance."""
        ask = getattr(self.transport, "experts_without_guidance", None)
        if ask is None:
            return
        lacking = await ask()
        if lacking:
            raise Rejected(
                ErrorCode.BAD_REQUEST,
                (
                    f"guidance_scale {request.guidance:g} (classifier-free guidance) needs expert workers that "
                    f"serve it, but a worker of expert{'s' * (len(lacking) > 1)} {', '.join(map(str, lacking))} does "
                    "not say so in its service metadata (an older ddm-fleet): upgrade the workers, or send "
                    "guidance_scale 1"
                ),
            )

    async def probe(self, expert: int) -> tuple[bool, str] | None:
        """Ask one worker of `expert` for a one-row y = -1 step: (True, "") when it serves it,
        (False, its message) when it refuses with `bad_request`, None when it cannot tell. The reply
        comes on a private inbox (bus.inbox: 128 random bits, unlike nats-py's request inboxes, which
        a worker that sees a few can predict); a step reply counts only for this probe's row and shape."""
        import secrets

        from bus.inbox import private_request
        from schemas import UNCONDITIONAL, StepReply, StepResult

        row_id = f"probe-{secrets.token_hex(8)}"
        probe = probe_step(expert, UNCONDITIONAL, self.image_shape, row_id=row_id)
        try:
            msg = await private_request(self.nc, subjects.expert_velocity(expert), probe, timeout=self.timeout)
        except Exception:  # no responders, timeout: unknown
            return None
        try:
            reply = unpack(msg.data, StepResult)
        except Exception:
            self._bad(expert, "an undecodable reply")
            return None
        if isinstance(reply, StepReply):
            shape = tuple(getattr(reply.velocity, "shape", ()))
            if reply.expert != expert or list(reply.row_ids) != [row_id] or shape != (1, *self.image_shape):
                self._bad(expert, f"a step reply for expert {reply.expert}, rows {list(reply.row_ids)[:2]}, {shape}")
                return None
            return True, ""
        if reply.code == ErrorCode.BAD_REQUEST:
            return False, reply.message
        return None

    def _bad(self, expert: int, what: str) -> None:
        self.bad_replies += 1
        log.warning("expert %d: the null-label probe got %s: ignored (expert asked again later)", expert, what)
