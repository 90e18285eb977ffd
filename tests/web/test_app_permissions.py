"""The web server runs as the shipped `web` user (CLIENT_PERMISSIONS in infra/nats/permissions.conf):
everything it does (submit, events, cancel, fleet status, $SRV discovery) is allowed, end to end."""

from __future__ import annotations

import logging

import pytest

from infra.nats_cluster import NatsCluster
from schemas import subjects
from tests.waiting import wait_until
from tests.web.fakes import FakeCoordinator, FakeWorkerService
from web.app import WebConfig, create_app

pytestmark = pytest.mark.bus


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with NatsCluster(1, name="ddm-web-perm", log_dir=tmp_path_factory.mktemp("nats-logs")) as c:
        yield c


async def _connect(url: str, errors: list[str]):
    import nats

    async def on_error(err):
        errors.append(str(err))

    return await nats.connect(url, error_cb=on_error, connect_timeout=2, allow_reconnect=False)


async def test_web_user_can_do_everything_the_viewer_needs(aiohttp_client, cluster, caplog):
    caplog.set_level(logging.WARNING, logger="web.app")
    errors: list[str] = []
    coord_nc = await _connect(cluster.url(0, "coordinator"), errors)
    worker_nc = await _connect(cluster.url(0, "worker-0"), errors)
    try:
        async with (
            FakeCoordinator(
                coord_nc, probe=False, frame_delay=0.05, status={"active_jobs": 1, "queued_jobs": 0}
            ) as coordinator,
            FakeWorkerService(worker_nc, 0, "torch", "cpu", subject=subjects.expert_velocity(0)) as worker,
        ):
            client = await aiohttp_client(
                create_app(WebConfig(nats_url=cluster.url(0, "web"), fleet_interval=0.3, discovery_window=0.2))
            )
            ws = await client.ws_connect("/ws")
            await ws.send_json({"type": "generate", "digits": "4,5", "steps": 4})
            kinds, fleet_ok = [], False
            while "done" not in kinds or not fleet_ok:
                msg = await ws.receive_json(timeout=20)
                kinds.append(msg["type"])
                assert msg["type"] != "error", msg
                if msg["type"] == "fleet":
                    workers = [w["id"] for e in msg["experts"] for w in e["workers"]]
                    fleet_ok = worker.id in workers and msg["coordinator"] == {"active_jobs": 1, "queued_jobs": 0}
            assert kinds.index("accepted") < kinds.index("done") and "frame" in kinds
            # closing the tab publishes a cancel (allowed for `web`) that the coordinator receives
            await ws.send_json({"type": "generate", "digits": "1", "steps": 400})
            while (msg := await ws.receive_json(timeout=20))["type"] != "frame":
                assert msg["type"] != "error", msg
            job_id = msg["job_id"]
            await ws.close()
            await wait_until(
                lambda: job_id in coordinator.cancelled, timeout=5, what="the cancel from the closed socket"
            )
    finally:
        await coord_nc.close()
        await worker_nc.close()
    assert not [r.getMessage() for r in caplog.records if "ermission" in r.getMessage()]
    assert not [e for e in errors if "ermission" in e]
