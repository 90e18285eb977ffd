"""The viewer on any fleet: the model spec (web/spec.py) read from the coordinator and sent to the page,
RGB tiles (web/frames.py), labels as class names or indices (web/protocol.py). Pure units, then the
app against a real nats-server and a fake coordinator that serves a spec in its fleet status."""

from __future__ import annotations

import asyncio
import base64
import json

import numpy as np
import pytest

from schemas import DoneEvent, FrameEvent, JobAccepted
from schemas.spec import Conditioning, ModelSpec, legacy_spec
from tests.web.fakes import FakeCoordinator
from web.app import WebConfig, create_app
from web.frames import event_message, tile_channels, tiles_b64
from web.protocol import BadInput, parse_client_message, parse_labels
from web.spec import is_digit_fleet, spec_message, wire_label_field

RGB4 = ModelSpec(
    sample_shape=(3, 32, 32),
    conditioning=Conditioning(num_classes=4, class_names=["red", "green", "blue", "Sea Blue"]),
)
CIFAR = ModelSpec(
    sample_shape=(3, 32, 32),
    conditioning=Conditioning(
        num_classes=10,
        class_names=["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"],
    ),
)


# ---------------------------------------------------------------- tiles


def _rgb_input() -> np.ndarray:
    """[1, 3, 2, 2]: channel c of pixel (i, j)."""
    r = [[-1.0, 0.0], [1.0, 0.5]]
    g = [[1.0, 1.0], [-1.0, -1.0]]
    b = [[0.0, -1.0], [0.5, 1.0]]
    return np.array([[r, g, b]], np.float32)


def test_rgb_tiles_are_interleaved_rgb_bytes_row_major():
    tiles = tiles_b64(_rgb_input())
    assert len(tiles) == 1
    # pixel (0,0): r -1 -> 0, g 1 -> 255, b 0 -> 128 (rint(127.5)); then (0,1), (1,0), (1,1); 0.5 -> rint(191.25)
    assert list(base64.b64decode(tiles[0])) == [0, 255, 128, 128, 255, 0, 255, 0, 191, 191, 0, 255]
    assert tile_channels(3) == 3 and tile_channels(1) == tile_channels(2) == 1 and tile_channels(4) == 3


def test_other_channel_counts_first_three_channels_or_the_mean():
    x = _rgb_input()
    four = np.concatenate([x, np.full((1, 1, 2, 2), 1.0, np.float32)], axis=1)  # a 4th channel is not shown
    assert tiles_b64(four) == tiles_b64(x)
    two = x[:, :2]  # grey: the mean of the two channels
    assert list(base64.b64decode(tiles_b64(two)[0])) == [128, 191, 128, 96]  # means 0, .5, 0, -.25 (95.625 -> 96)


def test_a_value_range_other_than_minus_one_one_is_mapped_first():
    x = np.array([0.0, 0.5, 1.0, 2.0], np.float32).reshape(1, 1, 2, 2)
    assert list(base64.b64decode(tiles_b64(x, (0.0, 1.0))[0])) == [0, 128, 255, 255]
    assert tiles_b64(x * 2 - 1) == tiles_b64(x, (0.0, 1.0))


def test_frame_and_done_messages_carry_channels_and_labels():
    x = np.repeat(_rgb_input(), 2, axis=0)
    w = np.array([[1.0, 0.0], [0.0, 1.0]], np.float32)
    frame = event_message(FrameEvent(job_id="j", step=1, steps=2, t=0.5, x=x, x1=x, experts=[0, 1], weights=w))
    assert frame["channels"] == 3 and frame["size"] == [2, 2] and len(base64.b64decode(frame["tiles"][0])) == 12
    assert frame["x1"] == frame["tiles"]
    done = event_message(
        DoneEvent(job_id="j", images=x, labels=[3, -1], usage=w, steps=2, strategy="top1", elapsed_s=0.1)
    )
    assert done["channels"] == 3 and done["labels"] == done["digits"] == [3, -1]
    grey = event_message(
        DoneEvent(job_id="j", images=x[:, :1], digits=[1, 2], usage=w, steps=2, strategy="top1", elapsed_s=0)
    )
    assert grey["channels"] == 1 and grey["labels"] == [1, 2] and len(base64.b64decode(grey["tiles"][0])) == 4
    acc = event_message(JobAccepted(job_id="j", events_subject="s", labels=[0, 3], seed=5))
    assert acc["labels"] == acc["digits"] == [0, 3] and acc["seed"] == "5"


