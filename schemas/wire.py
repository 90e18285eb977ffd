"""Bytes <-> messages. The only place msgpack is called.

`pack(msg)` validates the size before anything is published; `unpack(data, Type)`
checks the size, decodes msgpack (no ext types, no pickles), validates with pydantic
and turns every failure into a `ProtocolError` with a stable code.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, TypeVar

import msgpack
from pydantic import BaseModel, TypeAdapter, ValidationError

from .errors import ErrorCode, ProtocolError
from .limits import MAX_PAYLOAD_BYTES

T = TypeVar("T")

_CODES = {c.value for c in ErrorCode}


def _refuse_ext(code: int, data: bytes) -> Any:
    raise ProtocolError(ErrorCode.BAD_REQUEST, f"msgpack extension type {code} is not allowed")


def pack(message: BaseModel, *, max_bytes: int = MAX_PAYLOAD_BYTES) -> bytes:
    """Encode a message; raises ProtocolError(too_large) if it would exceed `max_bytes`."""
    data = msgpack.packb(message.model_dump(mode="python"), use_bin_type=True)
    if len(data) > max_bytes:
        raise ProtocolError(
            ErrorCode.TOO_LARGE, f"{type(message).__name__} is {len(data)} bytes, over the {max_bytes}-byte limit"
        )
    return data


def loads(data: bytes | bytearray | memoryview, *, max_bytes: int = MAX_PAYLOAD_BYTES) -> Any:
    """Raw msgpack decode with our limits (size, no ext types, string map keys)."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"expected bytes, got {type(data).__name__}")
    if len(data) > max_bytes:
        raise ProtocolError(ErrorCode.TOO_LARGE, f"message of {len(data)} bytes is over the {max_bytes}-byte limit")
    if len(data) == 0:
        raise ProtocolError(ErrorCode.BAD_REQUEST, "empty message")
    try:
        return msgpack.unpackb(
            data,
            raw=False,
            use_list=True,
            strict_map_key=True,
            ext_hook=_refuse_ext,
        )
    except ProtocolError:
        raise
    except Exception as err:  # msgpack raises several types for corrupt input
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"undecodable msgpack: {type(err).__name__}: {err}") from None


@lru_cache(maxsize=None)
def _adapter(tp: Any) -> TypeAdapter:
    return TypeAdapter(tp)


def validate(obj: Any, tp: type[T] | Any) -> T:
    """Validate an already-decoded object against a model or a discriminated union."""
    if not isinstance(obj, dict):
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"message must be a msgpack map, got {type(obj).__name__}")
    try:
        return _adapter(tp).validate_python(obj)
    except ValidationError as err:
        raise _to_protocol_error(err) from None


def unpack(data: bytes | bytearray | memoryview, tp: type[T] | Any, *, max_bytes: int = MAX_PAYLOAD_BYTES) -> T:
    """Decode and validate; raises ProtocolError on anything wrong."""
    return validate(loads(data, max_bytes=max_bytes), tp)


def _to_protocol_error(err: ValidationError) -> ProtocolError:
    errors = err.errors(include_url=False, include_input=False)
    # Version problems win: a client on another version should hear that first.
    ordered = sorted(errors, key=lambda e: e["type"] != ErrorCode.UNSUPPORTED_VERSION.value)
    first = ordered[0]
    code = first["type"] if first["type"] in _CODES else ErrorCode.BAD_REQUEST.value
    parts = []
    for e in ordered[:5]:
        loc = ".".join(str(p) for p in e["loc"]) or "message"
        parts.append(f"{loc}: {e['msg']}")
    more = f" (+{len(errors) - 5} more)" if len(errors) > 5 else ""
    return ProtocolError(code, "; ".join(parts) + more)
