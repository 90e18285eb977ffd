"""Hostile input (issue 9): deep nesting, oversize payloads, wrong subjects, wrong key types, ext
types, huge declared shapes, and the websocket equivalents, against the decoders and against a real
worker, coordinator and web app on a private nats-server. Ends with `ddm-fleet fuzz` on every target.

Every case asserts the documented answer: a `ProtocolError` / `ErrorReply` with a code, a
`JobRejected`, `NoRespondersError`, the NATS max-payload error, or a websocket `error` message;
and that the process that got the input still serves a valid request afterwards.
"""

from __future__ import annotations

import json
import math
import struct
import time
from pathlib import Path

import msgpack
import numpy as np
import pytest

from schemas import ErrorCode, ProtocolError, StepRequest, encode_tensor, loads, pack, unpack
from schemas import limits
from schemas.fuzzing import MESSAGE_TARGETS, message_seeds
from schemas.tensor import decode_tensor

DOC = (Path(__file__).resolve().parents[1] / "docs" / "PROTOCOL.md").read_text()


def _code(data: bytes, tp) -> ProtocolError:
    with pytest.raises(ProtocolError) as err:
        unpack(data, tp)
    assert err.value.message
    return err.value


def _with_field(key: str, raw_value: bytes, base: dict | None = None) -> bytes:
    """A valid-looking message map whose `key` holds `raw_value` (already msgpack bytes)."""
    base = {k: v for k, v in (base or {"v": 1, "kind": "step_request"}).items() if k != key}
    head = msgpack.packb(base, use_bin_type=True)
    assert 0x80 <= head[0] <= 0x8E
    return bytes([head[0] + 1]) + head[1:] + msgpack.packb(key) + raw_value


STEP = message_seeds(image=(1, 32, 32), rows=(2,))[0]  # a valid StepRequest wire map


# ---------------------------------------------------------------- nesting


@pytest.mark.parametrize("level", [b"\x91", b"\x81\xa1k"], ids=["arrays", "maps"])
@pytest.mark.parametrize("depth", [limits.MAX_WIRE_DEPTH + 1, 100_000])
def test_nesting_past_the_decoder_limit_is_refused_at_once(level, depth):
    bare = level * depth + b"\xc0"
    for data in (bare, _with_field("x_t", bare), _with_field("row_ids", bare)):
        for tp in MESSAGE_TARGETS:
            start = time.perf_counter()
            err = _code(data, tp)
            assert err.code is ErrorCode.BAD_REQUEST and "StackError" in err.message
            assert time.perf_counter() - start < 1.0


@pytest.mark.parametrize("field", ["v", "kind", "code", "expert", "x_t", "shape", "dtype"])
def test_nesting_at_the_limit_gives_a_clear_error_not_a_recursion_error(field):
    """Regression: 1000-level structures decode (msgpack allows 1024); the error message then
    took repr() of them and raised RecursionError instead of ProtocolError."""
    nest = b"\x91" * (limits.MAX_WIRE_DEPTH - 2) + b"\xc0"
    if field in ("shape", "dtype"):
        spec = dict(STEP["x_t"])
        spec.pop(field)
        data = _with_field("x_t", _with_map_entry(spec, field, nest), STEP)
    else:
        data = _with_field(field, nest, STEP if field not in ("v", "kind") else {"v": 1, "kind": "x"})
    for tp in MESSAGE_TARGETS:
        err = _code(data, tp)
        assert err.code in (ErrorCode.BAD_REQUEST, ErrorCode.BAD_SHAPE, ErrorCode.BAD_DTYPE), err
        assert len(err.message) < 2000
    with pytest.raises(ProtocolError):
        decode_tensor({"dtype": "<f4", "shape": loads(nest), "data": b""})


def _with_map_entry(mapping: dict, key: str, raw_value: bytes) -> bytes:
    head = msgpack.packb(mapping, use_bin_type=True)
    return bytes([head[0] + 1]) + head[1:] + msgpack.packb(key) + raw_value


def test_decoder_depth_limit_is_the_documented_one():
    ok = loads(b"\x91" * limits.MAX_WIRE_DEPTH + b"\xc0")
    depth = 0
    while isinstance(ok, list):
        ok, depth = ok[0], depth + 1
    assert depth == limits.MAX_WIRE_DEPTH
    assert _code_loads(b"\x91" * (limits.MAX_WIRE_DEPTH + 1) + b"\xc0") is ErrorCode.BAD_REQUEST
    assert f"| msgpack nesting | {limits.MAX_WIRE_DEPTH} levels" in DOC


