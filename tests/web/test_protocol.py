"""Pure units of the web viewer: parsing page messages, encoding tiles, the outbox."""

from __future__ import annotations

import asyncio
import base64
import json

import numpy as np
import pytest

from schemas import MAX_JOB_IMAGES, ErrorCode, FailedEvent, FrameEvent, JobRequest, pack, unpack
from web.frames import event_message, tiles_b64
from web.protocol import BadInput, Cancel, Generate, Ping, parse_client_message, parse_digits
from web.session import Outbox


@pytest.mark.parametrize("text, digits", [("3,7,7", [3, 7, 7]), (" 0 9 ; 5 ", [0, 9, 5]), ("4", [4]), ([1, 2], [1, 2])])
def test_parse_digits_accepts(text, digits):
    assert parse_digits(text) == digits


@pytest.mark.parametrize(
    "value, fragment",
    [
        ("", "at least one digit"),
        ("3,a", "'a' is not a digit"),
        ("10", "'10' is not a digit"),
        ("-2", "'-2' is not a digit"),
        ([1, True], "integers 0-9"),
        ([11], "integers 0-9"),
        (3, "string like"),
    ],
)
def test_parse_digits_refuses_with_a_reason(value, fragment):
    with pytest.raises(BadInput) as err:
        parse_digits(value)
    assert fragment in str(err.value)


def test_generate_builds_a_schema_job_request():
    cmd = parse_client_message(
        json.dumps(
            {
                "type": "generate",
                "digits": "1,2",
                "steps": 12,
                "strategy": "full",
                "solver": "heun",
                "seed": 3,
                "ref": "r1",
            }
        )
    )
    assert isinstance(cmd, Generate) and cmd.ref == "r1"
    r = cmd.request
    assert (r.digits, r.steps, r.strategy, r.solver, r.seed, r.job_id) == ([1, 2], 12, "full", "heun", 3, None)
    assert r.n_images == 2
    big = parse_client_message(json.dumps({"type": "generate", "count": 1, "seed": "9223372036854775807"})).request
    assert big.seed == 2**63 - 1  # seeds come as text from the page; exact past 2**53
    with pytest.raises(BadInput, match="seed"):
        parse_client_message(json.dumps({"type": "generate", "count": 1, "seed": "9223372036854775808"}))
    with pytest.raises(BadInput, match="seed"):
        parse_client_message(json.dumps({"type": "generate", "count": 1, "seed": "12ab"}))


def test_empty_fields_fall_back_to_defaults_and_limits_are_the_schemas():
    r = parse_client_message(json.dumps({"type": "generate", "digits": "", "count": 5, "steps": None})).request
    assert r.count == 5 and r.digits is None and r.steps == 40
    with pytest.raises(BadInput) as err:
        parse_client_message(json.dumps({"type": "generate", "count": MAX_JOB_IMAGES + 1}))
    assert f"less than or equal to {MAX_JOB_IMAGES}" in str(err.value)


@pytest.mark.parametrize("value, expected", [(1, 1.0), (30, 30.0), (2.5, 2.5), (3600, 3600.0), (None, None)])
def test_generate_passes_a_deadline_into_the_job_request(value, expected):
    r = parse_client_message(json.dumps({"type": "generate", "digits": "3", "deadline_s": value})).request
    assert r.deadline_s == expected


@pytest.mark.parametrize(
    "value, fragment",
    [
        (0.5, "deadline_s must be 1-3600 seconds, got 0.5"),
        (0, "1-3600 seconds, got 0"),
        (-5, "got -5"),
        (3601, "1-3600 seconds, got 3601"),
        (1e300, "1-3600 seconds"),
        ("30", "deadline_s must be a number of seconds (1-3600), got '30'"),
        (True, "a number of seconds"),
        ([30], "a number of seconds"),
        ({"s": 1}, "a number of seconds"),
    ],
)
def test_generate_refuses_a_deadline_out_of_bounds_with_the_bounds(value, fragment):
    with pytest.raises(BadInput) as err:
        parse_client_message(json.dumps({"type": "generate", "digits": "3", "deadline_s": value, "ref": 9}))
    assert fragment in err.value.message and err.value.ref == 9 and err.value.code == "bad_request"


