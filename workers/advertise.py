"""What an expert worker advertises: its `nats.micro` service, its two endpoints and their metadata.

Service discovery: name `ddm-expert`; metadata has expert, backend, device, dtype (what the expert
computes in: float32 or bfloat16; `precision` is its older name), buckets,
max_batch, input_shape, num_classes, null_label ("true" only when the model has one), protocol, version,
worker_id, host, pid, checkpoint, subject, direct_subject, run_ahead (the most further steps one request
may ask it to run ahead: `StepRequest.ahead_t`, answered with up to that many more replies), guidance
("true": it serves `StepRequest.guidance`, classifier-free guidance), batch_quantum (only when it runs
batch-invariant, `--batch-invariant`: every forward computes a multiple of that many rows). Every value
is a string (the micro protocol's metadata is a map of strings); docs/PROTOCOL.md section 2.2 gives each
key's format.

Endpoints: `velocity` on `schemas.subjects.expert_velocity(K)` in the queue group
`expert_queue_group(K)` (every worker of expert K), and `direct` on the worker's own
`expert_direct(K, token)` (join-shortest-queue coordinators reach this one worker there). Discovery is
answered only on inbox reply subjects (`workers.discovery`). STATS `data` is what `stats()` returns.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Awaitable, Callable
from importlib import metadata as _md
from typing import Any

from bus.connect import flushed
from schemas import subjects
from schemas.limits import MAX_RUN_AHEAD
from schemas.version import PROTOCOL_VERSION

from .discovery import InboxOnlyService, add_inbox_only_service

SERVICE_NAME = "ddm-expert"
ENDPOINT_NAME = "velocity"
DIRECT_ENDPOINT_NAME = "direct"


def package_version() -> str:
    try:
        return _md.version("ddm-fleet")
    except _md.PackageNotFoundError:  # running from a source tree that is not installed
        return "0.0.0"


def worker_metadata(
    *,
    expert: int,
    backend: Any,
    buckets: tuple[int, ...],
    max_batch: int,
    max_request_rows: int,
    max_queue_rows: int | None,
    worker_id: str,
    checkpoint: str | None,
    direct_subject: str,
) -> dict[str, str]:
    """The service metadata of a worker of `expert` serving loaded `backend` (see the module docstring)."""
    be = backend
    meta = {
        "expert": str(expert),
        "buckets": ",".join(map(str, buckets)),
        "max_batch": str(max_batch),
        "max_request_rows": str(max_request_rows),
        "max_queue_rows": str(max_queue_rows or ""),
        "protocol": str(PROTOCOL_VERSION),
        "version": package_version(),
        "worker_id": worker_id,
        "host": socket.gethostname(),
        "pid": str(os.getpid()),
        "checkpoint": os.path.basename(checkpoint or getattr(be, "checkpoint_path", "") or ""),
        "subject": subjects.expert_velocity(expert),
        "direct_subject": direct_subject,
        "run_ahead": str(MAX_RUN_AHEAD),  # most further steps one request may ask for (StepRequest.ahead_t)
        "guidance": "true",  # serves StepRequest.guidance (a model without a null label still refuses it)
    }
    if hasattr(be, "describe"):
        meta.update(be.describe())
    else:
        meta.update(backend=str(be.name), device=str(be.device))
    shape = getattr(be, "input_shape", None)
    if shape:
        meta["input_shape"] = ",".join(map(str, shape))
    classes = getattr(be, "num_classes", None)
    if classes:
        meta["num_classes"] = str(classes)
    if getattr(be, "null_label", False):  # serves y = -1 (label unknown); absent: it does not
        meta["null_label"] = "true"
    spec = getattr(be, "spec", None)
    if spec is not None:  # the model spec as compact JSON (schemas.spec.ModelSpec)
        meta["spec"] = json.dumps(spec.to_json(), separators=(",", ":"))
    return meta


async def start_expert_service(
    nc: Any,
    *,
    expert: int,
    metadata: dict[str, str],
    on_drop: Callable[[str], None],
    stats: Callable[[], dict],
) -> InboxOnlyService:
    """Start the micro service of a worker of `expert` on `nc` (no endpoints yet: `add_expert_endpoints`);
    `on_drop` hears of discovery requests with a reply subject outside `_INBOX`; `stats()` is STATS `data`."""
    version = package_version()
    return await add_inbox_only_service(
        nc,
        on_drop,
        name=SERVICE_NAME,
        version=version if version.count(".") == 2 else "0.0.0",
        description=f"ddm-fleet expert {expert} velocity worker",
        metadata=metadata,
        stats_handler=lambda _endpoint: stats(),
    )


async def add_expert_endpoints(
    service: InboxOnlyService,
    nc: Any,
    *,
    expert: int,
    worker_id: str,
    direct_subject: str,
    handler: Callable[[Any], Awaitable[None]],
) -> None:
    """Add both endpoints of a worker of `expert` to its `service`, `handler` answering each; returns once
    the server has their subscriptions."""
    endpoint = {"expert": str(expert), "request": "StepRequest", "reply": "StepReply|ErrorReply"}
    await service.add_endpoint(
        name=ENDPOINT_NAME,
        subject=subjects.expert_velocity(expert),
        queue_group=subjects.expert_queue_group(expert),
        handler=handler,
        metadata=endpoint,
    )
    # the same handler on this worker's own subject (join-shortest-queue coordinators); its queue
    # group only matters if two workers ever shared a worker id
    await service.add_endpoint(
        name=DIRECT_ENDPOINT_NAME,
        subject=direct_subject,
        queue_group=subjects.expert_queue_group(expert),
        handler=handler,
        metadata={**endpoint, "worker_id": worker_id},
    )
    # the server has the endpoints' subscriptions before this returns (a request right after start()
    # would otherwise meet "no responders" on a loaded box)
    await flushed(nc)
