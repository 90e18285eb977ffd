"""Images/s and job latency through the whole fleet, next to the in-process ceiling; under load,
what happened to every job and how much memory each process of the fleet took.

For each --concurrency C, C clients each run --jobs-per-client jobs back to back (a closed
loop), and go on until the level has lasted --min-level-s seconds (5 by default, so a level of
one client measures seconds of work, not two short jobs); we report the jobs run, images/s and
p50/p99 job latency (submit -> final images at the client):

* fleet:   client -> NATS -> coordinator (`ddm-fleet coordinator`, its own process: router,
           scheduler, admission limits) -> NATS -> one worker process per expert
           (`ddm-fleet worker`, batching, bucket padding) and back, frames streamed;
* ceiling: the same scheduler, router and models in one process, experts called directly
           (no NATS, no msgpack, no worker processes), same continuous batching;

and the ratio fleet / ceiling of images/s, and where a tick's time goes on each path (the processes' own
clocks from /metrics: coordinator, wire, worker, forward; `benchmarks/step_profile.py`). Next to both,
the machine's forward-only limit: the experts' own forward timed in this process at --limit-batches
(best batch kept), one thread per core on the CPU, in images/s for the run's steps, solver and strategy
(see --limit-batches), with fleet / limit and ceiling / limit: how much of the hardware each path turns into images.

--guidance S: every job asks for classifier-free guidance at scale S (`JobRequest.guidance_scale`, flow/guidance.py):
each image is evaluated with its label and with the null label (two forward rows per image and expert, in the
same forward), so the forward-only limit's images/s is half the unguided one. The experts need a null label:
checkpoints without one are refused up front; the random UNets used without checkpoints get one.

Every job's outcome is counted: completed, rejected (the coordinator refused the submit:
admission control, `--max-rows` / `--max-queued-jobs`, with
the ErrorCode the client got), failed (accepted, then a FailedEvent, with its code) and LOST
(neither images nor a failure within --job-timeout seconds; must be 0). The coordinator's own
counters for the level are shown next to the clients' view, and what it still holds after the
level (active + queued jobs; 0 unless something leaked). Per process (coordinator, each worker,
nats-server, and this bench process, which runs the clients) the peak RSS over each level is
read from /proc/<pid>/status VmHWM, reset before the level through /proc/<pid>/clear_refs, with
the RSS at the level's end, and the CPU seconds each used in the level (/proc/<pid>/stat; the
ceiling's are the bench process's): what the fleet spends beyond the experts' forwards (the
coordinator, nats-server, the wire work in the workers, the clients decoding frames) is CPU the
experts cannot have on a machine where they all share the cores. From those the report reads the fleet's CPU
per image, split by role, against the experts' own forward CPU per image at the batch sizes the level ran
(timed with the forward-only limit): their ratio is the overhead factor (benchmarks/cpu_account.py), a
figure that does not move with the box's load as images/s does; for a latent fleet, the decoder's share of
that CPU. On the fleet path, the NATS traffic per image: nats-server's own counters (its monitoring
endpoint /varz) read before and after each level give the messages and bytes the clients published to it
(in) and it delivered (out), divided by the images made (benchmarks/nats_traffic.py). The 1-minute load
average before and after each level is recorded: on a shared machine it says how much of the box the bench had.

Uses checkpoints/ (expert<k>, router, partition) when present, else random UNets of --widths with
a random router (said in the report). A private nats-server on a free port is started and stopped.
--cohorts auto (the default) runs what `ddm-fleet up` starts on this host: one cohort where the fleet's
processes fill the CPU cores (no accelerator, one worker per expert), else the coordinator's auto; the
report's setup line says which.

examples:
  ddm-fleet bench fleet --concurrency 1,8,64 --steps 40
  ddm-fleet bench fleet --concurrency 1000 --jobs-per-client 1 --steps 8 --only fleet
  ddm-fleet bench fleet --concurrency 1000 --jobs-per-client 1 --steps 8 --only fleet \\
      --max-rows 100 --max-queued-jobs 100
  ddm-fleet bench fleet --widths 32,64,128 --concurrency 1,8 --steps 10 --json
  ddm-fleet bench fleet --concurrency 64 --steps 40 --only fleet --durable   # the cost of durable jobs
  ddm-fleet bench fleet --concurrency 1,8 --steps 20 --guidance 3 --checkpoints ck-null  # guided jobs
"""

from __future__ import annotations

import argparse
import os
import time

from bus.options import add_device_option, add_dtype_option, add_solver_option, add_threads_option
from client.guidance import guidance_scale
from workers.backends.torch_compile import COMPILE_CHOICES
from workers.config import add_batch_invariant_option, add_buckets_option

from . import cpu_account, nats_traffic, step_profile
from .options import (
    ENGINE_OPTIONS,
    add_router_option,
    announce_defaults,
    coordinator_config,
    positive_ints,
    require_at_least_one,
    router_path,
)
from .processes import Child, cli_argv, cpu_seconds, proc_memory, reset_peak, run_bench

