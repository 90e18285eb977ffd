"""How an expert worker encodes its answers: a velocity as a `StepReply`, a refusal as an `ErrorReply`.

The forward's velocities become the request's (guided rows folded with their null-label twins, in
float32) and are cast to the precision the request asked for (`StepRequest.reply_dtype`; a velocity
that does not fit float16 is `non_finite`). NaN / Inf from the model is `non_finite` when the input
was absurd (|x_t| over `SANE_ABS_X`: the request's fault, a retry elsewhere would get the same) and
`internal` otherwise. An error reply also carries the micro `Nats-Service-Error(-Code)` headers.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from flow.guidance import fold_twins
from schemas import ErrorCode, ErrorReply, ProtocolError, StepReply, StepRequest, pack
from schemas.tensor import to_wire_dtype

#: |x_t| above this is no diffusion sample (x_t = (1 - t) * noise + t * data stays within a few
#: units). A NaN/Inf velocity for such an input is answered `non_finite` (the request's fault),
#: not `internal`. Finite inputs up to ~1e19 are computed as usual; past that float32 overflows.
SANE_ABS_X = 1e4


def reply_velocity(v: np.ndarray, step: StepRequest, twins: np.ndarray, x_t: np.ndarray | None = None) -> np.ndarray:
    """The forward's velocities [B + G, C, H, W] -> the request's [B, C, H, W] in its wire dtype: NaN / Inf
    refused (`non_finite` when `x_t`, the request's input, is over `SANE_ABS_X`; else `internal`), guided
    rows combined with their twins (`guided`), then cast (float16 overflow: `non_finite`, saying so)."""
    if not np.isfinite(v).all():
        peak = float(np.abs(x_t).max()) if x_t is not None and x_t.size else 0.0
        if peak > SANE_ABS_X:
            raise ProtocolError(
                ErrorCode.NON_FINITE,
                f"the model's velocity is NaN/Inf for x_t values up to {peak:.3g} (float32 "
                f"overflow); a sample x_t stays within a few units of 0",
            )
        raise ProtocolError(ErrorCode.INTERNAL, "the model produced NaN/Inf velocities for this request")
    return to_wire_dtype(guided(v, step, twins), step.reply_dtype, name="velocity")


def guided(v: np.ndarray, step: StepRequest, twins: np.ndarray) -> np.ndarray:
    """The forward's velocities [B + G, C, H, W] -> the request's [B, C, H, W]: guided rows combined with
    their twins (`flow.guidance.fold_twins`), every other row as the model gave it. NaN/Inf (an overflow
    of the combination) is refused as the model's would be."""
    if not len(twins):
        return v
    out = fold_twins(v, twins, step.guidance)
    if not np.isfinite(out).all():
        raise ProtocolError(ErrorCode.INTERNAL, "the guided velocity overflowed (NaN/Inf) for this request")
    return out


def step_reply(
    step: StepRequest, velocity: np.ndarray, result: Any, *, expert: int, backend: Any, worker_id: str, ahead_index: int
) -> bytes:
    """The packed StepReply of `velocity` (already in the wire dtype) computed in `result`'s pass
    (`workers.batcher`: its compute time and bucket) by `backend` on worker `worker_id`."""
    return pack(
        StepReply(
            expert=expert,
            velocity=velocity,
            row_ids=list(step.row_ids),
            backend=backend.name,
            device=str(backend.device),
            worker_id=worker_id,
            compute_ms=round(result.info.compute_s * 1000.0, 3),
            batch_rows=result.info.bucket,
            ahead_index=ahead_index,
        )
    )


def error_reply(code: ErrorCode, message: str, request_id: str | None) -> tuple[bytes, dict[str, str]]:
    """(the packed ErrorReply, the micro error headers) of a refusal."""
    try:
        data = pack(ErrorReply(code=code, message=message, request_id=request_id))
    except Exception:  # e.g. a request_id that is not a valid Id
        data = pack(ErrorReply(code=code, message=message))
    headers = {
        "Nats-Service-Error": message[:512].replace("\r", " ").replace("\n", " "),
        "Nats-Service-Error-Code": code.value,
    }
    return data, headers
