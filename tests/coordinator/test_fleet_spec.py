"""coordinator.fleet_spec: the coordinator checks its router's and every worker's model spec at start
(real workers on a real nats-server); a worker that disagrees is named and not used, never a reason not
to start."""

from __future__ import annotations

import pytest

from coordinator.fleet_spec import check_fleet_spec, check_specs, check_worker, worker_spec
from models.tiny import make_tiny_expert
from schemas.spec import Conditioning, ModelSpec, SpecError, legacy_spec
from workers.service import ExpertWorker


def test_worker_spec_reads_json_or_implies_one_from_old_metadata():
    spec = ModelSpec(sample_shape=(3, 16, 16), conditioning=Conditioning(num_classes=4))
    import json

    assert worker_spec({"spec": json.dumps(spec.to_json())}) == spec
    old = worker_spec({"input_shape": "1,32,32", "num_classes": "10"})
    assert old.sample_shape == (1, 32, 32) and old.num_classes == 10
    with pytest.raises(SpecError, match="not JSON"):
        worker_spec({"spec": "{oops"})
    with pytest.raises(SpecError, match="sample_shape"):
        worker_spec({"spec": '{"sample_shape": [0, 1, 1]}'})


def test_check_specs_names_unreadable_and_different_workers():
    router = legacy_spec()
    odd = legacy_spec(in_channels=3)
    spec, bad = check_specs(
        router,
        {
            "expert 0 worker a": legacy_spec(),
            "expert 1 worker b": odd,
            "expert 1 worker c": SpecError("metadata 'spec' is not JSON"),
        },
    )
    assert spec == router and sorted(bad) == ["expert 1 worker b", "expert 1 worker c"]
    assert "sample_shape" in bad["expert 1 worker b"] and "not JSON" in bad["expert 1 worker c"]
    assert check_specs(router, {"expert 0 worker a": legacy_spec()}) == (router, {})


def test_check_worker_names_a_worker_whose_spec_differs():
    import json

    rgb = json.dumps(legacy_spec(in_channels=3).to_json())
    info = {"id": "SVC1", "metadata": {"worker_id": "w-odd", "expert": "1", "host": "box", "spec": rgb}}
    bad = check_worker(legacy_spec(), info)
    assert (bad.worker_id, bad.service_id, bad.host, bad.expert) == ("w-odd", "SVC1", "box", 1)
    assert "sample_shape" in bad.differs and bad.describe() == "expert 1 worker w-odd (service SVC1, host box)"
    same = {"id": "SVC2", "metadata": {"worker_id": "w-ok", "expert": "0", "input_shape": "1,32,32"}}
    assert check_worker(legacy_spec(), same) is None
    unreadable = {"id": "SVC3", "metadata": {"worker_id": "w-x", "expert": "0", "spec": "{oops"}}
    assert "unreadable spec" in check_worker(legacy_spec(), unreadable).differs
    assert check_worker(legacy_spec(), {"id": "SVC4", "metadata": {}}) is None  # no worker id: nothing to route by


async def test_a_fleet_of_agreeing_workers_passes(nats_url, nc, tmp_path):
    ck = make_tiny_expert(tmp_path / "e0", expert_id=0)
    async with ExpertWorker(0, str(ck), "torch", nats_url=nats_url, buckets=(1,)):
        spec, bad = await check_fleet_spec(nc, legacy_spec(), window_s=0.5)
    assert spec.sample_shape == (1, 32, 32) and bad == {}


async def test_a_worker_with_another_shape_is_named_and_the_fleet_is_the_routers(nats_url, nc, tmp_path):
    good = make_tiny_expert(tmp_path / "e0", expert_id=0)
    rgb = make_tiny_expert(tmp_path / "e1", expert_id=1, in_channels=3)
    async with (
        ExpertWorker(0, str(good), "torch", nats_url=nats_url, buckets=(1,)),
        ExpertWorker(1, str(rgb), "torch", nats_url=nats_url, buckets=(1,)) as odd,
    ):
        spec, bad = await check_fleet_spec(nc, legacy_spec(), window_s=0.5)
    assert spec == legacy_spec()
    ((name, why),) = bad.items()
    assert f"expert 1 worker {odd.worker_id}" in name and "sample_shape" in why and "(3, 32, 32)" in why