def test_a_latent_fleets_frames_show_their_decoded_previews_never_latents():
    latents = np.full((2, 4, 2, 2), 3.0, np.float32)  # in the latents' range [-4, 4]
    images = np.repeat(_rgb_input(), 2, axis=0)  # decoded: pixels in [-1, 1]
    w = np.array([[1.0, 0.0], [0.0, 1.0]], np.float32)
    kw = dict(job_id="j", steps=4, experts=[0, 1], weights=w)
    plain = event_message(FrameEvent(step=1, t=0.25, x=latents, x1=latents, **kw), (-4.0, 4.0), latent=True)
    assert plain["tiles"] == [] and plain["preview"] is False and "x1" not in plain
    assert plain["experts"] == [0, 1] and plain["weights"] == [[1.0, 0.0], [0.0, 1.0]]
    shown = event_message(
        FrameEvent(step=4, t=1.0, x=latents, preview=images.astype(np.float16), **kw), (-4.0, 4.0), latent=True
    )
    assert shown["preview"] is True and shown["size"] == [2, 2] and shown["channels"] == 3
    assert shown["tiles"] == tiles_b64(images)  # the previews in [-1, 1], not mapped from the latents' range
    done = event_message(
        DoneEvent(job_id="j", images=images, labels=[3, -1], usage=w, steps=4, strategy="top1", elapsed_s=0.1),
        (-4.0, 4.0),
        latent=True,
    )
    assert done["tiles"] == tiles_b64(images)
    # a pixel fleet: as before (tiles of x, x1 when asked, no preview key)
    pixels = event_message(FrameEvent(step=1, t=0.25, x=images, x1=images, **kw))
    assert pixels["tiles"] == pixels["x1"] == tiles_b64(images) and "preview" not in pixels


def test_preview_interval_is_a_multiple_of_frame_every():
    from web.session import preview_interval

    assert preview_interval(4, 1) == 4 and preview_interval(4, 3) == 6 and preview_interval(4, 4) == 4
    assert preview_interval(1, 5) == 5 and preview_interval(4, 999) == 999


def test_web_config_preview_every_is_bounded():
    assert WebConfig().preview_every == 4 and WebConfig(preview_every=10).preview_every == 10
    for bad in (0, -1, 10**6, True):
        with pytest.raises(ValueError, match="preview_every"):
            WebConfig(preview_every=bad)


def test_latent_spec_message_names_the_decoder():
    latent = ModelSpec.from_json(
        {**legacy_spec(in_channels=4, image_size=8).to_json(), "space": "latent", "decoder": "autoencoder@sha256:ab"}
    )
    msg = spec_message(latent)
    assert msg["space"] == "latent" and msg["decoder"] == "autoencoder@sha256:ab" and msg["sample_shape"] == [4, 8, 8]


# ---------------------------------------------------------------- spec and labels


def test_spec_message_of_the_mnist_and_an_rgb_fleet():
    mnist = spec_message(legacy_spec(), known=False)
    assert mnist == {
        "type": "spec",
        "known": False,
        "sample_shape": [1, 32, 32],
        "channels": 1,
        "size": [32, 32],
        "tile_channels": 1,
        "value_range": [-1.0, 1.0],
        "space": "pixels",
        "conditioning": "class",
        "num_classes": 10,
        "null_label": False,
        "class_names": [str(i) for i in range(10)],
        "digits": True,
        "decoder": None,
        "default_guidance_scale": None,  # the coordinator has not said
    }
    assert spec_message(legacy_spec(), default_guidance_scale=2.0)["default_guidance_scale"] == 2.0
    rgb = spec_message(RGB4)
    assert rgb["known"] and rgb["channels"] == rgb["tile_channels"] == 3 and rgb["sample_shape"] == [3, 32, 32]
    assert rgb["class_names"] == ["red", "green", "blue", "Sea Blue"] and rgb["num_classes"] == 4
    assert not rgb["digits"] and not is_digit_fleet(CIFAR) and is_digit_fleet(legacy_spec())
    unnamed = spec_message(ModelSpec(sample_shape=(3, 8, 8), conditioning=Conditioning(num_classes=3)))
    assert unnamed["class_names"] == ["0", "1", "2"] and not unnamed["digits"]
    none = spec_message(ModelSpec(sample_shape=(1, 8, 8), conditioning=Conditioning(kind="none", num_classes=0)))
    assert none["conditioning"] == "none" and none["class_names"] == []


@pytest.mark.parametrize(
    "value, labels",
    [
        ("red, blue", [0, 2]),
        ("green blue ?", [1, 2, -1]),
        ("Sea Blue; 3; -1", [3, 3, -1]),
        ("sea blue, RED", [3, 0]),  # case is ignored where it is unambiguous
        ("0 1 2 3", [0, 1, 2, 3]),
        ([3, -1, "green"], [3, -1, 1]),
    ],
)
def test_labels_are_class_names_or_indices(value, labels):
    assert parse_labels(value, RGB4) == labels