def _code_loads(data: bytes) -> ErrorCode:
    with pytest.raises(ProtocolError) as err:
        loads(data)
    return err.value.code


# ---------------------------------------------------------------- oversize and wide


def test_limits_section_of_the_protocol_doc_matches_the_code():
    assert f"| items in one msgpack array | {limits.MAX_WIRE_ARRAY_LEN} | `too_large` |" in DOC
    assert f"| entries in one msgpack map | {limits.MAX_WIRE_MAP_LEN} | `too_large` |" in DOC
    assert f"| arrays + maps in one message, at any depth | {limits.MAX_WIRE_CONTAINERS} | `too_large` |" in DOC


def test_message_over_the_size_limit_is_too_large():
    data = _with_field("row_ids", b"\xc6" + struct.pack(">I", limits.MAX_PAYLOAD_BYTES) + bytes(limits.MAX_PAYLOAD_BYTES))
    assert _code(data, StepRequest).code is ErrorCode.TOO_LARGE


@pytest.mark.parametrize("item", [b"\x90", b"\x80", b"\xc0", b"\x01"], ids=["arrays", "maps", "nils", "ints"])
def test_an_8mib_list_is_refused_by_its_header(item):
    """Regression: an 8 MiB step_request whose row_ids held 8M empty arrays took 52 s and 7.8 GB
    in pydantic (one error per item); the coordinator's submit subject had the same hole."""
    n = limits.MAX_PAYLOAD_BYTES - 64
    for key, tp in (("row_ids", StepRequest), ("digits", MESSAGE_TARGETS[3])):
        data = _with_field(key, b"\xdd" + struct.pack(">I", n) + item * n, {"v": 1, "kind": tp.model_fields["kind"].default})
        start = time.perf_counter()
        err = _code(data, tp)
        assert err.code is ErrorCode.TOO_LARGE and f"{limits.MAX_WIRE_ARRAY_LEN}" in err.message
        assert time.perf_counter() - start < 0.5


def test_array_and_map_lengths_at_and_over_the_limits():
    n = limits.MAX_WIRE_ARRAY_LEN
    assert len(loads(b"\xdc" + struct.pack(">H", n) + b"\x00" * n)) == n
    assert _code_loads(b"\xdc" + struct.pack(">H", n + 1) + b"\x00" * (n + 1)) is ErrorCode.TOO_LARGE
    m = limits.MAX_WIRE_MAP_LEN
    assert len(loads(msgpack.packb({f"k{i}": i for i in range(m)}))) == m
    assert _code_loads(msgpack.packb({f"k{i}": i for i in range(m + 1)})) is ErrorCode.TOO_LARGE
    # a header that declares more entries than the bytes could hold is a corrupt message, not a big one
    assert _code_loads(b"\xdd\xff\xff\xff\xff\x00") is ErrorCode.BAD_REQUEST
    assert _code_loads(b"\xdf\x00\x01\x00\x00\xa1k") is ErrorCode.BAD_REQUEST


def test_millions_of_tiny_containers_stop_at_the_container_budget():
    per = 2000
    outer = limits.MAX_PAYLOAD_BYTES // (per + 3)
    inner = b"\xdc" + struct.pack(">H", per) + b"\x90" * per
    data = b"\xdd" + struct.pack(">I", outer) + inner * outer  # ~8 MiB, ~8M empty arrays
    start = time.perf_counter()
    assert _code_loads(data) is ErrorCode.TOO_LARGE
    assert time.perf_counter() - start < 0.5
    budget = limits.MAX_WIRE_CONTAINERS
    assert len(loads(b"\xdc" + struct.pack(">H", budget - 1) + b"\x90" * (budget - 1))) == budget - 1
    assert _code_loads(b"\xdc" + struct.pack(">H", budget) + b"\x90" * budget) is ErrorCode.TOO_LARGE


def test_error_messages_about_huge_values_stay_short():
    spec = dict(STEP["x_t"], dtype="x" * 1_000_000, shape=list(range(10)))
    err = _code(msgpack.packb({**STEP, "x_t": spec}, use_bin_type=True), StepRequest)
    assert err.code is ErrorCode.BAD_DTYPE and len(err.message) < 1000
    err = _code(msgpack.packb({**STEP, "v": "1" * 1_000_000}, use_bin_type=True), StepRequest)
    assert err.code is ErrorCode.BAD_REQUEST and len(err.message) < 1000


