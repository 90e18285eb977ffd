"""Hostile input (issue 9): deep nesting, oversize payloads, wrong subjects, wrong key types, ext
types, huge declared shapes, and the websocket equivalents, against the decoders and against a real
worker, coordinator and web app on a private nats-server; and `ddm-fleet fuzz` on every target.

Every case asserts the documented answer: a `ProtocolError` / `ErrorReply` with a code, a
`JobRejected`, `NoRespondersError`, the NATS max-payload error, or a websocket `error` message;
and that the process that got the input still serves a valid request afterwards.
"""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path

import msgpack
import numpy as np
import pytest

from fuzzing.inputs import MESSAGE_TARGETS, message_seeds
from schemas import ErrorCode, JobRequest, ProtocolError, StepRequest, encode_tensor, limits, loads, pack, unpack
from schemas.tensor import decode_tensor

DOC = (Path(__file__).resolve().parents[2] / "docs" / "PROTOCOL.md").read_text()


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
    data = _with_field(
        "row_ids", b"\xc6" + struct.pack(">I", limits.MAX_PAYLOAD_BYTES) + bytes(limits.MAX_PAYLOAD_BYTES)
    )
    assert _code(data, StepRequest).code is ErrorCode.TOO_LARGE


@pytest.mark.parametrize("item", [b"\x90", b"\x80", b"\xc0", b"\x01"], ids=["arrays", "maps", "nils", "ints"])
def test_an_8mib_list_is_refused_by_its_header(item):
    """Regression: an 8 MiB step_request whose row_ids held 8M empty arrays took 52 s and 7.8 GB
    in pydantic (one error per item); the coordinator's submit subject had the same hole."""
    n = limits.MAX_PAYLOAD_BYTES - 64
    for key, tp in (("row_ids", StepRequest), ("digits", JobRequest)):
        data = _with_field(
            key, b"\xdd" + struct.pack(">I", n) + item * n, {"v": 1, "kind": tp.model_fields["kind"].default}
        )
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


@pytest.mark.parametrize(
    "ext",
    [b"\xd4\x05\x00", b"\xd4\x80\x00", b"\xd6\xff\x00\x00\x00\x01", b"\xc7\x00\x10", b"\xd8\x7f" + b"\x00" * 16],
    ids=["ext5", "ext-128", "timestamp", "ext8-empty", "fixext16"],
)
def test_extension_types_are_refused_anywhere(ext):
    cases = [
        ext,
        _with_field("x_t", ext, STEP),
        _with_field("row_ids", b"\x92" + ext + b"\xa1a", STEP),
        _with_field("x_t", _with_map_entry({k: v for k, v in STEP["x_t"].items() if k != "data"}, "data", ext), STEP),
    ]
    for data in cases:
        err = _code(data, StepRequest)
        assert err.code is ErrorCode.BAD_REQUEST and "extension type" in err.message, err


M = 2**23


@pytest.mark.parametrize(
    "shape, code",
    [
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
    ],
)
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


@pytest.mark.parametrize(
    "text, expected",
    [
        ('{"type": "ping", "ref": ' + "1" * 5000 + "}", "malformed JSON"),  # regression: ValueError escaped
        ('{"type": "generate", "count": ' + "9" * 4301 + "}", "malformed JSON"),
        ("[" * 100_000, "malformed JSON"),
        ('{"type": ' + "[" * 950 + "]" * 950 + "}", "unknown message type [["),
        ('{"type": "generate", "digits": [' + "[" * 950 + "]" * 950 + "]}", "digits must be integers 0-9, got [["),
        ('{"type": "generate", "digits": [' + ", ".join(["[0]"] * 20_000) + "]}", "digits must be integers 0-9"),
        ('{"type": "' + "x" * 100_000 + '"}', "unknown message type 'xxxx"),
    ],
)
def test_websocket_parser_answers_hostile_json_with_a_short_error(text, expected):
    """Parsed on a thread of its own: the 950-deep cases sit close to Python's recursion limit, which counts
    the frames below the parse too; the web app parses on its event loop, a few dozen frames deep, while a
    pytest-xdist worker runs tests a hundred frames deeper."""
    from concurrent.futures import ThreadPoolExecutor

    from web.protocol import BadInput, parse_client_message

    with ThreadPoolExecutor(1) as pool, pytest.raises(BadInput) as err:
        pool.submit(parse_client_message, text).result()
    assert expected in err.value.message and len(err.value.message) < 300, err.value.message


