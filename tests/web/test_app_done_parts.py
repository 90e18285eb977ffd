"""The web viewer on a fleet of 3x256x256 images: a tab's job of 16 images, whose `done` (12.6 MB of float32)
cannot fit one message, is not refused: the viewer asks for parts (`image_parts`), puts them together, and the
page gets every image in its `done`, the pixels of the coordinator's own result. Real nats-server, real
coordinator (stand-in experts, as in tests/coordinator/test_done_parts_fleet.py), real web app."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from coordinator.local_fleet import LabelRouter
from coordinator.service import Coordinator
from dataset.images import to_uint8
from tests.coordinator.test_done_parts_fleet import C2E, IMAGE, Elementwise
from tests.web.test_app_socket import collect_job, next_msg
from web.app import WebConfig, create_app
from web.session import WEB_CLIENT

N = 16


@pytest.fixture
async def coordinator(nats_url):
    async with Coordinator(
        LabelRouter(C2E, 2), num_experts=2, nats_url=nats_url, transport=Elementwise(), image_shape=IMAGE, max_rows=64
    ) as coord:
        yield coord


async def test_a_tab_gets_every_image_of_a_done_sent_in_parts(aiohttp_client, nats_url, coordinator):
    client = await aiohttp_client(create_app(WebConfig(nats_url=nats_url, fleet_interval=0.3, submit_timeout=5.0)))
    ws = await client.ws_connect("/ws", max_msg_size=0)  # a frame of 16 tiles is 4.2 MB of JSON: over aiohttp's 4 MiB
    await next_msg(ws, {"hello"})
    digits = ",".join(str(i % 10) for i in range(N))
    await ws.send_json({"type": "generate", "digits": digits, "steps": 2, "ref": 1})
    msgs = await collect_job(ws)
    assert [m["type"] for m in msgs][0] == "accepted" and msgs[-1]["type"] == "done", [m["type"] for m in msgs]
    done = msgs[-1]
    assert done["size"] == [256, 256] and done["channels"] == 3 and len(done["tiles"]) == N
    mine = coordinator.finished_event(done["job_id"], client=WEB_CLIENT).images  # [N, 3, 256, 256]
    want = to_uint8(mine.transpose(0, 2, 3, 1))
    for i, tile in enumerate(done["tiles"]):
        assert base64.b64decode(tile) == np.ascontiguousarray(want[i]).tobytes(), i
    await ws.close()