# ---------------------------------------------------------------- keys, ext types, shapes


@pytest.mark.parametrize("key", [1, -1, 2**40, None, True, 1.5, b"v"], ids=repr)
def test_map_keys_of_the_wrong_type_are_refused(key):
    for where in ("top", "tensor"):
        if where == "top":
            obj = {**STEP, key: 1}
        else:
            obj = {**STEP, "x_t": {**STEP["x_t"], key: 1}}
        err = _code(msgpack.packb(obj, use_bin_type=True), StepRequest)
        assert err.code is ErrorCode.BAD_REQUEST


@pytest.mark.parametrize("ext", [b"\xd4\x05\x00", b"\xd4\x80\x00", b"\xd6\xff\x00\x00\x00\x01",
                                 b"\xc7\x00\x10", b"\xd8\x7f" + b"\x00" * 16],
                         ids=["ext5", "ext-128", "timestamp", "ext8-empty", "fixext16"])
def test_extension_types_are_refused_anywhere(ext):
    cases = [ext, _with_field("x_t", ext, STEP), _with_field("row_ids", b"\x92" + ext + b"\xa1a", STEP),
             _with_field("x_t", _with_map_entry({k: v for k, v in STEP["x_t"].items() if k != "data"}, "data", ext),
                         STEP)]
    for data in cases:
        err = _code(data, StepRequest)
        assert err.code is ErrorCode.BAD_REQUEST and "extension type" in err.message, err


M = 2**23


@pytest.mark.parametrize("shape, code", [
    ([0, M, M, M, M], ErrorCode.TOO_LARGE),  # regression: numpy raised ValueError("array is too big")
    ([M, M, 0], ErrorCode.TOO_LARGE),
    ([0] * 8, None),
    ([2**63 - 1], ErrorCode.TOO_LARGE),
    ([2**64 - 1, 0], ErrorCode.TOO_LARGE),
    ([M + 1], ErrorCode.TOO_LARGE),
    ([1, M], ErrorCode.TOO_LARGE),  # 32 MiB of <f4 declared, no bytes
    ([-1], ErrorCode.BAD_SHAPE),
    ([-(2**63), 0], ErrorCode.BAD_SHAPE),
    ([1] * 9, ErrorCode.BAD_SHAPE),
    ([True], ErrorCode.BAD_SHAPE),
    ([1.0], ErrorCode.BAD_SHAPE),
])
def test_huge_negative_and_overflowing_dims_with_tiny_data(shape, code):
    spec = {"dtype": "<f4", "shape": shape, "data": b""}
    wire = msgpack.unpackb(msgpack.packb(spec, use_bin_type=True), raw=False)
    if code is None:
        assert decode_tensor(wire).shape == tuple(shape)
        return
    with pytest.raises(ProtocolError) as err:
        decode_tensor(wire)
    assert err.value.code is code
    msg = _code(msgpack.packb({**STEP, "x_t": spec}, use_bin_type=True), StepRequest)
    assert msg.code is code, msg


# ---------------------------------------------------------------- websocket parsing (no server)


@pytest.mark.parametrize("text, expected", [
    ('{"type": "ping", "ref": ' + "1" * 5000 + "}", "malformed JSON"),  # regression: ValueError escaped
    ('{"type": "generate", "count": ' + "9" * 4301 + "}", "malformed JSON"),
    ("[" * 100_000, "malformed JSON"),
    ('{"type": ' + "[" * 950 + "]" * 950 + "}", "unknown message type [["),
    ('{"type": "generate", "digits": [' + "[" * 950 + "]" * 950 + "]}", "digits must be integers 0-9, got [["),
    ('{"type": "generate", "digits": [' + ", ".join(["[0]"] * 20_000) + "]}", "digits must be integers 0-9"),
    ('{"type": "' + "x" * 100_000 + '"}', "unknown message type 'xxxx"),
])
def test_websocket_parser_answers_hostile_json_with_a_short_error(text, expected):
    from web.protocol import BadInput, parse_client_message

    with pytest.raises(BadInput) as err:
        parse_client_message(text)
    assert expected in err.value.message and len(err.value.message) < 300, err.value.message
