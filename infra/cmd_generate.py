"""Generate images through the fleet and save them as a PNG grid or an .npz file.

Submits the images as generation jobs to the coordinator (subscribing to each job's events
first, so no frame is missed), shows one progress bar over all images from the streamed frames,
and writes the final images in the order asked for. With --local it first starts an ephemeral
fleet in this process (its own nats-server, one worker per expert, a coordinator) from the
checkpoints in --checkpoints, so no running fleet is needed.

Shapes and classes come from the fleet's model spec (`schemas.spec`), asked of the coordinator
(`fleet_status(nc, spec=True)`; a coordinator older than specs serves the MNIST fleet, 1x32x32 and
ten classes "0"-"9"). --labels takes the fleet's class names or indices ("?" = label unknown);
--digits is the v1 spelling for 0-9; --count draws from the fleet's class count. Jobs name their
labels `digits` on a ten-class fleet (as v1 did) and `labels` on any other.

examples:
  ddm-fleet generate --digits 3,7,7 --out grid.png --local
  ddm-fleet generate --labels "cat,dog,?" --out pets.png --local --checkpoints ck-cifar   # class names
  ddm-fleet generate --count 16 --steps 40 --strategy top1 --seed 1 --out samples.npz
  ddm-fleet generate --count 1000 --seed 7 --out thousand.npz          # 4 jobs: 256 + 256 + 256 + 232
  ddm-fleet generate --digits 0,1,2,3,4,5,6,7,8,9 --solver heun --steps 20 --out g.png --json
  ddm-fleet generate --digits 5 --strategy full --nats nats://10.0.0.5:4222 --out five.png
  ddm-fleet generate --unconditional --count 16 --seed 3 --out free.png --local   # label unknown
  ddm-fleet generate --digits 3,7 --guidance 3 --out sharp.png --local --checkpoints ck-null   # guided

Any number of images: a job holds at most 256 (the protocol's limit), so more are split, in
order, into jobs of M = --images-per-job images (job j holds images j*M .. j*M+M-1), at most
--jobs-in-flight of them submitted at once.

Seeds: job j runs with seed (S + j) mod 2^63, where S is --seed (random when not given, and
printed). The coordinator draws row i's noise from (job seed, i) alone, so image n starts from
the noise of row n mod M of seed S + n // M: the images depend on S, M and the classes only,
never on --jobs-in-flight, timing or what else the fleet runs. A run of at most M images is one
job with seed S, as before; the first M images of any run with seed S are those of that single
job. --count draws all N classes at once from S, the way the coordinator draws a count job's
classes, so the classes do not depend on M.

--unconditional --count N: N images with the label unknown (digit -1 in the jobs, see
docs/PROTOCOL.md): the router alone picks the experts, from x_t and t. Every expert needs a null
label (`train-expert --label-dropout > 0`); a fleet whose experts have none refuses the job
(`bad_request`). --strategy oracle needs the label, so it is refused with --unconditional. Their
label is -1 in the .npz `labels` and in --json.

--guidance S: classifier-free guidance at scale S (0-20; 1 is off; typically 1.5-7), the jobs'
`guidance_scale`: each labelled image's velocity is v(x, null) + S (v(x, y) - v(x, null)) at every
routed expert, one more expert evaluation per image. Without --guidance the fleet's default applies
(the scale its judges chose, kept in its router.json; 1 for a fleet that names none). Every expert
needs a null label (as for --unconditional), and the fleet's workers must serve guidance; otherwise
the fleet refuses the job (`bad_request`). Unconditional images are not guided.

--out: .png writes one grid (images in rows of --per-row; grey for one channel, RGB for three);
.npz writes `images` float32 [N, C, H, W] in the spec's value range (e.g. [-1, 1]), `labels` int64
[N] (-1 = unknown), `class_names` str [num_classes] and `usage` float32 [N, K] (fraction of steps
each expert contributed to each image). --json prints the run summary with each image's label,
class name and expert usage (and `digit`, as v1 did, on a ten-digit fleet).
The bus URL defaults to $NATS_URL, else nats://127.0.0.1:4222.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field

from client.guidance import guidance_scale

#: Most images one `generate` run takes (about 400 MB of float32 images).
MAX_RUN_IMAGES = 100_000
#: Seeds are taken modulo this (the protocol's seed range is [0, 2^63)).
SEED_RANGE = 2**63


def parse_digits(text: str) -> list[int]:
    """ "3,7,7" -> [3, 7, 7]; argparse error naming the bad part otherwise."""
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


def _seed(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer seed, got {text!r}") from None
    if not 0 <= v < SEED_RANGE:
        raise argparse.ArgumentTypeError(f"the seed must lie in [0, 2^63), got {v}")
    return v


def _per_job(text: str) -> int:
    from schemas.limits import MAX_JOB_IMAGES

    v = _positive(text)
    if v > MAX_JOB_IMAGES:
        raise argparse.ArgumentTypeError(f"at most {MAX_JOB_IMAGES} images per job (the protocol's limit), got {v}")
    return v


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from bus.options import add_deprecated_alias, add_dtype_option, add_nats_option, add_solver_option
    from schemas.limits import MAX_GUIDANCE_SCALE, MAX_JOB_IMAGES, MAX_JOB_STEPS

    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument(
        "--labels",
        metavar="NAMES|INDICES",
        help='the class of each image, by the fleet\'s class names or indices, e.g. "cat,dog,?" or 3,5 '
        "(? = label unknown)",
    )
    what.add_argument(
        "--digits", type=parse_digits, metavar="D,D,...", help="the class of each image as 0-9, e.g. 3,7,7 (v1)"
    )
    what.add_argument(
        "--count",
        type=_positive,
        metavar="N",
        help=f"N images of random classes of the fleet drawn from --seed (at most {MAX_RUN_IMAGES})",
    )
    parser.add_argument(
        "--unconditional",
        action="store_true",
        help="with --count N: N images with the label unknown (-1); the router alone picks the "
        "experts (they need a null label: train-expert --label-dropout > 0; not with oracle)",
    )
    parser.add_argument(
        "--steps", type=_positive, default=40, help=f"solver steps (default %(default)s, at most {MAX_JOB_STEPS})"
    )
    parser.add_argument(
        "--guidance",
        type=guidance_scale,
        default=None,
        metavar="S",
        help=f"classifier-free guidance scale, 0-{MAX_GUIDANCE_SCALE:g}: 1 = off, typically 1.5-7 (default: the "
        "fleet's, 1 where it names none); needs experts with a null label (train-expert --label-dropout > 0)",
    )
    parser.add_argument(
        "--strategy",
        choices=("top1", "topk", "full", "oracle", "sample"),
        default="top1",
        help="expert routing: top1 (router argmax, default), topk (k best, renormalised), "
        "full (all experts, router weighted), oracle (the partition owning the class), "
        "sample (one expert drawn from the router's probabilities, seeded: keeps the class mix "
        "of --unconditional images)",
    )
    parser.add_argument(
        "--top-k", type=_positive, default=2, metavar="K", help="k for --strategy topk (default %(default)s)"
    )
    add_solver_option(parser)
    parser.add_argument(
        "--seed",
        type=_seed,
        default=None,
        help="seed S in [0, 2^63): same S (and --images-per-job), same images; job j of a split "
        "run gets seed S + j (default: random)",
    )
    parser.add_argument(
        "--images-per-job",
        type=_per_job,
        default=MAX_JOB_IMAGES,
        metavar="N",
        help=f"split the images into jobs of at most N (default and most {MAX_JOB_IMAGES})",
    )
    add_deprecated_alias(parser, "--max-images-per-job", "--images-per-job", type=_per_job, metavar="N")
    parser.add_argument(
        "--jobs-in-flight",
        type=_positive,
        default=4,
        metavar="J",
        help="most jobs submitted and not finished at once (default %(default)s)",
    )
    parser.add_argument(
        "--out", default="grid.png", metavar="PATH", help="output .png grid or .npz (default %(default)s)"
    )
    parser.add_argument(
        "--per-row", type=_positive, default=10, metavar="N", help="PNG grid images per row (default 10)"
    )
    parser.add_argument("--json", action="store_true", help="print a JSON summary with per-image expert usage")
    parser.add_argument(
        "--local",
        action="store_true",
        help="start an ephemeral fleet in this process (own nats-server, workers, coordinator)",
    )
    parser.add_argument(
        "--checkpoints",
        default="checkpoints",
        metavar="DIR",
        help="--local: directory with expert<k>.safetensors, router.safetensors, partition.json",
    )
    add_dtype_option(
        parser,
        help="--local: the experts' compute type: auto = bfloat16 where the CPU/GPU computes it natively "
        "(AMX or AVX512-BF16, CUDA compute capability >= 8.0), else float32; float32 for images identical "
        "bit for bit across hosts (default %(default)s; a running fleet's workers have their own)",
    )
    add_nats_option(
        parser,
        help="NATS server of a running fleet, or a comma-separated list of a cluster's nodes "
        "(default: $NATS_URL, else nats://127.0.0.1:4222); ignored with --local",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        metavar="S",
        help="give up after S seconds, for the whole run (default 600)",
    )
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


def split_images(n_images: int, per_job: int) -> list[range]:
    """Image index ranges of the jobs of an n-image run: [0, M), [M, 2M), ..., the last one shorter."""
    if n_images < 1 or per_job < 1:
        raise ValueError(f"need n_images >= 1 and per_job >= 1, got {n_images}, {per_job}")
    return [range(a, min(a + per_job, n_images)) for a in range(0, n_images, per_job)]


def job_seed(base_seed: int, job_index: int) -> int:
    """Seed of job `job_index` of a run seeded `base_seed`: (base_seed + job_index) mod 2^63."""
    return (int(base_seed) + int(job_index)) % SEED_RANGE


def requested_classes(args: argparse.Namespace, spec=None) -> list[int] | None:
    """The class of each image as asked: --digits, --labels (names or indices of `spec`'s classes, default
    the MNIST fleet's) or --unconditional --count N (-1 each); None for a plain --count. Raises ValueError
    for a label that is no class of the fleet."""
    from client.labels import parse_labels
    from schemas import UNCONDITIONAL
    from schemas.spec import legacy_spec

    spec = spec if spec is not None else legacy_spec()
    if getattr(args, "unconditional", False):  # the label unknown on every row
        return [UNCONDITIONAL] * args.count
    if getattr(args, "labels", None) is not None:
        return parse_labels(args.labels, spec)
    if args.digits is None:
        return None
    n = spec.num_classes
    bad = next((d for d in args.digits if d >= n), None)
    if bad is not None:
        raise ValueError(f"--digits {bad}: this fleet has {n} classes (0-{n - 1}); see --labels")
    return list(args.digits)


def plan_requests(args: argparse.Namespace, spec=None) -> tuple[list, int | None]:
    """The JobRequests of a run, in image order, and the run's seed S (None: one job, seed chosen
    by the coordinator). `spec`: the fleet's model spec (default: the MNIST fleet's); the labels go
    under `digits` on a ten-class fleet, `labels` on any other (client.labels.label_field). Raises
    ValueError for labels the fleet lacks, pydantic's ValidationError / schemas.ProtocolError for bad values."""
    import secrets

    from client.labels import job_labels
    from coordinator.rows import draw_digits
    from schemas import UNCONDITIONAL, JobRequest
    from schemas.spec import legacy_spec

    spec = spec if spec is not None else legacy_spec()
    classes = requested_classes(args, spec)
    n = len(classes) if classes is not None else args.count
    common = dict(
        steps=args.steps,
        strategy=args.strategy,
        top_k=args.top_k,
        solver=args.solver,
        stream=True,
        frame_every=max(1, args.steps // 100),
        **({"guidance_scale": args.guidance} if getattr(args, "guidance", None) is not None else {}),
    )
    if n <= args.images_per_job:  # one job, exactly as the coordinator runs a single request
        what = {"count": args.count} if classes is None else job_labels(spec, classes)
        return [JobRequest(seed=args.seed, **what, **common)], args.seed
    base = args.seed if args.seed is not None else secrets.randbits(63)
    if classes is None:  # drawn as the coordinator draws a count job's classes
        conditional = spec.conditioning.kind == "class"
        classes = draw_digits(base, n, spec.num_classes) if conditional else [UNCONDITIONAL] * n
    return [
        JobRequest(**job_labels(spec, classes[r.start : r.stop]), seed=job_seed(base, j), **common)
        for j, r in enumerate(split_images(n, args.images_per_job))
    ], base


@dataclass
class RunResult:
    """A whole run, its jobs' results joined in image order. images [N, C, H, W] float32 in the spec's
    value range, labels [N] (-1 = unknown), usage [N, K]; jobs: one {job_id, seed, first_image, images}
    per job."""

    images: object
    labels: list[int]
    usage: object
    elapsed_s: float
    seed: int | None
    jobs: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def join_results(dones: list, seeds: list[int], run_seed: int | None, elapsed_s: float) -> RunResult:
    """DoneEvents of the jobs, in job order -> one RunResult (notes of a split run say their job)."""
    import numpy as np

    jobs, notes, first = [], [], 0
    for j, done in enumerate(dones):
        jobs.append({"job_id": done.job_id, "seed": seeds[j], "first_image": first, "images": len(done.classes)})
        first += len(done.classes)
        notes += [f"job {j + 1}/{len(dones)}: {n}" if len(dones) > 1 else n for n in done.notes]
    if len(dones) == 1:
        elapsed_s = dones[0].elapsed_s
    return RunResult(
        images=np.concatenate([np.asarray(d.images, np.float32) for d in dones]),
        labels=[int(c) for done in dones for c in done.classes],
        usage=np.concatenate([np.asarray(d.usage, np.float32) for d in dones]),
        elapsed_s=elapsed_s,
        seed=run_seed if run_seed is not None else seeds[0],
        jobs=jobs,
        notes=notes,
    )


def image_range(spec) -> tuple[float, float]:
    """The value range of the images a fleet of `spec` returns: a pixel fleet's samples' range; a latent
    fleet's decoded images' (`image_value_range`, [-1, 1] when the spec does not say), never its latents'."""
    if spec.space == "pixels":
        return tuple(spec.value_range)
    return tuple(spec.image_value_range) if spec.image_value_range is not None else (-1.0, 1.0)


def save_output(result: RunResult, path: str, per_row: int, spec=None) -> None:
    """Write `result` to `path`: .npz (images, labels, class_names, usage) or a PNG grid (grey or RGB)."""
    import numpy as np

    from client.labels import class_names
    from schemas.spec import legacy_spec

    spec = spec if spec is not None else legacy_spec()
    ext = os.path.splitext(path)[1].lower()
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    if ext == ".npz":
        np.savez_compressed(
            path,
            images=np.asarray(result.images, np.float32),
            labels=np.asarray(result.labels, np.int64),
            class_names=np.asarray(class_names(spec), dtype=str),
            usage=np.asarray(result.usage, np.float32),
        )
    else:
        from infra.grid import write_grid

        lo, hi = image_range(spec)
        images = np.asarray(result.images, np.float32)
        if (lo, hi) != (-1.0, 1.0):  # the grid shows [-1, 1]
            images = (images - lo) / (hi - lo) * 2.0 - 1.0
        write_grid(path, images, nrow=min(per_row, len(result.labels)))


def _local_guidance(args: argparse.Namespace) -> float:
    """The scale the local fleet of --checkpoints will use: --guidance, else the fleet's default."""
    from pathlib import Path

    from models.fleet_guidance import fleet_default_guidance

    if args.guidance is not None:
        return args.guidance
    return fleet_default_guidance(Path(args.checkpoints) / "router.json")


def summary(result: RunResult, steps: int, strategy: str, path: str, spec=None, guidance: float | None = None) -> dict:
    """The --json summary: per image its index, label (-1 = unknown), class name ("?" when unknown), expert
    usage, and on the ten-digit (MNIST) fleet `digit` as well (as v1 printed it); `guidance` (the scale)
    only for a guided run."""
    from client.labels import class_names, name_of
    from schemas.spec import legacy_spec

    spec = spec if spec is not None else legacy_spec()
    names = class_names(spec)
    digit_fleet = names == [str(i) for i in range(10)]

    def image(i: int, label: int) -> dict:
        out = {"index": i, "label": label, "class": name_of(spec, label, names)}
        if digit_fleet:
            out["digit"] = label
        return {**out, "usage": [round(float(u), 4) for u in result.usage[i]]}

    out = {
        "job_id": result.jobs[0]["job_id"],
        "seed": result.seed,
        "steps": steps,
        "strategy": strategy,
        "elapsed_s": round(result.elapsed_s, 3),
        "out": path,
        "jobs": result.jobs,
        "sample_shape": list(spec.sample_shape),
        "class_names": names,
        "images": [image(i, int(c)) for i, c in enumerate(result.labels)],
        "notes": list(result.notes),
    }
    if guidance is not None and guidance != 1.0:
        out["guidance"] = guidance
    return out


class _JobError(Exception):
    """Job `index` (0-based) of a run failed with `err` (a client.jobs.JobFailed)."""

    def __init__(self, index: int, err: Exception):
        super().__init__(str(err))
        self.index, self.err = index, err


async def run_jobs(nc, requests: list, *, in_flight: int, timeout: float, bar=None) -> tuple[list, list[int]]:
    """Run the jobs, at most `in_flight` at once, within `timeout` seconds in all; (DoneEvents in job
    order, the seed each job ran with). `bar` (a tqdm over all images) follows the frames. On the first
    failure the other jobs are cancelled (on the coordinator too) and _JobError is raised."""
    import asyncio
    import time

    from client.jobs import JobFailed, run_job
    from schemas import ErrorCode, JobAccepted

    gate = asyncio.Semaphore(in_flight)
    deadline = time.monotonic() + timeout
    done_steps = [0] * len(requests)
    seeds = [r.seed for r in requests]
    many = len(requests) > 1

    def show() -> None:
        if bar is not None:
            bar.n = round(sum(r.n_images * s / r.steps for r, s in zip(requests, done_steps)), 2)
            bar.refresh()

    def on_event_of(j: int):
        def on_event(ev) -> None:
            if isinstance(ev, JobAccepted):
                seeds[j] = ev.seed
            elif ev.kind in ("frame", "done"):
                done_steps[j] = ev.step if ev.kind == "frame" else requests[j].steps
                if bar is not None:
                    for note in getattr(ev, "notes", []) if ev.kind == "frame" else []:
                        bar.write(f"note: job {j + 1}/{len(requests)}: {note}" if many else f"note: {note}")
                show()

        return on_event

    async def one(j: int, request):
        async with gate:
            left = deadline - time.monotonic()
            try:
                if left <= 0:
                    raise JobFailed(ErrorCode.DEADLINE_EXCEEDED, f"the run did not finish within {timeout:g} s")
                return await run_job(nc, request, on_event_of(j), timeout=left)
            except JobFailed as err:
                raise _JobError(j, err) from None

    tasks = [asyncio.create_task(one(j, r)) for j, r in enumerate(requests)]
    try:
        dones = await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)  # run_job cancels its job on the coordinator
        raise
    return list(dones), seeds


