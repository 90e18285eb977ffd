"""The quality comparison: a monolith against the DDM under each routing strategy.

Every configuration generates the same requested digits with the same seeds through the
fleet's public path (jobs submitted on NATS to a coordinator, experts served by workers),
then two independent judge classifiers (torch CNN and JAX/Flax residual CNN, see `judges.py`)
score them side by side. `Config` names one row of the table.

    rows = asyncio.run(evaluate(EvalSpec(...)))
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Config:
    name: str  # table row label
    model: str  # "ddm" or "monolith"
    strategy: str = "top1"
    top_k: int = 2

    @classmethod
    def parse(cls, text: str) -> Config:
        """'monolith' | 'top1' | 'top2' (any topK) | 'full' | 'oracle' | 'sample'."""
        t = text.strip().lower()
        if t == "monolith":
            return cls("monolith", "monolith")
        if t in ("top1", "full", "oracle", "sample"):
            return cls(f"ddm-{t}", "ddm", t)
        if t.startswith("top") and t[3:].isdigit() and int(t[3:]) >= 2:
            return cls(f"ddm-{t}", "ddm", "topk", int(t[3:]))
        raise ValueError(f"unknown configuration {text!r}: use monolith, top1, top2 (topK), full, oracle or sample")

    def guided(self, scale: float) -> Config:
        """This configuration's row at guidance `scale`: DDM rows are named `<name>-cfgS` (as the in-process
        sampler's files) when S is not 1; a monolith row is unchanged (it runs unguided)."""
        if self.model != "ddm" or scale == 1.0:
            return self
        return Config(f"{self.name}-cfg{scale:g}", self.model, self.strategy, self.top_k)


@dataclass
class EvalSpec:
    configs: Sequence[Config]
    checkpoints: str = "checkpoints"
    monolith: str | None = None  # default: <checkpoints>/monolith.safetensors
    per_class: int = 50
    steps: int = 40
    solver: str = "euler"
    seed: int = 0
    job_size: int = 50
    nats_url: str | None = None  # an existing fleet for the DDM rows; None = start one locally
    data_dir: str | None = None
    save_dir: str | None = None  # write <name>.npz (images, labels, usage) per configuration
    progress: bool = True
    device: str | None = None  # the local fleet's worker device (cuda, cuda:1, ...); None = the CPU
    num_classes: int = 10  # classes asked for, per_class of each (a prepared dataset's class count)
    dtype: str = "auto"  # the local fleet's experts: "auto" | "float32" | "bfloat16" (`models.precision`)
    # the DDM rows' classifier-free guidance scale, sent with every job (1: off, also on a fleet whose default
    # guides, so that a row is what its name says); monolith rows stay at 1
    guidance: float = 1.0


@dataclass
class Row:
    config: Config
    accuracy: float
    fid: float
    experts_per_step: float
    flops_per_image: float
    seconds: float
    n: int
    per_class_accuracy: list[float] = field(default_factory=list)
    predicted_counts: list[int] = field(default_factory=list)
    # judge 2 (the independent JAX classifier) on the same images, and how often the judges agree
    accuracy2: float = float("nan")
    fid2: float = float("nan")
    agreement: float = float("nan")
    per_class_accuracy2: list[float] = field(default_factory=list)
    predicted_counts2: list[int] = field(default_factory=list)

    def as_dict(self) -> dict:
        gen = self.config.model != "real"  # the real-digit baseline has no generation cost
        return {
            "config": self.config.name,
            "accuracy": self.accuracy,
            "fid": self.fid,
            "accuracy_judge2": self.accuracy2,
            "fid_judge2": self.fid2,
            "agreement": self.agreement,
            "experts_per_step": self.experts_per_step if gen else None,
            "flops_per_image": self.flops_per_image if gen else None,
            "seconds": self.seconds if gen else None,
            "n": self.n,
            "per_class_accuracy": self.per_class_accuracy,
            "predicted_counts": self.predicted_counts,
            "per_class_accuracy_judge2": self.per_class_accuracy2,
            "predicted_counts_judge2": self.predicted_counts2,
        }