# ---------------------------------------------------------------- over the bus: a real fleet
#
# fuzzing.fleet.Fleet: a private nats-server with max_payload 16 MiB (so messages between our 8 MiB
# limit and the server's reach our code), two tiny random experts, a coordinator, the web app.


@pytest.fixture(scope="module")
async def fleet(tmp_path_factory):
    from fuzzing.fleet import Fleet

    async with Fleet(str(tmp_path_factory.mktemp("hostile-fleet"))) as f:
        yield f


def _step_bytes(n: int = 2, **over) -> bytes:
    rng = np.random.default_rng(n)
    msg = {
        "v": 1,
        "kind": "step_request",
        "expert": 0,
        "x_t": encode_tensor(rng.standard_normal((n, 1, 32, 32)).astype(np.float32)),
        "t": encode_tensor(np.full(n, 0.5, np.float32)),
        "y": encode_tensor(np.arange(n) % 10),
        "request_id": "hostile",
    }
    msg.update(over)
    return msgpack.packb(msg, use_bin_type=True)


async def _ask_worker(fleet, data: bytes, expert: int = 0):
    from schemas import StepResult, subjects

    msg = await fleet.nc.request(subjects.expert_velocity(expert), data, timeout=10)
    return unpack(msg.data, StepResult)


async def _submit(fleet, data: bytes):
    from schemas import SubmitReply, subjects

    msg = await fleet.nc.request(subjects.jobs_submit("anon"), data, timeout=10)
    return unpack(msg.data, SubmitReply)


async def _still_serving(fleet) -> None:
    """The worker computes the model's velocity, and a real job completes."""
    from fuzzing.targets.coordinator import _real_job
    from schemas import StepReply

    data = _step_bytes(3)
    reply = await _ask_worker(fleet, data)
    assert isinstance(reply, StepReply), reply
    req = unpack(data, StepRequest)
    want = fleet.workers[0].backend.forward(np.array(req.x_t), np.array(req.t), np.array(req.y))
    np.testing.assert_allclose(reply.velocity, want, atol=1e-5)
    assert "2 images" in await _real_job(fleet.nc, f"alive{time.monotonic_ns()}", timeout=60)


@pytest.mark.bus
async def test_over_our_limit_under_the_nats_limit_gets_too_large(fleet):
    from schemas import ErrorReply, JobRejected

    assert fleet.nc.max_payload == 16 * 1024 * 1024
    pad = b"\xc6" + struct.pack(">I", limits.MAX_PAYLOAD_BYTES) + bytes(limits.MAX_PAYLOAD_BYTES)
    reply = await _ask_worker(fleet, _with_field("row_ids", pad, STEP))
    assert isinstance(reply, ErrorReply) and reply.code is ErrorCode.TOO_LARGE, reply
    reply = await _submit(fleet, _with_field("digits", pad, {"v": 1, "kind": "job_request"}))
    assert isinstance(reply, JobRejected) and reply.code is ErrorCode.TOO_LARGE, reply
    await _still_serving(fleet)


@pytest.mark.bus
async def test_over_the_nats_limit_the_client_gets_the_nats_error(fleet):
    import asyncio

    import nats.errors

    from schemas import subjects

    big = bytes(fleet.nc.max_payload + 1)
    with pytest.raises(nats.errors.MaxPayloadError):
        await fleet.nc.request(subjects.expert_velocity(0), big, timeout=5)
    with pytest.raises(nats.errors.MaxPayloadError):
        await fleet.nc.publish(subjects.jobs_submit("anon"), big)
    # a client that ignores the server's max_payload (raw protocol) is cut off by the server
    reader, writer = await asyncio.open_connection(fleet.server.host, fleet.server.port)
    try:
        assert (await reader.readline()).startswith(b"INFO ")
        writer.write(b'CONNECT {"verbose":false}\r\n' + f"PUB {subjects.expert_velocity(0)} {len(big)}\r\n".encode())
        await writer.drain()
        line = await asyncio.wait_for(reader.readline(), 10)
        assert b"Maximum Payload" in line, line
        await asyncio.wait_for(_until_hung_up(reader), 10)  # and disconnected
    finally:
        writer.close()
    await _still_serving(fleet)


