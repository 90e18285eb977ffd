"""What a coordinator answers about its fleet (`fleet_status`, `reported_spec`) and about one job
(`job_status`), from its engine, ledger, decode stage and transport: the bodies of
`Coordinator.status` / `reported_spec` / `job_status`, which `coordinator.intake` turns into replies."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from schemas import FleetStatus, JobStatus
from schemas.messages import RejectedWorkerInfo
from schemas.spec import ModelSpec

if TYPE_CHECKING:
    from .decoding import DecodeStage
    from .engine import Engine
    from .intake import Intake
    from .ledger import JobLedger


class StatusHost(Protocol):
    """What the answers read of their coordinator (`coordinator.service.Coordinator` is one)."""

    name: str
    instance: str
    spec: ModelSpec
    default_guidance: float
    engine: Engine
    ledger: JobLedger
    intake: Intake
    transport: Any  # its `rejected_workers`, when it discovers workers
    decode_stage: DecodeStage | None  # a latent fleet's
    decoder: Any  # a latent fleet's DecoderClient: its `image_shape`, `image_value_range` once learned


def rejected_workers(coord: StatusHost) -> list:
    """The workers on the bus (at the last discovery) whose model spec differs from the fleet's."""
    rejected = getattr(coord.transport, "rejected_workers", None) or {}
    return sorted(rejected.values(), key=lambda w: (w.expert, w.worker_id))


def reported_spec(coord: StatusHost, include_images: bool = False) -> ModelSpec:
    """The fleet's spec as `fleet.status` reports it; with `include_images`, naming the images clients
    get (`image_shape`, `image_value_range`): a pixel fleet's samples, a latent fleet's decoded
    images (left out while no decoder of its autoencoder has been found: `learn_images`)."""
    if not include_images:
        return coord.spec
    if coord.spec.space == "latent":
        dec = coord.decoder
        return coord.spec.with_images(getattr(dec, "image_shape", None), getattr(dec, "image_value_range", None))
    return coord.spec.with_images()


def fleet_status(coord: StatusHost, include_spec: bool = False, include_images: bool = False) -> FleetStatus:
    """The fleet status snapshot; with `include_spec`, the fleet's model spec too, and with
    `include_images` as well, the spec names the images clients get (`reported_spec`)."""
    st = coord.engine.status()
    st["jobs_rejected"] = st.get("jobs_rejected", 0) + coord.intake.rejected_unread  # every submit answered `rejected`
    rejected = [RejectedWorkerInfo(**w.to_json()) for w in rejected_workers(coord)] if include_spec else None
    spec = reported_spec(coord, include_images) if include_spec else None
    guidance = coord.default_guidance if include_spec else None
    return FleetStatus(
        coordinator=coord.name, spec=spec, rejected_workers=rejected, default_guidance_scale=guidance, **st
    )


async def job_status(coord: StatusHost, job_id: str, client: str | None = None) -> JobStatus | None:
    """What the coordinator knows of a job; None if nothing (never had it, or forgot it), or, with
    `client`, if the job is not that client's."""
    ledger, engine = coord.ledger, coord.engine
    internal = ledger.find(job_id, client)
    if internal is None and ledger.find_finished(job_id, client) is None:
        # A tick may have finished the job and still be publishing its events: wait for that.
        await engine.flush_events()
        internal = ledger.find(job_id, client)
    state = engine.job_state(internal) if internal is not None else None
    if state is None and internal is not None:
        # The scheduler let the job go and its end may still wait among the engine's events (a running
        # engine publishes a tick's events once the next requests are out): publish them first.
        await engine.flush_events()
    stage = coord.decode_stage
    if state is None and internal is not None and stage is not None and stage.is_decoding(internal):
        step, steps = ledger.progress(internal) or (0, 0)  # its images are being decoded
        state = {"state": "running", "step": step, "steps": steps}
    if state is not None:
        st = JobStatus(job_id=job_id, coordinator=coord.name, instance=coord.instance, **state)
        return ledger.stamp(internal, st)
    found = ledger.find_finished(job_id, client)
    if found is None:
        return None
    _, ev, (step, steps) = found
    return JobStatus(
        job_id=job_id,
        state="done" if ev.kind == "done" else "failed",
        step=step,
        steps=steps,
        coordinator=coord.name,
        instance=coord.instance,
        expert_dtypes=getattr(ev, "expert_dtypes", None),  # a done job that asked for them
        epoch=getattr(ev, "epoch", None),  # a job that asked for it: the epoch its result was published at
    )
