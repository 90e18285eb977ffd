"""Generate digits through the fleet and save them as a PNG grid or an .npz file.

Submits one job to the coordinator (subscribing to its events first, so no frame is missed),
shows a progress bar from the streamed frames, and writes the final images. With --local it
first starts an ephemeral fleet in this process (its own nats-server, one worker per expert,
a coordinator) from the checkpoints in --checkpoints, so no running fleet is needed.

examples:
  ddm-fleet generate --digits 3,7,7 --out grid.png --local
  ddm-fleet generate --count 16 --steps 40 --strategy top1 --seed 1 --out samples.npz
  ddm-fleet generate --digits 0,1,2,3,4,5,6,7,8,9 --solver heun --steps 20 --out g.png --json
  ddm-fleet generate --digits 5 --strategy full --nats nats://10.0.0.5:4222 --out five.png

--out: .png writes one grid (images in rows of --per-row); .npz writes `images` float32
[N, 1, 32, 32] in [-1, 1], `labels` int64 [N] and `usage` float32 [N, K] (fraction of steps each
expert contributed to each image). --json prints the job summary with per-image expert usage.
"""

from __future__ import annotations

import argparse
import os

DEFAULT_NATS = os.environ.get("NATS_URL", "nats://127.0.0.1:4222")


def parse_digits(text: str) -> list[int]:
    """"3,7,7" -> [3, 7, 7]; argparse error naming the bad part otherwise."""
    out = []
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        if not part.isdigit() or not 0 <= int(part) <= 9:
            raise argparse.ArgumentTypeError(f"digits must be comma-separated 0-9, got {part!r} in {text!r}")
        out.append(int(part))
    if not out:
        raise argparse.ArgumentTypeError("give at least one digit, e.g. --digits 3,7,7")
    return out