@pytest.mark.bus
async def test_messages_on_the_wrong_subject_get_a_clear_answer(fleet):
    import nats.errors

    from schemas import CancelReply, CancelRequest, ErrorReply, FleetStatus, JobRejected, subjects

    job = pack(JobRequest(digits=[1], steps=2))
    # a job request sent to an expert, a cancel sent to an expert
    for data in (job, pack(CancelRequest(job_id="j1"))):
        reply = await _ask_worker(fleet, data)
        assert isinstance(reply, ErrorReply) and reply.code is ErrorCode.BAD_REQUEST and "kind" in reply.message
    # a velocity request sent to jobs.submit, and to a job's cancel subject
    reply = await _submit(fleet, _step_bytes(2))
    assert isinstance(reply, JobRejected) and reply.code is ErrorCode.BAD_REQUEST and "kind" in reply.reason
    msg = await fleet.nc.request(subjects.job_cancel("anon", "j1"), _step_bytes(2), timeout=10)
    cancel = unpack(msg.data, CancelReply)
    assert cancel.cancelled is False and cancel.reason.startswith("bad_request")
    # anything on fleet.status gets the status
    msg = await fleet.nc.request(subjects.FLEET_STATUS, _step_bytes(1), timeout=10)
    assert unpack(msg.data, FleetStatus).num_experts == 2
    # an expert id nobody serves: NoResponders, at once
    start = time.perf_counter()
    with pytest.raises(nats.errors.NoRespondersError):
        await fleet.nc.request(subjects.expert_velocity(99), _step_bytes(1, expert=99), timeout=10)
    assert time.perf_counter() - start < 5
    # a request for expert 1 sent to expert 0's subject
    reply = await _ask_worker(fleet, _step_bytes(1, expert=1))
    assert isinstance(reply, ErrorReply) and reply.code is ErrorCode.UNKNOWN_EXPERT
    # garbage published with no reply subject anywhere: nobody can answer, nothing dies
    for subject in (
        subjects.expert_velocity(0),
        subjects.jobs_submit("anon"),
        subjects.job_cancel("anon", "j1"),
        subjects.FLEET_STATUS,
    ):
        for data in (b"\xc1", b"\x91" * 100_000, job, _step_bytes(1)):
            await fleet.nc.publish(subject, data)
    await fleet.nc.flush()
    await _still_serving(fleet)


@pytest.mark.parametrize("where", ["job id", "client name"])
@pytest.mark.parametrize("token", ["x" * 65, "bad%token", "é", "a" * 200, "j1\u2028"])
@pytest.mark.bus
async def test_cancel_and_status_on_a_token_that_is_no_job_id_get_bad_request_at_once(fleet, token, where):
    """Regression: the coordinator dropped cancel / status requests on `ddm.v1.c.<client>.jobs.<token>.*`
    whose token is not a job id, so the requester waited out its whole time-out. The same holds for
    a client token that is no client name."""
    from schemas import CancelRequest, ErrorReply, subjects

    client, job = ("anon", token) if where == "job id" else (token, "j1")
    for verb, body in (
        ("cancel", b""),
        ("cancel", pack(CancelRequest(job_id="j1"))),
        ("status", b""),
        ("status", b"\xc1"),
    ):
        subject = f"{subjects.CLIENTS_PREFIX}.{client}.jobs.{job}.{verb}"
        assert subjects.parse_job_subject(subject) is None
        start = time.perf_counter()
        msg = await fleet.nc.request(subject, body, timeout=10)
        assert time.perf_counter() - start < 2  # at once (an unknown job's answer waits 0.25-0.5 s)
        reply = unpack(msg.data, ErrorReply)
        assert reply.code is ErrorCode.BAD_REQUEST, reply
        assert where in reply.message and "1-64 characters of [A-Za-z0-9_-]" in reply.message, reply.message
        assert f"({len(token)} character" in reply.message and len(reply.message) < 300, reply.message
    # published without a reply subject: nothing to answer, nothing breaks
    await fleet.nc.publish(f"{subjects.CLIENTS_PREFIX}.{client}.jobs.{job}.cancel", b"")
    await fleet.nc.publish(f"{subjects.CLIENTS_PREFIX}.{client}.jobs.{job}.status", b"")
    await fleet.nc.flush()
    await _still_serving(fleet)


