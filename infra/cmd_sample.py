"""Sample images in-process from expert checkpoints and write a PNG grid (no NATS, no router).

Each requested class is routed to the checkpoint whose partition holds it (oracle routing, read from
each checkpoint's JSON), then integrated from t=0 noise to t=1 with Euler or Heun. One grid row per
class, labelled "<class name> (e<expert>)". Sample shape and class names come from the checkpoints'
model spec (`models.spec.spec_of`; checkpoints older than specs: 1x32x32, classes "0"-"9"); the
experts must agree on it. RGB experts give an RGB grid.

Classifier-free guidance (`--guidance S`, 1 = off) guides each image with its expert's null-label
prediction, as a fleet's workers do (`flow.guidance`); the default is the fleet's, from the router.json
beside the first checkpoint (`models.fleet_guidance`), else 1. Experts without a null label refuse S != 1.

Latent experts (spec `space: latent`) are decoded by the fleet's autoencoder before the grid is drawn:
`--autoencoder PATH`, else autoencoder.safetensors (or a diffusers VAE directory vae/) beside the first
checkpoint, checked against the autoencoder the spec names; `--npz` keeps the latents too. What cannot
become a grey or RGB grid is refused before any step is taken.

Examples (the shipped docs/samples.png; the colour fleet guided at 2; the latent fleet, decoded):
  ddm-fleet sample --checkpoint checkpoints/expert0.safetensors --checkpoint checkpoints/expert1.safetensors \\
      --classes 0-9 --per-class 10 --steps 40 --out docs/samples.png
  ddm-fleet sample --checkpoint checkpoints/colour/expert{0,1,2,3}.safetensors --guidance 2 --out colour.png
  ddm-fleet sample --checkpoint checkpoints/colour-latent/expert{0,1,2,3}.safetensors --out latent.png
"""

from __future__ import annotations

import argparse
import sys

from bus.options import add_dtype_option, add_solver_option, add_threads_option
from client.guidance import guidance_scale
from workers.config import add_batch_invariant_option


def parse_classes(text: str) -> list[int]:
    """ "0-9" or "1,3,7" or "0-4,9" -> sorted unique class ids."""
    out: set[int] = set()
    try:
        for part in text.split(","):
            part = part.strip()
            if not part:
                continue
            if "-" in part:
                lo, hi = (int(p) for p in part.split("-", 1))
                if lo > hi:
                    raise ValueError
                out.update(range(lo, hi + 1))
            else:
                out.add(int(part))
    except ValueError:
        raise ValueError(f"--classes must look like 0-9 or 1,3,7, got {text!r}") from None
    if not out:
        raise ValueError("--classes is empty")
    return sorted(out)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument(
        "--checkpoint",
        action="extend",
        nargs="+",
        default=None,
        metavar="PATH",
        help="expert .safetensors, one or more (repeatable; default: checkpoints/expert0 and expert1)",
    )
    parser.add_argument("--classes", default="0-9", help="classes to draw, e.g. 0-9 or 3,5 (default %(default)s)")
    parser.add_argument(
        "--per-class", type=int, default=10, metavar="N", help="samples per class = grid columns (default %(default)s)"
    )
    parser.add_argument("--steps", type=int, default=40, help="solver steps (default %(default)s)")
    add_solver_option(parser, deprecated_method=True)
    parser.add_argument("--seed", type=int, default=0, help="noise seed (default %(default)s)")
    add_threads_option(parser)
    add_dtype_option(parser)
    parser.add_argument("--out", default="samples.png", help="PNG to write (default %(default)s)")
    parser.add_argument(
        "--npz",
        default=None,
        help="also save the samples [N, C, H, W] (decoded, for latent experts; their latents as 'latents'), "
        "labels and class names to this .npz",
    )
    parser.add_argument(
        "--guidance",
        type=guidance_scale,
        default=None,
        metavar="S",
        help="classifier-free guidance scale (1 = off, 0-20; needs experts with a null label); default: the "
        "fleet's, from router.json beside the first checkpoint, else 1",
    )
    parser.add_argument(
        "--autoencoder",
        "--vae",
        dest="autoencoder",
        default=None,
        metavar="PATH",
        help="latent experts: the autoencoder that decodes them (default: autoencoder.safetensors or vae/ beside "
        "the first checkpoint; must be the one the spec names)",
    )
    add_batch_invariant_option(parser)


