"""The durable-job counters on a coordinator's /metrics (coordinator.metrics.watch_store over a
coordinator.durable_store.JobStore), against a real nats-server with JetStream: checkpoint writes and their
bytes, take-overs (a restart of the same name takes its previous run's job), and lease losses (the
previous run's next write finds the job taken)."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest

from bus.nats_server import NatsServer
from coordinator.durable_store import JobLost, JobStore
from coordinator.metrics import CoordinatorMetrics
from coordinator.scheduler import Scheduler, SchedulerConfig

SERIES = (
    "ddm_coordinator_checkpoints_written_total",
    "ddm_coordinator_checkpoint_bytes_total",
    "ddm_coordinator_job_takeovers_total",
    "ddm_coordinator_job_leases_lost_total",
)


@pytest.fixture
def js_server(tmp_path):
    with NatsServer(extra_config=f'jetstream {{ store_dir: "{tmp_path / "js"}" }}') as srv:
        yield srv


def counters(metrics: CoordinatorMetrics) -> tuple[float, ...]:
    return tuple(metrics.sample(name) for name in SERIES)


@pytest.mark.bus
async def test_checkpoint_takeover_and_lease_loss_counters_move(js_server):
    import nats

    nc = await nats.connect(js_server.url)
    try:
        first = await JobStore(nc, "coord", "run-1", lease_s=5.0).open()
        second = await JobStore(nc, "coord", "run-2", lease_s=5.0).open()  # a restart of the same name
        m1, m2 = (CoordinatorMetrics(Scheduler(SchedulerConfig(num_experts=2))) for _ in range(2))
        m1.watch_store(first)
        m2.watch_store(second)
        assert counters(m1) == (0, 0, 0, 0)
        text = generate_latest(m1.registry).decode()
        assert all(f"{name} 0.0" in text for name in SERIES), text  # exported before the first write

        assert await first.adopt("job-a", b"x" * 1000)
        await first.save("job-a", b"y" * 1500)
        assert counters(m1) == (2, 2500, 0, 0)

        assert await second.orphans() == [("job-a", (await second.owners.get("job-a")).revision)]
        data = await second.take("job-a", (await second.owners.get("job-a")).revision)
        assert data == b"y" * 1500
        assert counters(m2) == (1, 1500, 1, 0)  # the take-over rewrites the checkpoint (fencing)

        with pytest.raises(JobLost):
            await first.save("job-a", b"z" * 10)
        assert counters(m1) == (2, 2500, 0, 1) and not first.holds("job-a")
        assert await first.renew() == [] and counters(m1)[3] == 1  # a job lost is counted once

        await second.release("job-a")  # the job ended: no loss
        assert counters(m2) == (1, 1500, 1, 0)
        text = generate_latest(m2.registry).decode()
        assert (
            "ddm_coordinator_job_takeovers_total 1.0" in text
            and "ddm_coordinator_checkpoint_bytes_total 1500.0" in text
        )
    finally:
        await nc.drain()


def test_replicas_must_be_a_jetstream_count():
    for bad in (0, 6, 2.0):
        with pytest.raises(ValueError, match="replicas must be an int 1-5"):
            JobStore(None, "c", "i", replicas=bad)


@pytest.mark.bus
async def test_more_replicas_than_servers_is_refused_with_the_reason(js_server):
    """A single server has no R3: the coordinator gets JetStreamUnavailable naming the bucket, the
    server's reason and the option (cmd_coordinator prints it and exits 2)."""
    import nats

    from coordinator.durable_store import JetStreamUnavailable

    nc = await nats.connect(js_server.url)
    try:
        with pytest.raises(JetStreamUnavailable) as err:
            await JobStore(nc, "c", "i", replicas=3).open()
        msg = str(err.value)
        assert "ddm_jobs" in msg and "3 replica(s)" in msg and "--js-replicas" in msg, msg
        assert "non-clustered" in msg, msg
    finally:
        await nc.drain()