@pytest.mark.parametrize("case", ["nested-100k", "nested-1000-kind", "nested-1000-v", "wide-8mib", "ext", "int-keys"])
@pytest.mark.bus
async def test_hostile_bytes_over_the_bus_get_clear_errors(fleet, case):
    """Regression (nested-1000-*): the worker answered `internal` and the coordinator did not
    answer at all (RecursionError escaped its submit handler)."""
    from schemas import ErrorReply, JobRejected

    nest_deep = b"\x91" * 100_000 + b"\xc0"
    nest_1000 = b"\x91" * 1000 + b"\xc0"
    n = limits.MAX_PAYLOAD_BYTES - 64
    wide = b"\xdd" + struct.pack(">I", n) + b"\x90" * n
    step_cases = {
        "nested-100k": (nest_deep, ErrorCode.BAD_REQUEST),
        "nested-1000-kind": (_with_field("kind", nest_1000, STEP), ErrorCode.BAD_REQUEST),
        "nested-1000-v": (_with_field("v", nest_1000, STEP), ErrorCode.BAD_REQUEST),
        "wide-8mib": (_with_field("row_ids", wide, STEP), ErrorCode.TOO_LARGE),
        "ext": (_with_field("request_id", b"\xd4\x07\x00", STEP), ErrorCode.BAD_REQUEST),
        "int-keys": (msgpack.packb({**STEP, 7: 1}, use_bin_type=True), ErrorCode.BAD_REQUEST),
    }
    job_base = {"v": 1, "kind": "job_request", "digits": [1], "steps": 2}
    job_cases = {
        "nested-100k": nest_deep,
        "nested-1000-kind": _with_field("kind", nest_1000, job_base),
        "nested-1000-v": _with_field("v", nest_1000, job_base),
        "wide-8mib": _with_field("digits", wide, job_base),
        "ext": _with_field("seed", b"\xd6\xff\x00\x00\x00\x01", job_base),
        "int-keys": msgpack.packb({**job_base, 7: 1}, use_bin_type=True),
    }
    data, code = step_cases[case]
    start = time.perf_counter()
    reply = await _ask_worker(fleet, data)
    assert isinstance(reply, ErrorReply) and reply.code is code, reply
    reply = await _submit(fleet, job_cases[case])
    assert isinstance(reply, JobRejected) and reply.code is code, reply
    assert time.perf_counter() - start < 5
    await _still_serving(fleet)


@pytest.mark.parametrize(
    "shape, code",
    [
        ([0, M, M, M], ErrorCode.TOO_LARGE),
        ([1, 1, M, M], ErrorCode.TOO_LARGE),
        ([-1, 1, 32, 32], ErrorCode.BAD_SHAPE),
        ([2**64 - 1], ErrorCode.TOO_LARGE),
        ([2, 1, 32, 31], ErrorCode.BAD_SHAPE),
    ],
)
@pytest.mark.bus
async def test_declared_shapes_that_do_not_fit_the_data_over_the_bus(fleet, shape, code):
    from schemas import ErrorReply

    x = {"dtype": "<f4", "shape": shape, "data": bytes(8)}
    reply = await _ask_worker(fleet, _step_bytes(2, x_t=x))
    assert isinstance(reply, ErrorReply) and reply.code is code, reply