def sample_oracle(
    checkpoints: list[str],
    classes: list[int],
    per_class: int,
    steps: int,
    solver: str = "euler",
    seed: int = 0,
    progress: bool = True,
    dtype: str = "float32",
    guidance: float = 1.0,
    check=None,
    batch_quantum: int = 0,
):
    """-> (samples float32 [len(classes)*per_class, C, H, W] in model range, labels int64, expert ids int64,
    the experts' model spec). [C, H, W] is the spec's sample shape (latents, for latent experts).

    Rows are grouped class by class; each class uses the expert whose partition lists it. The experts run
    in the worker's torch backend, as a CPU worker computes them: `dtype` "bfloat16" under bfloat16 autocast
    ("auto": `models.precision`), `batch_quantum` > 1 batch-invariant (`--batch-invariant`).
    `guidance` s != 1: each row's velocity is v(x, null) + s (v(x, y) - v(x, null)), its null twin in the
    same forward (`flow.guidance.guided_velocity`); ValueError when the experts have no null label.
    `check(spec)`: called once the spec is known, before the first step (raise to refuse).
    """
    import numpy as np
    from tqdm import tqdm

    from coordinator.local_fleet import load_backends
    from flow.guidance import guided_velocity
    from flow.solver import sample
    from schemas.spec import fleet_spec
    from workers.backends import BackendError

    try:
        models = load_backends(checkpoints, "torch", dtype=dtype, batch_quantum=batch_quantum)
    except BackendError as err:
        raise ValueError(str(err)) from None
    owner, specs = {}, {}
    for i, (path, model) in enumerate(zip(checkpoints, models)):
        specs[f"expert {i} ({path})"] = model.spec
        for c in model.meta.get("partition", {}).get("classes", []):
            owner.setdefault(int(c), i)
    spec = fleet_spec(specs)  # SpecError (a ValueError) when the experts disagree
    missing = [c for c in classes if c not in owner]
    if missing:
        raise ValueError(f"no checkpoint's partition holds class(es) {missing}; pass the matching --checkpoint")
    if guidance != 1.0:
        lacking = [name for name, sp in specs.items() if not sp.conditioning.null_label]
        if lacking:
            raise ValueError(
                f"--guidance {guidance:g} needs experts trained with a null label (train-expert --label-dropout); "
                f"{lacking[0]} has none: use --guidance 1"
            )
    if check is not None:
        check(spec)
    y = np.repeat(np.asarray(classes, np.int64), per_class)
    which = np.asarray([owner[int(c)] for c in y], np.int64)
    x = np.random.default_rng(seed).standard_normal((len(y), *spec.sample_shape)).astype(np.float32)

    def velocity(xb, tb, yb):
        out = np.empty_like(xb)
        for k, model in enumerate(models):
            rows = np.nonzero(which == k)[0]
            if len(rows):
                out[rows] = guided_velocity(model.forward, xb[rows], tb[rows], yb[rows], guidance)
        return out

    with tqdm(total=steps, desc=f"sampling ({solver})", disable=not progress, unit="step") as bar:
        x = sample(velocity, x, y, steps, solver, callback=lambda *_: bar.update(1))
    return x, y, which, spec


def run(args: argparse.Namespace) -> int:
    try:
        classes = parse_classes(args.classes)
        if args.per_class < 1 or args.steps < 1:
            raise ValueError("--per-class and --steps must be >= 1")
        ckpts = args.checkpoint or ["checkpoints/expert0.safetensors", "checkpoints/expert1.safetensors"]
        if args.threads > 0:
            import torch

            torch.set_num_threads(args.threads)
        from infra.grid import write_grid
        from models.fleet_guidance import default_beside

        guidance = args.guidance if args.guidance is not None else default_beside(ckpts[0])
        codec = []  # the latent experts' decoder, found by `check` before the first step

        def check(spec) -> None:
            codec.extend(_decoder_for(spec, ckpts[0], args.autoencoder))
            shape = codec[0].info.image_shape if codec else spec.sample_shape
            if shape[0] not in (1, 3):
                raise ValueError(
                    f"the experts make {list(spec.sample_shape)} samples, which no grid shows (grey [1, H, W] or "
                    "RGB [3, H, W]); latent experts need their autoencoder (their spec says space latent)"
                )

        x, y, which, spec = sample_oracle(
            ckpts,
            classes,
            args.per_class,
            args.steps,
            args.solver,
            args.seed,
            dtype=getattr(args, "dtype", "auto"),
            guidance=guidance,
            check=check,
            batch_quantum=args.batch_quantum,
        )
    except (ValueError, FileNotFoundError) as e:
        print(f"sample: error: {e}", file=sys.stderr)
        return 2
    latents = None
    if codec:  # latents -> images, as a fleet's decoder stage does
        latents, x = x, codec[0].decode(x)
    from client.labels import class_names, name_of

    names = class_names(spec)
    labels = [f"{name_of(spec, c, names)} (e{int(which[i * args.per_class])})" for i, c in enumerate(classes)]
    lo, hi = (-1.0, 1.0) if codec else spec.value_range  # decoded images are in [-1, 1]
    shown = x if (lo, hi) == (-1.0, 1.0) else (x - lo) / (hi - lo) * 2.0 - 1.0  # the grid shows [-1, 1]
    try:
        path = write_grid(args.out, shown, nrow=args.per_class, row_labels=labels)
    except ValueError as e:  # neither grey nor RGB (e.g. 4-channel latents)
        print(f"sample: error: {e}", file=sys.stderr)
        return 2
    if args.npz:
        import numpy as np

        kept = {"latents": latents} if latents is not None else {}
        np.savez_compressed(
            args.npz, images=x, labels=y, experts=which, class_names=np.asarray(names, dtype=str), **kept
        )
    from models.precision import resolve_dtype

    dtype = resolve_dtype(getattr(args, "dtype", "auto"), backend="torch", device="cpu")
    extra = (f", guidance {guidance:g}" if guidance != 1.0 else "") + (", decoded" if codec else "")
    extra += f", batch-invariant ({args.batch_quantum} rows)" if args.batch_quantum else ""
    print(f"wrote {path} ({len(classes)} classes x {args.per_class}, {args.solver} {args.steps} steps, {dtype}{extra})")
    return 0


def _decoder_for(spec, first_checkpoint: str, given: str | None) -> list:
    """[the codec that decodes latent experts' samples] ([] for pixel experts): `given`, else the
    autoencoder beside the first checkpoint (`models.codec.fleet_codec`); ValueError saying what is missing."""
    from pathlib import Path

    from models.codec import fleet_codec, load_codec

    path = fleet_codec(spec, [Path(first_checkpoint).parent], given=given)  # AutoencoderError is a ValueError
    return [] if path is None else [load_codec(str(path))]
