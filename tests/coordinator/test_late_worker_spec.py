"""A worker that joins a running fleet with another model spec is found, named and never used.

Real nats-server, real `ddm-fleet worker` processes (tiny random torch checkpoints of two specs: 1x32x32
and 3x32x32 pixels), an in-process Coordinator whose spec is checked at start. The odd worker joins
after the coordinator started: the coordinator's worker discovery rejects it (a warning naming its
worker id, service id, host and expert, and what differs), lists it in `fleet.status` and on /metrics,
addresses only the matching worker (the odd one serves no request, with `--dispatch direct` and with
`--dispatch queue`, where the expert's queue group would reach it) and every job completes. When the
odd worker leaves, the list empties."""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from client.jobs import fleet_status, run_job
from coordinator.local_fleet import LabelRouter
from coordinator.service import Coordinator
from models.tiny import make_tiny_expert
from schemas import JobRequest
from schemas.spec import legacy_spec
from tests.waiting import wait_until

pytestmark = [pytest.mark.procs, pytest.mark.slow]

ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=os.getcwd())


async def _worker(checkpoint: Path, nats_url: str, log_path: Path) -> tuple[asyncio.subprocess.Process, str]:
    """A `ddm-fleet worker --expert 0` process, once ready; (process, its nats.micro service id)."""
    with open(log_path, "ab") as log:
        p = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "infra.cli",
            "worker",
            "--expert",
            "0",
            "--checkpoint",
            str(checkpoint),
            "--threads",
            "1",
            "--buckets",
            "1,2,4",
            "--nats",
            nats_url,
            stdout=asyncio.subprocess.PIPE,
            stderr=log,
            env=ENV,
        )
    line = (await asyncio.wait_for(p.stdout.readline(), 120)).decode()
    assert line.startswith("ready"), f"worker did not start: {line!r}\n{log_path.read_text()}"
    return p, line.rsplit("service_id=", 1)[1].split()[0]


async def _stop(p: asyncio.subprocess.Process) -> None:
    if p.returncode is None:
        p.terminate()
        try:
            await asyncio.wait_for(p.wait(), 30)
        except TimeoutError:
            p.kill()
            await p.wait()


async def _odd_requests(nc, service_id: str) -> int:
    """Requests the odd worker has served, from its own $SRV.STATS."""
    import json

    msg = await nc.request(f"$SRV.STATS.ddm-expert.{service_id}", b"", timeout=5)
    return sum(int(ep.get("num_requests", 0)) for ep in json.loads(msg.data)["endpoints"])