def _positive(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from schemas.limits import MAX_JOB_IMAGES, MAX_JOB_STEPS

    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--digits", type=parse_digits, metavar="D,D,...", help="the class of each image, e.g. 3,7,7")
    what.add_argument("--count", type=_positive, metavar="N",
                      help=f"N images of random classes drawn from --seed (at most {MAX_JOB_IMAGES})")
    parser.add_argument("--steps", type=_positive, default=40, help=f"solver steps (default %(default)s, at most {MAX_JOB_STEPS})")
    parser.add_argument("--strategy", choices=("top1", "topk", "full", "oracle"), default="top1",
                        help="expert routing: top1 (router argmax, default), topk (k best, renormalised), "
                             "full (all experts, router weighted), oracle (the partition owning the class)")
    parser.add_argument("--top-k", type=_positive, default=2, metavar="K", help="k for --strategy topk (default 2)")
    parser.add_argument("--solver", choices=("euler", "heun"), default="euler",
                        help="euler (1 expert call per step, default) or heun (2 per step, more accurate)")
    parser.add_argument("--seed", type=int, default=None, help="seed: same seed, same images (default: random)")
    parser.add_argument("--out", default="grid.png", metavar="PATH", help="output .png grid or .npz (default %(default)s)")
    parser.add_argument("--per-row", type=_positive, default=10, metavar="N", help="PNG grid images per row (default 10)")
    parser.add_argument("--json", action="store_true", help="print a JSON summary with per-image expert usage")
    parser.add_argument("--local", action="store_true",
                        help="start an ephemeral fleet in this process (own nats-server, workers, coordinator)")
    parser.add_argument("--checkpoints", default="checkpoints", metavar="DIR",
                        help="--local: directory with expert<k>.safetensors, router.safetensors, partition.json")
    parser.add_argument("--nats", default=DEFAULT_NATS, metavar="URL",
                        help="NATS server of a running fleet (default %(default)s, or $NATS_URL); ignored with --local")
    parser.add_argument("--timeout", type=float, default=600.0, metavar="S", help="give up after S seconds (default 600)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def local_buckets(n_images: int, largest: int = 64) -> tuple[int, ...]:
    """Worker batch sizes worth warming for one job of n images: 1, 2, 4, ... up to the first power of
    two that holds n (at most `largest`; bigger batches are split by the worker)."""
    out, b = [], 1
    while True:
        out.append(b)
        if b >= n_images or b >= largest:
            return tuple(out)
        b *= 2


def save_output(done, path: str, per_row: int) -> None:
    import numpy as np

    ext = os.path.splitext(path)[1].lower()
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    if ext == ".npz":
        np.savez_compressed(path, images=np.asarray(done.images, np.float32),
                            labels=np.asarray(done.digits, np.int64), usage=np.asarray(done.usage, np.float32))
    else:
        from coordinator.grid import write_grid

        write_grid(path, np.asarray(done.images), nrow=min(per_row, len(done.digits)))


def summary(done, accepted_seed, path: str) -> dict:
    return {
        "job_id": done.job_id, "seed": accepted_seed, "steps": done.steps, "strategy": done.strategy,
        "elapsed_s": round(done.elapsed_s, 3), "out": path,
        "images": [{"index": i, "digit": int(d), "usage": [round(float(u), 4) for u in done.usage[i]]}
                   for i, d in enumerate(done.digits)],
        "notes": list(done.notes),
    }


def run(args: argparse.Namespace) -> int:
    import asyncio
    import json
    import sys

    from schemas import JobAccepted, JobRequest, ProtocolError

    ext = os.path.splitext(args.out)[1].lower()
    if ext not in (".png", ".npz"):
        print(f"ddm-fleet generate: --out must end in .png or .npz, got {args.out!r}", file=sys.stderr)
        return 2
    try:
        request = JobRequest(digits=args.digits, count=args.count, steps=args.steps, strategy=args.strategy,
                             top_k=args.top_k, solver=args.solver, seed=args.seed, stream=True,
                             frame_every=max(1, args.steps // 100))
    except Exception as err:  # pydantic validation: limits
        print(f"ddm-fleet generate: bad request: {err}", file=sys.stderr)
        return 2

    async def job(nc) -> int:
        from tqdm import tqdm

        from coordinator.client import JobFailed, run_job

        bar = None if args.no_progress else tqdm(total=args.steps, desc="denoising", unit="step",
                                                 file=sys.stderr, disable=None)
        seed = {"value": args.seed}

        def on_event(ev) -> None:
            if isinstance(ev, JobAccepted):
                seed["value"] = ev.seed
            elif ev.kind == "frame" and bar is not None:
                bar.update(ev.step - bar.n)
                for note in ev.notes:
                    bar.write(f"note: {note}")

        try:
            done = await run_job(nc, request, on_event, timeout=args.timeout)
        except JobFailed as err:
            print(f"ddm-fleet generate: job failed ({err.code.value}): {err.reason}", file=sys.stderr)
            return 1
        finally:
            if bar is not None:
                bar.close()
        save_output(done, args.out, args.per_row)
        if args.json:
            print(json.dumps(summary(done, seed["value"], args.out), indent=2))
        else:
            print(f"wrote {len(done.digits)} images ({','.join(map(str, done.digits))}) to {args.out} "
                  f"in {done.elapsed_s:.2f} s (seed {seed['value']})")
        return 0

    async def main() -> int:
        import nats

        if args.local:
            from coordinator.local_fleet import LocalFleet

            print(f"starting a local fleet from {args.checkpoints}/ ...", file=sys.stderr, flush=True)
            async with LocalFleet.from_dir(args.checkpoints, buckets=local_buckets(request.n_images)) as fleet:
                return await job(fleet.nc)
        nc = await nats.connect(args.nats, name="ddm-generate", connect_timeout=5, max_reconnect_attempts=3,
                                reconnect_time_wait=0.5)
        try:
            return await job(nc)
        finally:
            await nc.drain()

    try:
        return asyncio.run(main())
    except FileNotFoundError as err:
        print(f"ddm-fleet generate: {err}", file=sys.stderr)
        return 2
    except ProtocolError as err:
        print(f"ddm-fleet generate: {err.code.value}: {err.message}", file=sys.stderr)
        return 1
    except ValueError as err:  # unreadable / mismatched checkpoint, router or partition files
        print(f"ddm-fleet generate: {err}", file=sys.stderr)
        return 2
    except Exception as err:
        if type(err).__name__ == "BackendError":  # an expert checkpoint the backend cannot load
            print(f"ddm-fleet generate: {err}", file=sys.stderr)
            return 2
        if type(err).__module__.startswith("nats"):
            print(f"ddm-fleet generate: cannot reach NATS at {args.nats}: {type(err).__name__} {err} "
                  "(start a fleet, or use --local)", file=sys.stderr)
            return 1
        raise