async def test_the_coordinator_starts_beside_an_odd_worker_names_it_and_serves_with_the_others(
    nats_url, nc, tmp_path, caplog
):
    """A worker of another sample shape on the bus when the coordinator starts (a misconfigured host, or
    one that lies): the coordinator starts anyway, names it in an error line, rejects it before the first
    expert call, and jobs run on the matching worker of the same expert."""
    import logging

    import numpy as np

    from client.jobs import run_job
    from coordinator.local_fleet import LabelRouter
    from coordinator.service import Coordinator
    from schemas import JobRequest

    good = make_tiny_expert(tmp_path / "e0", expert_id=0)
    rgb = make_tiny_expert(tmp_path / "e0rgb", expert_id=0, in_channels=3)
    async with (
        ExpertWorker(0, str(rgb), "torch", nats_url=nats_url, buckets=(1, 4)) as odd,
        ExpertWorker(0, str(good), "torch", nats_url=nats_url, buckets=(1, 4)) as ok,
    ):
        coord = Coordinator(LabelRouter([0] * 10, 1), num_experts=1, nats_url=nats_url, spec=legacy_spec())
        with caplog.at_level(logging.ERROR, logger="coordinator.fleet_spec"):
            async with coord:
                assert odd.worker_id in coord.transport.rejected_workers
                assert ok.worker_id not in coord.transport.rejected_workers
                for i in range(4):
                    done = await run_job(nc, JobRequest(job_id=f"j{i}", digits=[i], steps=4, seed=i), timeout=60)
                    assert done.images.shape == (1, 1, 32, 32) and np.isfinite(done.images).all()
                assert coord.transport.rejected_replies == 0  # never sent a request it had to refuse
        assert any(odd.worker_id in r.getMessage() and "not using" in r.getMessage() for r in caplog.records)


async def test_fleet_status_returns_the_spec_only_when_asked(nats_url, nc, tmp_path):
    from client.jobs import fleet_status
    from coordinator.local_fleet import LabelRouter
    from coordinator.service import Coordinator
    from schemas import FleetStatus, unpack

    rgb = make_tiny_expert(tmp_path / "e0", expert_id=0, in_channels=3)
    spec = legacy_spec(in_channels=3)
    async with ExpertWorker(0, str(rgb), "torch", nats_url=nats_url, buckets=(1,)):
        async with Coordinator(LabelRouter([0] * 10, 1), num_experts=1, nats_url=nats_url, spec=spec) as coord:
            assert coord.scheduler_config.image_shape == (3, 32, 32)
            plain = await nc.request("ddm.v1.fleet.status", b"", timeout=5)
            assert b"spec" not in plain.data and unpack(plain.data, FleetStatus).spec is None  # what a v1 client sees
            status = await fleet_status(nc, spec=True)
            routed = spec.model_copy(update={"arch": "label"})  # `arch`: what routes (coordinator.service.router_arch)
            assert status.spec == routed and status.spec.sample_shape == (3, 32, 32)
            as_json = await nc.request("ddm.v1.fleet.status", b'{"spec": true}', timeout=5)
            assert unpack(as_json.data, FleetStatus).spec == routed
            assert b"image_shape" not in as_json.data  # the image fields only when asked (below)