@pytest.mark.bus
async def test_absurd_finite_inputs_get_non_finite_not_internal(fleet):
    """Regression (found by `ddm-fleet fuzz worker`): x_t holding 1e30 is finite, but the model's
    float32 GroupNorm overflows and the velocity is NaN; the worker answered `internal` (a bug on
    our side, which the coordinator retries elsewhere). Now `non_finite`."""
    from schemas import ErrorReply, StepReply

    x = np.zeros((2, 1, 32, 32), np.float32)
    x[1, 0, 5, 5] = 1e30
    reply = await _ask_worker(fleet, _step_bytes(2, x_t=encode_tensor(x)))
    assert isinstance(reply, ErrorReply) and reply.code is ErrorCode.NON_FINITE and "1e+30" in reply.message, reply
    x[1, 0, 5, 5] = 1e6  # large but harmless: computed
    reply = await _ask_worker(fleet, _step_bytes(2, x_t=encode_tensor(x)))
    assert isinstance(reply, StepReply) and np.isfinite(reply.velocity).all()


# ---------------------------------------------------------------- the websocket


async def _ws(fleet, session):
    ws = await session.ws_connect(fleet.web_url + "/ws", max_msg_size=0)
    assert (await ws.receive_json(timeout=10))["type"] == "hello"
    return ws


async def _next(ws, types, timeout=20.0):
    while True:
        msg = await ws.receive_json(timeout=timeout)
        if msg["type"] in types:
            return msg


@pytest.mark.parametrize(
    "text, expected",
    [
        ('{"type": "ping", "ref": ' + "1" * 5000 + "}", "malformed JSON"),  # regression: the socket was dropped
        ("[" * 100_000 + "]" * 100_000, "malformed JSON"),
        ('{"type": "generate", "digits": [' + "[" * 900 + "]" * 900 + "]}", "digits must be integers 0-9"),
        ('{"type": "generate", "count": NaN}', "count: Input should be a valid integer"),
        ('{"type": "generate", "count": 1, "seed": "' + "9" * 19 + '0"}', "seed: Input should be less than"),
        ('{"type": "cancel", "job_id": "' + "x" * 100_000 + '"}', "no running job"),
        ("\u2028\x00", "malformed JSON"),
    ],
)
@pytest.mark.bus
async def test_websocket_hostile_text_gets_an_error_and_the_socket_keeps_working(fleet, text, expected):
    import aiohttp

    async with aiohttp.ClientSession() as session:
        ws = await _ws(fleet, session)
        await ws.send_str(text)
        err = await _next(ws, {"error", "accepted"})
        assert err["type"] == "error" and expected in err["message"] and len(err["message"]) < 400, err
        await ws.send_json({"type": "generate", "digits": "4", "steps": 2, "ref": 1})
        assert (await _next(ws, {"accepted", "error"}))["type"] == "accepted"
        assert (await _next(ws, {"done", "failed", "error"}))["type"] == "done"
        await ws.close()


@pytest.mark.bus
async def test_websocket_oversize_and_binary_frames(fleet):
    import aiohttp

    from web.protocol import MAX_CLIENT_MESSAGE_BYTES

    async with aiohttp.ClientSession() as session:
        ws = await _ws(fleet, session)
        await ws.send_bytes(b"\x00" * 1000)
        err = await _next(ws, {"error"})
        assert "not binary" in err["message"]
        await ws.send_str('{"type": "generate", "digits": "' + "1," * MAX_CLIENT_MESSAGE_BYTES + '1"}')
        msg = await ws.receive(timeout=10)
        assert msg.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED, aiohttp.WSMsgType.ERROR), msg
        assert ws.close_code in (aiohttp.WSCloseCode.MESSAGE_TOO_BIG, aiohttp.WSCloseCode.ABNORMAL_CLOSURE)
        # the server lives on: a new socket works
        ws = await _ws(fleet, session)
        await ws.send_json({"type": "ping", "ref": 2})
        assert (await _next(ws, {"pong"})) == {"type": "pong", "ref": 2}
        await ws.close()
        async with session.get(fleet.web_url + "/healthz") as resp:
            assert resp.status == 200


