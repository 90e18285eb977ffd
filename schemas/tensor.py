"""The msgpack tensor codec: `{"dtype": "<f4", "shape": [B, C, H, W], "data": <raw bytes>}`.

* `data` is the C-contiguous buffer, little-endian (or byte-order free for 1-byte types).
* Decoding is zero-copy (`np.frombuffer`) and the result is **read-only**: copy it
  before an in-place operation.
* Object dtypes, unknown dtypes, big-endian data, size mismatches and (optionally)
  non-finite values are refused with a `ProtocolError`; nothing is ever unpickled.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .errors import ErrorCode, ProtocolError, shown
from .limits import MAX_PAYLOAD_BYTES, MAX_TENSOR_NDIM

#: dtype strings accepted on the wire (numpy `dtype.str`).
ALLOWED_DTYPES: frozenset[str] = frozenset(
    {"<f2", "<f4", "<f8", "|i1", "<i2", "<i4", "<i8", "|u1", "<u2", "<u4", "<u8", "|b1"}
)
FLOAT_DTYPES: frozenset[str] = frozenset({"<f2", "<f4", "<f8"})
INT_DTYPES: frozenset[str] = frozenset({"|i1", "<i2", "<i4", "<i8", "|u1", "<u2", "<u4", "<u8"})

_KEYS = frozenset({"dtype", "shape", "data"})


def encode_tensor(array: Any) -> dict[str, Any]:
    """ndarray -> wire dict. Converts to C order and little-endian if needed."""
    a = np.asarray(array)
    if a.dtype.byteorder == ">" or (a.dtype.byteorder == "=" and not np.little_endian):
        a = a.astype(a.dtype.newbyteorder("<"))
    if a.dtype.str not in ALLOWED_DTYPES:
        raise ProtocolError(ErrorCode.BAD_DTYPE, f"dtype {a.dtype.str!r} cannot be sent; allowed: {sorted(ALLOWED_DTYPES)}")
    if a.ndim > MAX_TENSOR_NDIM:
        raise ProtocolError(ErrorCode.BAD_SHAPE, f"tensor rank {a.ndim} exceeds {MAX_TENSOR_NDIM}")
    # tobytes(order="C") copies non-contiguous views; np.ascontiguousarray would turn a 0-d array into [1].
    return {"dtype": a.dtype.str, "shape": [int(d) for d in a.shape], "data": a.tobytes(order="C")}


def decode_tensor(obj: Any, *, name: str = "tensor", finite: bool = False) -> np.ndarray:
    """Wire dict -> read-only ndarray view over the received bytes.

    Also accepts an ndarray (in-process construction); it is checked against the
    same dtype and rank rules but not copied.

    Raises `ProtocolError` with code bad_request / bad_dtype / bad_shape / too_large /
    non_finite; never returns a silently wrong array.
    """
    if isinstance(obj, np.ndarray):  # already decoded (in-process use)
        arr = _check_array(obj, name)
    else:
        arr = _decode_dict(obj, name)
    if finite and arr.dtype.kind == "f" and arr.size and not np.isfinite(arr).all():
        bad = int(arr.size - np.isfinite(arr).sum())
        raise ProtocolError(ErrorCode.NON_FINITE, f"{name} contains {bad} NaN/Inf value(s)")
    return arr


def _wire_dtype_str(dtype: np.dtype) -> str:
    """The wire string of a dtype, treating native byte order as what it is."""
    if dtype.byteorder == "=":
        return dtype.newbyteorder("<" if np.little_endian else ">").str
    return dtype.str


def _check_array(arr: np.ndarray, name: str) -> np.ndarray:
    """In-process arrays: same dtype/rank rules as the wire (big-endian is fine: encode swaps it)."""
    dt = arr.dtype
    wire = dt.newbyteorder("<").str if dt.byteorder == ">" else _wire_dtype_str(dt)
    if wire not in ALLOWED_DTYPES:
        raise ProtocolError(ErrorCode.BAD_DTYPE, f"{name} dtype {dt.str!r} cannot be sent; allowed: {sorted(ALLOWED_DTYPES)}")
    if arr.ndim > MAX_TENSOR_NDIM:
        raise ProtocolError(ErrorCode.BAD_SHAPE, f"{name} rank {arr.ndim} exceeds {MAX_TENSOR_NDIM}")
    return arr


def _decode_dict(obj: Any, name: str) -> np.ndarray:
    if not isinstance(obj, dict):
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"{name} must be a map {{dtype, shape, data}}, got {type(obj).__name__}")
    keys = set(obj)
    if keys != _KEYS:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"{name} must have exactly keys dtype, shape, data; got {sorted(map(shown, keys))}")
    dtype, shape, data = obj["dtype"], obj["shape"], obj["data"]
    if not isinstance(dtype, str) or dtype not in ALLOWED_DTYPES:
        raise ProtocolError(ErrorCode.BAD_DTYPE, f"{name} dtype {shown(dtype)} is not allowed; allowed: {sorted(ALLOWED_DTYPES)}")
    if not isinstance(shape, (list, tuple)) or len(shape) > MAX_TENSOR_NDIM:
        raise ProtocolError(ErrorCode.BAD_SHAPE, f"{name} shape must be a list of at most {MAX_TENSOR_NDIM} ints, got {shown(shape)}")
    for d in shape:
        if not isinstance(d, int) or isinstance(d, bool) or d < 0:
            raise ProtocolError(ErrorCode.BAD_SHAPE, f"{name} shape entries must be non-negative ints, got {shown(shape)}")
        if d > MAX_PAYLOAD_BYTES:
            raise ProtocolError(ErrorCode.TOO_LARGE, f"{name} shape {list(shape)} has a dimension over {MAX_PAYLOAD_BYTES}")
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"{name} data must be raw bytes (msgpack bin), got {type(data).__name__}")
    itemsize = np.dtype(dtype).itemsize
    n = math.prod(shape)
    # Zero dimensions count as 1 here: [0, 2**23, 2**23, 2**23] holds nothing, but numpy refuses
    # to build it ("array is too big"), and no real tensor has such a shape.
    if math.prod(max(d, 1) for d in shape) * itemsize > MAX_PAYLOAD_BYTES:
        raise ProtocolError(ErrorCode.TOO_LARGE, f"{name} of shape {list(shape)} needs {n * itemsize} bytes (non-zero "
                                                 f"dimensions: {math.prod(max(d, 1) for d in shape) * itemsize}), "
                                                 f"over the {MAX_PAYLOAD_BYTES}-byte limit")
    if isinstance(data, memoryview) and not data.c_contiguous:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"{name} data must be a contiguous buffer")
    nbytes = memoryview(data).nbytes
    if nbytes != n * itemsize:
        raise ProtocolError(
            ErrorCode.BAD_SHAPE,
            f"{name} data has {nbytes} bytes but shape {list(shape)} of {dtype} needs {n} x {itemsize} = {n * itemsize}",
        )
    raw = memoryview(data).cast("B") if isinstance(data, memoryview) else data
    if dtype == "|b1" and nbytes and np.frombuffer(raw, dtype=np.uint8).max() > 1:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"{name} is |b1 but holds bytes other than 0 and 1")
    arr = np.frombuffer(raw, dtype=np.dtype(dtype)).reshape(tuple(shape))
    arr.flags.writeable = False  # bytearray/memoryview input would otherwise give a writable view
    return arr