@pytest.mark.parametrize(
    "value, fragment",
    [
        ("red, purple", "'purple' is not a class of this fleet: enter class names or numbers 0-3"),
        ("4", "'4' is not a class"),
        ("", "enter at least one class, e.g. red,green,blue"),
        ([4], "class indices 0-3"),
        ([True], "class indices 0-3"),
        (7, "a string like"),
    ],
)
def test_labels_refused_with_a_reason(value, fragment):
    with pytest.raises(BadInput) as err:
        parse_labels(value, RGB4)
    assert fragment in err.value.message


def test_on_the_mnist_fleet_labels_are_digits_with_the_same_messages():
    assert parse_labels("3,7,7") == [3, 7, 7] and parse_labels("?,4") == [-1, 4]
    with pytest.raises(BadInput, match="'x' is not a digit"):
        parse_labels("3,x")


def test_the_request_names_labels_digits_on_ten_class_fleets_and_labels_otherwise():
    def request(msg, spec):
        return parse_client_message(json.dumps({"type": "generate", **msg}), spec).request

    mnist = request({"labels": "3,7"}, None)
    assert (mnist.digits, mnist.labels) == ([3, 7], None)  # v1 wire: every coordinator takes it
    assert "labels" not in mnist.model_dump()
    cifar = request({"labels": "cat, ship, ?"}, CIFAR)
    assert (cifar.digits, cifar.labels) == ([3, 8, -1], None) and wire_label_field(CIFAR) == "digits"
    rgb = request({"labels": "blue, red"}, RGB4)
    assert (rgb.labels, rgb.digits) == ([2, 0], None) and wire_label_field(RGB4) == "labels"
    assert request({"digits": [1, 2]}, RGB4).labels == [1, 2]  # v1 pages still work where the classes exist
    with pytest.raises(BadInput, match="digits: 7 is not a class of this fleet, which has classes 0-3"):
        request({"digits": "7"}, RGB4)
    with pytest.raises(BadInput, match="not both"):
        request({"digits": "1", "labels": "1"}, RGB4)
    with pytest.raises(BadInput, match="needs every image's digit"):
        request({"labels": "red, ?", "strategy": "oracle"}, RGB4)


# ---------------------------------------------------------------- the app, real bus, fake coordinator


async def _spec_msg(ws, known: bool, timeout: float = 20.0) -> dict:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        msg = await ws.receive_json(timeout=max(0.01, deadline - loop.time()))
        if msg["type"] == "spec" and msg["known"] == known:
            return msg


async def test_the_page_gets_the_coordinators_spec_and_labels_go_by_name(aiohttp_client, nats_url, nc):
    app = create_app(WebConfig(nats_url=nats_url, fleet_interval=0.2, discovery_window=0.1, submit_timeout=3.0))
    client = await aiohttp_client(app)
    status = {"kind": "fleet_status", "coordinator": "fake", "spec": RGB4.to_json()}
    async with FakeCoordinator(nc, status=status) as fake:
        ws = await client.ws_connect("/ws")
        spec = await _spec_msg(ws, known=True)
        assert spec["class_names"] == ["red", "green", "blue", "Sea Blue"] and spec["tile_channels"] == 3
        assert (await (await client.get("/api/spec")).json()) == spec
        await ws.send_json({"type": "generate", "labels": "blue, ?, Sea Blue", "steps": 3, "ref": 1})
        accepted = None
        while True:
            msg = await ws.receive_json(timeout=20)
            if msg["type"] == "accepted":
                accepted = msg
            if msg["type"] in ("done", "failed", "error", "rejected"):
                break
        assert msg["type"] == "done", msg
        assert accepted["labels"] == msg["labels"] == [2, -1, 3]
        req = fake.jobs[msg["job_id"]]
        assert (req.labels, req.digits) == ([2, -1, 3], None)  # not 10 classes: submitted as `labels`
        await ws.send_json({"type": "generate", "labels": "purple", "ref": 2})
        err = await ws.receive_json(timeout=10)
        while err["type"] != "error":
            err = await ws.receive_json(timeout=10)
        assert "'purple' is not a class of this fleet" in err["message"] and err["ref"] == 2
        await ws.close()


async def test_a_coordinator_without_specs_means_the_mnist_fleet(aiohttp_client, nats_url, nc):
    app = create_app(WebConfig(nats_url=nats_url, fleet_interval=0.2, discovery_window=0.1))
    client = await aiohttp_client(app)
    ws = await client.ws_connect("/ws")
    first = await _spec_msg(ws, known=False)  # on connect: assumed until a coordinator answers
    assert first["digits"] and first["channels"] == 1
    async with FakeCoordinator(nc, status={"kind": "fleet_status", "coordinator": "old"}):
        known = await _spec_msg(ws, known=True)
        assert {k: v for k, v in known.items() if k != "known"} == {k: v for k, v in first.items() if k != "known"}
    await ws.close()
