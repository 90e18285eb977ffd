"""Every message type round-trips through pack -> unpack (alone and through its
discriminated union), and every malformed message is refused with the right ErrorCode."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
from pydantic import BaseModel

import schemas
from schemas import (
    PROTOCOL_VERSION,
    CancelReply,
    CancelRequest,
    DoneEvent,
    DonePartEvent,
    ErrorCode,
    ErrorReply,
    FailedEvent,
    FrameEvent,
    JobAccepted,
    JobEvent,
    JobRejected,
    JobRequest,
    ProtocolError,
    StepReply,
    StepRequest,
    StepResult,
    SubmitReply,
    pack,
    unpack,
    validate,
)
from schemas import messages as messages_mod
from schemas.limits import MAX_ID_LEN, MAX_JOB_IMAGES, MAX_JOB_STEPS, MAX_STEP_ROWS
from schemas.tensor import encode_tensor

RNG = np.random.default_rng(1234)


def _x(b=3, c=1, h=8, w=8, dtype=np.float32):
    return RNG.standard_normal((b, c, h, w)).astype(dtype)


def _step_request(**kw) -> StepRequest:
    b = 3
    fields = dict(
        expert=1,
        x_t=_x(b),
        t=np.array([0.0, 0.5, 1.0], np.float32),
        y=np.array([3, 7, 0], np.int64),
        row_ids=["j1:0", "j1:1", "j2:0"],
        deadline=1.7e9,
        request_id="req-1",
    )
    fields.update(kw)
    return StepRequest(**fields)


#: One fully populated instance of every message type.
SAMPLES: list[BaseModel] = [
    _step_request(),
    StepRequest(expert=0, x_t=_x(1), t=np.zeros(1, np.float64), y=np.zeros(1, np.uint8)),  # defaults, other dtypes
    StepReply(
        expert=1,
        velocity=_x(3),
        row_ids=["a", "b", "c"],
        backend="torch",
        device="cpu",
        worker_id="w-1",
        compute_ms=12.5,
        batch_rows=8,
    ),
    StepReply(expert=0, velocity=_x(2, dtype=np.float16)),
    ErrorReply(code=ErrorCode.TOO_LARGE, message="batch of 600 rows exceeds the limit of 512", request_id="req-9"),
    JobRequest(
        job_id="job_1",
        digits=[0, 1, 9],
        steps=20,
        solver="heun",
        strategy="topk",
        top_k=2,
        seed=42,
        stream=False,
        frame_every=5,
        deadline_s=30.0,
    ),
    JobRequest(count=4, session="tab-1"),
    JobAccepted(
        job_id="job_1",
        events_subject=schemas.subjects.job_events("anon", "job_1"),
        digits=[0, 1, 9],
        seed=42,
        queue_position=3,
    ),
    JobRejected(code=ErrorCode.OVERLOADED, reason="too many jobs in flight"),
    FrameEvent(
        job_id="job_1",
        step=5,
        steps=20,
        t=0.25,
        x=_x(3, dtype=np.float16),
        experts=[0, 1, -1],
        weights=np.array([[1, 0], [0, 1], [0.5, 0.5]], np.float32),
        notes=["row 2: expert 1 slow"],
    ),
    DoneEvent(
        job_id="job_1",
        images=np.clip(_x(3), -1, 1),
        digits=[0, 1, 9],
        usage=np.array([[1, 0], [0, 1], [0.5, 0.5]], np.float32),
        steps=20,
        strategy="full",
        elapsed_s=1.25,
        notes=["done"],
    ),
    FailedEvent(job_id="job_1", code=ErrorCode.UNAVAILABLE, reason="no worker for expert 1"),
    CancelRequest(job_id="job_1"),
    CancelReply(job_id="job_1", cancelled=False, reason="already done"),
]

if hasattr(messages_mod, "FleetStatus"):  # added alongside the coordinator's status endpoint
    SAMPLES.append(
        messages_mod.FleetStatus(
            coordinator="coord-1",
            active_jobs=2,
            active_rows=12,
            queued_jobs=1,
            max_rows=256,
            max_queued_jobs=64,
            num_experts=2,
            jobs_submitted=10,
            jobs_done=7,
            jobs_failed=1,
            jobs_cancelled=1,
            jobs_rejected=0,
            images_done=70,
            ticks=400,
            rows_per_s=210.5,
            tick_ms_p50=40.0,
            uptime_s=12.5,
            unavailable_experts=[1],
        )
    )

if hasattr(messages_mod, "JobStatus"):  # added alongside the coordinator's job status endpoint
    SAMPLES.append(messages_mod.JobStatus(job_id="job_1", state="running", step=5, steps=20, coordinator="coord-1"))
    SAMPLES.append(messages_mod.JobStatus(job_id="job_2", state="unknown"))
    SAMPLES.append(
        messages_mod.JobStatus(
            job_id="job_3", state="unknown", coordinator="coord-b", instance="20261126T085650Z-00aa11"
        )
    )

SAMPLES.append(
    JobAccepted(
        job_id="job_2",
        events_subject=schemas.subjects.job_events("anon", "job_2"),
        digits=[4],
        seed=1,
        coordinator="coord-a",
        instance="20261126T085649Z-3fa2c1",
    )
)

SAMPLES.append(messages_mod.DecodeRequest(decoder="ab" * 32, latents=_x(2), request_id="r1", deadline=5.0))
SAMPLES.append(messages_mod.DecodeReply(decoder="0f" * 32, images=_x(2), worker_id="w", device="cpu", compute_ms=1.5))
SAMPLES.append(  # a latent fleet's done, with the latents the job asked for
    DoneEvent(
        job_id="j_lat",
        images=_x(1),
        digits=[3],
        usage=np.ones((1, 2), np.float32),
        steps=4,
        strategy="top1",
        elapsed_s=0.5,
        latents=np.zeros((1, 4, 8, 8), np.float32),
    )
)

# a result too large for one message (JobRequest.image_parts): its parts, then the done that counts them
SAMPLES.append(DonePartEvent(job_id="j_big", part=0, parts=3, start=0, total=3, images=np.clip(_x(2), -1, 1)))
SAMPLES.append(DonePartEvent(job_id="j_big", part=2, parts=3, start=0, total=3, latents=_x(3), epoch=2))
SAMPLES.append(
    DoneEvent(
        job_id="j_big",
        parts=3,
        labels=[0, 11, -1],
        usage=np.ones((3, 2), np.float32),
        steps=4,
        strategy="top1",
        elapsed_s=0.5,
        epoch=2,
    )
)
SAMPLES.append(JobRequest(job_id="j_big", count=3, image_parts=True))

UNIONS = {
    JobEvent: (JobAccepted, FrameEvent, DonePartEvent, DoneEvent, FailedEvent),
    SubmitReply: (JobAccepted, JobRejected, ErrorReply),
    StepResult: (StepReply, ErrorReply),
    messages_mod.DecodeResult: (messages_mod.DecodeReply, ErrorReply),
}


def _equal(a: BaseModel, b: BaseModel) -> None:
    assert type(a) is type(b)
    for name in type(a).model_fields:
        va, vb = getattr(a, name), getattr(b, name)
        if isinstance(va, np.ndarray):
            assert isinstance(vb, np.ndarray) and not vb.flags.writeable
            assert va.dtype == vb.dtype and va.shape == vb.shape and va.tobytes() == vb.tobytes(), name
        else:
            assert va == vb and type(va) is type(vb), (name, va, vb)


def test_samples_cover_every_message_type():
    defined = {
        obj
        for obj in vars(messages_mod).values()
        if isinstance(obj, type)
        and issubclass(obj, messages_mod.Message)
        and obj is not messages_mod.Message
        and not obj.__name__.startswith("_")
    }
    assert defined == {type(m) for m in SAMPLES}
    exported = {getattr(schemas, n) for n in schemas.__all__ if isinstance(getattr(schemas, n), type)}
    assert defined <= exported


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip_every_message(msg):
    raw = pack(msg)
    assert isinstance(raw, bytes)
    _equal(msg, unpack(raw, type(msg)))
    wire = msgpack.unpackb(raw, raw=False)
    assert wire["v"] == PROTOCOL_VERSION and wire["kind"] == type(msg).model_fields["kind"].default
    assert pack(unpack(raw, type(msg))) == raw  # stable re-encoding


@pytest.mark.parametrize("union", list(UNIONS), ids=["JobEvent", "SubmitReply", "StepResult", "DecodeResult"])
def test_round_trip_through_discriminated_unions(union):
    members = UNIONS[union]
    for msg in SAMPLES:
        raw = pack(msg)
        if isinstance(msg, members):
            _equal(msg, unpack(raw, union))
        else:
            err = pytest.raises(ProtocolError, unpack, raw, union).value
            assert err.code is ErrorCode.BAD_REQUEST and "kind" in err.message


def test_every_union_member_has_a_sample():
    for members in UNIONS.values():
        assert set(members) <= {type(m) for m in SAMPLES}


def test_error_codes_travel_as_strings_and_come_back_as_enums():
    wire = msgpack.unpackb(pack(SAMPLES[4]), raw=False)
    assert wire["code"] == "too_large"
    assert unpack(pack(SAMPLES[4]), StepResult).code is ErrorCode.TOO_LARGE
    wire["code"] = "no_such_code"  # a newer release's code: kept as its string, a failure like any other
    newer = validate(wire, ErrorReply)
    assert isinstance(newer.code, ErrorCode) and newer.code.value == "no_such_code" and newer.code == "no_such_code"
    assert newer.code not in list(ErrorCode) and msgpack.unpackb(pack(newer), raw=False)["code"] == "no_such_code"
    err = pytest.raises(ProtocolError, validate, {**wire, "code": "Not A Code!"}, ErrorReply).value
    assert err.code is ErrorCode.BAD_REQUEST and "Not A Code!" in err.message and "bad_shape" in err.message
    for bad in (3, None, ["bad_request"], b"bad_request", "x" * 65):
        err = pytest.raises(ProtocolError, validate, {**wire, "code": bad}, ErrorReply).value
        assert err.code is ErrorCode.BAD_REQUEST and "error code must be one of" in err.message


def test_long_error_messages_are_clipped_not_rejected():
    msg = ErrorReply(code="internal", message="x" * 10_000)
    assert len(msg.message) == messages_mod.MAX_MESSAGE_LEN
    assert unpack(pack(msg), ErrorReply).message == msg.message


# ---------------------------------------------------------------- malformed messages


def _wire(msg: BaseModel) -> dict:
    return msgpack.unpackb(pack(msg), raw=False)


def _refused(obj, tp, code: ErrorCode, *words: str) -> ProtocolError:
    raw = msgpack.packb(obj, use_bin_type=True)
    with pytest.raises(ProtocolError) as info:
        unpack(raw, tp)
    err = info.value
    assert err.code is code, err
    for w in words:
        assert w in err.message, (w, err.message)
    return err


def test_missing_fields_are_bad_request_naming_the_field():
    good = _wire(_step_request())
    for name in ("expert", "x_t", "t", "y"):
        _refused({k: v for k, v in good.items() if k != name}, StepRequest, ErrorCode.BAD_REQUEST, name)
    _refused({k: v for k, v in good.items() if k != "v"}, StepRequest, ErrorCode.BAD_REQUEST, "version")
    _refused({k: v for k, v in good.items() if k != "kind"}, StepRequest, ErrorCode.BAD_REQUEST, "kind")
    for msg in SAMPLES:
        w = _wire(msg)
        required = [n for n, f in type(msg).model_fields.items() if f.is_required()]
        for name in required:
            _refused({k: v for k, v in w.items() if k != name}, type(msg), ErrorCode.BAD_REQUEST, name)


def test_extra_fields_are_bad_request():
    for msg in SAMPLES:
        _refused({**_wire(msg), "surprise": 1}, type(msg), ErrorCode.BAD_REQUEST, "surprise")


@pytest.mark.parametrize(
    "field, value",
    [
        ("expert", "1"),
        ("expert", 1.0),
        ("expert", True),
        ("expert", None),
        ("expert", -1),
        ("expert", [1]),
        ("row_ids", "abc"),
        ("row_ids", [1, 2, 3]),
        ("row_ids", ["a", "b", None]),
        ("row_ids", ["", "b", "c"]),
        ("row_ids", ["a" * (MAX_ID_LEN + 1), "b", "c"]),
        ("deadline", "tomorrow"),
        ("request_id", 5),
        ("kind", "step_reply"),
        ("kind", 3),
        ("x_t", b"raw"),
        ("x_t", None),
        ("t", [0.0, 0.5, 1.0]),
        ("y", {"dtype": "<i8"}),
    ],
)
def test_wrong_field_types_are_bad_request(field, value):
    wire = _wire(_step_request())
    _refused({**wire, field: value}, StepRequest, ErrorCode.BAD_REQUEST)


def test_wrong_types_in_job_request_are_not_coerced():
    base = _wire(JobRequest(digits=[1, 2]))
    for field, value in [
        ("steps", "40"),
        ("steps", 40.0),
        ("stream", 1),
        ("stream", "yes"),
        ("digits", [1, "2"]),
        ("digits", [1.0]),
        ("seed", "7"),
        ("solver", "rk4"),
        ("strategy", "best"),
    ]:
        _refused({**base, field: value}, JobRequest, ErrorCode.BAD_REQUEST, field)
    ok = validate({**base, "deadline_s": 5}, JobRequest)  # an int is a fine float
    assert ok.deadline_s == 5.0 and isinstance(ok.deadline_s, float)


def test_unknown_protocol_version_is_unsupported_version_even_for_unknown_kinds():
    for msg in SAMPLES:
        err = _refused({**_wire(msg), "v": 2}, type(msg), ErrorCode.UNSUPPORTED_VERSION, "2", f"v{PROTOCOL_VERSION}")
        assert "not supported" in err.message
    # a future message we do not know, with fields we do not know: the version is what we report
    _refused({"v": 2, "kind": "hologram", "z": 1}, JobEvent, ErrorCode.UNSUPPORTED_VERSION)
    _refused({"v": 0, "kind": "cancel", "job_id": "a"}, CancelRequest, ErrorCode.UNSUPPORTED_VERSION)
    for bad in ("1", 1.0, True, None):
        _refused({**_wire(SAMPLES[0]), "v": bad}, StepRequest, ErrorCode.BAD_REQUEST, "v")


def test_unknown_kind_in_a_union_is_bad_request():
    _refused({"v": 1, "kind": "hologram"}, JobEvent, ErrorCode.BAD_REQUEST, "kind")


# -- StepRequest shapes and values


def _with(msg_wire: dict, **tensors) -> dict:
    return {**msg_wire, **{k: encode_tensor(v) for k, v in tensors.items()}}


@pytest.mark.parametrize(
    "tensors, code, words",
    [
        (dict(x_t=np.zeros((3, 64), np.float32)), ErrorCode.BAD_SHAPE, ["x_t", "[B, C, H, W]"]),
        (dict(x_t=np.zeros((3, 1, 1, 8, 8), np.float32)), ErrorCode.BAD_SHAPE, ["x_t"]),
        (
            dict(x_t=np.zeros((0, 1, 8, 8), np.float32), t=np.zeros(0, np.float32), y=np.zeros(0, np.int64)),
            ErrorCode.BAD_SHAPE,
            ["empty"],
        ),
        (dict(t=np.zeros(2, np.float32)), ErrorCode.BAD_SHAPE, ["t must be [B] = [3]"]),
        (dict(t=np.zeros((3, 1), np.float32)), ErrorCode.BAD_SHAPE, ["t must be"]),
        (dict(y=np.zeros(4, np.int64)), ErrorCode.BAD_SHAPE, ["y must be [B] = [3]"]),
        (dict(y=np.zeros((), np.int64)), ErrorCode.BAD_SHAPE, ["y"]),
        (dict(x_t=np.zeros((3, 1, 8, 8), np.int32)), ErrorCode.BAD_DTYPE, ["x_t", "float"]),
        (dict(t=np.zeros(3, np.int64)), ErrorCode.BAD_DTYPE, ["t must be a float"]),
        (dict(y=np.zeros(3, np.float32)), ErrorCode.BAD_DTYPE, ["y must be an integer"]),
        (dict(y=np.zeros(3, np.bool_)), ErrorCode.BAD_DTYPE, ["y"]),
        (dict(t=np.array([0.0, 1.5, 0.5], np.float32)), ErrorCode.BAD_REQUEST, ["[0, 1]"]),
        (dict(t=np.array([0.0, -1e-6, 0.5], np.float32)), ErrorCode.BAD_REQUEST, ["[0, 1]"]),
        (dict(t=np.array([0.0, np.nan, 0.5], np.float32)), ErrorCode.NON_FINITE, ["t"]),
        (dict(t=np.array([0.0, np.inf, 0.5], np.float32)), ErrorCode.NON_FINITE, ["t"]),
        (dict(x_t=np.full((3, 1, 8, 8), np.nan, np.float32)), ErrorCode.NON_FINITE, ["x_t", "192 NaN/Inf"]),
        (dict(x_t=np.full((3, 1, 8, 8), -np.inf, np.float16)), ErrorCode.NON_FINITE, ["x_t"]),
    ],
)
def test_step_request_shape_dtype_and_value_checks(tensors, code, words):
    _refused(_with(_wire(_step_request()), **tensors), StepRequest, code, *words)


def test_step_request_row_ids_length_must_match_batch():
    wire = _wire(_step_request())
    _refused({**wire, "row_ids": ["a", "b"]}, StepRequest, ErrorCode.BAD_SHAPE, "row_ids", "2", "3")
    _refused({**wire, "row_ids": ["a", "b", "c", "d"]}, StepRequest, ErrorCode.BAD_SHAPE, "row_ids")
    assert validate({**wire, "row_ids": []}, StepRequest).row_ids == []  # empty means "not used"


def test_step_request_size_mismatch_inside_a_tensor_is_bad_shape():
    wire = _wire(_step_request())
    wire["x_t"]["data"] = wire["x_t"]["data"][:-4]
    _refused(wire, StepRequest, ErrorCode.BAD_SHAPE, "x_t", "bytes")
    wire = _wire(_step_request())
    wire["y"]["shape"] = [4]  # claims more rows than it carries
    _refused(wire, StepRequest, ErrorCode.BAD_SHAPE, "y")


def test_step_request_dtype_refusals_reach_the_client_as_bad_dtype():
    wire = _wire(_step_request())
    for dtype in ("|O", ">f4", "<c8", "bogus"):
        w = {**wire, "x_t": {**wire["x_t"], "dtype": dtype}}
        _refused(w, StepRequest, ErrorCode.BAD_DTYPE, "x_t")


def test_oversize_batch_rows_are_too_large():
    n = MAX_STEP_ROWS + 1
    wire = _with(
        _wire(_step_request(row_ids=[])),
        x_t=np.zeros((n, 1, 2, 2), np.float32),
        t=np.zeros(n, np.float32),
        y=np.zeros(n, np.int64),
    )
    _refused(wire, StepRequest, ErrorCode.TOO_LARGE, str(MAX_STEP_ROWS))
    n = MAX_STEP_ROWS  # the limit itself is fine
    ok = _with(wire, x_t=np.zeros((n, 1, 2, 2), np.float32), t=np.zeros(n, np.float32), y=np.zeros(n, np.int64))
    assert validate(ok, StepRequest).x_t.shape[0] == n


def test_huge_tensor_claim_inside_a_message_is_too_large():
    wire = _wire(_step_request())
    wire["x_t"] = {"dtype": "<f4", "shape": [2**40, 1, 32, 32], "data": b""}
    _refused(wire, StepRequest, ErrorCode.TOO_LARGE, "x_t")


# -- other messages


def test_step_reply_checks():
    wire = _wire(SAMPLES[2])
    _refused({**wire, "row_ids": ["a"]}, StepReply, ErrorCode.BAD_SHAPE, "row_ids")
    _refused(_with(wire, velocity=np.zeros((3, 64), np.float32)), StepReply, ErrorCode.BAD_SHAPE, "velocity")
    _refused(_with(wire, velocity=np.full((3, 1, 2, 2), np.inf, np.float32)), StepReply, ErrorCode.NON_FINITE)
    _refused(_with(wire, velocity=np.zeros((3, 1, 2, 2), np.int8)), StepReply, ErrorCode.BAD_DTYPE)
    _refused({**wire, "compute_ms": -1.0}, StepReply, ErrorCode.BAD_REQUEST, "compute_ms")


def test_job_request_rules():
    assert JobRequest(count=2).n_images == 2 and JobRequest(digits=[1, 2, 3]).n_images == 3
    base = _wire(JobRequest(digits=[1]))
    both = {**base, "count": 3}
    _refused(both, JobRequest, ErrorCode.BAD_REQUEST, "exactly one")
    _refused({k: v for k, v in base.items() if k != "digits"}, JobRequest, ErrorCode.BAD_REQUEST, "exactly one")
    _refused({**base, "digits": []}, JobRequest, ErrorCode.BAD_REQUEST, "empty")
    _refused({**base, "digits": [10]}, JobRequest, ErrorCode.BAD_REQUEST, "digits")
    _refused({**base, "digits": [0] * (MAX_JOB_IMAGES + 1)}, JobRequest, ErrorCode.TOO_LARGE, str(MAX_JOB_IMAGES))
    _refused({**base, "digits": None, "count": MAX_JOB_IMAGES + 1}, JobRequest, ErrorCode.BAD_REQUEST, "count")
    _refused({**base, "steps": MAX_JOB_STEPS + 1}, JobRequest, ErrorCode.BAD_REQUEST, "steps")
    _refused({**base, "steps": 0}, JobRequest, ErrorCode.BAD_REQUEST, "steps")
    for bad_id in ("has space", "a.b", "*", ">", "", "x" * 65):
        _refused({**base, "job_id": bad_id}, JobRequest, ErrorCode.BAD_REQUEST, "job_id")
    _refused({**base, "seed": -1}, JobRequest, ErrorCode.BAD_REQUEST, "seed")
    _refused({**base, "deadline_s": 0}, JobRequest, ErrorCode.BAD_REQUEST, "deadline_s")


def test_frame_and_done_event_shape_checks():
    frame = _wire(SAMPLES[9])
    _refused({**frame, "experts": [0, 1]}, FrameEvent, ErrorCode.BAD_SHAPE, "experts")
    _refused(_with(frame, weights=np.zeros((2, 2), np.float32)), FrameEvent, ErrorCode.BAD_SHAPE, "weights")
    _refused(_with(frame, x=np.zeros((3, 64), np.float16)), FrameEvent, ErrorCode.BAD_SHAPE, "x")
    _refused({**frame, "t": 1.5}, FrameEvent, ErrorCode.BAD_REQUEST, "t")
    _refused({**frame, "step": 21}, FrameEvent, ErrorCode.BAD_REQUEST, "step")
    done = _wire(SAMPLES[10])
    _refused({**done, "digits": [1]}, DoneEvent, ErrorCode.BAD_SHAPE, "digits")
    _refused(_with(done, usage=np.zeros(3, np.float32)), DoneEvent, ErrorCode.BAD_SHAPE, "usage")
    _refused(_with(done, images=np.full((3, 1, 8, 8), np.nan, np.float32)), DoneEvent, ErrorCode.NON_FINITE, "images")
    _refused({**done, "strategy": "best"}, DoneEvent, ErrorCode.BAD_REQUEST, "strategy")


def test_in_process_construction_rejects_the_same_things():
    # servers build replies in Python; a bad reply must fail there, not on the client
    from pydantic import ValidationError

    with pytest.raises(ValidationError):
        StepReply(expert=0, velocity=np.full((1, 1, 2, 2), np.nan, np.float32))
    with pytest.raises(ValidationError):
        FrameEvent(job_id="a", step=0, steps=1, t=0.5, x=np.array([object()]), experts=[0], weights=np.zeros((1, 2)))


def test_coordinator_name_and_instance_are_optional_and_bounded():
    """`accepted` / `job_status` name the answering coordinator and its run; an old peer that sends
    neither decodes to "" (no owner known), and a name or instance over 128 characters is refused."""
    bare = msgpack.packb({"v": 1, "kind": "accepted", "job_id": "j1", "events_subject": "e", "digits": [1], "seed": 0})
    accepted = unpack(bare, JobAccepted)
    assert (accepted.coordinator, accepted.instance) == ("", "")
    for field in ("coordinator", "instance"):
        with pytest.raises(ProtocolError) as err:
            unpack(
                msgpack.packb(
                    {
                        "v": 1,
                        "kind": "accepted",
                        "job_id": "j1",
                        "events_subject": "e",
                        "digits": [1],
                        "seed": 0,
                        field: "x" * 129,
                    }
                ),
                JobAccepted,
            )
        assert err.value.code == ErrorCode.BAD_REQUEST and field in err.value.message
    with pytest.raises(ProtocolError) as err:
        unpack(
            msgpack.packb({"v": 1, "kind": "job_status", "job_id": "j1", "state": "unknown", "instance": "x" * 129}),
            messages_mod.JobStatus,
        )
    assert err.value.code == ErrorCode.BAD_REQUEST and "instance" in err.value.message