# ---------------------------------------------------------------- unauthenticated, auth on


async def _until_hung_up(reader) -> bytes:
    """Everything the server sends until it closes the connection (a reset counts as closed)."""
    out = b""
    try:
        while line := await reader.readline():
            out += line
    except ConnectionResetError:
        pass
    return out


@pytest.fixture(scope="module")
def auth_cluster(tmp_path_factory):
    from infra.nats_cluster import NatsCluster

    with NatsCluster(1, name="ddm-hostile", log_dir=tmp_path_factory.mktemp("nats-logs")) as c:
        yield c


@pytest.mark.bus
async def test_unauthenticated_raw_connections_are_cut_off_and_reach_no_worker(auth_cluster, tiny_expert_checkpoint):
    import asyncio

    import nats

    from schemas import StepReply, StepResult, subjects
    from workers.service import ExpertWorker

    node = auth_cluster.nodes[0]
    async with ExpertWorker(
        0, tiny_expert_checkpoint, "torch", nats_url=auth_cluster.url(0, "worker-0"), buckets=(1, 2), dtype="float32"
    ) as worker:
        data = _step_bytes(1)
        attempts = [
            f"PUB {subjects.expert_velocity(0)} {len(data)}\r\n".encode() + data + b"\r\n",  # no CONNECT at all
            b'CONNECT {"verbose":false}\r\n' + f"PUB {subjects.expert_velocity(0)} 1\r\nx\r\n".encode(),
            b'CONNECT {"user":"worker-0","pass":"guess"}\r\n' + f"SUB {subjects.ALL_EXPERTS} 1\r\n".encode(),
        ]
        for raw in attempts:
            reader, writer = await asyncio.open_connection(node.host, node.port)
            try:
                assert (await reader.readline()).startswith(b"INFO ")
                writer.write(raw)
                await writer.drain()
                rest = await asyncio.wait_for(_until_hung_up(reader), 10)
                assert b"-ERR 'Authorization Violation'" in rest, rest
            finally:
                writer.close()
        assert worker.metrics.snapshot()["requests"] == 0  # nothing reached the worker
        coord = await nats.connect(auth_cluster.url(0, "coordinator"), allow_reconnect=False)
        try:
            reply = unpack((await coord.request(subjects.expert_velocity(0), data, timeout=10)).data, StepResult)
            assert isinstance(reply, StepReply)
        finally:
            await coord.close()
        assert worker.metrics.snapshot()["requests"] == 1


# ---------------------------------------------------------------- `ddm-fleet fuzz`, every target


def _fuzz(*args: str, timeout: float = 300) -> dict:
    import os
    import subprocess
    import sys

    script = Path(sys.executable).with_name("ddm-fleet")
    out = subprocess.run(
        [str(script), "fuzz", *args, "--json", "--no-progress"],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"},
    )
    assert out.returncode == 0, f"exit {out.returncode}\n{out.stdout[-4000:]}\n{out.stderr[-4000:]}"
    return json.loads(out.stdout)


@pytest.mark.parametrize("engine", ["atheris", "random"])
@pytest.mark.procs
def test_ddm_fleet_fuzz_finds_no_crash_in_the_decoders(engine):
    runs = 1500
    report = _fuzz("codec", "messages", "--runs", str(runs), "--engine", engine, "--seed", "3")
    assert report["crashes"] == 0
    assert [t["target"] for t in report["targets"]] == ["codec", "messages"]
    for t in report["targets"]:
        assert t["engine"] == engine and t["runs"] == runs and t["tried"] == runs, t
        assert t["crashes"] == 0 and t["samples"] == [], t["samples"]
        assert t["ok"] + t["clear"] == runs and t["clear"] > 0 and t["wall_s"] > 0
        assert set(t["codes"]) <= {c.value for c in ErrorCode}
    if engine == "random":  # the structure-aware generator reaches valid inputs too
        assert all(t["ok"] > 0 for t in report["targets"])