@pytest.mark.parametrize("dispatch", ["direct", "queue"])
async def test_a_late_worker_of_another_spec_is_rejected_by_name_and_never_used(
    dispatch, nats_url, nc, tmp_path, caplog
):
    good_ck = make_tiny_expert(tmp_path / "good", expert_id=0, widths=(8, 16, 32))
    odd_ck = make_tiny_expert(tmp_path / "odd", expert_id=0, widths=(8, 16, 32), in_channels=3)
    good, _ = await _worker(good_ck, nats_url, tmp_path / "good.log")
    odd = None
    try:
        coord = Coordinator(
            LabelRouter([0] * 10, 1),
            num_experts=1,
            nats_url=nats_url,
            spec=legacy_spec(),
            metrics_port=0,
            dispatch=dispatch,
        )
        coord.worker_check_s = 0.5
        caplog.set_level(logging.WARNING, logger="coordinator.worker_discovery")
        async with coord:
            assert coord.rejected_workers() == []
            odd, odd_service = await _worker(odd_ck, nats_url, tmp_path / "odd.log")
            await wait_until(lambda: coord.rejected_workers(), timeout=30, what="the odd worker rejected")
            (bad,) = coord.rejected_workers()
            assert bad.service_id == odd_service and bad.expert == 0 and bad.host
            assert "sample_shape" in bad.differs and "(3, 32, 32)" in bad.differs
            warned = [r.getMessage() for r in caplog.records if "its model spec differs" in r.getMessage()]
            assert len(warned) == 1, warned
            assert bad.worker_id in warned[0] and odd_service in warned[0] and "expert 0" in warned[0]
            # the fleet keeps serving with the matching worker; the odd one gets nothing
            results = await asyncio.wait_for(
                asyncio.gather(*(run_job(nc, JobRequest(digits=[i, 9 - i], steps=4, seed=i)) for i in range(6))), 120
            )
            assert all(r.images.shape == (2, 1, 32, 32) and np.isfinite(r.images).all() for r in results)
            assert await _odd_requests(nc, odd_service) == 0
            # fleet.status (when asked with the spec) lists it; v1 status requests never see the key
            status = await fleet_status(nc, spec=True)
            assert [w.worker_id for w in status.rejected_workers] == [bad.worker_id]
            assert status.rejected_workers[0].service_id == odd_service and status.jobs_failed == 0
            plain = await nc.request("ddm.v1.fleet.status", b"", timeout=5)
            assert b"rejected_workers" not in plain.data
            # /metrics
            text = await asyncio.to_thread(
                lambda: urllib.request.urlopen(f"http://127.0.0.1:{coord.metrics_port}/metrics", timeout=5).read()
            )
            metrics = text.decode()
            assert "ddm_coordinator_rejected_workers 1.0" in metrics
            assert "ddm_coordinator_workers_rejected_total 1.0" in metrics
            # the odd worker leaves: the list empties, the total stays
            await _stop(odd)
            await wait_until(lambda: not coord.rejected_workers(), timeout=30, what="the odd worker forgotten")
            assert coord.metrics.sample("ddm_coordinator_workers_rejected_total") == 1.0
    finally:
        for p in (good, odd):
            if p is not None:
                await _stop(p)


async def test_leaving_ends_the_worker_watch_even_when_a_discovery_swallows_its_cancel(nats_url, nc, tmp_path):
    """nats-py can turn a cancel into a ConnectionClosedError (and 3.11's wait_for can drop one): a watch loop
    that kept going after that would hang asyncio.run's shutdown (seen: a coordinator that never exited after
    SIGTERM). Leaving the coordinator ends the watch anyway, within a discovery window."""
    ck = make_tiny_expert(tmp_path / "e", expert_id=0, widths=(8, 16, 32))
    worker, _ = await _worker(ck, nats_url, tmp_path / "w.log")
    try:
        coord = Coordinator(LabelRouter([0] * 10, 1), num_experts=1, nats_url=nats_url, spec=legacy_spec())
        coord.worker_check_s = 0.05
        swallowed = []
        inside = asyncio.Event()

        async def stubborn_refresh(window_s: float = 0.3) -> dict:
            inside.set()
            try:
                await asyncio.Event().wait()  # a discovery that lasts until the cancel reaches it
            except asyncio.CancelledError:
                swallowed.append(1)  # what a lost cancel looks like to the loop: the call just returns
                asyncio.current_task().uncancel()
            return {}

        async with coord:
            coord.transport.refresh_workers = stubborn_refresh
            watch = coord.running.watch
            await asyncio.wait_for(inside.wait(), 30)  # leave while the watch is inside a discovery
        assert watch.done() and swallowed, (watch, swallowed)
    finally:
        await _stop(worker)


async def test_a_gather_cancelled_while_nats_reads_it_as_closed_still_ends(nats_url):
    """bus.gather_replies re-raises a cancel that reached it as another error (nats-py's ConnectionClosedError
    for a cancelled next_msg once the connection closes), instead of returning as if the window were over."""
    import nats

    from bus.gather import gather_replies

    nc2 = await nats.connect(nats_url)
    task = asyncio.ensure_future(gather_replies(nc2, "nobody.answers", window=30))
    await asyncio.sleep(0.2)
    await nc2.close()  # next_msg now reads a cancel as ConnectionClosedError
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 5)