def test_other_messages_and_refs():
    assert parse_client_message('{"type": "ping", "ref": 4}') == Ping(4)
    assert parse_client_message('{"type": "cancel", "job_id": "web1"}') == Cancel("web1")
    with pytest.raises(BadInput, match="ref must be"):
        parse_client_message(json.dumps({"type": "ping", "ref": {"a": 1}}))
    with pytest.raises(BadInput, match="malformed JSON"):
        parse_client_message("[" * 100_000)  # deep nesting is an error message, not a crash
    with pytest.raises(BadInput) as err:
        parse_client_message('{"type": "generate", "digits": "x", "ref": 7}')
    assert err.value.ref == 7  # errors carry the ref so the page can match them


def test_tiles_are_the_channel_mean_in_pixels_and_survive_non_finite():
    x = np.array([-1.0, 0.0, 1.0, 5.0, np.nan, np.inf, -np.inf, -3.0], np.float32).reshape(1, 1, 2, 4)
    assert list(base64.b64decode(tiles_b64(x)[0])) == [0, 128, 255, 255, 0, 255, 0, 0]
    two = np.stack([np.full((2, 2), -1.0), np.full((2, 2), 0.0)], axis=0)[None]  # [1, 2, 2, 2]: mean -0.5
    assert list(base64.b64decode(tiles_b64(two)[0])) == [64] * 4  # rint(63.75)
    with pytest.raises(ValueError, match="N, C, H, W"):
        tiles_b64(np.zeros((2, 32, 32)))


def test_tiles_are_raw_gray_bytes_per_image():
    x = np.stack([np.full((1, 32, 32), -1.0), np.full((1, 32, 32), 1.0)]).astype(np.float16)
    tiles = tiles_b64(x)
    assert [set(base64.b64decode(t)) for t in tiles] == [{0}, {255}]
    assert all(len(base64.b64decode(t)) == 1024 for t in tiles)


def test_event_messages():
    ev = FrameEvent(
        job_id="j1",
        step=3,
        steps=10,
        t=0.3,
        x=np.zeros((2, 1, 32, 32), np.float16),
        experts=[0, -1],
        weights=np.array([[0.12345, 0.87655], [0.5, 0.5]], np.float32),
    )
    msg = event_message(ev)
    assert msg["type"] == "frame" and msg["size"] == [32, 32] and len(msg["tiles"]) == 2
    assert msg["weights"][0] == [0.123, 0.877] and msg["experts"] == [0, -1]
    fail = event_message(FailedEvent(job_id="j1", code=ErrorCode.UNAVAILABLE, reason="expert 1 gone"))
    assert fail == {"type": "failed", "job_id": "j1", "code": "unavailable", "reason": "expert 1 gone"}
    with pytest.raises(TypeError):
        event_message(object())


async def test_outbox_coalesces_frames_and_keeps_order():
    box = Outbox()
    box.put({"n": 1})
    box.put_latest("a", "a1")
    box.put_latest("b", "b1")
    box.put_latest("a", "a2")  # replaces a1, keeps a's place before b
    box.put({"n": 2})
    box.put_latest("c", "c1")
    box.drop("c")
    got = [await box.get() for _ in range(4)]
    assert got == [("msg", {"n": 1}), ("latest", "a2"), ("latest", "b1"), ("msg", {"n": 2})]
    waiter = asyncio.ensure_future(box.get())
    await asyncio.sleep(0.01)  # a chance to (wrongly) complete: there is no event for 'nothing happened'
    assert not waiter.done()  # dropped 'c' is skipped; nothing else queued
    box.close()
    assert await waiter is None


async def test_a_dropped_slot_queued_again_goes_last_and_previews_are_not_superseded():
    box = Outbox()
    box.put_latest("job", "frame 3")
    box.drop("job")  # a preview frame supersedes it (web/session.py `_queue_event`)
    box.put_latest("job/preview", "preview 4")
    box.put_latest("job", "frame 5")  # queued after the preview, never in frame 3's old place
    got = [await box.get() for _ in range(2)]
    assert got == [("latest", "preview 4"), ("latest", "frame 5")]