async def test_a_pixel_fleet_reports_its_samples_as_its_images_when_asked(nats_url, nc, tmp_path):
    """`{"spec": true, "image_spec": true}`: the spec also names the images jobs return; a pixel fleet's are
    its samples (`sample_shape`, `value_range`). A body with `v` / `kind` is taken the same (they are ignored)."""
    import json

    import msgpack

    from client.jobs import fleet_status
    from coordinator.local_fleet import LabelRouter
    from coordinator.service import Coordinator
    from schemas import FleetStatus, unpack

    rgb = make_tiny_expert(tmp_path / "e0", expert_id=0, in_channels=3)
    spec = legacy_spec(in_channels=3)
    async with ExpertWorker(0, str(rgb), "torch", nats_url=nats_url, buckets=(1,)):
        async with Coordinator(LabelRouter([0] * 10, 1), num_experts=1, nats_url=nats_url, spec=spec):
            status = await fleet_status(nc, spec=True, image_spec=True)
            plain = await fleet_status(nc, spec=True)
            body = {"v": 1, "kind": "fleet_status_request", "spec": True, "image_spec": True}
            as_msgpack = await nc.request("ddm.v1.fleet.status", msgpack.packb(body), timeout=5)
            as_json = await nc.request("ddm.v1.fleet.status", json.dumps(body).encode(), timeout=5)
            alone = await nc.request("ddm.v1.fleet.status", b'{"image_spec": true}', timeout=5)
    assert status.spec.image_shape == status.spec.sample_shape == (3, 32, 32)
    assert status.spec.image_value_range == status.spec.value_range == (-1.0, 1.0)
    assert plain.spec.image_shape is None and plain.spec.image_value_range is None
    for reply in (as_msgpack, as_json):
        assert unpack(reply.data, FleetStatus).spec == status.spec
    assert unpack(alone.data, FleetStatus).spec is None  # image_spec without spec asks for nothing


def test_every_fleet_reports_its_routing_network_as_arch(tmp_path):
    """`arch` in the reported spec is what routes the fleet, by one rule, whatever the router checkpoint
    stored: the shipped MNIST router (no stored spec: its implied one says "unet"), a colour fleet's (its
    spec says "router") and a tiny router whose spec was copied from DiT experts (says "dit") all report
    "router"; the class-table stand-in reports "label"; a router object that does not say, "router"."""
    from pathlib import Path

    from coordinator.local_fleet import LabelRouter
    from coordinator.service import Coordinator, router_arch
    from coordinator.startup import router_spec
    from models.tiny import make_tiny_router

    root = Path(__file__).resolve().parents[2] / "checkpoints"
    dit = legacy_spec().model_copy(update={"arch": "dit"})
    tiny = make_tiny_router(tmp_path / "router", 2, meta={"spec": dit.to_json()})
    made = {
        "mnist": (root / "router.safetensors", root / "partition.json"),
        "colour": (root / "colour" / "router.safetensors", root / "colour" / "partition.json"),
        "tiny": (tiny, root / "partition.json"),
    }
    stored = {name: router_spec(r).arch for name, (r, _) in made.items()}
    assert stored == {"mnist": "unet", "colour": "router", "tiny": "dit"}  # what the checkpoints say
    for name, (r, part) in made.items():
        coord = Coordinator.from_files(r, part, nats_url="nats://127.0.0.1:1")
        assert coord.reported_spec().arch == coord.reported_spec(include_images=True).arch == "router", name
    label = Coordinator(LabelRouter([0] * 10, 1), num_experts=1, nats_url="nats://127.0.0.1:1", spec=dit)
    assert label.reported_spec().arch == "label"

    class Plain:
        def weights(self, x, t, y):
            raise AssertionError("not called")

    assert router_arch(Plain()) == "router"
    bare = Coordinator(Plain(), num_experts=1, nats_url="nats://127.0.0.1:1")  # no spec: the implied one
    assert bare.reported_spec().arch == "router"


async def test_a_start_that_fails_part_way_closes_what_it_opened(nats_url):
    """A latent spec that names no autoencoder: the start fails with a clear ValueError after the spec
    check, and the connection the coordinator opened for itself is closed (nothing left subscribed)."""
    from coordinator.local_fleet import LabelRouter
    from coordinator.service import Coordinator

    spec = legacy_spec().model_copy(update={"space": "latent", "decoder": "not-an-autoencoder"})
    coord = Coordinator(LabelRouter([0] * 10, 1), num_experts=1, nats_url=nats_url, spec=spec)
    with pytest.raises(ValueError, match="names no autoencoder"):
        await coord.__aenter__()
    assert coord.nc is not None and coord.nc.is_closed and coord._subs == []
