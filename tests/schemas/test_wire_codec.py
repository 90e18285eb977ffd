"""The tensor codec and the msgpack layer: exact round trips, and every kind of bad
bytes refused with a ProtocolError carrying the right ErrorCode (never a crash, never a
silently wrong array)."""

from __future__ import annotations

import math

import msgpack
import numpy as np
import pytest

from schemas import ErrorCode, ProtocolError, StepRequest, pack, unpack
from schemas.limits import MAX_PAYLOAD_BYTES, MAX_TENSOR_NDIM
from schemas.tensor import ALLOWED_DTYPES, decode_tensor, encode_tensor
from schemas.wire import loads


def _code(fn, *args, **kw) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        fn(*args, **kw)
    err = info.value
    assert isinstance(err.code, ErrorCode)
    assert err.message and str(err) == err.message
    return err


def _wire(obj) -> dict:
    """What the receiver sees: the encoded dict after a msgpack round trip."""
    return msgpack.unpackb(msgpack.packb(obj, use_bin_type=True), raw=False)


# ---------------------------------------------------------------- round trips


@pytest.mark.parametrize("dtype", sorted(ALLOWED_DTYPES))
def test_every_allowed_dtype_round_trips_bit_for_bit(dtype):
    rng = np.random.default_rng(0)
    dt = np.dtype(dtype)
    if dt.kind == "b":
        a = rng.integers(0, 2, size=(3, 5)).astype(dt)
    elif dt.kind == "f":
        a = rng.standard_normal((3, 5)).astype(dt)
        a[0, 0] = np.nan  # the plain codec carries NaN/Inf exactly; FiniteTensor is stricter
        a[0, 1] = -np.inf
    else:
        info = np.iinfo(dt)
        a = rng.integers(info.min, info.max, size=(3, 5), dtype=dt, endpoint=True)
    enc = encode_tensor(a)
    assert enc["dtype"] == dtype and enc["shape"] == [3, 5] and isinstance(enc["data"], bytes)
    out = decode_tensor(_wire(enc))
    assert out.dtype == a.dtype and out.shape == a.shape
    assert out.tobytes() == a.tobytes()  # bit for bit, NaN payloads included


def test_decoded_array_is_a_read_only_view_over_the_message_bytes():
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    raw = msgpack.packb(encode_tensor(a), use_bin_type=True)
    wire = msgpack.unpackb(raw, raw=False)
    out = decode_tensor(wire)
    assert not out.flags.writeable
    assert out.base is not None  # a view, not a copy
    with pytest.raises(ValueError):
        out[0, 0] = 1.0
    # bytearray / memoryview input (in-process) is also handed back read-only
    for buf in (bytearray(a.tobytes()), memoryview(bytearray(a.tobytes()))):
        view = decode_tensor({"dtype": "<f4", "shape": [3, 4], "data": buf})
        assert not view.flags.writeable
        np.testing.assert_array_equal(view, a)


def test_big_endian_and_non_contiguous_arrays_are_normalised_on_encode():
    a = np.arange(24, dtype=">f8").reshape(2, 3, 4)
    enc = encode_tensor(a)
    assert enc["dtype"] == "<f8"
    np.testing.assert_array_equal(decode_tensor(_wire(enc)), a)
    b = np.arange(24, dtype=np.int32).reshape(4, 6).T  # Fortran order view
    out = decode_tensor(_wire(encode_tensor(b)))
    np.testing.assert_array_equal(out, b)
    assert out.flags.c_contiguous


def test_zero_sized_and_scalar_tensors_round_trip():
    for a in (np.zeros((0, 1, 32, 32), np.float32), np.float32(2.5), np.zeros((3, 0), np.int64)):
        out = decode_tensor(_wire(encode_tensor(a)))
        assert out.shape == np.shape(a) and out.dtype == np.asarray(a).dtype
        assert out.tobytes() == np.asarray(a).tobytes()


# ---------------------------------------------------------------- tensor map refused


@pytest.mark.parametrize(
    "dtype",
    [
        "|O",
        "O",
        ">f4",
        ">i8",
        ">u2",
        "=f4",
        "float32",
        "f4",
        "<c8",
        "<c16",
        "<M8[s]",
        "<m8[s]",
        "|V4",
        "<U3",
        "|S3",
        "<f16",
        "",
        4,
        None,
        b"<f4",
    ],
)
def test_object_unknown_big_endian_and_non_string_dtypes_are_bad_dtype(dtype):
    obj = {"dtype": dtype, "shape": [1], "data": b"\x00" * 4}
    err = _code(decode_tensor, obj, name="x_t")
    assert err.code is ErrorCode.BAD_DTYPE
    assert "x_t" in err.message and "allowed" in err.message