@pytest.mark.slow  # ~6 s: ddm-fleet fuzz as a process on its own fleet
@pytest.mark.procs
def test_ddm_fleet_fuzz_finds_no_crash_in_worker_coordinator_and_websocket():
    runs = 250
    report = _fuzz("worker", "coordinator", "websocket", "--runs", str(runs), "--timeout", "8", "--seed", "5")
    assert report["crashes"] == 0, json.dumps(report, indent=1)[:4000]
    assert [t["target"] for t in report["targets"]] == ["worker", "coordinator", "websocket"]
    for t in report["targets"]:
        assert t["runs"] == runs and t["tried"] == runs and t["crashes"] == 0, t
        assert t["ok"] + t["clear"] + t["unanswered"] == runs and t["ok"] > 0 and t["clear"] > 0, t
        assert t["check"] and not t["check"].startswith("FAILED"), t["check"]
    worker, coordinator, websocket = report["targets"]
    # every request is answered: cancel / status on a token that is no job id too (bad_request)
    assert worker["unanswered"] == 0 and coordinator["unanswered"] == 0 and websocket["unanswered"] == 0
    assert "bad_request" in worker["codes"] and "no_responders" in worker["codes"]
    assert "bad_request" in coordinator["codes"] and "bad_request" in websocket["codes"]
    assert coordinator["oks"].get("job_status", 0) > 0, coordinator["oks"]  # the status subject is fuzzed
    assert coordinator["codes"].get("not_a_job_id", 0) > 0, coordinator["codes"]  # answered bad_request


def test_fuzz_messages_target_covers_job_status():
    """`ddm-fleet fuzz messages` decodes JobStatus (the status reply): it is a target, it has valid
    seeds in every state family, and the generator reaches both its accepted and refused paths."""
    import random

    from fuzzing.inputs import corpus, messages_one, pure_inputs
    from schemas import JobStatus

    assert JobStatus in MESSAGE_TARGETS
    seeds = [s for s in message_seeds() if s["kind"] == "job_status"]
    assert {s["state"] for s in seeds} >= {"queued", "running", "unknown"}
    index = MESSAGE_TARGETS.index(JobStatus)
    assert sum(1 for c in corpus("messages") if c[0] == index) == len(seeds)
    for c in corpus("messages"):
        if c[0] == index:
            assert messages_one(c) == ("ok", "JobStatus")
    gen = pure_inputs("messages", random.Random("job-status"))
    outcomes = {"ok": 0, "clear": 0}
    for _ in range(4000):
        data = gen()
        if MESSAGE_TARGETS[data[0] % len(MESSAGE_TARGETS)] is JobStatus:
            kind, detail = messages_one(data)
            outcomes[kind] += 1
            if kind == "ok":
                assert detail == "JobStatus"
    assert outcomes["ok"] > 0 and outcomes["clear"] > 0, outcomes


def test_subject_tokens_refuse_a_trailing_newline():
    """Regression: `^...$` also matched "abc\\n", so job_events("abc\\n") built a subject with a
    newline in it (a broken NATS protocol line)."""
    from schemas import subjects

    for bad in ("abc\n", "abc\r\n", "a b", "", "x" * 65, "a.b", "é"):
        for make in (subjects.job_events, subjects.job_cancel, subjects.job_status):
            with pytest.raises(ValueError):
                make("anon", bad)
            with pytest.raises(ValueError):
                make(bad, "j1")
        with pytest.raises(ValueError):
            subjects.jobs_submit(bad)
        with pytest.raises(ValueError):
            subjects.inbox_prefix(bad)
        assert subjects.parse_job_subject(f"{subjects.CLIENTS_PREFIX}.anon.jobs.{bad}.cancel") is None
        assert subjects.parse_job_subject(f"{subjects.CLIENTS_PREFIX}.{bad}.jobs.j1.cancel") is None
        assert subjects.parse_submit_subject(f"{subjects.CLIENTS_PREFIX}.{bad}.jobs.submit") is None
    assert subjects.job_events("c-1", "web-0_A") == f"{subjects.PREFIX}.c.c-1.jobs.web-0_A.events"
