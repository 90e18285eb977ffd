"""Property-based tests of the wire codec (hypothesis).

* any allowed dtype and shape round-trips bit for bit;
* any byte string given to `unpack` either validates or raises ProtocolError, nothing else;
* mutating an encoded message never yields an array whose size disagrees with its shape
  (or whose bytes disagree with what was on the wire).
"""

from __future__ import annotations

import math

import msgpack
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from schemas import (
    ErrorCode,
    ErrorReply,
    JobEvent,
    JobRequest,
    ProtocolError,
    StepRequest,
    StepResult,
    SubmitReply,
    pack,
    unpack,
)
from schemas.tensor import ALLOWED_DTYPES, decode_tensor, encode_tensor

FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TARGETS = [StepRequest, StepResult, JobRequest, JobEvent, SubmitReply, ErrorReply]


def _arrays(dtype: str):
    shapes = hnp.array_shapes(min_dims=0, max_dims=5, min_side=0, max_side=6)
    return hnp.arrays(np.dtype(dtype), shapes)  # all bit patterns: NaN payloads, -0.0, extremes


@FUZZ
@given(st.sampled_from(sorted(ALLOWED_DTYPES)).flatmap(_arrays))
def test_any_allowed_array_round_trips_exactly(a):
    raw = msgpack.packb(encode_tensor(a), use_bin_type=True)
    out = decode_tensor(msgpack.unpackb(raw, raw=False))
    assert out.dtype == a.dtype and out.shape == a.shape
    assert out.tobytes() == a.tobytes()
    assert not out.flags.writeable


@FUZZ
@given(st.sampled_from(sorted(ALLOWED_DTYPES)).flatmap(_arrays), st.sampled_from(["C", "F"]), st.booleans())
def test_any_layout_and_byte_order_encodes_to_little_endian_c_order(a, order, swap):
    src = np.asarray(a, order=order)
    if swap and src.dtype.itemsize > 1:
        src = src.astype(src.dtype.newbyteorder(">"))
    enc = encode_tensor(src)
    assert enc["dtype"] in ALLOWED_DTYPES and enc["shape"] == list(a.shape)
    assert enc["data"] == a.tobytes(order="C")


def _unpack_or_protocol_error(raw: bytes, tp) -> object | None:
    """The property: unpack validates, or raises ProtocolError; any other exception fails the test."""
    try:
        return unpack(raw, tp)
    except ProtocolError as err:
        assert isinstance(err.code, ErrorCode) and err.message
        return None


@FUZZ
@given(st.binary(max_size=512), st.sampled_from(TARGETS))
def test_arbitrary_bytes_validate_or_raise_protocol_error(raw, tp):
    _unpack_or_protocol_error(raw, tp)


_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(allow_nan=True),
    st.text(max_size=8),
    st.binary(max_size=16),
    st.sampled_from(["<f4", "<i8", "|b1", "step_request", "frame", "error", "bad_request", "v", "kind"]),
)
_values = st.recursive(
    _scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=4)),
    max_leaves=20,
)


@FUZZ
@given(
    st.dictionaries(
        st.sampled_from(
            [
                "v",
                "kind",
                "expert",
                "x_t",
                "t",
                "y",
                "row_ids",
                "job_id",
                "code",
                "message",
                "digits",
                "count",
                "dtype",
                "shape",
                "data",
                "other",
            ]
        ),
        _values,
        max_size=8,
    ),
    st.sampled_from(TARGETS),
)
def test_arbitrary_msgpack_maps_validate_or_raise_protocol_error(obj, tp):
    obj.setdefault("v", 1)
    _unpack_or_protocol_error(msgpack.packb(obj, use_bin_type=True), tp)


def _encoded_step_request(b: int, h: int, dtype: str) -> bytes:
    rng = np.random.default_rng(b * 100 + h)
    return pack(
        StepRequest(
            expert=0,
            x_t=rng.standard_normal((b, 1, h, h)).astype(dtype),
            t=rng.random(b).astype(np.float32),
            y=rng.integers(0, 10, b),
            row_ids=[f"r{i}" for i in range(b)],
        )
    )


def _arrays_in(msg) -> list[np.ndarray]:
    return [getattr(msg, n) for n in type(msg).model_fields if isinstance(getattr(msg, n), np.ndarray)]


def _check_arrays_honest(msg, raw: bytes) -> None:
    """Every array agrees with its own shape and with the bytes that were on the wire."""
    wire = msgpack.unpackb(raw, raw=False)
    for name in type(msg).model_fields:
        a = getattr(msg, name)
        if not isinstance(a, np.ndarray):
            continue
        spec = wire[name]
        assert a.size == math.prod(a.shape)
        assert a.dtype.str == spec["dtype"] and list(a.shape) == spec["shape"]
        assert a.nbytes == len(spec["data"]) and a.tobytes() == spec["data"]
        assert not a.flags.writeable


@FUZZ
@given(st.integers(1, 4), st.sampled_from([2, 4]), st.sampled_from(["<f4", "<f2", "<f8"]), st.data())
def test_mutated_messages_never_yield_a_dishonest_array(b, h, dtype, data):
    raw = bytearray(_encoded_step_request(b, h, dtype))
    edits = data.draw(st.lists(st.tuples(st.integers(0, len(raw) - 1), st.integers(0, 255)), min_size=1, max_size=6))
    for pos, byte in edits:
        raw[pos] = byte
    cut = len(raw) - data.draw(st.sampled_from([0, 0, 0, 1, 3, 8]))
    mutated = bytes(raw[:cut])
    msg = _unpack_or_protocol_error(mutated, StepRequest)
    if msg is not None:
        _check_arrays_honest(msg, mutated)
        x = msg.x_t
        assert x.ndim == 4 and msg.t.shape == (x.shape[0],) and msg.y.shape == (x.shape[0],)
        assert np.isfinite(x).all() and ((msg.t >= 0) & (msg.t <= 1)).all()


def _factor_list(n: int) -> list[int]:
    """Prime factors of n ([n] for n < 2)."""
    out, p = [], 2
    while n > 1 and p * p <= n:
        while n % p == 0:
            out.append(p)
            n //= p
        p += 1
    return out + ([n] if n > 1 or not out else [])


@FUZZ
@given(st.integers(1, 3), st.data())
def test_mutated_shape_and_dtype_fields_never_yield_a_dishonest_array(b, data):
    good = msgpack.unpackb(_encoded_step_request(b, 2, "<f4"), raw=False)
    field = data.draw(st.sampled_from(["x_t", "t", "y"]))
    spec = dict(good[field])
    n_bytes = len(spec["data"])
    spec["dtype"] = data.draw(st.sampled_from(sorted(ALLOWED_DTYPES) + [">f4", "|O", "<c8"]))
    itemsize = np.dtype(spec["dtype"]).itemsize
    # either any shape at all, or a reshuffle whose size matches the bytes (gets past the codec)
    fitting = st.permutations(_factor_list(n_bytes // itemsize) + [1] * data.draw(st.integers(0, 2)))
    spec["shape"] = data.draw(st.one_of(st.lists(st.integers(-2, 40), max_size=6), fitting))
    raw = msgpack.packb({**good, field: spec}, use_bin_type=True)
    msg = _unpack_or_protocol_error(raw, StepRequest)
    if msg is not None:
        _check_arrays_honest(msg, raw)
