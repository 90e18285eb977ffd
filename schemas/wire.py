"""Bytes <-> messages. The only place msgpack is called.

`pack(msg)` validates the size before anything is published; `unpack(data, Type)`
checks the size, decodes msgpack (no ext types, no timestamps, no pickles; bounded array and
map lengths, container count and nesting: see `schemas.limits`), checks the protocol version,
validates with pydantic in strict mode (no "3" -> 3 coercion) and
turns every failure into a `ProtocolError` with a stable code.
"""

from __future__ import annotations

import re
from functools import cache
from typing import Any, TypeVar

import msgpack
from pydantic import BaseModel, TypeAdapter, ValidationError
from pydantic_core import PydanticSerializationError

from .errors import ErrorCode, ProtocolError, shown
from .limits import MAX_PAYLOAD_BYTES, MAX_WIRE_ARRAY_LEN, MAX_WIRE_CONTAINERS, MAX_WIRE_MAP_LEN
from .version import PROTOCOL_VERSION

T = TypeVar("T")

_CODES = {c.value for c in ErrorCode}
_EXCEEDS = re.compile(r"^(\d+) exceeds max_(array|map)_len")


def _refuse_ext(code: int, data: bytes) -> Any:
    raise ProtocolError(ErrorCode.BAD_REQUEST, f"msgpack extension type {code} is not allowed")


class _ContainerHook:
    """msgpack list_hook / object_hook: refuses timestamps (ext type -1 is decoded without calling
    ext_hook) and counts containers, so a message of millions of tiny arrays stops early."""

    __slots__ = ("left",)

    def __init__(self, budget: int):
        self.left = budget

    def __call__(self, value: Any) -> Any:
        self.left -= 1
        if self.left < 0:
            raise ProtocolError(
                ErrorCode.TOO_LARGE,
                f"message has over {MAX_WIRE_CONTAINERS} arrays and maps; the limit is {MAX_WIRE_CONTAINERS}",
            )
        items = value.values() if isinstance(value, dict) else value
        for item in items:
            if isinstance(item, msgpack.Timestamp):
                raise ProtocolError(ErrorCode.BAD_REQUEST, "msgpack extension type -1 (timestamp) is not allowed")
        return value


def pack(message: BaseModel, *, max_bytes: int = MAX_PAYLOAD_BYTES) -> bytes:
    """Encode a message; raises ProtocolError(too_large) if it would exceed `max_bytes`."""
    if not isinstance(message, BaseModel):
        raise ProtocolError(ErrorCode.INTERNAL, f"pack() takes a schemas message, got {type(message).__name__}")
    try:
        fast = getattr(message, "wire_dict", None)  # FrameEvent: its dump built directly (same bytes)
        data = msgpack.packb(fast() if fast is not None else message.model_dump(mode="python"), use_bin_type=True)
    except PydanticSerializationError as err:
        cause = err.__cause__ if isinstance(err.__cause__, ProtocolError) else None
        if cause is not None:
            raise cause from None
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"cannot encode {type(message).__name__}: {err}") from None
    except ProtocolError:  # encode_tensor's own (bad dtype / rank), raised as is by the fast path
        raise
    except (TypeError, ValueError, OverflowError) as err:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"cannot encode {type(message).__name__}: {err}") from None
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
    hook = _ContainerHook(MAX_WIRE_CONTAINERS)
    try:
        obj = msgpack.unpackb(
            data,
            raw=False,
            use_list=True,
            strict_map_key=True,
            ext_hook=_refuse_ext,
            object_hook=hook,
            list_hook=hook,
            max_array_len=min(MAX_WIRE_ARRAY_LEN, len(data)),  # each item takes >= 1 byte, a map entry >= 2
            max_map_len=min(MAX_WIRE_MAP_LEN, len(data) // 2),
        )
        if isinstance(obj, msgpack.Timestamp):
            raise ProtocolError(ErrorCode.BAD_REQUEST, "msgpack extension type -1 (timestamp) is not allowed")
        return obj
    except ProtocolError:
        raise
    except ValueError as err:
        # msgpack checks a container's declared length before building it: "N exceeds max_array_len(M)".
        # Over our limit in a message long enough to hold it: too_large; otherwise a corrupt header.
        m = _EXCEEDS.match(str(err))
        if m and int(m.group(1)) > (MAX_WIRE_ARRAY_LEN if m.group(2) == "array" else MAX_WIRE_MAP_LEN):
            if int(m.group(1)) * (1 if m.group(2) == "array" else 2) <= len(data):
                raise ProtocolError(
                    ErrorCode.TOO_LARGE,
                    f"msgpack {m.group(2)} of {m.group(1)} entries; the limit is "
                    f"{MAX_WIRE_ARRAY_LEN} array items, {MAX_WIRE_MAP_LEN} map entries",
                ) from None
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"undecodable msgpack: {decode_failure(err)}") from None
    except Exception as err:  # msgpack raises several types for corrupt input
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"undecodable msgpack: {decode_failure(err)}") from None


#: What a msgpack decoder error means when it carries no text of its own (msgpack's C decoder
#: raises FormatError and StackError with an empty message).
_SILENT_DECODE_ERRORS = {
    "FormatError": "a byte that starts no msgpack value (such as 0xc1, which msgpack never uses)",
    "StackError": "arrays / maps nested deeper than the decoder's limit of 1024 levels",
    "OutOfData": "the message ends in the middle of a value",
    "ExtraData": "more bytes after the first msgpack value",
}


