"""The msgpack tensor codec: `{"dtype": "<f4", "shape": [B, C, H, W], "data": <raw bytes>}`.

* `data` is the C-contiguous buffer, little-endian (or byte-order free for 1-byte types).
* Decoding is zero-copy (`np.frombuffer`) and the result is **read-only**: copy it
  before an in-place operation.
* Object dtypes, unknown dtypes, big-endian data, size mismatches and (optionally)
  non-finite values are refused with a `ProtocolError`; nothing is ever unpickled.

Reduced-precision wire (the expert step's `x_t` / `velocity`, see `to_wire_dtype`):

* float16 is the numpy type `"<f2"`; it decodes to a read-only float16 view (zero-copy).
* bfloat16 has no numpy type: it travels as dtype `"bfloat16"`, `data` the upper 16 bits of each
  IEEE float32 (little-endian uint16, rounded to nearest even). In Python a `BFloat16Array` (a
  float32 array) encodes that way, and decoding widens it to a read-only **float32** array (one
  conversion pass, the only decode that is not a view).
"""

from __future__ import annotations

import math
import sys
import warnings
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
#: The wire tag of bfloat16 (not a numpy type string: numpy has no bfloat16).
BFLOAT16 = "bfloat16"
#: Every dtype string `decode_tensor` accepts.
WIRE_DTYPE_TAGS: frozenset[str] = ALLOWED_DTYPES | {BFLOAT16}
#: Names of the float precisions an expert step may travel in (`StepRequest.reply_dtype`, the
#: coordinator's `--wire-dtype`); "float32" is what every peer has always sent.
WIRE_FLOATS: tuple[str, ...] = ("float32", "float16", "bfloat16")
#: Largest finite float16 (a float32 above it would become Inf).
FLOAT16_MAX = 65504.0

_KEYS = frozenset({"dtype", "shape", "data"})


class BFloat16Array(np.ndarray):
    """A float32 array [any shape] that `encode_tensor` sends as bfloat16 (dtype "bfloat16").
    Make one with `to_wire_dtype(a, "bfloat16")` or `a.astype(np.float32).view(BFloat16Array)`."""


def bfloat16_bits(a: np.ndarray) -> np.ndarray:
    """float32 [...] -> uint16 [...]: the bfloat16 bit patterns, rounded to nearest even; NaN stays
    a (quiet) NaN, ±Inf stays ±Inf; finite values within half a bfloat16 step of float32's
    maximum round to Inf (`to_wire_dtype` refuses those)."""
    u = np.ascontiguousarray(a, np.float32).view(np.uint32)
    rounded = ((u + (np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1)))) >> 16).astype(np.uint16)
    nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    if nan.any():
        rounded[nan] = np.uint16(0x7FC0)
    return rounded


def bfloat16_to_float32(bits: np.ndarray) -> np.ndarray:
    """uint16 bfloat16 bit patterns [...] -> float32 [...] (exact)."""
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


def _loaded_torch():
    """torch when this process has already imported it (workers, the coordinator), else None.
    schemas never imports torch itself: it is no dependency of the protocol."""
    return sys.modules.get("torch")


def _torch_view(torch, a: np.ndarray):
    """A torch tensor over `a`'s memory (torch warns about read-only arrays; it only reads them here)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(a)


def _on_one_thread(torch, op):
    """op() with one torch intra-op thread in this thread (the setting is per thread; restored after).
    These casts run on event loops, beside a router or a model on the other cores: with torch's default
    OpenMP team a 256 x 1024 cast took ~900 us of process CPU (the team spins after each op) against
    ~230 us on one thread, at ~15 - 25% more wall time (~290 against ~245 us)."""
    before = torch.get_num_threads()
    if before == 1:
        return op()
    torch.set_num_threads(1)
    try:
        return op()
    finally:
        torch.set_num_threads(before)


def _half_cast(a: np.ndarray, dtype: Any) -> np.ndarray:
    """float32 <-> float16 [...] (a new array). numpy's float16 casts are scalar loops (~1.3 ns per
    value on x86); torch's use F16C (~20x faster), so torch is used where it is already loaded."""
    torch = _loaded_torch()
    if torch is None or not a.flags.c_contiguous:
        with np.errstate(over="ignore"):
            return a.astype(dtype)
    to = torch.float16 if np.dtype(dtype) == np.float16 else torch.float32
    return _on_one_thread(torch, lambda: _torch_view(torch, a).to(to).numpy())


