"""The fleet's model spec, checked at the coordinator's start.

The coordinator reads the spec of its router checkpoint, which is the fleet's, and asks every expert
worker on the bus for its spec (`$SRV.INFO.ddm-expert`: the `spec` key of the service metadata,
compact JSON; workers of releases before specs advertise `input_shape` / `num_classes` instead, from
which the spec is implied). A worker that disagrees on what the fleet produces (sample shape, value
range, space, prediction, time convention, classes), or whose spec does not read, is named in an
error line and not used; it is never a reason not to start (one odd host, or one that lies, must
not stop the service).

    spec, odd = await check_fleet_spec(nc, router_spec)   # odd: {worker name: what differs}

Workers that start later are checked as the coordinator discovers them (`check_worker`, called by
the transport's periodic `$SRV.INFO` discovery, coordinator/worker_discovery.py): a worker whose spec differs
is rejected (never addressed directly, its replies refused), logged by name and counted; the
coordinator keeps serving with the matching workers. The workers found odd at the start are rejected
the same way before the coordinator serves its first job.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

from bus.gather import gather_replies
from schemas.spec import ModelSpec, SpecError, fleet_spec, legacy_spec

log = logging.getLogger(__name__)

#: The NATS micro service name every expert worker registers (workers.service.SERVICE_NAME).
EXPERT_SERVICE = "ddm-expert"


def worker_spec(metadata: dict) -> ModelSpec:
    """A worker's spec from its service metadata: the `spec` JSON, else the spec implied by
    `input_shape` ("C,H,W") and `num_classes` (workers of releases before specs)."""
    raw = metadata.get("spec")
    if raw:
        try:
            data = json.loads(raw)
        except (TypeError, ValueError) as err:
            raise SpecError(f"metadata 'spec' is not JSON: {err}") from None
        return ModelSpec.from_json(data if isinstance(data, dict) else {}, where="metadata 'spec'")
    try:
        c, h, w = (int(v) for v in str(metadata.get("input_shape", "1,32,32")).split(","))
        classes = int(metadata.get("num_classes", 10))
    except ValueError as err:
        raise SpecError(f"metadata input_shape / num_classes unreadable: {err}") from None
    if h != w:
        return ModelSpec(sample_shape=(c, h, w))
    return legacy_spec(
        in_channels=c, image_size=h, num_classes=classes, null_label=metadata.get("null_label") == "true"
    )


def _member_name(md: dict) -> str:
    where = f"{md.get('host', '?')} pid {md.get('pid', '?')}"
    return f"expert {md.get('expert', '?')} worker {md.get('worker_id', '?')} ({where})"


async def discover_worker_specs(nc, *, window_s: float = 0.5) -> dict[str, ModelSpec | SpecError]:
    """{member name: spec} for every expert worker that answers `$SRV.INFO.ddm-expert` within
    `window_s`; a worker whose advertised spec is unreadable maps to its SpecError."""
    out: dict[str, ModelSpec | SpecError] = {}
    for raw in await gather_replies(nc, f"$SRV.INFO.{EXPERT_SERVICE}", window=window_s):
        try:
            info = json.loads(raw)
        except ValueError:
            continue
        md = info.get("metadata") if isinstance(info, dict) else None
        if not isinstance(md, dict):
            continue
        name = _member_name(md)
        try:
            out[name] = worker_spec(md)
        except SpecError as err:
            out[name] = err
    return out


def check_specs(router_spec: ModelSpec, workers: dict[str, ModelSpec | SpecError]) -> tuple[ModelSpec, dict[str, str]]:
    """(the fleet's spec: the router's, completed from the agreeing workers (class names); {worker name:
    what differs} for every worker that differs or advertises an unreadable spec). Pure."""
    odd: dict[str, str] = {}
    agree: dict[str, ModelSpec] = {"router": router_spec}
    for name, spec in workers.items():
        if isinstance(spec, SpecError):
            odd[name] = f"unreadable spec: {spec}"
            continue
        diff = router_spec.differences(spec)
        if diff:
            odd[name] = "; ".join(diff)
        else:
            agree[name] = spec
    return fleet_spec(agree), odd


async def check_fleet_spec(nc, router_spec: ModelSpec, *, window_s: float = 0.5) -> tuple[ModelSpec, dict[str, str]]:
    """Discover the workers on the bus: (the fleet's spec, {odd worker's name: what differs}); logs each
    odd worker as an error (it is not used) and the count of those that agree."""
    workers = await discover_worker_specs(nc, window_s=window_s)
    spec, odd = check_specs(router_spec, workers)
    for name, why in odd.items():
        log.error("not using %s: its model spec differs from the fleet's (%s)", name, why)
    log.info(
        "fleet spec: %s, %s, %d classes; %d worker(s) agree%s",
        list(spec.sample_shape),
        spec.space,
        spec.num_classes,
        len(workers) - len(odd),
        f", {len(odd)} differ (not used)" if odd else "",
    )
    return spec, odd


@dataclass(frozen=True)
class RejectedWorker:
    """A worker on the bus whose model spec differs from the fleet's (or cannot be read): not used."""

    worker_id: str
    service_id: str
    host: str
    expert: int
    differs: str

    def describe(self) -> str:
        """Who it is: "expert K worker <id> (service <nats.micro id>, host <hostname>)"."""
        return f"expert {self.expert} worker {self.worker_id} (service {self.service_id}, host {self.host})"

    def to_json(self) -> dict:
        return {
            "worker_id": self.worker_id,
            "service_id": self.service_id,
            "host": self.host,
            "expert": self.expert,
            "differs": self.differs,
        }


def check_worker(fleet: ModelSpec, info: dict) -> RejectedWorker | None:
    """A worker's `$SRV.INFO` reply (decoded JSON) checked against the fleet's spec: None when it serves
    the same fleet (or names no worker id: nothing to route by), else the RejectedWorker saying what differs."""
    md = info.get("metadata") if isinstance(info, dict) else None
    if not isinstance(md, dict) or not isinstance(md.get("worker_id"), str):
        return None
    try:
        diff = fleet.differences(worker_spec(md))
    except SpecError as err:
        diff = [f"unreadable spec: {err}"]
    if not diff:
        return None
    try:
        expert = int(md.get("expert", -1))
    except (TypeError, ValueError):
        expert = -1
    return RejectedWorker(
        worker_id=md["worker_id"][:128],
        service_id=str(info.get("id", "?"))[:64],
        host=str(md.get("host", "?"))[:128],
        expert=expert,
        differs="; ".join(diff)[:1000],
    )