def decode_failure(err: BaseException) -> str:
    """ "FormatError: <reason>" for a msgpack decode error: the decoder's own text, or where it has
    none a sentence saying what such an error means; never an empty reason."""
    name = type(err).__name__
    text = str(err).strip()
    if not text:
        text = _SILENT_DECODE_ERRORS.get(name, "the decoder gave no reason (corrupt or truncated msgpack)")
    return f"{name}: {text}"


@cache
def _adapter(tp: Any) -> TypeAdapter:
    return TypeAdapter(tp)


def check_envelope(obj: Any) -> None:
    """Every message is a map with an int `v` equal to PROTOCOL_VERSION and a str `kind`.

    Checked before the body so that a peer on another version hears
    `unsupported_version`, whatever else changed in its messages.
    """
    if not isinstance(obj, dict):
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"message must be a msgpack map, got {type(obj).__name__}")
    if "v" not in obj:
        raise ProtocolError(ErrorCode.BAD_REQUEST, "message has no protocol version field v")
    v = obj["v"]
    if not isinstance(v, int) or isinstance(v, bool):
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"protocol version v must be an int, got {shown(v)}")
    if v != PROTOCOL_VERSION:
        raise ProtocolError(
            ErrorCode.UNSUPPORTED_VERSION,
            f"protocol version {v} is not supported; this build speaks v{PROTOCOL_VERSION}",
        )
    if not isinstance(obj.get("kind"), str):
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"message field kind must be a string, got {shown(obj.get('kind'))}")


def validate(obj: Any, tp: type[T] | Any) -> T:
    """Validate an already-decoded object against a model or a discriminated union.

    Strict: wire types must match (an int field refuses "3" and true; a float
    field takes an int). `v` and `kind` must be present (see `check_envelope`).
    """
    check_envelope(obj)
    try:
        return _adapter(tp).validate_python(obj, strict=True)
    except ValidationError as err:
        raise _to_protocol_error(err) from None
    except ProtocolError:
        raise
    except RecursionError:
        raise ProtocolError(ErrorCode.BAD_REQUEST, "message is nested too deeply") from None


def unpack(
    data: bytes | bytearray | memoryview,
    tp: type[T] | Any,
    *,
    max_bytes: int = MAX_PAYLOAD_BYTES,
    ignore_unknown: bool = False,
) -> T:
    """Decode and validate; raises ProtocolError on anything wrong. `ignore_unknown`: keys the message's
    model (by its `kind`) does not define are dropped first, at every level, instead of refused: a
    client reading a newer service's replies and events, as docs/PROTOCOL.md tells clients to. Services
    read requests strictly (the default)."""
    obj = loads(data, max_bytes=max_bytes)
    if ignore_unknown and isinstance(obj, dict):
        cls = message_classes().get(obj.get("kind"))
        if cls is not None:
            obj = _known_only(obj, cls)
    return validate(obj, tp)


@cache
def message_classes() -> dict[str, type[BaseModel]]:
    """{kind: message class} of every protocol message (the tolerant reader's lookup, the JSON Schema's list)."""
    from . import messages

    out: dict[str, type[BaseModel]] = {}
    stack = [messages.Message]
    while stack:
        cls = stack.pop()
        stack.extend(cls.__subclasses__())
        field = cls.model_fields.get("kind")
        # the protocol's own messages only: a subclass elsewhere (a coordinator's checkpoint) would make the
        # list depend on what was imported before its first call
        if field is not None and isinstance(field.default, str) and cls.__module__ == messages.__name__:
            out.setdefault(field.default, cls)
    return out


def _nested_model(annotation: Any) -> tuple[type[BaseModel] | None, bool]:
    """(the model class inside a field's annotation (Optional / Union / Annotated / list), or None; whether
    it is a list of them)."""
    import typing

    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, False
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (list, tuple) and args:
        inner, _ = _nested_model(args[0])
        return inner, inner is not None
    for arg in args:
        inner, many = _nested_model(arg)
        if inner is not None:
            return inner, many
    return None, False


@cache
def _field_plan(cls: type[BaseModel]) -> tuple[frozenset[str], dict[str, tuple[type[BaseModel], bool]]]:
    """(the keys `cls` defines (field names or aliases), {key: (nested model, is a list)} for its fields that
    hold models): computed once per class."""
    keys, nested = set(), {}
    for name, field in cls.model_fields.items():
        key = field.alias or name
        keys.add(key)
        sub, many = _nested_model(field.annotation)
        if sub is not None:
            nested[key] = (sub, many)
    return frozenset(keys), nested


def _known_only(obj: dict, cls: type[BaseModel]) -> dict:
    """`obj` without the keys `cls` does not define (by field name or alias), recursively into nested models;
    `obj` itself when there is nothing to drop (a frame: no copy)."""
    keys, nested = _field_plan(cls)
    if obj.keys() <= keys and (not nested or nested.keys().isdisjoint(obj)):
        return obj
    out = {}
    for key, value in obj.items():
        if key not in keys:
            continue
        if key in nested:
            sub, many = nested[key]
            if many and isinstance(value, list):
                value = [_known_only(v, sub) if isinstance(v, dict) else v for v in value]
            elif isinstance(value, dict):
                value = _known_only(value, sub)
        out[key] = value
    return out


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
