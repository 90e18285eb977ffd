"""Sample images in-process from expert checkpoints and write a PNG grid (no NATS, no router).

Each requested class is routed to the checkpoint whose partition holds it (oracle routing, read from
each checkpoint's JSON), then integrated from t=0 noise to t=1 with Euler or Heun. One grid row per
class, labelled "<class name> (e<expert>)". Sample shape and class names come from the checkpoints'
model spec (`models.spec.spec_of`; checkpoints older than specs: 1x32x32, classes "0"-"9"); the
experts must agree on it. RGB experts give an RGB grid.

Example (the shipped docs/samples.png):
  ddm-fleet sample --checkpoint checkpoints/expert0.safetensors --checkpoint checkpoints/expert1.safetensors \\
      --classes 0-9 --per-class 10 --steps 40 --out docs/samples.png
"""

from __future__ import annotations

import argparse
import sys

from bus.options import add_deprecated_alias, add_dtype_option


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
        action="append",
        default=None,
        metavar="PATH",
        help="expert .safetensors (repeat per expert; default: checkpoints/expert0 and expert1)",
    )
    parser.add_argument("--classes", default="0-9", help="classes to draw, e.g. 0-9 or 3,5 (default %(default)s)")
    parser.add_argument(
        "--per-class", type=int, default=10, metavar="N", help="samples per class = grid columns (default %(default)s)"
    )
    parser.add_argument("--steps", type=int, default=40, help="solver steps (default %(default)s)")
    parser.add_argument(
        "--solver",
        choices=("euler", "heun"),
        default="euler",
        help="euler (1 expert call per step) or heun (2 per step, more accurate) (default %(default)s)",
    )
    add_deprecated_alias(parser, "--method", "--solver", choices=("euler", "heun"))
    parser.add_argument("--seed", type=int, default=0, help="noise seed (default %(default)s)")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: torch's choice)")
    add_dtype_option(parser)
    parser.add_argument("--out", default="samples.png", help="PNG to write (default %(default)s)")
    parser.add_argument(
        "--npz", default=None, help="also save the raw samples [N, C, H, W], labels and class names to this .npz"
    )


def sample_oracle(
    checkpoints: list[str],
    classes: list[int],
    per_class: int,
    steps: int,
    solver: str = "euler",
    seed: int = 0,
    progress: bool = True,
    dtype: str = "float32",
):
    """-> (images float32 [len(classes)*per_class, C, H, W] in model range, labels int64, expert ids int64,
    the experts' model spec). [C, H, W] is the spec's sample shape.

    Rows are grouped class by class; each class uses the expert whose partition lists it. `dtype`
    "bfloat16" runs the experts under bfloat16 autocast on the CPU ("auto": `models.precision`).
    """
    import numpy as np
    import torch
    from tqdm import tqdm

    from flow.solver import sample
    from models.checkpoint import load_torch_model
    from models.precision import resolve_dtype
    from models.spec import spec_of
    from schemas.spec import fleet_spec

    models, owner, specs = [], {}, {}
    for i, path in enumerate(checkpoints):
        model, meta = load_torch_model(path)
        models.append(model)
        specs[f"expert {i} ({path})"] = spec_of(meta, where=str(path))
        for c in meta.get("partition", {}).get("classes", []):
            owner.setdefault(int(c), i)
    spec = fleet_spec(specs)  # SpecError (a ValueError) when the experts disagree
    missing = [c for c in classes if c not in owner]
    if missing:
        raise ValueError(f"no checkpoint's partition holds class(es) {missing}; pass the matching --checkpoint")
    y = np.repeat(np.asarray(classes, np.int64), per_class)
    which = np.asarray([owner[int(c)] for c in y], np.int64)
    x = np.random.default_rng(seed).standard_normal((len(y), *spec.sample_shape)).astype(np.float32)

    bf16 = resolve_dtype(dtype, backend="torch", device="cpu") == "bfloat16"

    def velocity(xb, tb, yb):
        out = np.empty_like(xb)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            for k, model in enumerate(models):
                rows = np.nonzero(which == k)[0]
                if len(rows):
                    out[rows] = (
                        model(torch.from_numpy(xb[rows]), torch.from_numpy(tb[rows]), torch.from_numpy(yb[rows]))
                        .float()
                        .numpy()
                    )
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

        x, y, which, spec = sample_oracle(
            ckpts, classes, args.per_class, args.steps, args.solver, args.seed, dtype=getattr(args, "dtype", "auto")
        )
    except (ValueError, FileNotFoundError) as e:
        print(f"sample: error: {e}", file=sys.stderr)
        return 2
    from client.labels import class_names, name_of

    names = class_names(spec)
    labels = [f"{name_of(spec, c, names)} (e{int(which[i * args.per_class])})" for i, c in enumerate(classes)]
    lo, hi = spec.value_range
    shown = x if (lo, hi) == (-1.0, 1.0) else (x - lo) / (hi - lo) * 2.0 - 1.0  # the grid shows [-1, 1]
    try:
        path = write_grid(args.out, shown, nrow=args.per_class, row_labels=labels)
    except ValueError as e:  # neither grey nor RGB (e.g. 4-channel latents)
        print(f"sample: error: {e}", file=sys.stderr)
        return 2
    if args.npz:
        import numpy as np

        np.savez_compressed(args.npz, images=x, labels=y, experts=which, class_names=np.asarray(names, dtype=str))
    from models.precision import resolve_dtype

    dtype = resolve_dtype(getattr(args, "dtype", "auto"), backend="torch", device="cpu")
    print(f"wrote {path} ({len(classes)} classes x {args.per_class}, {args.solver} {args.steps} steps, {dtype})")
    return 0