#: The `ddm-fleet coordinator` settings this bench takes (the fleet's coordinator gets them; the
#: ceiling's engine and scheduler too, where they apply), and the defaults it changes: bigger limits
#: and a longer step timeout, so that a loaded box measures throughput instead of refusals and retries.
COORDINATOR_OPTIONS = (
    "max_rows",
    "max_queued_jobs",
    "max_client_rows",
    "max_client_queued_jobs",
    "submit_rate",
    "status_rate",
    "step_timeout",
    "retries",
    *ENGINE_OPTIONS,
    "wire_dtype",
    "hedge",
    "hedge_after_s",
    "dispatch",
    "durable",
)
# (the simulated clients are sessions of one NATS client: its quotas and rate limits are lifted)
COORDINATOR_DEFAULTS = {
    "max_rows": 4096,
    "max_queued_jobs": 4096,
    "max_client_rows": 4096,
    "max_client_queued_jobs": 4096,
    "submit_rate": None,
    "status_rate": None,
    "step_timeout": 60.0,
    "retries": 1,
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from coordinator.config import CoordinatorConfig

    parser.add_argument(
        "--concurrency", default="1,8,64", metavar="C,C,...", help="concurrent clients to measure (default %(default)s)"
    )
    parser.add_argument("--steps", type=int, default=40, help="solver steps per job (default %(default)s)")
    parser.add_argument("--images-per-job", type=int, default=1, metavar="N", help="images per job (default 1)")
    parser.add_argument(
        "--jobs-per-client",
        type=int,
        default=2,
        metavar="N",
        help="jobs each client runs back to back, at least (default %(default)s; see --min-level-s)",
    )
    parser.add_argument(
        "--min-level-s",
        type=float,
        default=5.0,
        metavar="S",
        help="each level lasts at least S seconds, on both paths: a client whose jobs all completed "
        "starts another until the level has run S seconds (and it has run --jobs-per-client), so a "
        "level of few clients measures more than a second of work; the jobs run are reported per "
        "level. 0: exactly --jobs-per-client jobs (default %(default)s)",
    )
    parser.add_argument(
        "--limit-batches",
        default="1,2,4,8,32,128",
        metavar="B,B,...|none",
        help="batch sizes at which the experts' own forward is timed in this process for the "
        "forward-only limit and the CPU accounting's forward per row (read at each level's mean batch, "
        "so the small batches of few clients are timed too), on the CPU one thread per core: "
        "images/s = best rows/s / (steps x "
        "evaluations per step (heun 2) x experts per row (top1/oracle 1, topk k, full all) x forward rows "
        "per evaluation (2 with --guidance: the label's and the null label's, else 1)), where "
        "best rows/s is each expert's best over these batches, averaged over experts by time per "
        "row (rows spread evenly), times this machine's cores (on a GPU: the device's own rate). "
        "fleet / limit and ceiling / limit are reported; none: skip it (default %(default)s)",
    )
    parser.add_argument("--strategy", choices=("top1", "topk", "full", "oracle"), default="top1")
    parser.add_argument(
        "--guidance",
        type=guidance_scale,
        default=1.0,
        metavar="S",
        help="classifier-free guidance scale of every job, 0-20: 1 = off (default); otherwise each image costs "
        "two forward rows per evaluation (its label and the null label), in the fleet, the ceiling and the "
        "forward-only limit alike. Needs experts with a null label (train-expert --label-dropout > 0); the "
        "random UNets used without checkpoints get one",
    )
    add_solver_option(parser)
    parser.add_argument("--no-stream", action="store_true", help="jobs do not stream frames (only final images)")
    parser.add_argument(
        "--checkpoints",
        default="checkpoints",
        metavar="DIR",
        help="expert<k>.safetensors, router.safetensors, partition.json (default %(default)s)",
    )
    add_router_option(parser)
    parser.add_argument(
        "--widths",
        default="32,64,128",
        help="UNet widths of the random experts used when --checkpoints has none (default %(default)s)",
    )
    add_dtype_option(
        parser,
        help="the experts' compute type in the workers and in the ceiling: auto = bfloat16 where the device "
        "computes it natively (CPU with AMX or AVX512-BF16, CUDA compute capability >= 8.0), else float32 "
        "(default %(default)s)",
    )
    parser.add_argument(
        "--backend",
        choices=("torch", "jax"),
        default="torch",
        help="model runtime of the workers and of the ceiling's experts (default %(default)s)",
    )
    parser.add_argument(
        "--compile",
        choices=COMPILE_CHOICES,
        default="auto",
        help="torch: compile the experts (torch.compile, inductor freezing) in the workers, the ceiling and the "
        "forward-only limit alike; auto = on for a CPU with a C++ compiler ($DDM_FLEET_COMPILE=on|off "
        "overrides; workers.backends.torch_compile) (default %(default)s)",
    )
    add_batch_invariant_option(
        parser,
        help="batch-invariant experts (`ddm-fleet worker --batch-invariant`: every forward at a multiple of "
        "%(const)s rows) in the workers, the ceiling and the forward-only limit alike: what reproducible "
        "images under load cost",
    )
    add_device_option(
        parser,
        default=None,
        help_suffix=" (jax: gpu), of the workers and of the ceiling's experts; on a GPU host both paths "
        "share the one device",
        default_help="the backend's own, the CPU",
    )
    add_threads_option(
        parser,
        default=None,
        help_suffix=" per expert, both paths; also the coordinator's router",
        default_help="this machine's cores shared out among the worker processes, at least 1, as "
        "docs/DEPLOYMENT.md advises for workers sharing a host: torch's own default gives every process all "
        "the cores, and their spinning threads then fight",
    )
    add_buckets_option(parser, help="worker batch buckets (default %(default)s)")
    parser.add_argument(
        "--job-timeout",
        type=float,
        default=900.0,
        metavar="S",
        help="a job with neither images nor a failure after S seconds counts as LOST (default %(default)s)",
    )
    parser.add_argument(
        "--workers-per-expert",
        type=int,
        default=1,
        metavar="N",
        help="fleet: worker processes per expert, in its queue group (default %(default)s)",
    )
    CoordinatorConfig.add_arguments(parser, only=COORDINATOR_OPTIONS, defaults=COORDINATOR_DEFAULTS)
    parser.add_argument(
        "--merge",
        choices=("auto", "always"),
        default="auto",
        help="fleet: `ddm-fleet worker --merge` (default %(default)s: queued requests share a forward "
        "pass only where that is cheaper; always: every pass filled up to the largest bucket)",
    )
    parser.add_argument("--only", choices=("fleet", "ceiling"), default=None, help="measure one path only")
    parser.add_argument("--json", action="store_true", help="print the results as JSON instead of a table")


def check_args(args: argparse.Namespace) -> None:
    """Raise ValueError naming the first bad option; sets args.concurrency_list."""
    args.concurrency_list = positive_ints(args.concurrency, "--concurrency")
    router_path(args)  # --router, when given, must exist
    positive_ints(args.buckets, "--buckets")
    require_at_least_one(args, ("steps", "images_per_job", "jobs_per_client", "workers_per_expert"))
    if not args.job_timeout > 0:
        raise ValueError("--job-timeout must be > 0 seconds")
    if not args.min_level_s >= 0:
        raise ValueError("--min-level-s must be >= 0 seconds")
    _limit_batches(args)
    coordinator_config(args)  # the coordinator's settings: ValueError naming the flag


def _limit_batches(args: argparse.Namespace) -> list[int]:
    """--limit-batches as a list ([] for none); ValueError naming the flag."""
    text = str(getattr(args, "limit_batches", "none"))
    return [] if text.strip().lower() == "none" else positive_ints(text, "--limit-batches")


def run(args: argparse.Namespace) -> int:
    announce_defaults(args, COORDINATOR_DEFAULTS)
    return run_bench("fleet", args, check_args, bench_fleet, format_table)


# ----------------------------------------------------------------------------- models


def _models(args, tmpdir: str) -> dict:
    """Expert checkpoint paths, router and partition files (the coordinator process loads them),
    number of experts, class_to_expert and a description."""
    from coordinator.local_fleet import shipped_paths
    from coordinator.startup import router_spec
    from dataset.partition import load_manifest

    try:
        paths = shipped_paths(args.checkpoints)
    except FileNotFoundError:
        paths = None
    if paths is not None:
        manifest = load_manifest(paths["partition"])
        k = manifest.num_experts
        if len(paths["experts"]) < k:
            raise FileNotFoundError(
                f"{paths['partition']} has {k} experts but {args.checkpoints}/ holds "
                f"{len(paths['experts'])} expert checkpoints"
            )
        router = router_path(args)
        if _guided(args):
            _check_null_labels(paths["experts"][:k], args.guidance)
        autoencoder = _latent_autoencoder(args.checkpoints, router_spec(router))
        return {
            "experts": [str(p) for p in paths["experts"][:k]],
            "router": str(router),
            "partition": str(paths["partition"]),
            "k": k,
            "c2e": [int(manifest.class_to_expert(y)) for y in range(router_spec(router).num_classes)],
            "autoencoder": autoencoder,
            "described": f"checkpoints in {args.checkpoints}/"
            + (f", router {router}" if args.router is not None else "")
            + (f", latent: a decoder of {autoencoder} decodes every job's images" if autoencoder else ""),
        }
    if args.router is not None:
        raise ValueError(
            f"--router needs the experts and partition it was trained with, and {args.checkpoints}/ "
            "has none (see --checkpoints)"
        )
    import numpy as np

    from dataset.partition import partition_by_classes, save_manifest
    from models.config import UNetConfig, parse_widths
    from models.tiny import make_tiny_expert, make_tiny_router

    # Random UNets of --widths with the default (full-size) embeddings, so timings match a trained expert's shape.
    full = UNetConfig()
    experts = [
        str(
            make_tiny_expert(
                os.path.join(tmpdir, f"expert{k}"),
                expert_id=k,
                seed=k,
                widths=parse_widths(args.widths),
                time_dim=full.time_dim,
                class_dim=full.class_dim,
                groups=full.groups,
                null_label=_guided(args),  # --guidance: the null label's embedding row (random, like the rest)
            )
        )
        for k in range(2)
    ]
    router = make_tiny_router(
        os.path.join(tmpdir, "router"),
        2,
        seed=2,
        width=8,
        emb_dim=64,
        meta={"note": "random, untrained: for `bench fleet` without checkpoints"},
    )
    groups = [list(range(5)), list(range(5, 10))]
    partition = save_manifest(partition_by_classes(np.arange(10), groups), os.path.join(tmpdir, "partition.json"))
    return {
        "experts": experts,
        "router": str(router),
        "partition": str(partition),
        "k": 2,
        "c2e": [0] * 5 + [1] * 5,
        "described": f"random UNets widths={args.widths}"
        + (" with a null label" if _guided(args) else "")
        + ", random router",
    }


def _guided(args) -> bool:
    """--guidance other than 1: every job is guided."""
    return getattr(args, "guidance", 1.0) != 1.0


def _check_null_labels(experts, scale: float) -> None:
    """ValueError naming the first expert checkpoint without a null label: a guided job evaluates every image
    with the null label too, and the fleet refuses it (the ceiling's experts would fail each call)."""
    from models.checkpoint import load_meta
    from models.spec import spec_of

    for path in experts:
        if not spec_of(load_meta(path), str(path)).conditioning.null_label:
            raise ValueError(
                f"--guidance {scale:g} needs experts with a null label, and {path} has none "
                "(train-expert --label-dropout > 0), or leave --guidance at 1"
            )


def _latent_autoencoder(directory, spec) -> str | None:
    """A latent fleet's autoencoder (in `directory`, the one its spec names), whose decoder the fleet runs
    and the ceiling calls in-process; None for a pixel fleet (`models.codec.fleet_codec`)."""
    from models.codec import fleet_codec

    path = fleet_codec(spec, [directory])
    return None if path is None else str(path)


def _requests(args, c: int, tag: str) -> list:
    """One job maker per client: maker(j) -> the client's j-th JobRequest (j = 0, 1, ...)."""
    from schemas import JobRequest

    # Each simulated client is its own session, so the coordinator's per-client quotas and fair
    # admission see C clients (as C browser tabs would be), not one client with C x J jobs.
    def maker(i: int):
        def make(j: int) -> JobRequest:
            return JobRequest(
                job_id=f"b{tag}{c}x{i}x{j}",
                count=args.images_per_job,
                steps=args.steps,
                strategy=args.strategy,
                solver=args.solver,
                seed=i * 1000 + j,
                stream=not args.no_stream,
                session=f"bench-{i}",
                guidance_scale=getattr(args, "guidance", 1.0),
            )

        return make

    return [maker(i) for i in range(c)]


OUTCOMES = ("completed", "rejected", "failed", "lost")


async def _closed_loop(run_one, per_client, min_jobs: int, min_s: float = 0.0) -> dict:
    """Run each client's jobs back to back, all clients concurrently.

    per_client: one maker(j) -> JobRequest per client (`_requests`). Each client runs `min_jobs`
    jobs, then goes on starting jobs while the level has lasted less than `min_s` seconds, as long as
    every job it ran completed (a refused or failed job ends its extra jobs: no submit storm against
    admission control). run_one(request) -> (outcome, detail, answer_s): ("completed", DoneEvent),
    ("rejected", code), ("failed", code) or ("lost", None), and the seconds until the submit was
    answered (accepted or rejected; None if never). Returns counts per outcome, the codes, images/s
    and latency over the completed jobs, the p50/p99 time to answer a submit, and the jobs each
    client ran ([min, max])."""
    import asyncio
    from collections import Counter

    import numpy as np

    lat: list[float] = []
    answer: list[float] = []
    images = 0
    counts: Counter = Counter()
    codes = {"rejected": Counter(), "failed": Counter()}
    ran: list[int] = []

    async def client(make):
        nonlocal images
        j, all_completed = 0, True
        while j < min_jobs or (all_completed and time.perf_counter() - start < min_s):
            req = make(j)
            j += 1
            t0 = time.perf_counter()
            outcome, detail, answer_s = await run_one(req)
            counts[outcome] += 1
            if answer_s is not None:
                answer.append(answer_s)
            if outcome == "completed":
                lat.append(time.perf_counter() - t0)
                images += len(detail.classes)
            else:
                all_completed = False
                if outcome in codes:
                    codes[outcome][str(detail)] += 1
        ran.append(j)

    def pct(values, q):
        return round(float(np.percentile(values, q)), 4) if values else None

    start = time.perf_counter()
    await asyncio.gather(*(client(m) for m in per_client))
    wall = time.perf_counter() - start
    return {
        "submitted": sum(ran),
        "jobs_per_client": [min(ran), max(ran)] if ran else [0, 0],
        **{k: counts[k] for k in OUTCOMES},
        "rejected_codes": dict(codes["rejected"]),
        "failed_codes": dict(codes["failed"]),
        "images": images,
        "jobs": len(lat),
        "wall_s": round(wall, 3),
        "images_per_s": round(images / wall, 2),
        "p50_s": pct(lat, 50),
        "p99_s": pct(lat, 99),
        "answer_p50_s": pct(answer, 50),
        "answer_p99_s": pct(answer, 99),
    }


# ----------------------------------------------------------------------------- the forward-only limit

#: Seconds each (expert, batch size) forward is repeated for, at least (2 forwards at least, after one warm-up).
LIMIT_TIME_S = 0.3


def _forward_limit(args, models) -> dict | None:
    """What this machine could serve if it did nothing but the experts' forwards.

    Each expert's own forward (the backend the workers use, this process, random inputs) is timed at
    each of --limit-batches; its best rows/s is kept. On the CPU with torch the forward runs on one
    thread and the machine's rate is that per-core rate times os.cpu_count() (one thread per core, no
    fighting threads); elsewhere (a GPU, jax) one process's rate is the device's. Rows are taken as
    spread evenly over the experts, so the experts' rates are averaged by time per row. Then
    images/s = rows/s / (steps x evaluations per step x experts per row) (`coordinator.scheduler.job_cost`
    per image). Returns None when --limit-batches is none."""
    import gc
    import statistics

    import numpy as np

    from coordinator.local_fleet import load_backends
    from coordinator.scheduler import EVALS_PER_STEP, experts_per_row

    batches = _limit_batches(args)
    if not batches:
        return None
    backend_name = getattr(args, "backend", "torch")
    device = getattr(args, "device", None)
    per_core = backend_name == "torch" and (device is None or str(device).startswith("cpu"))
    load0 = os.getloadavg()[0]
    torch_threads = None
    if per_core:
        import torch

        torch_threads = torch.get_num_threads()
        torch.set_num_threads(1)
    try:
        backends = load_backends(
            models["experts"],
            backend_name,
            dtype=args.dtype,
            buckets=(),
            device=device,
            compile=args.compile,
            batch_quantum=getattr(args, "batch_quantum", 0),
        )
        rng = np.random.default_rng(0)
        experts = []
        for be in backends:
            by_batch, cpu_by_batch = {}, {}
            for b in batches:
                x = rng.standard_normal((b, *be.input_shape)).astype(np.float32)
                t = rng.uniform(0, 1, b).astype(np.float32)
                y = rng.integers(0, max(int(be.num_classes), 1), b).astype(np.int64)
                be.forward(x, t, y)  # warm-up (a new shape may compile)
                times: list[float] = []
                cpu: list[float] = []  # this process's CPU seconds per forward (every thread's)
                end = time.perf_counter() + LIMIT_TIME_S
                while len(times) < 2 or time.perf_counter() < end:
                    t0, c0 = time.perf_counter(), time.process_time()
                    be.forward(x, t, y)
                    times.append(time.perf_counter() - t0)
                    cpu.append(time.process_time() - c0)
                by_batch[b] = round(b / statistics.median(times), 1)
                cpu_by_batch[b] = statistics.median(cpu) / b
            best = max(by_batch, key=by_batch.get)
            experts.append(
                {
                    "best_batch": best,
                    "rows_per_s": by_batch[best],
                    "rows_per_s_by_batch": by_batch,
                    # what a row costs the forward alone (benchmarks.cpu_account): CPU seconds per row
                    "cpu_s_per_row_by_batch": {k: float(f"{v:.4g}") for k, v in cpu_by_batch.items()},
                }
            )
        del backends
        gc.collect()
    finally:
        if torch_threads is not None:
            torch.set_num_threads(torch_threads)
    units = (os.cpu_count() or 1) if per_core else 1
    per_unit = 1.0 / statistics.fmean(1.0 / e["rows_per_s"] for e in experts)
    req = _requests(args, 1, "limit")[0](0)
    evals = EVALS_PER_STEP.get(args.solver, 1)
    epr = experts_per_row(req, models["k"])
    # a guided image is two forward rows per evaluation (its label's and its null twin's): `job_cost`
    per_eval = (req.n_images + req.n_guided) // req.n_images
    rows_per_image = args.steps * evals * epr * per_eval
    rows_per_s = per_unit * units
    return {
        "images_per_s": round(rows_per_s / rows_per_image, 2),
        "rows_per_s": round(rows_per_s, 1),
        "rows_per_image": rows_per_image,
        "evals_per_step": evals,
        "experts_per_row": epr,
        "rows_per_eval": per_eval,
        "threads_per_forward": 1 if per_core else None,
        "units": units,
        "unit": "core" if per_core else "device",
        "batches": list(batches),
        "experts": experts,
        "load1": [round(load0, 2), round(os.getloadavg()[0], 2)],  # a loaded machine lowers the limit
    }


def limit_at_load(limit: dict, rows_in_flight: float, experts: int) -> dict:
    """The forward-only limit a level's load allows: with `rows_in_flight` rows (clients x images per job x
    experts per row x forward rows per evaluation, 2 when guided) spread over `experts` experts, no expert
    call can hold more than rows / experts rows, so each expert's rate is read at that batch (log-linear
    between the timed batches; clamped to the smallest and largest timed) instead of at its best.
    -> {"batch", "images_per_s", "rows_per_s"}."""
    import statistics

    batch = max(1.0, rows_in_flight / max(experts, 1))
    rates = []
    for e in limit["experts"]:
        rate = cpu_account.at_batch(e["rows_per_s_by_batch"], batch)
        rates.append(min(rate, e["rows_per_s"]))  # never above the expert's best
    rows_per_s = limit["units"] / statistics.fmean(1.0 / r for r in rates)
    return {
        "batch": round(batch, 1),
        "rows_per_s": round(rows_per_s, 1),
        "images_per_s": round(rows_per_s / limit["rows_per_image"], 2),
    }


# ----------------------------------------------------------------------------- the two paths


async def _ceiling(args, models) -> dict:
    import asyncio

    from coordinator.engine import Engine
    from coordinator.local_fleet import InProcessTransport, load_backends
    from coordinator.scheduler import Rejected, Scheduler, SchedulerConfig
    from coordinator.service import load_router_and_partition
    from coordinator.startup import router_spec

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    router, k, c2e = load_router_and_partition(models["router"], models["partition"])
    buckets = positive_ints(args.buckets, "--buckets")
    backends = await asyncio.to_thread(
        load_backends,
        models["experts"],
        getattr(args, "backend", "torch"),
        dtype=args.dtype,
        buckets=buckets,
        device=getattr(args, "device", None),
        compile=args.compile,
        batch_quantum=getattr(args, "batch_quantum", 0),
    )
    waiting: dict[str, asyncio.Future] = {}
    codec = None
    if models.get("autoencoder"):  # a latent fleet: the ceiling decodes every job's latents in-process too
        from models.codec import load_codec

        codec = load_codec(models["autoencoder"], device=getattr(args, "device", None) or "cpu")

    async def decoded(ev, fut):
        try:
            images = await asyncio.to_thread(codec.decode, ev.images)
        except Exception as err:  # a decoder that cannot decode its own latents: the bench stops, saying why
            fut.done() or fut.set_exception(err)
            return
        fut.done() or fut.set_result(ev.model_copy(update={"images": images}))

    decodes: set[asyncio.Task] = set()  # held until done (the loop keeps only weak references)

    def emit(ev):
        fut = waiting.get(ev.job_id)
        if fut is not None and not fut.done() and ev.kind in ("done", "failed"):
            if codec is not None and ev.kind == "done":
                task = asyncio.ensure_future(decoded(ev, fut))
                decodes.add(task)
                task.add_done_callback(decodes.discard)
            else:
                fut.set_result(ev)

    cfg = coordinator_config(args)
    engine = Engine(
        Scheduler(
            SchedulerConfig(
                num_experts=k,
                max_rows=cfg.max_rows,
                max_queued_jobs=cfg.max_queued_jobs,
                class_to_expert=c2e,
                image_shape=tuple(router_spec(models["router"]).sample_shape),  # the fleet's, not MNIST's
                num_classes=len(c2e),
            )
        ),
        router,
        InProcessTransport(backends, buckets),
        emit,
        cohorts=cfg.cohorts,
        route_every=cfg.route_every,
        speculate=cfg.speculate,
        early_update=cfg.early_update,
    )
    task = asyncio.create_task(engine.run())

    async def run_one(req):
        waiting[req.job_id] = fut = asyncio.get_running_loop().create_future()
        try:
            try:
                engine.submit(req)
            except Rejected as err:
                return "rejected", err.code.value, 0.0
            try:
                ev = await asyncio.wait_for(fut, args.job_timeout)
            except TimeoutError:
                await engine.cancel(req.job_id, "the bench gave up on it")
                return "lost", None, 0.0
            return ("completed", ev, 0.0) if ev.kind == "done" else ("failed", ev.code.value, 0.0)
        finally:
            waiting.pop(req.job_id, None)

    try:
        await _closed_loop(run_one, _requests(args, 1, "w"), args.jobs_per_client)  # warm-up
        out = []
        for level, c in enumerate(args.concurrency_list):
            me = os.getpid()
            reset_peak(me)
            load0, cpu0, t0 = os.getloadavg()[0], cpu_seconds(me), time.monotonic()
            clocks0 = _engine_clocks(engine)
            res = await _closed_loop(run_one, _requests(args, c, f"c{level}-"), args.jobs_per_client, args.min_level_s)
            d = step_profile.delta(clocks0, _engine_clocks(engine))
            res["split_ms"] = step_profile.inprocess_split(
                int(d["ticks"]),
                d["tick_s"],
                d["router_s"],
                d["call_s"],
                _client_step_s(res, c, args.steps),
            )
            res["load1"] = [round(load0, 2), round(os.getloadavg()[0], 2)]
            res["memory"] = {"bench (in-process fleet)": proc_memory(me)}
            res["cpu"] = _cpu_used(
                {"bench (in-process fleet)": cpu0}, {"bench (in-process fleet)": me}, time.monotonic() - t0
            )
            out.append(res)
        return out
    finally:
        await engine.stop()
        await task


def _client_step_s(res: dict, c: int, steps: int) -> float | None:
    """At one client, the level's wall time per step of its jobs (jobs run back to back, so this is what
    one user waits per step, submit and done included); None at more clients (a tick serves many jobs)."""
    return res["wall_s"] / (res["jobs"] * steps) if c == 1 and res.get("jobs") else None


def _engine_clocks(engine) -> dict:
    """An in-process engine's tick, router and expert-call clocks, as the fleet's coordinator exports them."""
    from prometheus_client import generate_latest

    text = generate_latest(engine.metrics.registry).decode()
    return step_profile.parse_samples(text, step_profile.COORDINATOR_SERIES)


def _cpu_used(before: dict, pids: dict, wall_s: float) -> dict:
    """{"wall_s": level seconds, "seconds": {process: CPU seconds used in the level}} (None: gone)."""
    out = {}
    for name, pid in pids.items():
        now = cpu_seconds(pid)
        out[name] = None if now is None or before.get(name) is None else round(now - before[name], 2)
    return {"wall_s": round(wall_s, 2), "seconds": out}


async def fleet_job(nc, request, bound: float):
    """One job through the fleet with `client.jobs.run_job`, classified:
    ("completed", DoneEvent, answer_s), ("rejected", code, answer_s) when the submit was refused,
    ("failed", code, answer_s) when an accepted job failed, ("lost", None, answer_s) when neither
    images nor a failure came within `bound` seconds (the job is then cancelled by run_job).
    answer_s: seconds until the submit was answered (None if never). The client's own timeouts
    are set beyond `bound`, so any failure seen within it came from the fleet."""
    import asyncio

    from client.jobs import JobFailed, run_job
    from schemas import JobAccepted

    accepted = None
    t0 = time.perf_counter()

    def seen(ev):
        nonlocal accepted
        if isinstance(ev, JobAccepted):
            accepted = time.perf_counter() - t0

    try:
        done = await asyncio.wait_for(
            run_job(nc, request, seen, timeout=None, idle_timeout=bound + 60, submit_timeout=bound + 60), bound
        )
    except JobFailed as err:
        if accepted is None:
            return "rejected", err.code.value, time.perf_counter() - t0
        return "failed", err.code.value, accepted
    except TimeoutError:
        return "lost", None, accepted
    return "completed", done, accepted


def _split_samples(coordinator_port: int, worker_ports: list[int]) -> tuple[dict | None, list[dict | None]]:
    """The coordinator's and each worker's clock counters (`benchmarks.step_profile`)."""
    return (
        step_profile.scrape(coordinator_port, step_profile.COORDINATOR_SERIES),
        [step_profile.scrape(p, step_profile.WORKER_SERIES) for p in worker_ports],
    )


async def _coordinator_counts(nc) -> dict | None:
    from client.jobs import JobFailed, fleet_status

    try:
        st = await fleet_status(nc, timeout=10)
    except JobFailed:
        return None
    return st.model_dump()


COUNTERS = ("jobs_submitted", "jobs_done", "jobs_failed", "jobs_cancelled", "jobs_rejected")


async def _hedge_counts(port: int) -> dict[str, float] | None:
    """{"requests": n, "won": n, "lost": n, "failed": n} summed over experts, scraped from the
    coordinator's /metrics (ddm_coordinator_expert_requests_total / _hedges_total), with "guessed" and
    "guessed_unused" (ddm_coordinator_rows_guessed_total / _unused_total); None if unreadable."""
    import asyncio
    import re
    import urllib.request

    def get() -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            return r.read().decode()

    try:
        text = await asyncio.to_thread(get)
    except OSError:
        return None
    out = {"requests": 0.0, "won": 0.0, "lost": 0.0, "failed": 0.0, "guessed": 0.0, "guessed_unused": 0.0}
    for line in text.splitlines():
        for key, name in (
            ("guessed", "ddm_coordinator_rows_guessed_total "),
            ("guessed_unused", "ddm_coordinator_rows_guessed_unused_total "),
        ):
            if line.startswith(name):
                out[key] = float(line.rsplit(" ", 1)[1])
        if line.startswith("ddm_coordinator_expert_requests_total{"):
            out["requests"] += float(line.rsplit(" ", 1)[1])
        m = re.match(r'ddm_coordinator_expert_hedges_total\{.*outcome="(\w+)".*\} (\S+)', line)
        if m and m.group(1) in out:
            out[m.group(1)] += float(m.group(2))
    return out


async def _fleet(args, models) -> dict:
    import asyncio
    import tempfile

    from bus.connect import connect
    from bus.nats_server import NatsServer
    from client.jobs import client_connect_options, client_from_url

    buckets = positive_ints(args.buckets, "--buckets")
    durable = coordinator_config(args).durable
    store = tempfile.TemporaryDirectory(prefix="ddm-bench-js-") if durable else None
    js = f'jetstream {{ store_dir: "{store.name}" }}' if store else ""
    with NatsServer(extra_config=js) as srv:
        children: list[Child] = []
        nc = None
        try:
            from bus.nats_server import free_port

            per = getattr(args, "workers_per_expert", 1)
            worker_ports: list[int] = []
            worker_experts: list[int] = []  # the expert each worker of worker_ports serves
            for i, path in enumerate(models["experts"]):
                for j in range(per):
                    cmd = cli_argv(
                        "worker",
                        "--expert",
                        i,
                        "--checkpoint",
                        path,
                        "--nats",
                        srv.url,
                        "--buckets",
                        args.buckets,
                        "--max-batch",
                        max(buckets),
                        "--merge",
                        getattr(args, "merge", "auto"),
                    )
                    worker_ports.append(free_port())
                    worker_experts.append(i)
                    cmd += ["--dtype", args.dtype, "--metrics-port", str(worker_ports[-1])]
                    cmd += ["--compile", args.compile] if getattr(args, "backend", "torch") == "torch" else []
                    cmd += ["--backend", getattr(args, "backend", "torch")]
                    cmd += ["--device", args.device] if getattr(args, "device", None) else []
                    quantum = getattr(args, "batch_quantum", 0)
                    cmd += ["--batch-quantum", str(quantum)] if quantum else []
                    cmd += ["--threads", str(args.threads)] if args.threads else []
                    children.append(await Child.start(f"worker{i}" + (f".{j}" if per > 1 else ""), cmd))
            if models.get("autoencoder"):  # a latent fleet: one decoder process turns final latents into images
                cmd = cli_argv("decoder", "--checkpoint", models["autoencoder"], "--nats", srv.url)
                cmd += ["--threads", str(args.threads)] if args.threads else []
                cmd += ["--device", args.device] if getattr(args, "device", None) else []
                children.append(await Child.start("decoder", cmd))
            await asyncio.gather(*(c.wait_ready(600) for c in children))
            env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)} if args.threads else None
            metrics_port = free_port()
            coordinator = await Child.start(
                "coordinator",
                cli_argv(
                    "coordinator",
                    "--router",
                    models["router"],
                    "--partition",
                    models["partition"],
                    "--nats",
                    srv.url,
                    "--wait-experts-s",
                    120,
                    "--metrics-port",
                    metrics_port,
                    *coordinator_config(args).to_argv(only=COORDINATOR_OPTIONS),
                ),
                env,
            )
            children.insert(0, coordinator)
            await coordinator.wait_ready(300)
            nc = await connect(
                srv.url,
                name="ddm-bench-clients",
                reconnect="forever",
                **client_connect_options(client_from_url(srv.url)),
            )
            pids = {c.name: c.pid for c in children}
            pids["nats-server"] = srv.proc.pid
            pids["bench (clients)"] = os.getpid()

            async def run_one(req):
                return await fleet_job(nc, req, args.job_timeout)

            def check_alive():
                dead = [c for c in children if not c.alive()]
                if dead:
                    raise RuntimeError(
                        "; ".join(
                            f"{c.name} exited with {c.proc.returncode} during the bench:\n{c.last_lines()}"
                            for c in dead
                        )
                    )

            warm = await _closed_loop(run_one, _requests(args, 1, "w"), args.jobs_per_client)
            if warm["completed"] != warm["submitted"]:
                check_alive()
                raise RuntimeError(f"the warm-up job did not complete: {warm}")
            start_memory = {name: proc_memory(pid) for name, pid in pids.items()}
            out = []
            for level, c in enumerate(args.concurrency_list):
                before = await _coordinator_counts(nc)
                hedges_before = await _hedge_counts(metrics_port)
                split_before = await asyncio.to_thread(_split_samples, metrics_port, worker_ports)
                reset = {name: reset_peak(pid) for name, pid in pids.items()}
                warned = {ch.name: ch.warnings for ch in children}
                varz0 = await asyncio.to_thread(nats_traffic.read_varz, srv.http_port, srv.host)
                load0, t0 = os.getloadavg()[0], time.monotonic()
                cpu0 = {name: cpu_seconds(pid) for name, pid in pids.items()}
                res = await _closed_loop(
                    run_one, _requests(args, c, f"f{level}-"), args.jobs_per_client, args.min_level_s
                )
                res["cpu"] = _cpu_used(cpu0, pids, time.monotonic() - t0)
                varz1 = await asyncio.to_thread(nats_traffic.read_varz, srv.http_port, srv.host)
                res["nats"] = nats_traffic.traffic(varz0, varz1, res["images"])
                res["load1"] = [round(load0, 2), round(os.getloadavg()[0], 2)]
                res["memory"] = {name: proc_memory(pid) for name, pid in pids.items()}
                res["peak_reset"] = all(reset.values())
                res["log_warnings"] = {
                    ch.name: {"count": ch.warnings - warned[ch.name], "last": ch.last_warning}
                    for ch in children
                    if ch.warnings > warned[ch.name]
                }
                check_alive()
                after = await _coordinator_counts(nc)
                if before is not None and after is not None:
                    res["coordinator"] = {
                        **{k: after[k] - before[k] for k in COUNTERS},
                        "active_jobs_after": after["active_jobs"],
                        "queued_jobs_after": after["queued_jobs"],
                    }
                else:
                    res["coordinator"] = None
                hedges_after = await _hedge_counts(metrics_port)
                split_after = await asyncio.to_thread(_split_samples, metrics_port, worker_ports)
                worker_deltas = [step_profile.delta(b, a) for b, a in zip(split_before[1], split_after[1])]
                res["worker_rows"] = cpu_account.worker_rows(worker_deltas, worker_experts)
                res["split_ms"] = step_profile.fleet_split(
                    step_profile.delta(split_before[0], split_after[0]),
                    step_profile.summed(worker_deltas),
                    _client_step_s(res, c, args.steps),
                )
                if hedges_before is not None and hedges_after is not None:
                    h = {k: hedges_after[k] - hedges_before[k] for k in hedges_after}
                    res["speculation"] = {
                        "rows_guessed": int(h.pop("guessed")),
                        "rows_guessed_unused": int(h.pop("guessed_unused")),
                    }
                    sent = h["won"] + h["lost"] + h["failed"]
                    res["hedges"] = {
                        **{k: int(v) for k, v in h.items()},
                        "sent": int(sent),
                        "rate": round(sent / h["requests"], 4) if h["requests"] else 0.0,
                    }
                out.append(res)
            return start_memory, out
        finally:
            if nc is not None:
                from bus.connect import drain_or_close

                await drain_or_close(nc)
            # coordinator first (its running jobs fail), then the workers
            for group in (children[:1], children[1:]):
                await asyncio.gather(*(c.stop() for c in group), return_exceptions=True)
    if store is not None:
        store.cleanup()