def _images_asked(args: argparse.Namespace) -> int:
    """How many images the run makes (--labels: its entries, before they are checked against the fleet)."""
    import re

    if args.digits is not None:
        return len(args.digits)
    if args.labels is not None:
        text = args.labels.strip()
        parts = re.split(r"[,;]", text) if ("," in text or ";" in text) else text.split()
        return sum(1 for p in parts if p.strip())
    return args.count


def run(args: argparse.Namespace) -> int:
    import asyncio
    import json
    import sys
    import time

    from schemas import ProtocolError

    ext = os.path.splitext(args.out)[1].lower()
    if ext not in (".png", ".npz"):
        print(f"ddm-fleet generate: --out must end in .png or .npz, got {args.out!r}", file=sys.stderr)
        return 2
    n_images = _images_asked(args)
    if args.unconditional and args.count is None:
        print(
            "ddm-fleet generate: --unconditional takes --count N (every image's label is unknown), not --digits or "
            "--labels (where ? marks an unknown label)",
            file=sys.stderr,
        )
        return 2
    if args.unconditional and args.strategy == "oracle":
        print(
            "ddm-fleet generate: --strategy oracle needs each image's class; use top1, topk, full or sample with "
            "--unconditional",
            file=sys.stderr,
        )
        return 2
    if n_images > MAX_RUN_IMAGES:
        print(
            f"ddm-fleet generate: {n_images} images asked for; one run makes at most {MAX_RUN_IMAGES} "
            "(run it several times with different --seed)",
            file=sys.stderr,
        )
        return 2
    try:  # checked against the MNIST fleet's spec before connecting; again against the fleet's own below
        plan_requests(args if args.labels is None else argparse.Namespace(**{**vars(args), "labels": "0"}))
    except Exception as err:  # pydantic validation: limits
        print(f"ddm-fleet generate: bad request: {err}", file=sys.stderr)
        return 2

    async def job(nc) -> int:
        from tqdm import tqdm

        from client.jobs import JobFailed, fleet_status
        from client.labels import name_of
        from schemas.spec import legacy_spec

        try:  # the fleet's shapes and classes; a coordinator older than specs serves the MNIST fleet
            status = await fleet_status(nc, spec=True, timeout=5.0)
        except JobFailed as err:
            print(f"ddm-fleet generate: {err.reason} (start a coordinator, or use --local)", file=sys.stderr)
            return 1
        spec = status.spec if status.spec is not None else legacy_spec()
        try:
            requests, run_seed = plan_requests(args, spec)
        except Exception as err:  # a label the fleet lacks; pydantic validation: limits
            print(f"ddm-fleet generate: bad request: {err}", file=sys.stderr)
            return 2
        n_images = sum(r.n_images for r in requests)

        bar = (
            None
            if args.no_progress
            else tqdm(
                total=n_images,
                desc=f"denoising ({len(requests)} job{'s' * (len(requests) > 1)})",
                unit="image",
                file=sys.stderr,
                disable=None,
                bar_format="{l_bar}{bar}| {n:.1f}/{total} images [{elapsed}<{remaining}]",
            )
        )
        started = time.monotonic()
        try:
            dones, seeds = await run_jobs(nc, requests, in_flight=args.jobs_in_flight, timeout=args.timeout, bar=bar)
        except _JobError as err:
            which = f"job {err.index + 1} of {len(requests)}" if len(requests) > 1 else "job"
            print(f"ddm-fleet generate: {which} failed ({err.err.code.value}): {err.err.reason}", file=sys.stderr)
            return 1
        finally:
            if bar is not None:
                bar.close()
        result = join_results(dones, seeds, run_seed, time.monotonic() - started)
        try:
            save_output(result, args.out, args.per_row, spec)
        except ValueError as err:  # e.g. a grid of 4-channel latents
            print(f"ddm-fleet generate: {err}", file=sys.stderr)
            return 2
        if args.json:
            print(json.dumps(summary(result, args.steps, args.strategy, args.out, spec, args.guidance), indent=2))
        else:
            names = [name_of(spec, c) for c in result.labels]
            shown = ",".join(names) if len(names) <= 64 else "..."
            jobs = f" as {len(requests)} jobs" if len(requests) > 1 else ""
            print(
                f"wrote {len(result.labels)} images ({shown}) to {args.out} in {result.elapsed_s:.2f} s{jobs} "
                f"(seed {result.seed})"
            )
        return 0

    async def main() -> int:
        from bus.connect import connect, drain_or_close

        if args.local:
            from coordinator.local_fleet import LocalFleet

            print(f"starting a local fleet from {args.checkpoints}/ ...", file=sys.stderr, flush=True)
            rows = min(n_images, args.images_per_job * args.jobs_in_flight)
            rows *= 2 if _local_guidance(args) != 1.0 else 1  # guided rows ride with their null twins
            async with LocalFleet.from_dir(
                args.checkpoints, buckets=local_buckets(rows), dtype=getattr(args, "dtype", "auto")
            ) as fleet:
                return await job(fleet.nc)
        from client.jobs import client_connect_options, client_from_url

        try:  # the jobs belong to the NATS user of --nats ("anon" without one)
            client = client_from_url(args.nats)
        except ValueError as err:
            print(f"ddm-fleet generate: {err}", file=sys.stderr)
            return 2
        nc = await connect(
            args.nats,
            name="ddm-generate",
            reconnect=3,
            first_connect_attempts=4,
            reconnect_wait_s=0.5,
            connect_timeout_s=5,
            **client_connect_options(client),
        )
        try:
            return await job(nc)
        finally:
            await drain_or_close(nc)

    from bus.connect import BusUnavailable, without_credentials

    try:
        return asyncio.run(main())
    except BusUnavailable as err:
        print(f"ddm-fleet generate: {err} Or use --local to run a fleet in this process.", file=sys.stderr)
        return 1
    except FileNotFoundError as err:
        print(f"ddm-fleet generate: {err}", file=sys.stderr)
        return 2
    except ProtocolError as err:
        print(f"ddm-fleet generate: {err.code.value}: {err.message}", file=sys.stderr)
        return 1
    except ValueError as err:  # unreadable / mismatched checkpoint, router or partition files; a bad --nats URL
        print(f"ddm-fleet generate: {err}", file=sys.stderr)
        return 2
    except Exception as err:
        if type(err).__name__ == "BackendError":  # an expert checkpoint the backend cannot load
            print(f"ddm-fleet generate: {err}", file=sys.stderr)
            return 2
        if type(err).__module__.startswith("nats"):
            print(
                f"ddm-fleet generate: NATS at {without_credentials(args.nats)}: {type(err).__name__} {err} "
                "(start a fleet, or use --local)",
                file=sys.stderr,
            )
            return 1
        raise
