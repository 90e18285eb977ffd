"""An ephemeral, all-in-one fleet in this process: nats-server + expert workers + coordinator.

    async with LocalFleet(expert_checkpoints=["checkpoints/expert0.safetensors", ...],
                          router=..., num_experts=2, class_to_expert=[...]) as fleet:
        done = await run_job(fleet.nc, JobRequest(digits=[3, 7]))

`LocalFleet.from_dir("checkpoints")` uses the shipped file names (expert<k>.safetensors,
router.safetensors, partition.json) and serves the router's model spec, so any fleet directory works
(RGB, any class count, UNet or DiT experts). Used by `ddm-fleet generate --local`, `bench fleet` and
tests; a user with no NATS server can generate images with it.

`InProcessTransport` calls loaded backends directly (no NATS, same batching): the ceiling the
bench compares the fleet against.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

DEFAULT_DIR = "checkpoints"


def shipped_paths(directory: str | os.PathLike = DEFAULT_DIR) -> dict[str, Any]:
    """{"experts": [expert0.safetensors, ...], "router": ..., "partition": ...} in `directory`.

    Raises FileNotFoundError naming what is missing and how to get it."""
    d = Path(directory)
    router, partition = d / "router.safetensors", d / "partition.json"
    experts = []
    k = 0
    while (d / f"expert{k}.safetensors").exists():
        experts.append(d / f"expert{k}.safetensors")
        k += 1
    missing = [str(p) for p in (router, partition) if not p.exists()]
    if not experts:
        missing.append(str(d / "expert0.safetensors"))
    if missing:
        raise FileNotFoundError(
            f"missing {', '.join(missing)}: train or fetch the checkpoints first (see checkpoints/README.md), "
            "or pass --checkpoints DIR"
        )
    return {"experts": experts, "router": router, "partition": partition}


class LabelRouter:
    """A router that ignores x_t and t: weight `confidence` on the expert owning the class label,
    the rest spread over the others. A stand-in where no trained router is at hand (benches,
    tests); the real one is `models.router.Router`. A row whose label is unknown (y = -1, an
    unconditional row) has no owner: it gets uniform weights 1/K (top1 then picks expert 0).

    weights(x_t [B, C, H, W], t [B], y [B]) -> [B, K] (rows sum to 1)."""

    #: what routes, as a fleet's reported spec gives it (`arch`): a class table, no network
    arch = "label"

    def __init__(self, class_to_expert: Sequence[int], num_experts: int, confidence: float = 0.8):
        if num_experts < 1 or not 0 < confidence <= 1:
            raise ValueError("need num_experts >= 1 and 0 < confidence <= 1")
        self.class_to_expert = np.asarray(class_to_expert, dtype=np.int64)
        if ((self.class_to_expert < 0) | (self.class_to_expert >= num_experts)).any():
            raise ValueError(
                f"class_to_expert {self.class_to_expert.tolist()} names experts outside [0, {num_experts})"
            )
        self.num_experts = num_experts
        self.confidence = confidence

    def weights(self, x_t: np.ndarray, t: np.ndarray, y: np.ndarray) -> np.ndarray:
        y = np.asarray(y, dtype=np.int64)
        k = self.num_experts
        if k == 1:
            return np.ones((len(y), 1))
        w = np.full((len(y), k), (1.0 - self.confidence) / (k - 1))
        known = np.nonzero(y >= 0)[0]
        w[known, self.class_to_expert[y[known]]] = self.confidence
        w[y < 0] = 1.0 / k
        return w


class InProcessTransport:
    """Velocity calls straight into loaded backends, run off the event loop (one thread each).

    `buckets`: the batch sizes the backends were warmed at. A backend that needs fixed shapes
    (`pads_to_buckets`: XLA, jax, CUDA) then gets its rows padded up to the smallest bucket that
    holds them, and split at the largest, as a worker's batcher does; without it jax.jit would
    compile a new program for every batch size the scheduler makes. Classifier-free guidance
    (`guidance=`, a scale per row) is computed as a worker does: the guided rows' null twins in the same
    forward, combined by `flow.guidance`; a backend without a null label refuses it (`ExpertUnavailable`)."""

    def __init__(self, backends: Sequence[Any], buckets: Sequence[int] = ()):
        self.backends = list(backends)
        self.buckets = tuple(sorted(int(b) for b in buckets))
        self._locks = [asyncio.Lock() for _ in self.backends]

    async def velocity(
        self,
        expert: int,
        x: np.ndarray,
        t: np.ndarray,
        y: np.ndarray,
        row_ids,
        guidance: np.ndarray | None = None,
    ) -> np.ndarray:
        """v [n, C, H, W] float32 of rows x [n, C, H, W] at t [n], labels y [n]; guidance [n] float32 scales."""
        from flow.guidance import add_null_twins, fold_twins, guided_rows

        from .errors import ExpertUnavailable

        if not 0 <= expert < len(self.backends):
            raise ExpertUnavailable(expert, "not loaded in this process")
        backend = self.backends[expert]
        x, t, y = np.ascontiguousarray(x, np.float32), t.astype(np.float32), y.astype(np.int64)
        twins = guided_rows(y, guidance) if guidance is not None else np.zeros(0, np.int64)
        if len(twins) and not getattr(backend, "null_label", False):
            raise ExpertUnavailable(expert, "classifier-free guidance needs a null label; this expert's model has none")
        x, t, y = add_null_twins(x, t, y, twins)
        async with self._locks[expert]:  # a backend runs one forward at a time
            if not self.buckets or not getattr(backend, "pads_to_buckets", False):
                v = await asyncio.to_thread(backend.forward, x, t, y)
            else:
                v = await asyncio.to_thread(self._padded_forward, backend, x, t, y)
        return fold_twins(v, twins, guidance) if len(twins) else v

    def _padded_forward(self, backend, x: np.ndarray, t: np.ndarray, y: np.ndarray) -> np.ndarray:
        from workers.batcher import bucket_for, pad_rows

        top = self.buckets[-1]
        parts = []
        for s in range(0, len(x), top):
            n = min(top, len(x) - s)
            b = bucket_for(n, self.buckets)
            out = backend.forward(pad_rows(x[s : s + n], b), pad_rows(t[s : s + n], b), pad_rows(y[s : s + n], b))
            parts.append(np.asarray(out)[:n])
        return parts[0] if len(parts) == 1 else np.concatenate(parts)


def load_backends(
    paths: Sequence[str | os.PathLike],
    backend: str = "torch",
    *,
    dtype: str = "auto",
    buckets: Sequence[int] = (),
    device: str | None = None,
    compile: str = "off",
    batch_quantum: int = 0,
) -> list[Any]:
    """One loaded backend per checkpoint (on `device`, None: the backend's default), warmed at `buckets`,
    computing in `dtype` ("auto" | "float32" | "bfloat16", `models.precision`); torch: `compile` "off" |
    "on" | "auto" (`workers.backends.torch_compile`); `batch_quantum` > 1: batch-invariant, as a worker's
    `--batch-invariant` (`BackendBase.make_batch_invariant`)."""
    from workers.backends import get_backend

    out = []
    extra = {"compile": compile} if backend == "torch" else {}
    for p in paths:
        be = get_backend(backend, dtype=dtype, **({"device": device} if device else {}), **extra)
        be.load(p)
        if batch_quantum:
            be.make_batch_invariant(batch_quantum)
        if buckets:
            be.warmup(buckets)
        out.append(be)
    return out


class LocalFleet:
    """nats-server (own, on a free port, unless `nats_url` is given) + `workers_per_expert`
    in-process ExpertWorkers per checkpoint + a Coordinator, and for a latent fleet a DecoderWorker of
    `decoder_checkpoint` (`from_dir` finds the autoencoder beside the checkpoints). Async context manager."""

    def __init__(
        self,
        expert_checkpoints: Sequence[str | os.PathLike],
        router: Any,
        *,
        num_experts: int,
        class_to_expert: Sequence[int] | None = None,
        nats_url: str | None = None,
        workers_per_expert: int = 1,
        backend: str = "torch",
        device: str | None = None,
        dtype: str = "auto",
        compile: str = "off",
        buckets: Sequence[int] = (1, 2, 4, 8, 16, 32, 64),
        batch_quantum: int = 0,
        coordinator_options: dict | None = None,
        decoder_checkpoint: str | os.PathLike | None = None,
    ):
        if len(expert_checkpoints) != num_experts:
            raise ValueError(f"{len(expert_checkpoints)} expert checkpoints for {num_experts} experts")
        self.expert_checkpoints = [os.fspath(p) for p in expert_checkpoints]
        self.router = router
        self.num_experts = num_experts
        self.class_to_expert = class_to_expert
        self.url = nats_url
        self.workers_per_expert = workers_per_expert
        self.backend = backend
        self.device = device  # the workers' device (None: the backend's default, the CPU for torch)
        self.dtype = dtype  # the workers' dtype: "auto" | "float32" | "bfloat16" (`models.precision`)
        # torch workers: "off" (a short-lived fleet: a compile would cost more than it saves), "on", "auto"
        self.compile = compile
        self.buckets = tuple(buckets)
        self.batch_quantum = batch_quantum  # > 1: batch-invariant workers (`--batch-invariant`)
        self.coordinator_options = dict(coordinator_options or {})
        self.server = None
        self.nc = None
        self.workers: list = []
        self.coordinator = None
        # a latent fleet's autoencoder: an in-process decoder serves it (`ddm-fleet decoder`'s service)
        self.decoder_checkpoint = None if decoder_checkpoint is None else os.fspath(decoder_checkpoint)
        self.decoder = None

    @classmethod
    def from_dir(cls, directory: str | os.PathLike = DEFAULT_DIR, **kw) -> LocalFleet:
        from models.fleet_guidance import fleet_default_guidance

        from .service import load_router_and_partition, router_spec

        paths = shipped_paths(directory)
        router, k, c2e = load_router_and_partition(paths["router"], paths["partition"])
        options = dict(kw.get("coordinator_options") or {})
        options.setdefault("spec", router_spec(paths["router"]))
        options.setdefault("fleet_guidance", fleet_default_guidance(paths["router"]))
        kw["coordinator_options"] = options
        if "decoder_checkpoint" not in kw:  # a latent fleet decodes with the autoencoder beside it
            from models.codec import fleet_codec

            kw["decoder_checkpoint"] = fleet_codec(options["spec"], [directory])
        return cls(paths["experts"][:k], router, num_experts=k, class_to_expert=c2e, **kw)

    async def __aenter__(self) -> LocalFleet:
        from bus.connect import connect
        from bus.nats_server import NatsServer
        from workers.service import ExpertWorker

        from .service import Coordinator

        try:
            if self.url is None:
                self.server = NatsServer()
                await asyncio.to_thread(self.server.start)
                self.url = self.server.url
            # a short-lived client of its own (or the given) server: bounded reconnects, as nats-py's default
            self.nc = await connect(self.url, name="local-fleet", reconnect=60, first_connect_attempts=3)
            # workers one after another: loading + warm-up is CPU bound anyway
            for k, path in enumerate(self.expert_checkpoints):
                for _ in range(self.workers_per_expert):
                    w = ExpertWorker(
                        expert=k,
                        checkpoint=path,
                        backend=self.backend,
                        device=self.device,
                        dtype=self.dtype,
                        nats_url=self.url,
                        buckets=self.buckets,
                        compile=self.compile,  # a serving option of every backend; only torch uses it
                        batch_quantum=self.batch_quantum,
                    )
                    await w.start()
                    self.workers.append(w)
            if self.decoder_checkpoint is not None:
                from workers.decoder_service import DecoderWorker

                self.decoder = DecoderWorker(self.decoder_checkpoint, nats_url=self.url, device=self.device or "cpu")
                await self.decoder.start()
            self.coordinator = Coordinator(
                self.router,
                num_experts=self.num_experts,
                class_to_expert=self.class_to_expert,
                nats_url=self.url,
                **self.coordinator_options,
            )
            await self.coordinator.__aenter__()
        except BaseException:
            await self.__aexit__(None, None, None)
            raise
        return self

    async def __aexit__(self, *exc) -> None:
        if self.coordinator is not None:
            await self.coordinator.__aexit__(None, None, None)
            self.coordinator = None
        for w in reversed(self.workers):
            try:
                await w.stop()
            except Exception:
                log.exception("stopping a worker failed")
        self.workers = []
        if self.decoder is not None:
            try:
                await self.decoder.stop()
            except Exception:
                log.exception("stopping the decoder failed")
            self.decoder = None
        if self.nc is not None:
            from bus.connect import drain_or_close

            await drain_or_close(self.nc)
            self.nc = None
        if self.server is not None:
            await asyncio.to_thread(self.server.__exit__, None, None, None)  # stop + remove its config dir
            self.server = None