def add_sampling_arguments(parser) -> None:
    """The sampling flags `ddm-fleet eval` and `python -m evaluation.sample_inprocess` share, so that the
    two make the same images from the same flags: --steps, --solver, --seed, --images-per-job (and its
    deprecated spelling --job-size)."""
    from bus.options import add_deprecated_alias, add_solver_option

    parser.add_argument("--steps", type=int, default=40, help="solver steps (default %(default)s)")
    add_solver_option(parser)
    parser.add_argument(
        "--seed", type=int, default=0, help="first job seed: job j is seeded seed + j (default %(default)s)"
    )
    parser.add_argument(
        "--images-per-job",
        type=int,
        default=50,
        metavar="N",
        help="images per job; they share its seed (default %(default)s)",
    )
    add_deprecated_alias(parser, "--job-size", "--images-per-job", type=int, metavar="N")


def requested_digits(per_class: int, num_classes: int = 10) -> np.ndarray:
    """[num_classes * per_class] classes 0..C-1 (MNIST: the digits), each per_class times, interleaved so
    every job mixes classes."""
    return np.tile(np.arange(num_classes), per_class).astype(np.int64)


async def generate_through_fleet(nc, digits: np.ndarray, cfg: Config, spec: EvalSpec, bar=None):
    """Submit jobs of spec.job_size concurrently; returns (images [N, C, H, W], usage [N,K]). MNIST's ten
    classes are asked as `digits` (the v1 spelling), any other class count as `labels`."""
    from client.jobs import run_job
    from schemas import JobRequest

    chunks = [digits[i : i + spec.job_size] for i in range(0, len(digits), spec.job_size)]

    async def one(j: int, chunk: np.ndarray):
        field = "digits" if spec.num_classes == 10 else "labels"
        req = JobRequest(
            **{field: chunk.tolist()},
            steps=spec.steps,
            solver=spec.solver,
            strategy=cfg.strategy,
            top_k=cfg.top_k,
            seed=spec.seed + j,
            stream=False,
            guidance_scale=spec.guidance if cfg.model == "ddm" else 1.0,
        )
        done = await run_job(nc, req, timeout=3600)
        if bar is not None:
            bar.update(len(chunk))
        return np.asarray(done.images, np.float32), np.asarray(done.usage, np.float32)

    results = await asyncio.gather(*(one(j, c) for j, c in enumerate(chunks)))
    return np.concatenate([r[0] for r in results]), np.concatenate([r[1] for r in results])


def _fleet_for(model: str, spec: EvalSpec):
    from coordinator.local_fleet import LabelRouter, LocalFleet

    opts = {
        "coordinator_options": {"max_rows": 4096, "max_queued_jobs": 1024},
        "device": spec.device,
        "dtype": spec.dtype,
    }
    if model == "ddm":
        if spec.nats_url:
            return None
        return LocalFleet.from_dir(spec.checkpoints, **opts)
    path = spec.monolith or os.path.join(spec.checkpoints, "monolith.safetensors")
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"monolith checkpoint {path} not found; train it (checkpoints/README.md) or drop 'monolith' from --configs"
        )
    from coordinator.startup import router_spec

    opts["coordinator_options"]["spec"] = router_spec(path)  # the monolith's own spec: its shape and classes
    zeros = [0] * spec.num_classes
    return LocalFleet([path], LabelRouter(zeros, 1), num_experts=1, class_to_expert=zeros, **opts)


def _flops(cfg: Config, spec: EvalSpec, experts_per_step: float) -> float:
    from flow.solver import EVALS_PER_STEP, check_method

    from .flops import expert_flops, router_flops

    evals = EVALS_PER_STEP[check_method(spec.solver)]
    if cfg.model == "monolith":
        path = spec.monolith or os.path.join(spec.checkpoints, "monolith.safetensors")
        return spec.steps * evals * expert_flops(path)
    ckpt = os.path.join(spec.checkpoints, "expert0.safetensors")
    # oracle needs no router (the class decides); the others run it once per step
    router = 0 if cfg.strategy == "oracle" else router_flops(os.path.join(spec.checkpoints, "router.safetensors"))
    return spec.steps * evals * (router + experts_per_step * expert_flops(ckpt))


