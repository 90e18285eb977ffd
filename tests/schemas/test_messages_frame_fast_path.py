"""FrameEvent's fast path: `FrameEvent.trusted` (no validation) and `wire_dict` (used by `pack`)
must give exactly the bytes the validated model and pydantic's own dump give, for any frame the
coordinator can make; and what they pack must unpack to the same frame."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from schemas import ErrorCode, FrameEvent, ProtocolError, pack, unpack


def _frame_fields(rng: np.random.Generator, n: int, k: int, with_x1: bool, notes: int) -> dict:
    x = rng.normal(size=(n, 1, 4, 4)).astype(np.float16)
    w = rng.random((n, k)).astype(np.float32)
    return dict(
        job_id=f"job-{rng.integers(1e9)}",
        step=int(rng.integers(0, 40)),
        steps=40,
        t=float(rng.random()),
        x=x,
        experts=[int(e) for e in rng.integers(-1, k, size=n)],
        weights=w / w.sum(axis=1, keepdims=True),
        notes=[f"row {i}: note" for i in range(notes)],
        x1=(rng.normal(size=x.shape).astype(np.float16) if with_x1 else None),
    )


@pytest.mark.parametrize("seed", range(12))
def test_trusted_frames_pack_to_the_bytes_of_validated_ones(seed):
    rng = np.random.default_rng(seed)
    fields = _frame_fields(
        rng, n=int(rng.integers(1, 5)), k=int(rng.integers(1, 9)), with_x1=bool(seed % 2), notes=seed % 3
    )
    validated = FrameEvent(**fields)
    trusted = FrameEvent.trusted(**fields)
    slow = msgpack.packb(validated.model_dump(mode="python"), use_bin_type=True)  # pydantic's own dump
    assert validated.wire_dict().keys() == validated.model_dump(mode="python").keys()
    assert pack(validated) == slow and pack(trusted) == slow
    back = unpack(pack(trusted), FrameEvent)
    np.testing.assert_array_equal(back.x, fields["x"])
    np.testing.assert_array_equal(back.weights, fields["weights"])
    assert (back.step, back.steps, back.t, back.experts, back.notes) == (
        fields["step"],
        fields["steps"],
        fields["t"],
        fields["experts"],
        fields["notes"],
    )
    assert (back.x1 is None) == (fields["x1"] is None)


def test_fast_path_keeps_packs_errors():
    rng = np.random.default_rng(0)
    fields = _frame_fields(rng, n=1, k=2, with_x1=False, notes=0)
    bad = FrameEvent.trusted(**{**fields, "x": fields["x"].astype(np.complex64)})
    with pytest.raises(ProtocolError) as err:
        pack(bad)
    assert err.value.code == ErrorCode.BAD_DTYPE
    big = FrameEvent.trusted(**fields)
    with pytest.raises(ProtocolError) as err:
        pack(big, max_bytes=64)
    assert err.value.code == ErrorCode.TOO_LARGE