def resolve_bench_compile(args) -> str:
    """--compile decided once for the workers, the ceiling and the forward limit: "on" or "off"."""
    from workers.backends.torch_compile import resolve_compile

    if getattr(args, "backend", "torch") != "torch":
        return "off"
    on, _ = resolve_compile(getattr(args, "compile", "auto"), device=getattr(args, "device", None) or "cpu")
    return "on" if on else "off"


def bench_cohorts(args, experts: int) -> int | str:
    """--cohorts as given, except "auto" (the default): what `ddm-fleet up` starts on this host, 1 where the
    fleet's processes fill its CPU cores (`coordinator.cohorts.cohorts_on_shared_cores`: no accelerator for
    the workers, one worker per expert), else the coordinator's own auto."""
    from coordinator.cohorts import AUTO_COHORTS, cohorts_on_shared_cores
    from models.precision import host_has_accelerator

    if args.cohorts != AUTO_COHORTS:
        return args.cohorts
    per = getattr(args, "workers_per_expert", 1)
    device = getattr(args, "device", None)
    accelerator = host_has_accelerator() if device is None else not str(device).startswith("cpu")
    n = cohorts_on_shared_cores(per, experts * per, cores=os.cpu_count() or 1, accelerator=accelerator)
    return AUTO_COHORTS if n is None else n


