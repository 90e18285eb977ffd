"""The web viewer's websocket protocol, against a real nats-server and a fake coordinator
(a nats-py responder that speaks the real schemas: tests/web/fakes.py)."""

from __future__ import annotations

import asyncio
import base64
import json

import pytest

from schemas import MAX_JOB_IMAGES, subjects
from tests.waiting import wait_until
from tests.web.fakes import FakeCoordinator
from web.app import WebConfig, create_app


@pytest.fixture
async def client(aiohttp_client, nats_url):
    app = create_app(WebConfig(nats_url=nats_url, fleet_interval=0.3, discovery_window=0.15, submit_timeout=2.0))
    return await aiohttp_client(app)


@pytest.fixture
async def coordinator(nc):
    async with FakeCoordinator(nc, reject_over=50) as fake:
        yield fake


async def next_msg(ws, types, timeout=20.0):
    """Next message whose type is in `types` (fleet snapshots and pongs are skipped unless asked)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        msg = await ws.receive_json(timeout=max(0.01, deadline - loop.time()))
        if msg["type"] in types:
            return msg


async def collect_job(ws, timeout=30.0):
    """Messages up to and including the first done / failed / rejected / error."""
    out = []
    while True:
        msg = await next_msg(ws, {"accepted", "frame", "done", "failed", "rejected", "error"}, timeout)
        out.append(msg)
        if msg["type"] in {"done", "failed", "rejected", "error"}:
            return out


async def test_hello_then_generate_streams_frames_and_done(client, coordinator):
    ws = await client.ws_connect("/ws")
    hello = await next_msg(ws, {"hello"})
    assert hello["max_images"] == MAX_JOB_IMAGES and "oracle" in hello["strategies"]
    await ws.send_json({"type": "generate", "digits": "3,7,7", "steps": 6, "strategy": "top1", "ref": 1})
    msgs = await collect_job(ws)
    kinds = [m["type"] for m in msgs]
    assert kinds[0] == "accepted" and kinds[-1] == "done", msgs
    accepted, done = msgs[0], msgs[-1]
    assert accepted["ref"] == 1 and accepted["digits"] == [3, 7, 7]
    job_id = accepted["job_id"]
    frames = [m for m in msgs if m["type"] == "frame"]
    assert frames, "no intermediate frame reached the socket"
    for f in frames:
        assert f["job_id"] == job_id and f["size"] == [32, 32] and len(f["tiles"]) == 3
        assert f["experts"] == [0, 1, 1]
        assert f["weights"][0] == [0.9, 0.1]
        assert len(base64.b64decode(f["tiles"][0])) == 32 * 32
    assert [f["step"] for f in frames] == sorted(f["step"] for f in frames)
    assert done["job_id"] == job_id and done["digits"] == [3, 7, 7] and len(done["tiles"]) == 3
    # the fake's final image for digit 3 is flat at 3/4.5 - 1 -> grey level (x+1)*127.5
    pixels = base64.b64decode(done["tiles"][0])
    assert set(pixels) == {round((3 / 4.5) * 127.5)}
    assert done["usage"][1] == [0.0, 1.0]
    assert job_id in coordinator.finished
    await ws.close()


async def test_count_and_options_reach_the_coordinator(client, coordinator):
    ws = await client.ws_connect("/ws")
    await ws.send_json(
        {
            "type": "generate",
            "count": 4,
            "steps": 5,
            "strategy": "topk",
            "top_k": 2,
            "solver": "heun",
            "seed": 11,
            "frame_every": 2,
        }
    )
    msgs = await collect_job(ws)
    assert msgs[-1]["type"] == "done" and len(msgs[-1]["tiles"]) == 4
    req = coordinator.jobs[msgs[0]["job_id"]]
    assert (req.count, req.steps, req.strategy, req.solver, req.seed, req.frame_every) == (4, 5, "topk", "heun", 11, 2)
    assert req.job_id.startswith("web")
    await ws.close()


@pytest.mark.parametrize(
    "payload, expected",
    [
        ({"type": "generate", "digits": "3,x,7"}, "'x' is not a digit"),
        ({"type": "generate", "digits": "12"}, "'12' is not a digit"),
        ({"type": "generate", "count": 10000}, "count: Input should be less than or equal to 256"),
        ({"type": "generate", "digits": ",".join(["1"] * 10000)}, "far too long; the limit is 256 images"),
        ({"type": "generate", "digits": [1] * 10000}, "10000 images requested; the limit is 256"),
        ({"type": "generate", "digits": "1", "steps": 0}, "steps: Input should be greater than or equal to 1"),
        ({"type": "generate", "digits": "1", "steps": "many"}, "steps: Input should be a valid integer"),
        ({"type": "generate", "digits": "1", "steps": 2.5}, "steps: Input should be a valid integer"),
        (
            {"type": "generate", "digits": "1", "strategy": "best"},
            "strategy: Input should be 'top1', 'topk', 'full', 'oracle' or 'sample'",
        ),
        ({"type": "generate", "digits": "1", "count": 3}, "give exactly one of labels"),
        ({"type": "generate"}, "give exactly one of labels"),
        ({"type": "generate", "digits": "1", "job_id": "mine"}, "unknown field(s) in generate: job_id"),
        ({"type": "generate", "digits": "1", "deadline_s": 0.5}, "deadline_s must be 1-3600 seconds, got 0.5"),
        ({"type": "generate", "digits": "1", "deadline_s": "30"}, "deadline_s must be a number of seconds"),
        ({"type": "launch"}, "unknown message type 'launch'"),
        ({"kind": "generate"}, "message has no 'type'"),
        ({"type": "cancel", "job_id": "someone-elses"}, "no running job 'someone-elses' in this tab"),
        ({"type": "cancel"}, "cancel needs a job_id"),
        ([1, 2, 3], "must be a JSON object"),
        ("{not json", "malformed JSON"),
        (b"\x00\x01", "send JSON text frames, not binary"),
    ],
)
async def test_bad_input_gets_a_visible_error_and_the_socket_keeps_working(client, coordinator, payload, expected):
    ws = await client.ws_connect("/ws")
    if isinstance(payload, bytes):
        await ws.send_bytes(payload)
    elif isinstance(payload, str):
        await ws.send_str(payload)
    else:
        await ws.send_str(json.dumps(payload))
    err = await next_msg(ws, {"error", "accepted"})
    assert err["type"] == "error", err
    assert expected in err["message"], err["message"]
    # same socket still serves a good job afterwards
    await ws.send_json({"type": "generate", "digits": [5], "steps": 3})
    msgs = await collect_job(ws)
    assert msgs[-1]["type"] == "done", msgs
    await ws.close()


async def test_rejection_from_the_coordinator_is_shown(client, coordinator):
    ws = await client.ws_connect("/ws")
    await ws.send_json({"type": "generate", "count": 60, "steps": 3, "ref": "big"})
    msg = await next_msg(ws, {"rejected", "accepted", "error"})
    assert msg["type"] == "rejected" and msg["code"] == "overloaded" and msg["ref"] == "big"
    assert "at most 50 images" in msg["message"]
    await ws.close()


async def test_no_coordinator_gives_a_clear_error(client):
    ws = await client.ws_connect("/ws")
    await ws.send_json({"type": "generate", "digits": "1", "steps": 3})
    msg = await next_msg(ws, {"error", "accepted"})
    assert msg["type"] == "error" and msg["code"] == "unavailable"
    assert "no coordinator is running" in msg["message"]
    await ws.close()


async def test_tabs_see_only_their_own_jobs(client, coordinator):
    a = await client.ws_connect("/ws")
    b = await client.ws_connect("/ws")
    await a.send_json({"type": "generate", "digits": "1,2", "steps": 8})
    await b.send_json({"type": "generate", "digits": "8", "steps": 8})
    msgs_a = await collect_job(a)
    msgs_b = await collect_job(b)
    ids_a = {m["job_id"] for m in msgs_a}
    ids_b = {m["job_id"] for m in msgs_b}
    assert len(ids_a) == 1 and len(ids_b) == 1 and ids_a != ids_b
    # B cannot cancel A's job
    await b.send_json({"type": "cancel", "job_id": ids_a.pop()})
    err = await next_msg(b, {"error"})
    assert "no running job" in err["message"]
    await a.close()
    await b.close()


async def test_cancel_from_the_page(client, coordinator):
    coordinator.frame_delay = 0.05
    ws = await client.ws_connect("/ws")
    await ws.send_json({"type": "generate", "digits": "4", "steps": 200})
    job_id = (await next_msg(ws, {"accepted"}))["job_id"]
    await next_msg(ws, {"frame"})
    await ws.send_json({"type": "cancel", "job_id": job_id, "ref": 9})
    msg = await next_msg(ws, {"cancelled"})
    assert msg == {"type": "cancelled", "job_id": job_id, "ref": 9}
    await wait_until(lambda: job_id in coordinator.cancelled, timeout=5, what="the coordinator to see the cancel")
    await ws.close()


async def test_closing_the_socket_cancels_its_jobs(client, coordinator):
    coordinator.frame_delay = 0.05
    ws = await client.ws_connect("/ws")
    await ws.send_json({"type": "generate", "digits": "1,2,3", "steps": 200})
    job_id = (await next_msg(ws, {"accepted"}))["job_id"]
    await next_msg(ws, {"frame"})
    await ws.close()
    await wait_until(lambda: job_id in coordinator.cancelled, timeout=10, what="the cancel from the closed socket")
    assert job_id not in coordinator.finished


async def test_per_tab_job_limit(aiohttp_client, nats_url, coordinator):
    coordinator.frame_delay = 0.05
    app = create_app(WebConfig(nats_url=nats_url, max_jobs_per_socket=2))
    client = await aiohttp_client(app)
    ws = await client.ws_connect("/ws")
    for _ in range(3):
        await ws.send_json({"type": "generate", "digits": "1", "steps": 200})
    err = await next_msg(ws, {"error"})
    assert err["code"] == "overloaded" and "limit is 2" in err["message"]
    await ws.close()


async def test_undecodable_event_is_reported_not_fatal(client, coordinator, nc):
    coordinator.frame_delay = 0.05
    ws = await client.ws_connect("/ws")
    await ws.send_json({"type": "generate", "digits": "2", "steps": 40})
    job_id = (await next_msg(ws, {"accepted"}))["job_id"]
    await nc.publish(subjects.job_events(coordinator.owners[job_id], job_id), b"\xc1 garbage")
    err = await next_msg(ws, {"error"})
    assert err["job_id"] == job_id and "undecodable event" in err["message"]
    msgs = await collect_job(ws)
    assert msgs[-1]["type"] == "done"
    await ws.close()


async def test_healthz_index_and_static(client):
    assert (await client.get("/healthz")).status == 200
    page = await client.get("/")
    assert page.status == 200 and "<canvas" not in (text := await page.text()) and 'id="generate"' in text
    for path in ("/static/app.js", "/static/style.css"):
        assert (await client.get(path)).status == 200
    assert (await client.get("/static/../app.py")).status in (403, 404)


async def test_events_before_the_submit_reply_still_come_after_accepted(client, nc):
    async with FakeCoordinator(nc, reply_late=True, frame_delay=0.0):
        ws = await client.ws_connect("/ws")
        await ws.send_json({"type": "generate", "digits": "0,9", "steps": 5, "ref": "early"})
        msgs = await collect_job(ws)
        kinds = [m["type"] for m in msgs]
        # nothing lost, accepted first, done last; early frames coalesce, a pending frame yields to the result
        assert kinds[0] == "accepted" and kinds[-1] == "done" and set(kinds[1:-1]) <= {"frame"}, kinds
        assert msgs[0]["ref"] == "early" and msgs[1]["digits"] == [0, 9]
        await ws.close()


async def test_server_shutdown_closes_sockets_and_cancels_their_jobs(nats_url, nc):
    from aiohttp import WSMsgType
    from aiohttp.test_utils import TestClient, TestServer

    async with FakeCoordinator(nc, frame_delay=0.05) as coordinator:
        server = TestServer(create_app(WebConfig(nats_url=nats_url)))
        client = TestClient(server)
        await client.start_server()
        try:
            ws = await client.ws_connect("/ws")
            await ws.send_json({"type": "generate", "digits": "6", "steps": 500})
            job_id = (await next_msg(ws, {"accepted"}))["job_id"]
            closing = asyncio.ensure_future(server.close())  # on_shutdown closes sockets: 1001 going away
            while (msg := await ws.receive(timeout=20)).type not in (
                WSMsgType.CLOSE,
                WSMsgType.CLOSED,
                WSMsgType.CLOSING,
            ):
                pass
            assert msg.type == WSMsgType.CLOSE and msg.data == 1001, msg
            await asyncio.wait_for(closing, 30)
        finally:
            await client.close()
        await wait_until(lambda: job_id in coordinator.cancelled, timeout=5, what="the cancel at shutdown")


async def test_jobs_are_submitted_in_the_viewers_namespace_with_one_session_tag_per_user(client, coordinator):
    """Ownership: on an open bus the viewer's jobs belong to client "web" (its inbox prefix is
    `_INBOX_web`); each user (here one address, two sockets) tags its jobs with its own session, the
    scheduler's fairness key: the same on both sockets."""
    tags = []
    for _ in range(2):
        ws = await client.ws_connect("/ws")
        for _ in range(2):
            await ws.send_json({"type": "generate", "digits": "3", "steps": 2})
            job_id = (await next_msg(ws, {"accepted"}))["job_id"]
            await collect_job(ws)
            assert coordinator.owners[job_id] == "web"
            tags.append(coordinator.jobs[job_id].session)
        await ws.close()
    assert len(set(tags)) == 1  # one user
    assert all(subjects.is_token(t) for t in tags)