#: The largest magnitude `frame_float16` keeps: below float16's largest finite value (65504), so no
#: finite sample becomes Inf in a frame.
FRAME_FLOAT16_LIMIT = 6e4


def frame_float16(a: np.ndarray) -> np.ndarray:
    """float32 [...] -> float16 [...] clipped to +-FRAME_FLOAT16_LIMIT (a new array; NaN stays NaN):
    what a frame carries. Bit for bit `np.clip(a, -6e4, 6e4).astype(np.float16)` (round to nearest
    even), through torch's F16C cast where torch is loaded (the coordinator's ~10x faster path, as in
    `_half_cast`)."""
    torch = _loaded_torch()
    if torch is None or a.dtype != np.float32 or not a.flags.c_contiguous:
        with np.errstate(over="ignore"):
            return np.clip(a, -FRAME_FLOAT16_LIMIT, FRAME_FLOAT16_LIMIT).astype(np.float16)
    return _on_one_thread(
        torch, lambda: _torch_view(torch, a).clamp(-FRAME_FLOAT16_LIMIT, FRAME_FLOAT16_LIMIT).to(torch.float16).numpy()
    )


def widen_float32(a: np.ndarray) -> np.ndarray:
    """A float array [...] as float32: itself (no copy) when it already is, else a new array."""
    if a.dtype == np.float32:
        return a
    if a.dtype == np.float16:
        return _half_cast(a, np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        return a.astype(np.float32)


def to_wire_dtype(a: Any, wire: str | None, *, name: str = "tensor") -> np.ndarray:
    """A float array [...] as it should travel in precision `wire` ("float32" | "float16" |
    "bfloat16"; None = "float32"): float32 (a view when it already is), float16 (a new array),
    or a `BFloat16Array` view of float32 values. Raises ProtocolError(non_finite) when a finite
    value does not fit the narrower type (|a| > 65504 for float16), naming the largest |value|,
    and ProtocolError(bad_dtype) for another `wire`."""
    wire = wire or "float32"
    a = np.asarray(a)
    if wire == "float32":
        return np.ascontiguousarray(a, np.float32)
    if wire not in WIRE_FLOATS:
        raise ProtocolError(ErrorCode.BAD_DTYPE, f"wire precision {shown(wire)} is not one of {list(WIRE_FLOATS)}")
    a32 = np.ascontiguousarray(a, np.float32)
    if wire == "float16":
        peak = float(np.abs(a32).max(initial=0.0)) if a32.size else 0.0
        if peak > FLOAT16_MAX and math.isfinite(peak):
            raise ProtocolError(
                ErrorCode.NON_FINITE,
                f"{name} overflows float16: |value| up to {peak:.6g} > {FLOAT16_MAX:g}; "
                f"use float32 (or bfloat16) on the wire",
            )
        return _half_cast(a32, np.float16)
    out = a32.view(BFloat16Array)
    # Only values within half a bfloat16 step of float32's maximum round up to Inf.
    if a32.size and float(np.abs(a32).max(initial=0.0)) >= 3.3961e38:
        finite = np.isfinite(a32)
        if (np.isinf(bfloat16_to_float32(bfloat16_bits(a32))) & finite).any():
            raise ProtocolError(
                ErrorCode.NON_FINITE,
                f"{name} overflows bfloat16 (values near float32's maximum); use float32 on the wire",
            )
    return out


def as_received(a: np.ndarray) -> np.ndarray:
    """The float32 values a receiver decodes from `a` as `to_wire_dtype` made it for the wire (float32
    as is, float16 widened, a `BFloat16Array` rounded to bfloat16): what the other side will compute with."""
    if isinstance(a, BFloat16Array):
        return bfloat16_to_float32(bfloat16_bits(np.asarray(a).view(np.ndarray)))
    return widen_float32(np.asarray(a))


def encode_tensor(array: Any) -> dict[str, Any]:
    """ndarray -> wire dict. Converts to C order and little-endian if needed; a `BFloat16Array`
    is sent as dtype "bfloat16"."""
    if isinstance(array, BFloat16Array):
        if array.ndim > MAX_TENSOR_NDIM:
            raise ProtocolError(ErrorCode.BAD_SHAPE, f"tensor rank {array.ndim} exceeds {MAX_TENSOR_NDIM}")
        bits = bfloat16_bits(np.asarray(array).view(np.ndarray))
        return {
            "dtype": BFLOAT16,
            "shape": [int(d) for d in array.shape],
            "data": bits.astype("<u2", copy=False).tobytes(),
        }
    a = np.asarray(array)
    if a.dtype.byteorder == ">" or (a.dtype.byteorder == "=" and not np.little_endian):
        a = a.astype(a.dtype.newbyteorder("<"))
    if a.dtype.str not in ALLOWED_DTYPES:
        raise ProtocolError(
            ErrorCode.BAD_DTYPE, f"dtype {a.dtype.str!r} cannot be sent; allowed: {sorted(ALLOWED_DTYPES)}"
        )
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
    if finite and arr.dtype.kind == "f" and arr.size:
        bad = _count_non_finite(arr)
        if bad:
            raise ProtocolError(ErrorCode.NON_FINITE, f"{name} contains {bad} NaN/Inf value(s)")
    return arr


def _count_non_finite(arr: np.ndarray) -> int:
    """NaN/Inf values in a float array. float16 is checked on its bits (all exponent bits set),
    which is ~10x faster than numpy's float16 isfinite."""
    if arr.dtype.itemsize == 2 and arr.dtype.kind == "f" and arr.flags.c_contiguous:
        bits = arr.view(np.uint16)
        special = (bits & np.uint16(0x7C00)) == np.uint16(0x7C00)
        return int(special.sum()) if special.any() else 0
    ok = np.isfinite(arr)
    return 0 if ok.all() else int(arr.size - ok.sum())


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
        raise ProtocolError(
            ErrorCode.BAD_DTYPE, f"{name} dtype {dt.str!r} cannot be sent; allowed: {sorted(ALLOWED_DTYPES)}"
        )
    if arr.ndim > MAX_TENSOR_NDIM:
        raise ProtocolError(ErrorCode.BAD_SHAPE, f"{name} rank {arr.ndim} exceeds {MAX_TENSOR_NDIM}")
    return arr


#: numpy dtype of each numpy wire tag, built once (bfloat16 has none: it takes the full path).
_NUMPY_DTYPES: dict[str, np.dtype] = {tag: np.dtype(tag) for tag in ALLOWED_DTYPES - {"|b1"}}


def _decode_plain(obj: Any) -> np.ndarray | None:
    """The common tensor, checked with exact-type tests only: a dict of exactly the three keys, a
    numpy tag other than |b1, a list of at most MAX_TENSOR_NDIM positive plain ints, `bytes` of
    exactly the size the shape needs, within MAX_PAYLOAD_BYTES. Returns its read-only view, or None
    for anything else, which `_decode_dict`'s full checks then accept or refuse by name. (A frame
    carries two tensors, and this path is about half the cost of the full one.)"""
    if type(obj) is not dict or len(obj) != 3:
        return None
    dtype, shape, data = obj.get("dtype"), obj.get("shape"), obj.get("data")
    np_dtype = _NUMPY_DTYPES.get(dtype) if type(dtype) is str else None
    if np_dtype is None or type(shape) is not list or len(shape) > MAX_TENSOR_NDIM or type(data) is not bytes:
        return None
    n = 1
    for d in shape:
        if type(d) is not int or d < 1:  # bools, other types, zero and negative dimensions: full checks
            return None
        n *= d
    if n * np_dtype.itemsize != len(data) or len(data) > MAX_PAYLOAD_BYTES:
        return None
    return np.frombuffer(data, dtype=np_dtype).reshape(shape)  # a view of immutable bytes: read-only


def _decode_dict(obj: Any, name: str) -> np.ndarray:
    arr = _decode_plain(obj)
    if arr is not None:
        return arr
    if not isinstance(obj, dict):
        raise ProtocolError(
            ErrorCode.BAD_REQUEST, f"{name} must be a map {{dtype, shape, data}}, got {type(obj).__name__}"
        )
    keys = set(obj)
    if keys != _KEYS:
        raise ProtocolError(
            ErrorCode.BAD_REQUEST, f"{name} must have exactly keys dtype, shape, data; got {sorted(map(shown, keys))}"
        )
    dtype, shape, data = obj["dtype"], obj["shape"], obj["data"]
    if not isinstance(dtype, str) or dtype not in WIRE_DTYPE_TAGS:
        raise ProtocolError(
            ErrorCode.BAD_DTYPE, f"{name} dtype {shown(dtype)} is not allowed; allowed: {sorted(WIRE_DTYPE_TAGS)}"
        )
    if not isinstance(shape, (list, tuple)) or len(shape) > MAX_TENSOR_NDIM:
        raise ProtocolError(
            ErrorCode.BAD_SHAPE, f"{name} shape must be a list of at most {MAX_TENSOR_NDIM} ints, got {shown(shape)}"
        )
    for d in shape:
        if not isinstance(d, int) or isinstance(d, bool) or d < 0:
            raise ProtocolError(
                ErrorCode.BAD_SHAPE, f"{name} shape entries must be non-negative ints, got {shown(shape)}"
            )
        if d > MAX_PAYLOAD_BYTES:
            raise ProtocolError(
                ErrorCode.TOO_LARGE, f"{name} shape {list(shape)} has a dimension over {MAX_PAYLOAD_BYTES}"
            )
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ProtocolError(
            ErrorCode.BAD_REQUEST, f"{name} data must be raw bytes (msgpack bin), got {type(data).__name__}"
        )
    itemsize = 2 if dtype == BFLOAT16 else np.dtype(dtype).itemsize
    n = math.prod(shape)
    # Zero dimensions count as 1 here: [0, 2**23, 2**23, 2**23] holds nothing, but numpy refuses
    # to build it ("array is too big"), and no real tensor has such a shape.
    if math.prod(max(d, 1) for d in shape) * itemsize > MAX_PAYLOAD_BYTES:
        raise ProtocolError(
            ErrorCode.TOO_LARGE,
            f"{name} of shape {list(shape)} needs {n * itemsize} bytes (non-zero "
            f"dimensions: {math.prod(max(d, 1) for d in shape) * itemsize}), "
            f"over the {MAX_PAYLOAD_BYTES}-byte limit",
        )
    if isinstance(data, memoryview) and not data.c_contiguous:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"{name} data must be a contiguous buffer")
    nbytes = memoryview(data).nbytes
    if nbytes != n * itemsize:
        raise ProtocolError(
            ErrorCode.BAD_SHAPE,
            f"{name} data has {nbytes} bytes but shape {list(shape)} of {dtype} needs "
            f"{n} x {itemsize} = {n * itemsize}",
        )
    raw = memoryview(data).cast("B") if isinstance(data, memoryview) else data
    if dtype == "|b1" and nbytes and np.frombuffer(raw, dtype=np.uint8).max() > 1:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"{name} is |b1 but holds bytes other than 0 and 1")
    if dtype == BFLOAT16:  # no numpy type: widen to float32 (the one decode that copies)
        arr = bfloat16_to_float32(np.frombuffer(raw, dtype="<u2")).reshape(tuple(shape))
    else:
        arr = np.frombuffer(raw, dtype=np.dtype(dtype)).reshape(tuple(shape))
    arr.flags.writeable = False  # bytearray/memoryview input would otherwise give a writable view
    return arr