async def bench_fleet(args) -> dict:
    import tempfile

    from models.precision import resolve_dtype

    if not hasattr(args, "concurrency_list"):
        check_args(args)
    # "auto" decided once, here: the workers, the ceiling and the forward limit compute in the same dtype
    args.dtype = resolve_dtype(args.dtype, backend=getattr(args, "backend", "torch"), device=args.device)
    args.compile = resolve_bench_compile(args)
    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="ddm-bench-fleet-") as tmp:
        models = _models(args, tmp)
        if args.threads is None:  # share the cores out among the worker processes
            args.threads = max(1, (os.cpu_count() or 1) // (models["k"] * getattr(args, "workers_per_expert", 1)))
        args.cohorts = bench_cohorts(args, models["k"])  # both paths: the fleet and the ceiling
        limit = _forward_limit(args, models)  # first: the machine is quiet, no fleet processes yet
        ceiling = await _ceiling(args, models) if args.only != "fleet" else None
        start_memory, fleet = await _fleet(args, models) if args.only != "ceiling" else (None, None)
    rows = []
    for level, c in enumerate(args.concurrency_list):  # one row per level (a concurrency may repeat)
        row = {"concurrency": c}
        if fleet:
            row["fleet"] = fleet[level]
            row["fleet"]["cpu_account"] = cpu_account.account(
                fleet[level]["cpu"]["seconds"],
                fleet[level]["images"],
                args.steps,
                fleet[level].get("worker_rows"),
                limit,
                fleet[level]["cpu"].get("wall_s"),
            )
        if ceiling:
            row["ceiling"] = ceiling[level]
        if fleet and ceiling:
            row["ratio"] = round(fleet[level]["images_per_s"] / max(ceiling[level]["images_per_s"], 1e-9), 3)
        if limit is not None:
            in_flight = c * args.images_per_job * limit["experts_per_row"] * limit.get("rows_per_eval", 1)
            at_load = limit_at_load(limit, in_flight, models["k"])
            row["limit_at_load"] = at_load
            for path in ("fleet", "ceiling"):
                if path in row:
                    row[f"{path}_over_limit"] = round(row[path]["images_per_s"] / max(limit["images_per_s"], 1e-9), 3)
                    row[f"{path}_over_limit_at_load"] = round(
                        row[path]["images_per_s"] / max(at_load["images_per_s"], 1e-9), 3
                    )
        rows.append(row)
    cfg = coordinator_config(args)
    setup = {
        "models": models["described"],
        "experts": models["k"],
        "steps": args.steps,
        "images_per_job": args.images_per_job,
        "jobs_per_client": args.jobs_per_client,
        "min_level_s": args.min_level_s,
        "strategy": args.strategy,
        "solver": args.solver,
        "guidance": getattr(args, "guidance", 1.0),
        "stream": not args.no_stream,
        "dtype": args.dtype,
        "compile": args.compile,
        "batch_quantum": getattr(args, "batch_quantum", 0),
        "backend": getattr(args, "backend", "torch"),
        "device": getattr(args, "device", None) or "default",
        "threads": args.threads,
        "cpus": os.cpu_count(),
        "max_rows": cfg.max_rows,
        "max_queued_jobs": cfg.max_queued_jobs,
        "job_timeout_s": args.job_timeout,
        "step_timeout_s": cfg.step_timeout,
        "retries": cfg.retries,
        "workers_per_expert": getattr(args, "workers_per_expert", 1),
        "wire_dtype": cfg.wire_dtype,
        "hedge": cfg.hedge,
        "cohorts": cfg.cohorts,
        "route_every": cfg.route_every,
        "speculate": "on" if cfg.speculate else "off",
        "run_ahead": cfg.run_ahead,
        "run_ahead_rows": cfg.run_ahead_rows,
        "early_update": "on" if cfg.early_update else "off",
        "durable": cfg.durable,
        "merge": getattr(args, "merge", "auto"),
        "load_avg_start": [round(v, 2) for v in load_start],
        "load_avg_end": [round(v, 2) for v in os.getloadavg()],
    }
    out = {"setup": setup, "rows": rows, "limit": limit}
    if start_memory is not None:
        out["fleet_memory_at_start"] = start_memory  # after start-up and one warm-up job
    return out


# ----------------------------------------------------------------------------- report


def _mib(b) -> str:
    return f"{b / 2**20:.0f}" if b is not None else "?"


def _codes(d: dict) -> str:
    return ",".join(f"{k}:{v}" for k, v in sorted(d.items())) if d else "-"


def _num(v, fmt: str, width: int) -> str:
    return f"{v:>{width}{fmt}}" if v is not None else f"{'-':>{width}}"


def _traffic_lines(rows: list[dict]) -> list[str]:
    """The fleet path's NATS traffic per image, a line per level (none without fleet levels)."""
    levels = [(r["concurrency"], r["fleet"]["nats"]) for r in rows if "nats" in r.get("fleet", {})]
    if not levels:
        return []
    return [
        "NATS per image (nats-server's /varz over each level: in = what the fleet's processes and the clients "
        "published, out = what it delivered; payload + headers):",
        *("  " + nats_traffic.format_traffic(c, t) for c, t in levels),
    ]


def format_table(results: dict) -> str:
    s = results["setup"]
    lines = [
        f"bench fleet: {s['models']}; {s['experts']} experts, {s['steps']} {s['solver']} steps, {s['strategy']}, "
        + (f"guidance {s['guidance']:g}, " if s.get("guidance", 1.0) != 1.0 else "")
        + f"{s['images_per_job']} image(s)/job, {s['jobs_per_client']} jobs/client"
        + (f" at least, levels of {s['min_level_s']:g} s at least" if s.get("min_level_s") else "")
        + f", stream={s['stream']}, "
        f"dtype={s.get('dtype') or ('bfloat16' if s.get('bf16') else 'float32')}, "
        f"{s.get('backend', 'torch')} on {s.get('device', 'default')}, {s['cpus']} cpus"
        + (", durable jobs" if s.get("durable") else "")
    ]
    if "max_rows" in s:
        lines.append(
            f"admission limits (coordinator process and ceiling): max_rows={s['max_rows']}, "
            f"max_queued_jobs={s['max_queued_jobs']}; coordinator step timeout {s['step_timeout_s']:g} s, "
            f"{s['retries']} retries; a job is LOST without images or a failure within "
            f"{s['job_timeout_s']:g} s; load avg at start {' '.join(map(str, s['load_avg_start']))}, "
            f"at end {' '.join(map(str, s['load_avg_end']))}"
        )
    lim = results.get("limit")
    lines.append(
        f"{'conc':>5} | {'fleet img/s':>11} {'p50 s':>7} {'p99 s':>7} {'jobs':>5} | {'ceil img/s':>10} {'p50 s':>7} "
        f"{'p99 s':>7} {'jobs':>5} | {'fleet/ceil':>10} {'fleet/lim':>9} {'ceil/lim':>8}"
    )
    for r in results["rows"]:
        f, c = r.get("fleet"), r.get("ceiling")
        fs = (
            f"{f['images_per_s']:>11.1f} {_num(f['p50_s'], '.3f', 7)} {_num(f['p99_s'], '.3f', 7)} "
            f"{_num(f.get('submitted'), 'd', 5)}"
            if f
            else f"{'-':>11} {'-':>7} {'-':>7} {'-':>5}"
        )
        cs = (
            f"{c['images_per_s']:>10.1f} {_num(c['p50_s'], '.3f', 7)} {_num(c['p99_s'], '.3f', 7)} "
            f"{_num(c.get('submitted'), 'd', 5)}"
            if c
            else f"{'-':>10} {'-':>7} {'-':>7} {'-':>5}"
        )
        ratios = (
            f"{_num(r.get('ratio'), '.2f', 10)} {_num(r.get('fleet_over_limit'), '.2f', 9)} "
            f"{_num(r.get('ceiling_over_limit'), '.2f', 8)}"
        )
        lines.append(f"{r['concurrency']:>5} | {fs} | {cs} | {ratios}")
    if lim:
        per = ", ".join(
            f"expert{i} {e['rows_per_s']:,.0f} rows/s at batch {e['best_batch']}" for i, e in enumerate(lim["experts"])
        )
        how = f"one thread per core x {lim['units']} cores" if lim["unit"] == "core" else "one process on the device"
        lines.append(
            f"forward-only limit {lim['images_per_s']:.1f} img/s = {lim['rows_per_s']:,.0f} rows/s / "
            f"{lim['rows_per_image']} rows per image ({s['steps']} steps x {lim['evals_per_step']} evaluation(s) "
            f"x {lim['experts_per_row']} expert(s) per row"
            + (
                f" x {lim['rows_per_eval']} forward rows per evaluation (guided: the label's and the null label's)"
                if lim.get("rows_per_eval", 1) != 1
                else ""
            )
            + "); rows/s: the experts' own forward in this process at "
            f"their best batch of {','.join(map(str, lim['batches']))} ({per}), {how}, experts averaged by time "
            "per row"
            + (f" (load1 {lim['load1'][0]}>{lim['load1'][1]} while timed)" if lim.get("load1") else "")
            + ". jobs = jobs the clients ran in the level"
        )
        at_load = [r for r in results["rows"] if r.get("limit_at_load")]
        if at_load:
            lines.append(
                "the limit at each level's load (no expert call can hold more than clients x images per job x "
                "forward rows per evaluation x experts per row / experts rows; each expert's forward read at that "
                "batch): "
                + "; ".join(
                    f"conc {r['concurrency']}: batch {r['limit_at_load']['batch']:g}, "
                    f"{r['limit_at_load']['images_per_s']:.1f} img/s"
                    + "".join(
                        f", {path}/that {r[f'{path}_over_limit_at_load']:.2f}"
                        for path in ("fleet", "ceiling")
                        if f"{path}_over_limit_at_load" in r
                    )
                    for r in at_load
                )
            )
    accounts = [
        (r["concurrency"], r["fleet"]["cpu_account"]) for r in results["rows"] if "cpu_account" in r.get("fleet", {})
    ]
    if accounts:
        lines.append(
            "CPU per image (user + system seconds of the fleet's processes / images made; forward = the experts' "
            "own forward CPU for the rows the workers computed, at their mean batch; overhead = fleet / forward):"
        )
        lines.extend("  " + cpu_account.format_account(c, acc) for c, acc in accounts)
    lines += _traffic_lines(results["rows"])
    outcome_rows = [
        (path, r["concurrency"], r[path])
        for r in results["rows"]
        for path in ("fleet", "ceiling")
        if path in r and "submitted" in r[path]
    ]
    if outcome_rows:
        lines.append(
            "jobs per level (codes as the clients got them; answer = submit -> accepted/rejected; coord = the "
            "coordinator process's own counters for the level, and jobs it still held after it):"
        )
        lines.append(
            f"{'path':<7} {'conc':>5} | {'submitted':>9} {'completed':>9} {'rejected':>8} {'failed':>6} "
            f"{'LOST':>4} | {'rejected codes':<16} {'failed codes':<14} | {'answer p99 s':>12} | "
            f"{'coord rej':>9} {'done':>5} {'left':>4} | load1 before>after"
        )
        for path, conc, x in outcome_rows:
            co = x.get("coordinator")
            cs = (
                f"{co['jobs_rejected']:>9} {co['jobs_done']:>5} {co['active_jobs_after'] + co['queued_jobs_after']:>4}"
                if co
                else f"{'-':>9} {'-':>5} {'-':>4}"
            )
            load = f"{x['load1'][0]}>{x['load1'][1]}" if "load1" in x else "-"
            lines.append(
                f"{path:<7} {conc:>5} | {x['submitted']:>9} {x['completed']:>9} {x['rejected']:>8} "
                f"{x['failed']:>6} {x['lost']:>4} | {_codes(x['rejected_codes']):<16} "
                f"{_codes(x['failed_codes']):<14} | {_num(x.get('answer_p99_s'), '.3f', 12)} | {cs} | {load}"
            )
    for r in results["rows"]:
        h = r.get("fleet", {}).get("hedges")
        if h:
            lines.append(
                f"  conc {r['concurrency']}: {h['requests']} expert requests, {h['sent']} hedged "
                f"({100 * h['rate']:.2f}%: won {h['won']}, lost {h['lost']}, failed {h['failed']}); "
                f"wire {s.get('wire_dtype', 'float32')}, {s.get('workers_per_expert', 1)} worker(s)/expert, "
                f"merge {s.get('merge', 'auto')}, cohorts {s.get('cohorts', 'auto')}, "
                f"early update {s.get('early_update', 'off')}, "
                f"speculate {s.get('speculate', 'on')}"
                + (
                    ""
                    if not (g := r["fleet"].get("speculation"))
                    else f" ({g['rows_guessed']} rows guessed, {g['rows_guessed_unused']} unused)"
                )
                + f", run ahead {s.get('run_ahead', 0)}"
            )
    for r in results["rows"]:
        lines += step_profile.format_split(
            r["concurrency"], r.get("fleet", {}).get("split_ms"), r.get("ceiling", {}).get("split_ms")
        )
    for r in results["rows"]:
        for name, w in r.get("fleet", {}).get("log_warnings", {}).items():
            lines.append(
                f"  conc {r['concurrency']}: {name} logged {w['count']} warning/error line(s), last: {w['last']}"
            )
    cpu_rows = [
        (path, r["concurrency"], r[path]["cpu"])
        for r in results["rows"]
        for path in ("fleet", "ceiling")
        if r.get(path, {}).get("cpu")
    ]
    if cpu_rows:
        lines.append(
            f"CPU seconds per process over each level (in cores: CPU s / wall s; this box has "
            f"{s.get('cpus', '?')}), and CPU s per image:"
        )
        for path, conc, cpu in cpu_rows:
            done = next(r for r in results["rows"] if r["concurrency"] == conc)[path].get("completed") or 0
            secs = {n: v for n, v in cpu["seconds"].items() if v is not None}
            total = sum(secs.values())
            cells = ", ".join(f"{n} {v:.1f} ({v / max(cpu['wall_s'], 1e-9):.2f})" for n, v in secs.items())
            per = f"{total / done:.3f}" if done else "-"
            lines.append(
                f"  {path:<7} conc {conc}: {cells}; total {total:.1f} s = "
                f"{total / max(cpu['wall_s'], 1e-9):.2f} cores over {cpu['wall_s']:.1f} s; {per} CPU s/image"
            )
    mem_rows = [(str(r["concurrency"]), r["fleet"]) for r in results["rows"] if "memory" in r.get("fleet", {})]
    if mem_rows:
        scope = "reset before each level" if all(x.get("peak_reset") for _, x in mem_rows) else "since process start"
        if results.get("fleet_memory_at_start"):
            mem_rows.insert(0, ("start", {"memory": results["fleet_memory_at_start"]}))
        names = list(mem_rows[-1][1]["memory"])
        lines.append(
            f"fleet RSS MiB per process: peak over the level (VmHWM, {scope}) / at the level's end (VmRSS); "
            "start = after start-up and the warm-up jobs"
            + (
                "; the bench process still holds the ceiling's models (that path ran first)"
                if any("ceiling" in r for r in results["rows"])
                else ""
            )
            + ":"
        )
        width = max(13, *(len(n) for n in names))
        lines.append(f"{'conc':>5} | " + " | ".join(f"{n:>{width}}" for n in names))
        for conc, x in mem_rows:
            cells = []
            for n in names:
                m = x["memory"].get(n)
                cells.append(f"{(_mib(m['peak']) + ' / ' + _mib(m['rss'])) if m else 'gone':>{width}}")
            lines.append(f"{conc:>5} | " + " | ".join(cells))
    return "\n".join(lines)