async def evaluate(spec: EvalSpec, judges=None, *, score: bool = True) -> list[Row]:
    """Generate and score every configuration. `judges` (a `judges.Judges`) defaults to both cached
    judges, trained once if missing. `score=False` only generates and saves (spec.save_dir), for
    `evaluation.rescore` to score with intervals; it returns no rows."""
    from tqdm import tqdm

    from bus.connect import connect

    from .judges import Judges

    if not score and not spec.save_dir:
        raise ValueError("generating without scoring needs a directory to save the images in")
    if judges is None and score:
        judges = await asyncio.to_thread(Judges.load, spec.data_dir, progress=spec.progress)
    digits = requested_digits(spec.per_class, spec.num_classes)
    rows: list[Row] = []
    by_model: dict[str, list[Config]] = {}
    for c in spec.configs:
        by_model.setdefault(c.model, []).append(c)
    for model, cfgs in by_model.items():
        fleet = _fleet_for(model, spec)
        if fleet is None:
            from client.jobs import client_connect_options, client_from_url

            nc = await connect(
                spec.nats_url,
                name="ddm-eval",
                reconnect=60,
                first_connect_attempts=3,
                **client_connect_options(client_from_url(spec.nats_url)),
            )
        else:
            await fleet.__aenter__()
            nc = fleet.nc
        try:
            for cfg in cfgs:
                t0 = time.perf_counter()
                with tqdm(total=len(digits), desc=cfg.name, unit="img", disable=not spec.progress) as bar:
                    images, usage = await generate_through_fleet(nc, digits, cfg, spec, bar)
                seconds = time.perf_counter() - t0
                if not score:
                    Path(spec.save_dir).mkdir(parents=True, exist_ok=True)
                    np.savez_compressed(
                        Path(spec.save_dir) / f"{cfg.name}.npz", images=images, labels=digits, usage=usage
                    )
                    log.info("%s: %d images in %.1f s", cfg.name, len(images), seconds)
                    continue
                d = await asyncio.to_thread(judges.score, images, digits)
                s, s2 = d.judge1, d.judge2
                eps = float(usage.sum(axis=1).mean())
                rows.append(
                    Row(
                        cfg,
                        s.accuracy,
                        s.fid,
                        eps,
                        _flops(cfg, spec, eps),
                        seconds,
                        s.n,
                        s.per_class_accuracy,
                        s.predicted_counts,
                        accuracy2=s2.accuracy,
                        fid2=s2.fid,
                        agreement=d.agreement,
                        per_class_accuracy2=s2.per_class_accuracy,
                        predicted_counts2=s2.predicted_counts,
                    )
                )
                if spec.save_dir:
                    Path(spec.save_dir).mkdir(parents=True, exist_ok=True)
                    np.savez_compressed(
                        Path(spec.save_dir) / f"{cfg.name}.npz", images=images, labels=digits, usage=usage
                    )
                log.info(
                    "%s: accuracy %.4f / %.4f, FID %.3f / %.3f (judge 1 / judge 2), judges agree %.4f",
                    cfg.name,
                    s.accuracy,
                    s2.accuracy,
                    s.fid,
                    s2.fid,
                    d.agreement,
                )
        finally:
            if fleet is None:
                from bus.connect import drain_or_close

                await drain_or_close(nc)
            else:
                await fleet.__aexit__(None, None, None)
    return rows


def baseline_row(judges, spec: EvalSpec) -> Row:
    """Real validation digits (the requested digits, one real image each) scored like the generated rows."""
    d = judges.score_real(requested_digits(spec.per_class), spec.data_dir)
    s, s2 = d.judge1, d.judge2
    return Row(
        Config("real-val", "real"),
        s.accuracy,
        s.fid,
        float("nan"),
        float("nan"),
        0.0,
        s.n,
        s.per_class_accuracy,
        s.predicted_counts,
        accuracy2=s2.accuracy,
        fid2=s2.fid,
        agreement=d.agreement,
        per_class_accuracy2=s2.per_class_accuracy,
        predicted_counts2=s2.predicted_counts,
    )


def format_table(rows: Sequence[Row], spec: EvalSpec, judges=None) -> str:
    """Markdown table, one line per configuration; judge 1 and judge 2 side by side. A `baseline_row`
    among `rows` prints with '-' for the generation-only columns."""
    lines = [
        f"{10 * spec.per_class} images ({spec.per_class} per digit), {spec.steps} {spec.solver} steps, "
        f"seeds from {spec.seed}",
        *([judges.describe()] if judges is not None else []),
        "",
        "| configuration | cond. acc. judge 1 | cond. acc. judge 2 | FID judge 1 | FID judge 2 | judges agree "
        "| experts/step | GFLOPs/image | wall s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        gen = (
            "- | - | -"
            if r.config.model == "real"
            else f"{r.experts_per_step:.2f} | {r.flops_per_image / 1e9:.2f} | {r.seconds:.1f}"
        )
        lines.append(
            f"| {r.config.name} | {r.accuracy:.4f} | {r.accuracy2:.4f} | {r.fid:.3f} | {r.fid2:.3f} | "
            f"{r.agreement:.4f} | {gen} |"
        )
    return "\n".join(lines)
