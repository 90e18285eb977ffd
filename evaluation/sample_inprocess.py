"""Generate a study's images in ONE process, without NATS: the experts, the router and the solver
called directly on large batches (thousands of rows) on one device.

The fleet (`ddm-fleet eval`, `evaluation/run.py`) is the public path and what the shipped numbers
use; this module exists for studies that need many images per configuration (5,000+ for paired
tests) on a GPU in minutes. It keeps the fleet's conventions so the two are comparable image for
image: the same requested digits (`requested_digits`), jobs of --images-per-job rows
seeded `seed + j`, row i of a job starting from `coordinator.rows.initial_noise(seed, i)`, the same
solver (`flow.solver`) and routing strategies (`coordinator.strategies.select`), and
the router asked at every evaluation. Unconditional rows (y = -1) use the same seeds, so an
unconditional file pairs row for row with its conditional one. Classifier-free guidance (`--guidance S`,
as a job's `guidance_scale`) pairs each labelled row with its null-label twin in every expert's forward
and combines them with `flow.guidance`, as the fleet's workers do, so a guided job's images are the
fleet's bit for bit where the experts see the same batches (one job alone; files named `<config>-cfgS`;
`--guidance 1,1.5,2,3,4` sweeps the scales over the same digits and seeds).

Each configuration is written as `<name>.npz` in the format `ddm-fleet eval --save-images` writes
(`images` [N, C, H, W] in the checkpoints' spec shape (MNIST: [N, 1, 32, 32]), `labels` [N]
(-1 = unconditional), `usage` [N, K]); with `uint8=True`
the images are stored as uint8 pixels (`dataset.images.to_uint8`: (x + 1) * 127.5, rounded half to even), 4x
smaller (`evaluation.rescore` reads both).

    python -m evaluation.sample_inprocess --checkpoints out/study/k4 --configs top1,full,oracle \
        --monolith out/study/monolith.safetensors --per-class 500 --device cuda --out out/study/images
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dataset.images import to_uint8

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SampleConfig:
    """One output file: `model` is 'ddm' (router + experts) or a path to one checkpoint (a monolith or
    a distilled student, served alone); `strategy` top1 / topk / full / oracle / sample (ddm only);
    `guidance` the classifier-free guidance scale (1 = off; the models need a null label otherwise)."""

    name: str
    model: str
    strategy: str = "top1"
    top_k: int = 2
    unconditional: bool = False
    guidance: float = 1.0


def initial_batch(n: int, job_size: int, seed: int, shape=(1, 32, 32)) -> np.ndarray:
    """[n, *shape] float32: row r = row r % job_size of job r // job_size, seeded seed + job."""
    from coordinator.rows import initial_noise

    return np.stack([initial_noise(seed + r // job_size, r % job_size, shape) for r in range(n)])


class _TorchRouter:
    """The router CNN on a torch device: weights(x [B,1,32,32], t [B], y [B]) -> softmax [B, K] float32."""

    def __init__(self, path: str, device: str):
        import torch

        from models.router import Router

        r = Router.load(path)
        self.num_experts = r.num_experts
        self.device = torch.device(device)
        self.net = r.net.to(self.device).eval()

    def weights(self, x: np.ndarray, t: np.ndarray, y: np.ndarray, chunk: int = 4096) -> np.ndarray:
        import torch

        out = []
        with torch.inference_mode():
            for s in range(0, len(x), chunk):
                z = self.net(
                    torch.from_numpy(x[s : s + chunk]).to(self.device),
                    torch.from_numpy(np.asarray(t[s : s + chunk], np.float32)).to(self.device),
                    torch.from_numpy(np.asarray(y[s : s + chunk], np.int64)).to(self.device),
                )
                out.append(torch.softmax(z.double(), dim=1).float().cpu().numpy())
        return np.concatenate(out)


class _Experts:
    """K expert backends (torch) on one device; forward(k, x, t, y) in chunks of `chunk` rows."""

    def __init__(
        self,
        paths: Sequence[str],
        device: str,
        chunk: int = 2048,
        dtype: str = "auto",
        compile: str = "off",
        batch_quantum: int = 0,
    ):
        from coordinator.local_fleet import load_backends

        self.backends = load_backends(
            paths, "torch", device=device, dtype=dtype, compile=compile, batch_quantum=batch_quantum
        )
        self.dtype = self.backends[0].dtype if self.backends else "float32"
        self.chunk = chunk

    def forward(self, k: int, x: np.ndarray, t: np.ndarray, y: np.ndarray) -> np.ndarray:
        b = self.backends[k]
        parts = [
            b.forward(np.ascontiguousarray(x[s : s + self.chunk]), t[s : s + self.chunk], y[s : s + self.chunk])
            for s in range(0, len(x), self.chunk)
        ]
        return np.concatenate(parts) if parts else np.zeros_like(x)


def guided_forward(forward, k: int, x: np.ndarray, t: np.ndarray, y: np.ndarray, scale: float) -> np.ndarray:
    """forward(k, x, t, y) -> v [B, C, H, W] with classifier-free guidance at `scale` (1: forward itself):
    labelled rows ride with their null-label twins in the one call (`flow.guidance.add_null_twins`) and are
    combined by `flow.guidance.fold_twins`, the same rows in the same order as an expert worker forwards them."""
    from flow.guidance import guided_velocity

    return guided_velocity(lambda *batch: forward(k, *batch), x, t, y, scale)


def _ddm_velocity(
    experts: _Experts,
    router: _TorchRouter,
    strategy: str,
    top_k: int,
    owner: np.ndarray,
    usage: np.ndarray,
    seeds: np.ndarray | None = None,
    rows: np.ndarray | None = None,
    guidance: float = 1.0,
):
    """velocity(x, t, y) = sum_k w_k v_k with w from `strategy`; only experts with weight run on a row.
    With `guidance` s != 1 each v_k is guided: v_k(x, null) + s (v_k(x, y) - v_k(x, null)) (`guided_forward`,
    the rows expert k runs and their null twins in one forward, as the fleet sends them to its worker).

    Adds each row's nonzero weights' indicator to `usage` [N, K] (divide by the number of calls).
    Drawn strategies (`coordinator.strategies.DRAWN`) draw row i's expert at its quantile
    `draw_uniforms(seeds[i], rows[i])` at every call, as the fleet does for row rows[i] of a job seeded
    seeds[i]."""
    from coordinator.strategies import DRAWN, draw_uniforms, select

    k_all = router.num_experts
    available = np.ones(k_all, bool)
    if strategy in DRAWN and (seeds is None or rows is None):
        raise ValueError(f"strategy {strategy} needs each row's job seed and index in its job")
    quantile = draw_uniforms(seeds, rows) if strategy in DRAWN else None  # [N] one per row, kept all job

    def velocity(x: np.ndarray, t: np.ndarray, y: np.ndarray) -> np.ndarray:
        w = select(strategy, router.weights(x, t, y), available, top_k=top_k, owner=owner, u=quantile)
        usage[:] += w > 0
        u = np.zeros_like(x)
        for k in range(k_all):
            rows = np.nonzero(w[:, k] > 0)[0]
            if len(rows):
                v = guided_forward(experts.forward, k, x[rows], t[rows], y[rows], guidance)
                u[rows] += w[rows, k].astype(np.float32)[:, None, None, None] * v
        return u

    return velocity


def generate(
    cfg: SampleConfig,
    *,
    digits: np.ndarray,
    noise: np.ndarray,
    steps: int,
    solver: str,
    device: str,
    checkpoints: str | None = None,
    seed: int = 0,
    job_size: int = 50,
    dtype: str = "auto",
    compile: str = "off",
    latent: bool = False,
    batch_quantum: int = 0,
) -> tuple[np.ndarray, np.ndarray]:
    """-> (images [N, C, H, W] float32 clipped to [-1, 1] as the fleet returns them, usage [N, K] float32).
    `latent`: the samples are a latent fleet's latents, returned unclipped as the fleet's scheduler hands
    them to its decoder (their range is the autoencoder's, not [-1, 1]).

    Row r belongs to job r // job_size seeded seed + r // job_size (as `initial_batch` makes `noise`):
    what the drawn strategies draw from. `dtype`: the experts' ("auto" | "float32" | "bfloat16",
    `models.precision`); the router computes in float32, as the coordinator does. `compile`: the experts'
    torch.compile setting ("off" | "on" | "auto", `workers.backends.torch_compile`). `batch_quantum` > 1: the
    experts compute batch-invariant, as workers run with `--batch-invariant` do, so the images are such a
    fleet's bit for bit whatever the batches (`BackendBase.make_batch_invariant`)."""
    from flow.solver import EVALS_PER_STEP, check_method, sample

    y = np.full(len(digits), -1, np.int64) if cfg.unconditional else np.asarray(digits, np.int64)
    evals = steps * EVALS_PER_STEP[check_method(solver)]
    if cfg.model == "ddm":
        d = Path(checkpoints or ".")
        part = json.loads((d / "partition.json").read_text())
        k = int(part["num_experts"])
        paths = [str(d / f"expert{i}.safetensors") for i in range(k)]
        experts = _Experts(paths, device, dtype=dtype, compile=compile, batch_quantum=batch_quantum)
        router = _TorchRouter(str(d / "router.safetensors"), device)
        if router.num_experts != k:
            raise ValueError(f"{d}: router has {router.num_experts} experts, partition {k}")
        if cfg.strategy == "oracle" and cfg.unconditional:
            raise ValueError("oracle routing needs the label; it is undefined for unconditional rows")
        c2e = np.asarray(part["class_to_expert"], np.int64)
        owner = c2e[np.clip(y, 0, len(c2e) - 1)]
        usage = np.zeros((len(y), k), np.float64)
        r = np.arange(len(y))
        velocity = _ddm_velocity(
            experts,
            router,
            cfg.strategy,
            cfg.top_k,
            owner,
            usage,
            seeds=seed + r // job_size,
            rows=r % job_size,
            guidance=cfg.guidance,
        )
    else:
        experts = _Experts([cfg.model], device, dtype=dtype, compile=compile, batch_quantum=batch_quantum)
        usage = np.zeros((len(y), 1), np.float64)

        def velocity(x, t, yy):
            usage[:] += 1
            return guided_forward(experts.forward, 0, x, t, yy, cfg.guidance)

    x = sample(velocity, noise, y, steps, method=solver)
    final = x.astype(np.float32) if latent else np.clip(x, -1.0, 1.0).astype(np.float32)  # as a job's `done` holds
    return final, (usage / evals).astype(np.float32)


def save_npz(path: Path, images: np.ndarray, labels: np.ndarray, usage: np.ndarray, uint8: bool, meta: dict) -> None:
    """Write `path` whole: a temporary file renamed into place, so an interrupted run leaves no half file."""
    if uint8:
        images = to_uint8(images)
    tmp = path.with_name(path.name + ".partial.npz")
    np.savez_compressed(
        tmp, images=images, labels=labels.astype(np.int64), usage=usage, meta=np.asarray(json.dumps(meta))
    )
    tmp.replace(path)


def parse_configs(
    text: str, checkpoints: str | None, monolith: str | None, distilled: str | None, unconditional: bool
) -> list[SampleConfig]:
    """'monolith,top1,top2,full,oracle,sample,distilled' -> configs (uncond- prefix when unconditional)."""
    out = []
    pre = "uncond-" if unconditional else ""
    for item in [s.strip().lower() for s in text.split(",") if s.strip()]:
        if item == "monolith":
            if not monolith:
                raise ValueError("'monolith' needs --monolith")
            out.append(SampleConfig(pre + "monolith", monolith, unconditional=unconditional))
        elif item == "distilled":
            if not distilled:
                raise ValueError("'distilled' needs --distilled")
            out.append(SampleConfig(pre + "distilled", distilled, unconditional=unconditional))
        elif item in ("top1", "full", "oracle", "sample"):
            out.append(SampleConfig(f"{pre}ddm-{item}", "ddm", item, unconditional=unconditional))
        elif item.startswith("top") and item[3:].isdigit():
            out.append(SampleConfig(f"{pre}ddm-{item}", "ddm", "topk", int(item[3:]), unconditional=unconditional))
        else:
            raise ValueError(f"unknown configuration {item!r}: monolith, distilled, top1, topK, full, oracle, sample")
    return out


def with_guidance(configs: Sequence[SampleConfig], scale: float) -> list[SampleConfig]:
    """`configs` guided at `scale` (named <name>-cfg<scale>), or as they are at scale 1; ValueError outside
    0-20 (what a job's guidance_scale allows)."""
    import dataclasses
    import math

    from schemas.limits import MAX_GUIDANCE_SCALE

    if not (math.isfinite(scale) and 0.0 <= scale <= MAX_GUIDANCE_SCALE):
        raise ValueError(f"--guidance must be a number in [0, {MAX_GUIDANCE_SCALE:g}] (1 = off), got {scale}")
    if scale == 1.0:
        return list(configs)
    return [dataclasses.replace(c, name=f"{c.name}-cfg{scale:g}", guidance=float(scale)) for c in configs]


def checkpoints_spec(configs: Sequence[SampleConfig], checkpoints: str | None):
    """The one model spec every configuration's checkpoints share (shape and classes of the images);
    ValueError naming the first that differs."""
    from models.checkpoint import load_meta
    from models.spec import spec_of

    paths = []
    for cfg in configs:
        if cfg.model == "ddm":
            d = Path(checkpoints or ".")
            k = int(json.loads((d / "partition.json").read_text())["num_experts"])
            paths += [d / f"expert{i}.safetensors" for i in range(k)]
        else:
            paths.append(Path(cfg.model))
    specs = {str(p): spec_of(load_meta(p), str(p)) for p in dict.fromkeys(paths)}
    first_path, first = next(iter(specs.items()))
    for path, spec in specs.items():
        if spec.sample_shape != first.sample_shape or spec.num_classes != first.num_classes:
            raise ValueError(
                f"{path} makes {list(spec.sample_shape)} images of {spec.num_classes} classes, {first_path} "
                f"{list(first.sample_shape)} of {first.num_classes}: configurations must be comparable"
            )
    return first


def latent_decoder(spec, args) -> object | None:
    """For a spec with `space: latent`: the codec that decodes its samples (--autoencoder, else
    autoencoder.safetensors, or a diffusers VAE directory vae/, beside the checkpoints or the monolith),
    checked against the autoencoder the spec names (`models.codec.fleet_codec`). None for a pixel spec."""
    from models.codec import fleet_codec, load_codec

    dirs = (args.checkpoints, args.monolith and Path(args.monolith).parent)
    path = fleet_codec(spec, dirs, given=args.autoencoder)
    return None if path is None else load_codec(str(path), device=args.device)


def _scales(text: str) -> tuple[float, ...]:
    """argparse type of --guidance: "2" or "1,1.5,2,3,4" -> distinct scales in the order given."""
    try:
        scales = tuple(dict.fromkeys(float(part) for part in text.split(",") if part.strip()))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--guidance takes a scale or a comma list of scales, got {text!r}") from None
    if not scales:
        raise argparse.ArgumentTypeError("--guidance is empty")
    return scales


def build_parser() -> argparse.ArgumentParser:
    """The `python -m evaluation.sample_inprocess` command line (options named as `ddm-fleet eval`'s)."""
    from bus.options import add_device_option, add_dtype_option
    from workers.backends.torch_compile import COMPILE_CHOICES
    from workers.config import add_batch_invariant_option

    from .run import add_sampling_arguments

    p = argparse.ArgumentParser(
        prog="python -m evaluation.sample_inprocess",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--checkpoints", metavar="DIR", help="DDM directory: partition.json, router.safetensors, expert<k>.safetensors"
    )
    p.add_argument(
        "--monolith", metavar="PATH", help="monolith checkpoint (.safetensors) for the 'monolith' configuration"
    )
    p.add_argument("--distilled", metavar="PATH", help="distilled student checkpoint for the 'distilled' configuration")
    p.add_argument(
        "--configs",
        default="monolith,top1,top2,full,oracle",
        help="comma list of monolith, distilled, top1, topK, full, oracle, sample (default %(default)s)",
    )
    p.add_argument(
        "--unconditional",
        action="store_true",
        help="label unknown (y = -1) for every row; files are named uncond-<config>.npz; no oracle",
    )
    p.add_argument(
        "--per-class", type=int, default=500, metavar="N", help="images per digit: 10 x N in all (default %(default)s)"
    )
    add_sampling_arguments(p)  # --steps, --solver, --seed, --images-per-job: as `ddm-fleet eval`'s
    p.add_argument(
        "--guidance",
        type=_scales,
        default=(1.0,),
        metavar="S[,S...]",
        help="classifier-free guidance scale, as a job's guidance_scale: 1 = off, typically 1.5-7, 0-20; needs "
        "checkpoints with a null label; files are named <config>-cfgS. A comma list is a sweep: every "
        "configuration at every scale, the same digits and seeds (default 1)",
    )
    add_device_option(p)
    add_dtype_option(p)
    p.add_argument(
        "--compile",
        choices=COMPILE_CHOICES,
        default="off",
        help="torch.compile the experts (inductor freezing; workers.backends.torch_compile): images as a "
        "compiled worker computes them; pays off from a few thousand images (default %(default)s)",
    )
    add_batch_invariant_option(p)
    p.add_argument("--float-images", action="store_true", help="store float32 images (default uint8)")
    p.add_argument(
        "--autoencoder",
        "--vae",
        dest="autoencoder",
        metavar="PATH",
        help="a latent fleet's autoencoder (or diffusers AutoencoderKL directory), which decodes the samples before "
        "they are saved (default: autoencoder.safetensors or vae/ beside the --checkpoints or the --monolith; must "
        "be the one the spec names)",
    )
    p.add_argument("--out", required=True, metavar="DIR", help="directory for <config>.npz")
    p.add_argument(
        "--skip-existing",
        action="store_true",
        help="resume an interrupted run: keep every <config>.npz already in --out (written whole, "
        "via a temporary file) and generate only the missing ones",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    from tqdm import tqdm

    from .run import requested_digits  # the digits `ddm-fleet eval` asks for

    configs = parse_configs(args.configs, args.checkpoints, args.monolith, args.distilled, args.unconditional)
    try:
        configs = [c for scale in args.guidance for c in with_guidance(configs, scale)]
    except ValueError as err:
        raise SystemExit(f"error: {err}") from None
    spec = checkpoints_spec(configs, args.checkpoints)
    digits = requested_digits(args.per_class, max(1, spec.num_classes))
    noise = initial_batch(len(digits), args.images_per_job, args.seed, tuple(spec.sample_shape))
    try:
        codec = latent_decoder(spec, args)
    except (ValueError, OSError) as err:
        raise SystemExit(f"error: {err}") from None
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from models.precision import resolve_dtype

    dtype = resolve_dtype(args.dtype, backend="torch", device=args.device)
    print(json.dumps({"dtype": dtype, "asked": args.dtype}), flush=True)
    if args.skip_existing:
        kept = [c.name for c in configs if (out / f"{c.name}.npz").exists()]
        if kept:
            print(json.dumps({"kept": kept}), flush=True)
        configs = [c for c in configs if c.name not in kept]
    for cfg in tqdm(configs, desc="configurations", unit="config"):
        start = time.perf_counter()
        images, usage = generate(
            cfg,
            digits=digits,
            noise=noise,
            steps=args.steps,
            solver=args.solver,
            device=args.device,
            checkpoints=args.checkpoints,
            seed=args.seed,
            job_size=args.images_per_job,
            dtype=dtype,
            compile=args.compile,
            latent=spec.space == "latent",
            batch_quantum=args.batch_quantum,
        )
        if codec is not None:  # latents -> images, as the fleet's decoder stage does
            images = codec.decode(images)
        labels = np.full(len(digits), -1, np.int64) if cfg.unconditional else digits
        meta = {
            "config": cfg.__dict__,
            "steps": args.steps,
            "solver": args.solver,
            "guidance": cfg.guidance,
            "seed": args.seed,
            "job_size": args.images_per_job,
            "per_class": args.per_class,
            "device": args.device,
            "dtype": dtype,
            "compile": args.compile,
            "batch_quantum": args.batch_quantum,
            "decoded_by": None if codec is None else codec.content_hash,
            "seconds": round(time.perf_counter() - start, 2),
        }
        save_npz(out / f"{cfg.name}.npz", images, labels, usage, not args.float_images, meta)
        print(
            json.dumps(
                {
                    "wrote": str(out / f"{cfg.name}.npz"),
                    "n": len(labels),
                    "experts_per_eval": round(float(usage.sum(1).mean()), 3),
                    "finite": bool(np.isfinite(images).all()),
                    "seconds": meta["seconds"],
                }
            ),
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