async def test_a_deadline_from_the_page_fails_the_job_with_deadline_exceeded(client, nats_url, nc, tiny_fleet_files):
    """`deadline_s` reaches the real coordinator as the job's deadline: a page job that waits in the
    queue (behind another client's long job, one row in all) past its 1 s deadline ends `failed` /
    `deadline_exceeded`; the job without one runs on."""
    from client.jobs import cancel_job, submit_job
    from coordinator.service import Coordinator
    from models.router import Router
    from schemas import JobRequest
    from workers.service import ExpertWorker

    workers = []
    try:
        for k, path in enumerate(tiny_fleet_files["experts"]):
            workers.append(ExpertWorker(expert=k, checkpoint=path, nats_url=nats_url, buckets=(1,)))
            await workers[-1].start()
        router = Router.load(tiny_fleet_files["router"])
        async with Coordinator(
            router,
            num_experts=2,
            class_to_expert=[0] * 5 + [1] * 5,
            nats_url=nats_url,
            max_rows=1,
            name="deadline-coordinator",
        ) as coord:
            blocker = await submit_job(nc, JobRequest(job_id="blocker", digits=[1], steps=1000, stream=False))
            assert blocker.queue_position == 0
            ws = await client.ws_connect("/ws")
            await ws.send_json({"type": "generate", "digits": "3", "steps": 5, "deadline_s": 1, "ref": "late"})
            msgs = await collect_job(ws, timeout=30)
            accepted, end = msgs[0], msgs[-1]
            assert accepted["type"] == "accepted" and accepted["queue_position"] == 1, msgs
            assert end["type"] == "failed" and end["job_id"] == accepted["job_id"], msgs
            assert end["code"] == "deadline_exceeded" and "deadline of 1 s" in end["reason"], end
            assert coord.engine.job_state("blocker")["state"] == "running"  # no deadline: it runs on
            await ws.close()
            assert await cancel_job(nc, "blocker")
    finally:
        for w in workers:
            await w.stop()


