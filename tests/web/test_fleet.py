"""Fleet panel data: NATS micro discovery (several replies collected), rates from STATS,
the coordinator's FLEET_STATUS, and workers leaving. Real nats-server, real nats.micro services."""

from __future__ import annotations

import asyncio

import pytest

from tests.web.fakes import FakeCoordinator, FakeWorkerService
from web.app import WebConfig, create_app
from web.fleet import FleetMonitor, gather_replies


async def test_gather_replies_collects_every_service(nc):
    async with FakeWorkerService(nc, 0, "torch", "cpu") as a, FakeWorkerService(nc, 1, "jax", "cpu") as b:
        replies = await gather_replies(nc, "$SRV.PING.ddm-expert", window=1.0)  # room for a late reply on a busy box
        assert len(replies) >= 2
        ids = {r.decode() for r in replies}
        assert any(a.id in r for r in ids) and any(b.id in r for r in ids)


async def test_snapshot_groups_workers_by_expert_and_drops_leavers(nc):
    monitor = FleetMonitor(nc, window=0.5)
    async with FakeCoordinator(
        nc,
        status={
            "active_jobs": 2,
            "queued_jobs": 3,
            "rows_per_s": 120.5,
            "unavailable_experts": [1],
            "kind": "fleet_status",
        },
    ):
        async with (
            FakeWorkerService(nc, 0, "torch", "cpu", compiled=True) as w0a,
            FakeWorkerService(nc, 0, "torch-xla", "xla:0") as w0b,
        ):
            async with FakeWorkerService(nc, 1, "jax", "cuda:0", dtype="bfloat16") as w1:
                snap1 = await monitor.snapshot()
                w0a.rows += 640
                await asyncio.sleep(0.2)  # not an ordering wait: the rate is rows over the time between snapshots
                snap2 = await monitor.snapshot()
            snap3 = await monitor.snapshot()  # w1 has left: kept one round, stale
            snap4 = await monitor.snapshot()  # ... and gone the round after
    experts = {e["expert"]: e["workers"] for e in snap2["experts"]}
    assert {w["id"] for w in experts[0]} >= {w0a.id, w0b.id}
    assert [(w["backend"], w["dtype"]) for w in experts[1] if w["id"] == w1.id] == [("jax", "bfloat16")]
    row = next(w for w in experts[0] if w["id"] == w0a.id)
    assert row["device"] == "cpu" and row["host"] == "testhost" and row["rate_unit"] == "rows/s"
    assert row["dtype"] == "float32" and row["compiled"] is True
    assert [w["compiled"] for w in experts[1] if w["id"] == w1.id] == [False]  # no key: an older worker
    assert row["rows"] == 640 and 640 / 2 < row["rows_per_s"] < 640 / 0.2 + 1  # 640 rows over ~0.4 s
    first = next(w for e in snap1["experts"] for w in e["workers"] if w["id"] == w0a.id)
    assert first["rows_per_s"] is None  # one snapshot is not a rate yet
    assert snap2["coordinator"] == {"active_jobs": 2, "queued_jobs": 3, "rows_per_s": 120.5, "unavailable_experts": [1]}
    rows3 = {w["id"]: w for e in snap3["experts"] for w in e["workers"]}
    assert rows3[w1.id]["stale"] is True and rows3[w1.id]["rows_per_s"] is None
    assert rows3[w1.id]["backend"] == "jax" and rows3[w1.id]["expert"] == 1  # its last metadata
    assert rows3[w0a.id]["stale"] is False
    assert w1.id not in {w["id"] for e in snap4["experts"] for w in e["workers"]}
    assert w0a.id in {w["id"] for e in snap4["experts"] for w in e["workers"]}


async def test_latency_per_worker_from_its_histogram_else_from_micro_processing_time(nc):
    # every snapshot must hear both workers: a discovery window with room for a reply late on a busy box (0.2 s
    # missed one beside a full suite and a spinning process); each snapshot waits out its window
    monitor = FleetMonitor(nc, window=1.0)
    async with FakeWorkerService(nc, 0, "sim", "sim:instant") as w, FakeWorkerService(nc, 1, "sim", "sim:instant") as v:
        w.latency = (1.0, 10)
        snap1 = await monitor.snapshot()
        w.latency = (1.5, 20)  # 10 more requests took 0.5 s: 50 ms each
        for _ in range(3):  # v reports no histogram: nats.micro's own processing time counts
            assert (await nc.request(v.subject, b"x", timeout=5)).data == b"ok"
        snap2 = await monitor.snapshot()
        snap3 = await monitor.snapshot()  # nothing served since: no latency to show
    rows = lambda snap: {r["id"]: r for e in snap["experts"] for r in e["workers"]}  # noqa: E731
    assert rows(snap1)[w.id]["latency_ms"] is None  # one snapshot is not a rate yet
    assert rows(snap2)[w.id]["latency_ms"] == 50.0
    assert rows(snap2)[v.id]["latency_ms"] is not None and 0 <= rows(snap2)[v.id]["latency_ms"] < 1000
    assert rows(snap3)[w.id]["latency_ms"] is None and rows(snap3)[v.id]["latency_ms"] is None
    assert rows(snap2)[w.id]["host"] == "testhost"


async def test_no_coordinator_means_null_status(nc):
    snap = await FleetMonitor(nc, window=0.1, status_timeout=0.2).snapshot()
    assert snap["coordinator"] is None and snap["type"] == "fleet" and snap["coordinator_stale"] is False


async def test_one_missed_coordinator_status_repeats_the_last_one_marked_stale(nc):
    monitor = FleetMonitor(nc, window=0.1, status_timeout=0.3)
    async with FakeCoordinator(nc, status={"active_jobs": 4, "kind": "fleet_status"}):
        first = await monitor.snapshot()
    missed_once = await monitor.snapshot()  # the coordinator has gone: its last status, stale
    missed_twice = await monitor.snapshot()
    assert first["coordinator"] == {"active_jobs": 4} and first["coordinator_stale"] is False
    assert missed_once["coordinator"] == {"active_jobs": 4} and missed_once["coordinator_stale"] is True
    assert missed_twice["coordinator"] is None and missed_twice["coordinator_stale"] is False


async def test_sockets_and_api_get_periodic_fleet_snapshots(aiohttp_client, nats_url, nc):
    app = create_app(WebConfig(nats_url=nats_url, fleet_interval=0.2, discovery_window=0.1))
    client = await aiohttp_client(app)
    async with FakeWorkerService(nc, 3, "torch", "cpu") as w:
        ws = await client.ws_connect("/ws")
        for _ in range(30):
            msg = await ws.receive_json(timeout=20)
            if msg["type"] == "fleet" and any(e["expert"] == 3 for e in msg["experts"]):
                break
        else:
            pytest.fail("no fleet snapshot listing the worker")
        api = await (await client.get("/api/fleet")).json()
        assert any(wk["id"] == w.id for e in api["experts"] for wk in e["workers"])
    for _ in range(30):  # after the worker stops, a later snapshot no longer lists it
        msg = await ws.receive_json(timeout=20)
        if msg["type"] == "fleet" and not any(e["expert"] == 3 for e in msg["experts"]):
            break
    else:
        pytest.fail("the stopped worker stayed in the fleet panel")
    await ws.close()
