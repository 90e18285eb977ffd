"""What a coordinator needs before it serves: its router and partition from files, and (optionally)
a worker for every expert."""

from __future__ import annotations

import asyncio
import os
import time

from schemas import subjects

from .null_labels import probe_step


def load_router_and_partition(router_path: str | os.PathLike, partition_path: str | os.PathLike):
    """(router with .weights(x, t, y) -> [B, K], num_experts, class_to_expert list[10]) from files."""
    from dataset.partition import load_manifest
    from models.router import Router

    for p, what in ((router_path, "router"), (partition_path, "partition manifest")):
        if not os.path.exists(p):
            raise FileNotFoundError(f"{what} {os.fspath(p)!r} does not exist")
    manifest = load_manifest(partition_path)
    router = Router.load(router_path)
    rk = getattr(router, "num_experts", manifest.num_experts)
    if rk != manifest.num_experts:
        raise ValueError(
            f"router {os.fspath(router_path)!r} weighs {rk} experts but partition "
            f"{os.fspath(partition_path)!r} has {manifest.num_experts}: use files from the same run"
        )
    classes = int(getattr(getattr(router, "cfg", None), "num_classes", 10))
    c2e = [int(manifest.class_to_expert(y)) for y in range(classes)]
    return router, int(manifest.num_experts), c2e


def router_spec(router_path: str | os.PathLike):
    """The model spec of a router checkpoint (`models.spec.spec_of` of its JSON: stored, or implied
    by its config for routers made before specs). Raises SpecError / FileNotFoundError."""
    from pathlib import Path

    from bus.json_file import read_json_file
    from models.spec import SpecError, spec_of

    path = Path(router_path)
    meta_path = path.with_suffix(".json")
    if not meta_path.exists():
        raise FileNotFoundError(f"router metadata {meta_path} does not exist (expected next to {path.name})")
    return spec_of(read_json_file(meta_path, error=SpecError), where=str(meta_path))


async def wait_for_experts(nc, num_experts: int, timeout: float = 30.0) -> None:
    """Block until every expert subject has at least one responder (or raise TimeoutError)."""
    import nats.errors

    from bus.inbox import private_request

    probe = {k: probe_step(k) for k in range(num_experts)}
    deadline = time.monotonic() + timeout
    missing = set(range(num_experts))
    while missing:
        for k in sorted(missing):
            try:
                await private_request(nc, subjects.expert_velocity(k), probe[k], timeout=max(1.0, min(10.0, timeout)))
                missing.discard(k)
            except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
                pass
        if missing:
            if time.monotonic() > deadline:
                raise TimeoutError(f"experts {sorted(missing)} have no workers after {timeout:g} s")
            await asyncio.sleep(0.2)