async def test_the_viewers_probe_ignores_another_coordinators_unknown(nats_url, nc, tiny_fleet_files):
    """Two coordinators on the bus: a tab's job waits (silent) in coord-a's queue while coord-a
    answers status 1 s late and coord-b says `unknown` after 0.5 s. The viewer's probe knows the
    job's coordinator from `accepted` and does not fail the job; it completes once it gets rows."""
    from client.jobs import cancel_job, submit_job
    from models.router import Router
    from schemas import JobRequest
    from tests.coordinator.lagging import LaggingCoordinator
    from web.session import Session
    from workers.service import ExpertWorker

    sent: list[dict] = []

    async def send(msg: dict) -> None:
        sent.append(msg)

    def of(kind: str) -> list[dict]:
        return [m for m in sent if m["type"] == kind]

    router = Router.load(tiny_fleet_files["router"])
    opts = dict(num_experts=2, class_to_expert=[0] * 5 + [1] * 5, nats_url=nats_url, max_rows=1)
    workers = []
    session = Session(nc, send, probe_every=0.3, lost_after=5, unresponsive_after=60)
    sender = asyncio.ensure_future(session.run_sender())
    try:
        for k, path in enumerate(tiny_fleet_files["experts"]):
            workers.append(ExpertWorker(expert=k, checkpoint=path, nats_url=nats_url, buckets=(1,)))
            await workers[-1].start()
        async with LaggingCoordinator(router, name="coord-a", status_lag=1.0, **opts) as a:
            await submit_job(nc, JobRequest(job_id="tab-blocker", digits=[1], steps=1000, stream=False))
            session.handle(json.dumps({"type": "generate", "digits": "3", "steps": 5}))
            await wait_until(lambda: of("accepted") or of("error") or of("rejected"), timeout=10, what="accepted")
            assert of("accepted") and of("accepted")[0]["queue_position"] == 1, sent
            a.ticking.clear()  # hold the tab's job queued (silent) however fast the blocker would run
            async with LaggingCoordinator(router, name="coord-b", **opts) as b:
                await wait_until(lambda: b.status_requests >= 3 or of("failed"), timeout=30, what="3 probes")
                assert not of("failed"), of("failed")  # coord-b's "unknown" did not fail the tab's job
                assert not of("done"), "the tab's job must still have been queued while probed"
                assert await cancel_job(nc, "tab-blocker")
                a.ticking.set()
                await wait_until(lambda: of("done") or of("failed"), timeout=60, what="the tab's job to end")
            assert of("done") and not of("failed"), sent[-3:]
    finally:
        await session.close()
        sender.cancel()
        await cancel_job(nc, "tab-blocker")
        for w in workers:
            await w.stop()


