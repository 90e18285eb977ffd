"""Classifier-free guidance on the wire: `job_request.guidance_scale` (left out when unset: the fleet's
default, so v1 clients' bytes do not change; an explicit 1 turns it off), `step_request.guidance` (a per-row
float tensor, left out when absent) and `job_status.guidance_scale` (only when a job asked for one); bad values
are refused saying why."""

from __future__ import annotations

import math

import msgpack
import numpy as np
import pytest

from schemas import ErrorCode, JobRequest, JobStatus, StepRequest, loads, pack, unpack
from tests.schemas.test_messages_unconditional import _refused


def _wire(kind: str = "job_request", **fields) -> bytes:
    return msgpack.packb({"v": 1, "kind": kind, **fields}, use_bin_type=True)


def test_unset_packs_as_before_an_explicit_one_is_kept_and_other_scales_round_trip():
    plain = JobRequest(digits=[3, -1], seed=4, steps=5)
    assert plain.guidance_scale is None and plain.guidance == 1.0 and plain.n_guided == 0
    assert "guidance_scale" not in loads(pack(plain))
    # the bytes a v1 client sends, with no guidance_scale key, are exactly what the model packs
    v1 = unpack(_wire(digits=[3], seed=1, steps=2), JobRequest)
    assert v1.guidance_scale is None and v1.n_guided == 0
    assert pack(v1) == pack(JobRequest(digits=[3], seed=1, steps=2))
    # 1 asked for: off even where the fleet's default guides, so it stays on the wire
    off = JobRequest(digits=[3, -1], seed=4, steps=5, guidance_scale=1.0)
    assert loads(pack(off))["guidance_scale"] == 1.0 and unpack(pack(off), JobRequest).guidance_scale == 1.0
    assert off.guidance == 1.0 and off.n_guided == 0
    guided = JobRequest(digits=[3, -1, 7], seed=4, guidance_scale=2.5)
    assert loads(pack(guided))["guidance_scale"] == 2.5
    back = unpack(pack(guided), JobRequest)
    assert back.guidance_scale == 2.5 and back.n_guided == 2  # the -1 row is never doubled
    assert unpack(_wire(digits=[1], guidance_scale=3), JobRequest).guidance_scale == 3.0  # an int is a float
    assert JobRequest(count=4, guidance_scale=0.0).n_guided == 4  # s = 0: the unconditional velocity, still paired


@pytest.mark.parametrize("bad", [-0.5, 20.5, 1e9, math.inf, -math.inf, math.nan])
def test_bad_scales_are_refused_clearly(bad):
    data = _wire(digits=[1], guidance_scale=bad)
    msg = _refused(data, JobRequest, ErrorCode.BAD_REQUEST, "guidance_scale", "[0, 20]")
    assert "1 = no guidance" in msg
    with pytest.raises(ValueError, match="guidance_scale"):
        JobRequest(digits=[1], guidance_scale=bad)


@pytest.mark.parametrize("bad", ["2", True, None, [2.0]])
def test_a_scale_of_another_type_is_refused(bad):
    _refused(_wire(digits=[1], guidance_scale=bad), JobRequest, ErrorCode.BAD_REQUEST, "guidance_scale")


def _step(**extra) -> StepRequest:
    return StepRequest(
        expert=0,
        x_t=np.zeros((3, 1, 4, 4), np.float32),
        t=np.full(3, 0.5, np.float32),
        y=np.array([1, -1, 2], np.int64),
        **extra,
    )


def test_step_guidance_is_left_out_unless_given_and_round_trips():
    assert "guidance" not in loads(pack(_step()))
    s = np.array([2.0, 2.0, 1.0], np.float32)
    data = pack(_step(guidance=s))
    assert set(loads(data)["guidance"]) == {"dtype", "shape", "data"}  # the tensor codec
    back = unpack(data, StepRequest)
    np.testing.assert_array_equal(back.guidance, s)
    assert back.guidance.dtype == np.float32


def test_bad_step_guidance_is_refused():
    x = np.zeros((2, 1, 4, 4), np.float32)
    base = dict(expert=0, x_t=x, t=np.zeros(2, np.float32), y=np.zeros(2, np.int64))

    def wire(g) -> bytes:
        return pack(StepRequest.model_construct(**base, guidance=g))

    _refused(wire(np.ones(3, np.float32)), StepRequest, ErrorCode.BAD_SHAPE, "guidance", "[B] = [2]")
    _refused(wire(np.ones(2, np.int64)), StepRequest, ErrorCode.BAD_DTYPE, "guidance")
    _refused(wire(np.array([1.0, np.nan], np.float32)), StepRequest, ErrorCode.NON_FINITE)
    _refused(wire(np.array([1.0, 21.0], np.float32)), StepRequest, ErrorCode.BAD_REQUEST, "[0, 20]")


def test_job_status_says_the_scale_only_when_given():
    plain = JobStatus(job_id="a", state="running", step=1, steps=4)
    assert "guidance_scale" not in loads(pack(plain))
    guided = JobStatus(job_id="a", state="running", step=1, steps=4, guidance_scale=3.0)
    assert unpack(pack(guided), JobStatus).guidance_scale == 3.0
