"""Unconditional rows on the wire: a `job_request` digit of -1 (label unknown) and a `step_request`
y of -1, their refusals (oracle, other negatives), and backward compatibility with old requests."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from schemas import UNCONDITIONAL, ErrorCode, JobRequest, ProtocolError, StepRequest, pack, unpack


def _wire(**fields) -> bytes:
    return msgpack.packb({"v": 1, "kind": "job_request", **fields}, use_bin_type=True)


def _refused(data: bytes, cls, code: ErrorCode, *words: str) -> str:
    with pytest.raises(ProtocolError) as err:
        unpack(data, cls)
    assert err.value.code == code, err.value.message
    for w in words:
        assert w in err.value.message, err.value.message
    return err.value.message


def test_unconditional_is_minus_one():
    assert UNCONDITIONAL == -1


def test_job_request_with_unknown_labels_round_trips():
    req = JobRequest(digits=[-1, 3, -1], seed=4, strategy="full")
    back = unpack(pack(req), JobRequest)
    assert back.digits == [-1, 3, -1] and back.strategy == "full" and back.seed == 4
    assert back.n_images == 3 and back.n_unconditional == 2
    assert JobRequest(digits=[3]).n_unconditional == 0 and JobRequest(count=5).n_unconditional == 0
    for strategy in ("top1", "topk", "full"):
        assert unpack(_wire(digits=[-1] * 4, strategy=strategy), JobRequest).n_unconditional == 4


def test_oracle_with_an_unknown_label_is_refused_clearly():
    msg = _refused(
        _wire(digits=[2, -1, 5], strategy="oracle"),
        JobRequest,
        ErrorCode.BAD_REQUEST,
        "oracle",
        "label unknown",
        "row 1",
        "top1",
    )
    assert "1 of 3" in msg
    with pytest.raises(ValueError, match="oracle"):  # the in-process constructor refuses it too
        JobRequest(digits=[-1], strategy="oracle")
    assert unpack(_wire(digits=[2, 5], strategy="oracle"), JobRequest).digits == [2, 5]  # known labels: as before


@pytest.mark.parametrize("bad", [-2, -100, 10])
def test_other_labels_outside_0_9_are_still_refused(bad):
    _refused(_wire(digits=[3, bad]), JobRequest, ErrorCode.BAD_REQUEST, "digits")


def test_an_old_style_request_parses_and_packs_as_before():
    old = {"v": 1, "kind": "job_request", "digits": [3, 7], "steps": 20, "strategy": "topk", "top_k": 2, "seed": 9}
    req = unpack(msgpack.packb(old, use_bin_type=True), JobRequest)
    assert (req.digits, req.steps, req.strategy, req.seed, req.n_unconditional) == ([3, 7], 20, "topk", 9, 0)
    # no new key travels: what a client sends is readable by a coordinator that predates -1 digits
    keys = set(msgpack.unpackb(pack(req), raw=False))
    assert keys == {
        "v",
        "kind",
        "job_id",
        "digits",
        "count",
        "steps",
        "solver",
        "strategy",
        "top_k",
        "seed",
        "stream",
        "frame_every",
        "deadline_s",
        "session",
    }
    assert unpack(_wire(count=3), JobRequest).count == 3


def test_step_request_carries_minus_one_labels():
    req = StepRequest(
        expert=0,
        x_t=np.zeros((2, 1, 32, 32), np.float32),
        t=np.array([0.0, 0.5], np.float32),
        y=np.array([UNCONDITIONAL, 4], np.int64),
    )
    back = unpack(pack(req), StepRequest)
    assert back.y.tolist() == [-1, 4]  # the schema only checks dtype / shape; the worker checks the range