async def test_each_address_has_its_own_job_quota_and_session_over_all_its_tabs(aiohttp_client, nats_url, coordinator):
    """Behind a trusted proxy, user A (three tabs) gets `max_jobs_per_client` jobs over all its tabs and
    then `overloaded`, while user B's first job is accepted; every job of A carries one session tag on
    all its tabs, B's another, so the coordinator shares the viewer's rows between users, not tabs."""
    coordinator.frame_delay = 0.05
    app = create_app(WebConfig(nats_url=nats_url, max_jobs_per_client=4, trusted_proxies=("127.0.0.1",)))
    client = await aiohttp_client(app)
    a_tabs = [await client.ws_connect("/ws", headers={"X-Forwarded-For": "203.0.113.7"}) for _ in range(3)]
    b_tab = await client.ws_connect("/ws", headers={"X-Forwarded-For": "198.51.100.9"})
    for ws in a_tabs:
        for _ in range(2):
            await ws.send_json({"type": "generate", "digits": "1", "steps": 200})
    accepted, refused = 0, []
    for ws in a_tabs:
        for _ in range(2):
            msg = await next_msg(ws, {"accepted", "error"})
            if msg["type"] == "accepted":
                accepted += 1
            else:
                refused.append(msg)
    assert accepted == 4 and len(refused) == 2
    assert all(m["code"] == "overloaded" and "the limit is 4, over all your tabs" in m["message"] for m in refused)
    await b_tab.send_json({"type": "generate", "digits": "2", "steps": 200})
    assert (await next_msg(b_tab, {"accepted", "error"}))["type"] == "accepted"
    await wait_until(lambda: len(coordinator.jobs) == 5, timeout=10, what="5 jobs at the coordinator")
    sessions = {}
    for req in coordinator.jobs.values():
        sessions.setdefault(req.digits[0], set()).add(req.session)
    assert len(sessions[1]) == 1 and len(sessions[2]) == 1 and sessions[1] != sessions[2]
    assert "203.0.113.7" not in next(iter(sessions[1]))  # a keyed hash: the tag does not tell the address
    for ws in [*a_tabs, b_tab]:
        await ws.close()
