"""Reduced-precision tensors on the expert wire: float16 / bfloat16 codec, `StepRequest.reply_dtype`,
zero-copy decoding, and clear errors for values a narrow type cannot hold."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from schemas import ErrorCode, ProtocolError, StepReply, StepRequest, decode_tensor, encode_tensor, pack, unpack
from schemas.tensor import (
    BFLOAT16,
    FLOAT16_MAX,
    BFloat16Array,
    bfloat16_bits,
    bfloat16_to_float32,
    to_wire_dtype,
    widen_float32,
)


def _request(x, **kw) -> StepRequest:
    b = len(x)
    return StepRequest(expert=0, x_t=x, t=np.full(b, 0.5, np.float32), y=np.zeros(b, np.int64), **kw)


def _x(b=3, seed=0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((b, 1, 4, 4)).astype(np.float32)


def test_float16_roundtrip_is_a_read_only_view_within_half_precision():
    x = _x()
    wire = msgpack.unpackb(pack(_request(to_wire_dtype(x, "float16"), reply_dtype="float16")), raw=False)
    assert wire["x_t"]["dtype"] == "<f2" and len(wire["x_t"]["data"]) == x.size * 2
    back = unpack(pack(_request(to_wire_dtype(x, "float16"))), StepRequest).x_t
    assert back.dtype == np.float16 and not back.flags.writeable
    np.testing.assert_allclose(back.astype(np.float32), x, rtol=2**-11, atol=1e-7)


def test_bfloat16_roundtrip_widens_to_float32_with_8_bit_mantissa():
    x = _x()
    msg = _request(to_wire_dtype(x, "bfloat16"), reply_dtype="bfloat16")
    wire = msgpack.unpackb(pack(msg), raw=False)
    assert wire["x_t"]["dtype"] == BFLOAT16 and len(wire["x_t"]["data"]) == x.size * 2
    assert wire["reply_dtype"] == "bfloat16"
    back = unpack(pack(msg), StepRequest)
    assert back.x_t.dtype == np.float32 and not back.x_t.flags.writeable and back.reply_dtype == "bfloat16"
    np.testing.assert_allclose(back.x_t, x, rtol=2**-8)


def test_bfloat16_rounds_to_nearest_even_and_keeps_nan_and_inf():
    one_plus_half_ulp = np.array([0x3F808000, 0x3F818000, 0x3F808001], np.uint32).view(np.float32)
    # 1 + 2^-8 is a tie: rounds to even (1.0); 1 + 3*2^-8 ties up to 1 + 2^-6; just over a tie rounds up
    assert list(bfloat16_bits(one_plus_half_ulp)) == [0x3F80, 0x3F82, 0x3F81]
    special = np.array([np.nan, np.inf, -np.inf, -0.0], np.float32)
    back = bfloat16_to_float32(bfloat16_bits(special))
    assert np.isnan(back[0]) and back[1] == np.inf and back[2] == -np.inf and np.signbit(back[3])
    nan_all_ones = np.array([0x7FFFFFFF], np.uint32).view(np.float32)  # would carry into the sign if rounded
    assert np.isnan(bfloat16_to_float32(bfloat16_bits(nan_all_ones)))[0]


def test_float32_default_is_unchanged_on_the_wire():
    """No reply_dtype key unless asked (older workers refuse unknown keys); x_t stays <f4, bit for bit."""
    x = _x()
    wire = msgpack.unpackb(pack(_request(x)), raw=False)
    assert "reply_dtype" not in wire
    assert wire["x_t"]["dtype"] == "<f4" and wire["x_t"]["data"] == x.tobytes()
    assert to_wire_dtype(x, None) is x and to_wire_dtype(x, "float32") is x
    assert unpack(pack(_request(x)), StepRequest).reply_dtype is None


def test_an_unknown_reply_dtype_is_a_clear_bad_request():
    wire = msgpack.unpackb(pack(_request(_x(), reply_dtype="float16")), raw=False)
    wire["reply_dtype"] = "float8"
    with pytest.raises(ProtocolError) as err:
        unpack(msgpack.packb(wire, use_bin_type=True), StepRequest)
    assert "reply_dtype" in err.value.message and "float16" in err.value.message


def test_float16_overflow_is_a_clear_non_finite_error():
    v = _x()
    v[1, 0, 2, 3] = -1.5e5
    with pytest.raises(ProtocolError) as err:
        to_wire_dtype(v, "float16", name="velocity")
    assert err.value.code == ErrorCode.NON_FINITE
    assert "velocity overflows float16" in err.value.message and "150000" in err.value.message
    assert to_wire_dtype(np.full((1, 1, 1, 1), FLOAT16_MAX, np.float32), "float16")[0, 0, 0, 0] == FLOAT16_MAX
    assert to_wire_dtype(v, "bfloat16").dtype == np.float32  # bfloat16 has float32's range
    with pytest.raises(ProtocolError) as err:
        to_wire_dtype(np.full((1, 1, 1, 1), np.finfo(np.float32).max, np.float32), "bfloat16", name="velocity")
    assert err.value.code == ErrorCode.NON_FINITE and "overflows bfloat16" in err.value.message


def test_a_float16_reply_with_inf_is_refused_as_non_finite():
    v = np.ones((2, 1, 2, 2), np.float16)
    v[0, 0, 1, 1] = np.inf
    v[1, 0, 0, 0] = np.nan
    data = pack(StepReply(expert=0, velocity=np.ones((2, 1, 2, 2), np.float16)))
    wire = msgpack.unpackb(data, raw=False)
    wire["velocity"]["data"] = v.tobytes()
    with pytest.raises(ProtocolError) as err:
        unpack(msgpack.packb(wire, use_bin_type=True), StepReply)
    assert err.value.code == ErrorCode.NON_FINITE and "2 NaN/Inf" in err.value.message


def test_decoding_does_not_copy_the_tensor_bytes():
    x = _x()
    for spec in (encode_tensor(x), encode_tensor(x.astype(np.float16))):
        data = bytearray(spec["data"])
        arr = decode_tensor({**spec, "data": data})
        assert np.shares_memory(arr, np.frombuffer(data, np.uint8)) and not arr.flags.writeable
    assert widen_float32(x) is x  # float32 stays the same array
    half = x.astype(np.float16)
    np.testing.assert_array_equal(widen_float32(half), half.astype(np.float32))


def test_a_bfloat16_array_is_a_float32_array_that_only_encodes_narrower():
    x = _x()
    b = to_wire_dtype(x, "bfloat16")
    assert isinstance(b, BFloat16Array) and b.dtype == np.float32 and np.shares_memory(b, x)
    assert encode_tensor(b)["dtype"] == BFLOAT16 and encode_tensor(x)["dtype"] == "<f4"
    with pytest.raises(ProtocolError) as err:
        decode_tensor({"dtype": BFLOAT16, "shape": [3], "data": b"\0" * 4})
    assert err.value.code == ErrorCode.BAD_SHAPE  # 2 bytes per value


def test_frame_float16_is_numpys_clip_and_cast_bit_for_bit():
    """A frame's float16 x: the torch (F16C) path gives numpy's clip-then-cast bits on every kind of
    value (rounding ties, float16 subnormals and underflow, the clip limit, Inf, -0.0), and NaN stays
    NaN; inputs torch does not take (float64, non-contiguous) go numpy's way."""
    import sys

    import torch  # the coordinator has it loaded: the fast path

    from schemas.tensor import FRAME_FLOAT16_LIMIT, frame_float16

    assert "torch" in sys.modules
    rng = np.random.default_rng(5)
    parts = [rng.standard_normal(4096) * s for s in (1e-8, 1e-6, 1e-4, 1.0, 1e2, 1e4, 1e5)]
    ties = np.arange(1, 2049, dtype=np.float32) + 0.5  # halfway between float16 integers above 2048
    special = np.array(
        [0.0, -0.0, 65504.0, 65520.0, 6e4, -6e4, 59999.99, np.inf, -np.inf, 5.96e-8, 2.98e-8, -2.98e-8, 6.1e-5, 1e-45],
        np.float32,
    )
    a = np.concatenate([*parts, ties + 2048, special]).astype(np.float32).reshape(-1, 1, 2, 1)
    want = np.clip(a, -FRAME_FLOAT16_LIMIT, FRAME_FLOAT16_LIMIT).astype(np.float16)
    got = frame_float16(a)
    assert got.dtype == np.float16 and got.shape == a.shape
    assert np.array_equal(got.view(np.uint16), want.view(np.uint16))
    assert np.isfinite(got).all() and np.abs(got).max() <= FRAME_FLOAT16_LIMIT
    with_nan = a.copy()
    with_nan.flat[::97] = np.nan
    out = frame_float16(with_nan)
    assert np.array_equal(np.isnan(out), np.isnan(with_nan))
    assert np.array_equal(out[~np.isnan(out)].view(np.uint16), want[~np.isnan(with_nan)].view(np.uint16))
    # the cast runs on one torch thread (an OpenMP team would spin beside the router) and leaves this
    # thread's setting as it found it
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert np.array_equal(frame_float16(a).view(np.uint16), want.view(np.uint16))
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    for other in (a.astype(np.float64), a[::2]):
        assert np.array_equal(
            frame_float16(other).view(np.uint16), np.clip(other, -6e4, 6e4).astype(np.float16).view(np.uint16)
        )