def test_generate_passes_frame_x1_through_as_a_strict_boolean():
    base = {"type": "generate", "digits": "1,2"}
    assert parse_client_message(json.dumps(base)).request.frame_x1 is False  # off unless asked
    assert parse_client_message(json.dumps({**base, "frame_x1": True})).request.frame_x1 is True
    assert parse_client_message(json.dumps({**base, "frame_x1": False})).request.frame_x1 is False
    for bad in ("yes", 1, [True]):
        with pytest.raises(BadInput) as err:
            parse_client_message(json.dumps({**base, "frame_x1": bad, "ref": 7}))
        assert "frame_x1" in err.value.message and err.value.ref == 7


def test_frame_message_forwards_x1_tiles_only_when_the_event_has_them():
    x = np.zeros((2, 1, 4, 4), np.float16)
    x1 = np.ones((2, 1, 4, 4), np.float16)
    w = np.full((2, 2), 0.5, np.float32)
    plain = event_message(FrameEvent(job_id="j", step=1, steps=4, t=0.25, x=x, experts=[0, 1], weights=w))
    assert "x1" not in plain
    msg = event_message(FrameEvent(job_id="j", step=1, steps=4, t=0.25, x=x, x1=x1, experts=[0, 1], weights=w))
    assert len(msg["x1"]) == 2 and msg["tiles"] == plain["tiles"]
    assert base64.b64decode(msg["x1"][0]) == bytes([255] * 16)  # +1 -> white
    assert base64.b64decode(msg["tiles"][0]) == bytes([128] * 16)  # 0 -> mid grey


@pytest.mark.parametrize("value, expected", [(3, 3.0), (1.5, 1.5), (0, 0.0), (20, 20.0), (7.25, 7.25)])
def test_generate_passes_a_guidance_scale_into_the_job_request(value, expected):
    r = parse_client_message(json.dumps({"type": "generate", "digits": "3,7", "guidance_scale": value})).request
    assert r.guidance_scale == expected and isinstance(r.guidance_scale, float)
    assert r.n_guided == 2
    assert unpack(pack(r.model_copy(update={"job_id": "web1"})), JobRequest).guidance_scale == expected


def test_no_guidance_scale_leaves_the_job_request_byte_identical_and_one_turns_it_off():
    base = {"type": "generate", "digits": "3,?", "steps": 12, "seed": 4}
    plain = parse_client_message(json.dumps(base)).request
    for unset in (None, ""):  # empty fields fall back to the default like the others: the fleet's scale
        one = parse_client_message(json.dumps({**base, "guidance_scale": unset})).request
        assert one == plain and one.guidance_scale is None and one.n_guided == 0
        assert pack(one.model_copy(update={"job_id": "web1"})) == pack(plain.model_copy(update={"job_id": "web1"}))
    assert b"guidance_scale" not in pack(plain.model_copy(update={"job_id": "web1"}))
    for off in (1, 1.0):  # asked for: off, even on a fleet whose default guides, so it goes on the wire
        one = parse_client_message(json.dumps({**base, "guidance_scale": off})).request
        assert one.guidance_scale == 1.0 and one.guidance == 1.0 and one.n_guided == 0
        assert unpack(pack(one.model_copy(update={"job_id": "web1"})), JobRequest).guidance_scale == 1.0


@pytest.mark.parametrize(
    "text, fragment",
    [
        ('"3"', "guidance_scale must be a number (0-20, 1 = off), got '3'"),
        ("true", "guidance_scale must be a number (0-20, 1 = off), got True"),
        ("[3]", "guidance_scale must be a number"),
        ('{"s": 3}', "guidance_scale must be a number"),
        ("-0.5", "guidance_scale must be 0-20, 1 = off, got -0.5"),
        ("20.5", "guidance_scale must be 0-20, 1 = off, got 20.5"),
        ("1e400", "guidance_scale must be 0-20, 1 = off, got inf"),  # json reads an overflowing float as inf
        ("NaN", "guidance_scale must be 0-20, 1 = off, got nan"),
        ("-Infinity", "got -inf"),
        ("1" + "0" * 400, "guidance_scale must be 0-20"),  # a huge integer: compared, never made a float
    ],
)
def test_generate_refuses_a_bad_guidance_scale_with_the_bounds(text, fragment):
    raw = '{"type": "generate", "digits": "3", "ref": 9, "guidance_scale": ' + text + "}"
    with pytest.raises(BadInput) as err:
        parse_client_message(raw)
    assert fragment in err.value.message and err.value.ref == 9 and err.value.code == "bad_request"