@pytest.mark.parametrize(
    "shape, data, why",
    [
        ([2, 2], b"\x00" * 15, "15 bytes"),  # one byte short
        ([2, 2], b"\x00" * 17, "17 bytes"),  # one byte long
        ([4], b"", "0 bytes"),
        ([0], b"\x00" * 4, "4 bytes"),
        ([], b"\x00" * 8, "8 bytes"),  # scalar needs exactly 4
    ],
)
def test_data_length_must_equal_prod_shape_times_itemsize(shape, data, why):
    err = _code(decode_tensor, {"dtype": "<f4", "shape": shape, "data": data}, name="t")
    assert err.code is ErrorCode.BAD_SHAPE
    assert why in err.message and "t " in err.message


@pytest.mark.parametrize(
    "shape",
    [[-1], [2, -3], [1.5], ["2"], [True], [None], [[2]], "22", 3, None, {"a": 1}, [1] * (MAX_TENSOR_NDIM + 1)],
)
def test_malformed_shapes_are_bad_shape(shape):
    err = _code(decode_tensor, {"dtype": "<f4", "shape": shape, "data": b"\x00" * 4})
    assert err.code is ErrorCode.BAD_SHAPE


@pytest.mark.parametrize(
    "shape",
    [
        [2**62, 2**62],
        [2**63],
        [2**64 - 1],
        [0, 2**63],
        [0, 2**64 - 1],
        [MAX_PAYLOAD_BYTES // 4 + 1],
        [4096, 4096, 4096],
    ],
)
def test_huge_claimed_shapes_are_too_large_without_allocating(shape):
    # Goes through real msgpack so the ints are what a peer can actually send.
    err = _code(decode_tensor, _wire({"dtype": "<f4", "shape": shape, "data": b""}))
    assert err.code is ErrorCode.TOO_LARGE


def test_tensor_map_keys_and_types_are_checked():
    ok = encode_tensor(np.zeros(2, np.float32))
    assert _code(decode_tensor, [ok["dtype"], ok["shape"], ok["data"]]).code is ErrorCode.BAD_REQUEST
    assert _code(decode_tensor, "tensor").code is ErrorCode.BAD_REQUEST
    assert _code(decode_tensor, {k: ok[k] for k in ("dtype", "shape")}).code is ErrorCode.BAD_REQUEST
    assert _code(decode_tensor, {**ok, "order": "C"}).code is ErrorCode.BAD_REQUEST
    err = _code(decode_tensor, {**ok, "data": "\x00" * 8})  # str, not bin
    assert err.code is ErrorCode.BAD_REQUEST and "raw bytes" in err.message
    assert _code(decode_tensor, {**ok, "data": [0] * 8}).code is ErrorCode.BAD_REQUEST


def test_bool_tensor_bytes_must_be_zero_or_one():
    assert decode_tensor({"dtype": "|b1", "shape": [3], "data": b"\x00\x01\x00"}).tolist() == [False, True, False]
    err = _code(decode_tensor, {"dtype": "|b1", "shape": [3], "data": b"\x00\x02\x00"})
    assert err.code is ErrorCode.BAD_REQUEST


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("dtype", ["<f2", "<f4", "<f8"])
def test_finite_flag_refuses_nan_and_inf(bad, dtype):
    a = np.zeros((2, 3), dtype)
    a[1, 2] = bad
    assert np.isnan(decode_tensor(_wire(encode_tensor(a)))[1, 2]) == np.isnan(bad)  # allowed when not finite
    err = _code(decode_tensor, _wire(encode_tensor(a)), name="x_t", finite=True)
    assert err.code is ErrorCode.NON_FINITE and "x_t" in err.message and "1 NaN/Inf" in err.message


def test_in_process_arrays_obey_the_same_dtype_rules():
    assert _code(decode_tensor, np.array([object()])).code is ErrorCode.BAD_DTYPE
    assert _code(decode_tensor, np.zeros(2, np.complex64)).code is ErrorCode.BAD_DTYPE
    assert _code(decode_tensor, np.zeros((1,) * 9, np.float32)).code is ErrorCode.BAD_SHAPE
    assert decode_tensor(np.zeros(2, ">f4")).dtype.str == ">f4"  # encode swaps it later
    assert _code(encode_tensor, np.array(["a"])).code is ErrorCode.BAD_DTYPE
    assert _code(encode_tensor, np.zeros((1,) * 9)).code is ErrorCode.BAD_SHAPE


# ---------------------------------------------------------------- msgpack layer


def _step_bytes(b: int = 2) -> bytes:
    return pack(
        StepRequest(
            expert=0, x_t=np.zeros((b, 1, 4, 4), np.float32), t=np.zeros(b, np.float32), y=np.zeros(b, np.int64)
        )
    )


def test_truncated_messages_are_bad_request_at_every_cut():
    raw = _step_bytes()
    for cut in range(0, len(raw)):
        err = _code(unpack, raw[:cut], StepRequest)
        assert err.code is ErrorCode.BAD_REQUEST, (cut, err)


@pytest.mark.parametrize(
    "raw",
    [b"", b"\xc1", b"\xc1\xff garbage", b"\xff" * 32, bytes(range(256)), b"\x81\xa1v", b"\xdf\xff\xff\xff\xff"],
)
def test_garbage_bytes_are_bad_request(raw):
    assert _code(unpack, raw, StepRequest).code is ErrorCode.BAD_REQUEST


def test_trailing_bytes_after_a_valid_message_are_refused():
    assert _code(unpack, _step_bytes() + b"\x00", StepRequest).code is ErrorCode.BAD_REQUEST


@pytest.mark.parametrize("top", [[1, 2], "text", 7, 1.5, None, True, b"bytes"])
def test_non_map_top_level_is_bad_request(top):
    err = _code(unpack, msgpack.packb(top, use_bin_type=True), StepRequest)
    assert err.code is ErrorCode.BAD_REQUEST and "map" in err.message


def test_non_bytes_input_is_bad_request():
    assert _code(unpack, "a string", StepRequest).code is ErrorCode.BAD_REQUEST
    assert _code(unpack, None, StepRequest).code is ErrorCode.BAD_REQUEST


@pytest.mark.parametrize("depth", [200, 5000, 200_000])
def test_deeply_nested_msgpack_is_refused_cleanly(depth):
    good = msgpack.unpackb(_step_bytes(), raw=False)
    nest = b"\x91" * depth + b"\x01"  # [[[...1...]]]
    raw = b"\x81\xa1v" + nest  # {"v": [[[...]]]}
    assert _code(unpack, raw, StepRequest).code is ErrorCode.BAD_REQUEST
    # the same nesting inside an otherwise valid message, in a field and as an extra field
    head = msgpack.packb(good, use_bin_type=True)
    for key in (b"\xa7row_ids", b"\xa5extra"):
        raw = bytes([head[0] + 1]) + head[1:] + key + nest  # fixmap count + 1, one more pair
        assert _code(unpack, raw, StepRequest).code is ErrorCode.BAD_REQUEST
    if depth > 1024:  # beyond msgpack's own stack limit even the raw decode refuses it
        assert _code(loads, b"\x91" * depth + b"\xc0").code is ErrorCode.BAD_REQUEST


@pytest.mark.parametrize("ext", [msgpack.ExtType(1, b"\x00"), msgpack.ExtType(127, b""), msgpack.Timestamp(1, 0)])
def test_msgpack_ext_types_including_timestamps_are_refused(ext):
    good = msgpack.unpackb(_step_bytes(), raw=False)
    for where in ("top", "field", "nested"):
        if where == "top":
            raw = msgpack.packb(ext)
        elif where == "field":
            raw = msgpack.packb({**good, "request_id": ext}, use_bin_type=True)
        else:
            raw = msgpack.packb({**good, "row_ids": ["a", ext]}, use_bin_type=True)
        err = _code(unpack, raw, StepRequest)
        assert err.code is ErrorCode.BAD_REQUEST and "extension type" in err.message, (where, err)


def test_non_string_map_keys_are_refused():
    raw = msgpack.packb({1: 2, "v": 1}, use_bin_type=True)
    assert _code(unpack, raw, StepRequest).code is ErrorCode.BAD_REQUEST


def test_oversize_payload_on_unpack_is_too_large_before_decoding():
    raw = b"\x00" * (MAX_PAYLOAD_BYTES + 1)  # not even valid msgpack: the size check comes first
    err = _code(unpack, raw, StepRequest)
    assert err.code is ErrorCode.TOO_LARGE and str(MAX_PAYLOAD_BYTES) in err.message
    assert _code(unpack, _step_bytes(), StepRequest, max_bytes=100).code is ErrorCode.TOO_LARGE


def test_oversize_payload_on_pack_is_too_large():
    msg = StepRequest(
        expert=0, x_t=np.zeros((2, 1, 32, 32), np.float32), t=np.zeros(2, np.float32), y=np.zeros(2, np.int64)
    )
    assert len(pack(msg)) > 8192
    err = _code(pack, msg, max_bytes=8192)
    assert err.code is ErrorCode.TOO_LARGE and "StepRequest" in err.message
    # a real 8 MiB + 64 KiB batch: the batch is within MAX_STEP_ROWS but the bytes are over MAX_PAYLOAD_BYTES
    n = math.ceil(MAX_PAYLOAD_BYTES / (4 * 128 * 128)) + 1
    big = StepRequest(
        expert=0, x_t=np.zeros((n, 1, 128, 128), np.float32), t=np.zeros(n, np.float32), y=np.zeros(n, np.int64)
    )
    assert _code(pack, big).code is ErrorCode.TOO_LARGE


def _full_checks(obj, name="tensor"):
    """`decode_tensor` with the exact-type fast path turned off: every check written out."""
    import schemas.tensor as tensor

    saved = tensor._decode_plain
    tensor._decode_plain = lambda obj: None
    try:
        return decode_tensor(obj, name=name)
    finally:
        tensor._decode_plain = saved


@pytest.mark.parametrize("seed", range(40))
def test_the_fast_path_decodes_what_the_full_checks_decode(seed):
    """Random valid tensors of every fast dtype and rank: the fast path takes them (it is used),
    and gives the full path's array: dtype, shape, bytes and read-only."""
    from schemas.tensor import _decode_plain

    rng = np.random.default_rng(seed)
    dtype = sorted(ALLOWED_DTYPES - {"|b1"})[seed % 11]
    shape = [int(d) for d in rng.integers(1, 5, size=int(rng.integers(0, MAX_TENSOR_NDIM + 1)))]
    a = (rng.standard_normal(shape) * 100).astype(dtype)
    wire = _wire(encode_tensor(a))
    fast, full = _decode_plain(wire), _full_checks(wire)
    assert fast is not None, (dtype, shape)
    assert fast.dtype == full.dtype == np.dtype(dtype) and fast.shape == full.shape == tuple(shape)
    assert fast.tobytes() == full.tobytes() == a.tobytes()
    assert not fast.flags.writeable and not decode_tensor(wire).flags.writeable


@pytest.mark.parametrize(
    "obj",
    [
        {"dtype": "<f4", "shape": [0, 3], "data": b""},  # zero dimension: the max(d, 1) size rule
        {"dtype": "<f4", "shape": [True, 2], "data": b"\0" * 8},  # a bool is not a dimension
        {"dtype": "<f4", "shape": [-1], "data": b""},
        {"dtype": "<f4", "shape": (2,), "data": b"\0" * 8},  # a tuple (in-process), not the wire's list
        {"dtype": "<f4", "shape": [2], "data": bytearray(8)},  # not bytes: the full path makes the view read-only
        {"dtype": "<f4", "shape": [2], "data": memoryview(b"\0" * 8)},
        {"dtype": "<f4", "shape": [2], "data": b"\0" * 7},
        {"dtype": "|b1", "shape": [2], "data": b"\0\2"},  # bool bytes are checked for 0 / 1
        {"dtype": "bfloat16", "shape": [2], "data": b"\0" * 4},  # widened: the one decode that copies
        {"dtype": ">f4", "shape": [2], "data": b"\0" * 8},
        {"dtype": "<f4", "shape": [2], "data": b"\0" * 8, "extra": 1},
        {"dtype": "<f4", "shape": [2], "date": b"\0" * 8},
        {"dtype": "<f4", "shape": [1] * (MAX_TENSOR_NDIM + 1), "data": b"\0" * 4},
    ],
)
def test_the_fast_path_leaves_every_other_tensor_to_the_full_checks(obj):
    """What the fast path does not take it leaves whole to the full checks: the same array or the
    same error as before it existed."""
    from schemas.tensor import _decode_plain

    assert _decode_plain(obj) is None
    try:
        expected = _full_checks(obj)
    except ProtocolError as err:
        got = _code(decode_tensor, obj)
        assert (got.code, got.message) == (err.code, err.message)
    else:
        arr = decode_tensor(obj)
        assert arr.dtype == expected.dtype and arr.shape == expected.shape and arr.tobytes() == expected.tobytes()
        assert not arr.flags.writeable
