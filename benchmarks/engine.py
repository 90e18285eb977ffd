"""The coordinator's engine alone, in this process: rows/s and CPU per 1000 rows without NATS.

What one coordinator process can do is bounded by its engine: the scheduler, the router, the
Euler update and the events it makes. This bench runs exactly that engine (`coordinator.engine.Engine`
with the real `Scheduler` and the router from --checkpoints) against experts that answer at once in
this process (v = -x: no model, no wire), keeps --jobs jobs in the system (a finished job is replaced
at once), and packs every event with `schemas.pack` as the service does before publishing it. It
prints, over --duration seconds after --warmup:

* rows/s: row evaluations applied (`Scheduler.stats.row_evals`);
* CPU s per 1000 rows: this process's CPU time (all threads: the event loop and the router's thread);
* router share: the part of that spent in `Router.weights` (its thread's CPU time);
* the kernel's share of the CPU and minor page faults per 1000 rows (what glibc's malloc costs when
  it hands torch's freed activations back to the kernel: compare with DDM_FLEET_MALLOC_TUNING=0,
  infra/heap.py);
* events/s and MB/s of packed events (frames dominate with streamed 1-image jobs);
* ticks/s and the median tick.

Against `ddm-fleet bench scale --coordinator-capacity`, which runs a coordinator process, sim workers,
nats-server and streaming clients on the same cores, this isolates the engine's own cost: the
difference is what NATS publishing and the other processes take. Compare settings (--cohorts,
--route-every) or commits in one sitting; the absolute figures move with the box's load.

examples:
  ddm-fleet bench engine                                   # shipped router, 512 streamed 1-image 40-step jobs
  ddm-fleet bench engine --route-every 4 --duration 15
  ddm-fleet bench engine --cohorts 3 --jobs 1024 --json
"""

from __future__ import annotations

import argparse
import os
import resource
import threading
import time

from .options import add_engine_options, add_router_option, require_at_least_one, router_path
from .processes import run_bench


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--jobs", type=int, default=512, metavar="N", help="jobs kept in the system (default %(default)s)"
    )
    parser.add_argument(
        "--images-per-job", type=int, default=1, metavar="N", help="images per job (default %(default)s)"
    )
    parser.add_argument("--steps", type=int, default=40, help="solver steps per job (default %(default)s)")
    parser.add_argument(
        "--strategy",
        choices=("top1", "topk", "full", "oracle"),
        default="top1",
        help="expert routing of every job (default %(default)s)",
    )
    parser.add_argument("--no-stream", action="store_true", help="jobs without frames (only their final images)")
    add_engine_options(parser, "2 here, the experts being in-process")
    parser.add_argument(
        "--checkpoints",
        default="checkpoints",
        metavar="DIR",
        help="router.safetensors and partition.json from here (default %(default)s)",
    )
    add_router_option(parser)
    parser.add_argument(
        "--duration", type=float, default=8.0, metavar="S", help="seconds measured (default %(default)s)"
    )
    parser.add_argument(
        "--warmup",
        type=float,
        default=3.0,
        metavar="S",
        help="seconds of load before the measured ones (default %(default)s)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--json", action="store_true", help="print the results as JSON instead of a table")


def check_args(args: argparse.Namespace) -> None:
    require_at_least_one(args, ("jobs", "images_per_job", "steps", "route_every"))
    if not args.duration > 0 or not args.warmup >= 0:
        raise ValueError("--duration must be > 0 and --warmup >= 0")
    for path in (router_path(args), os.path.join(args.checkpoints, "partition.json")):
        if not os.path.exists(path):
            raise ValueError(f"{path} does not exist (--checkpoints names the folder with the router and partition)")


class InstantExperts:
    """Experts that answer at once in this process, v = -x (no model, no wire)."""

    async def velocity(self, k, x, t, y, row_ids):
        return -x


class TimedRouter:
    """The router, with the CPU time its calls take (thread time of the calling threads). `cpu_now()` includes
    the part of a call still running, so a window's reading never takes in a call that began before it."""

    def __init__(self, router):
        self.router = router
        self.num_experts = getattr(router, "num_experts", None)
        self.arch = getattr(router, "arch", None)  # the wrapped router's (coordinator.service.router_arch)
        self.cpu_s = 0.0  # finished calls
        self._open: dict[int, float] = {}  # thread id -> its CPU clock when its running call began
        self._lock = threading.Lock()

    def weights(self, x, t, y):
        tid, c0 = threading.get_ident(), time.thread_time()
        with self._lock:
            self._open[tid] = c0
        try:
            return self.router.weights(x, t, y)
        finally:
            used = time.thread_time() - c0
            with self._lock:
                self.cpu_s += used
                self._open.pop(tid, None)

    def cpu_now(self) -> float:
        """CPU seconds of every call so far, the running ones up to now."""
        with self._lock:
            total = self.cpu_s
            for tid, c0 in self._open.items():
                try:
                    total += time.clock_gettime(time.pthread_getcpuclockid(tid)) - c0
                except (OSError, ValueError):  # the thread ended between its call's end and now
                    pass
        return total


async def bench(args: argparse.Namespace) -> dict:
    import asyncio

    import numpy as np

    from client.labels import job_labels
    from coordinator.engine import Engine
    from coordinator.scheduler import Scheduler, SchedulerConfig
    from coordinator.service import load_router_and_partition, router_spec
    from schemas import JobRequest, pack

    from .scale import Progress

    router, k, c2e = load_router_and_partition(router_path(args), os.path.join(args.checkpoints, "partition.json"))
    spec = router_spec(router_path(args))  # the fleet's sample shape and class count
    timed = TimedRouter(router)
    n_rows = args.jobs * args.images_per_job
    sched = Scheduler(
        SchedulerConfig(
            num_experts=k,
            class_to_expert=c2e,
            max_rows=max(1024, n_rows),
            max_queued_jobs=max(1024, 2 * args.jobs),
            image_shape=tuple(spec.sample_shape),
            num_classes=len(c2e),
        )
    )
    packed = {"events": 0, "bytes": 0}

    def emit(ev):
        packed["events"] += 1
        packed["bytes"] += len(pack(ev))

    engine = Engine(
        sched,
        timed,
        InstantExperts(),
        emit,
        cohorts=args.cohorts,
        route_every=args.route_every,
        speculate=args.speculate,
        early_update=args.early_update,
    )
    task = asyncio.create_task(engine.run())
    rng = np.random.default_rng(0)
    submitted = 0

    def top_up() -> None:
        nonlocal submitted
        while sched.active_jobs + sched.queued_jobs < args.jobs:
            labels = [int(d) for d in rng.integers(0, len(c2e), size=args.images_per_job)]
            engine.submit(
                JobRequest(
                    job_id=f"engine-bench-{submitted}",
                    **job_labels(spec, labels),
                    steps=args.steps,
                    seed=submitted,
                    strategy=args.strategy,
                    stream=not args.no_stream,
                )
            )
            submitted += 1

    def snapshot() -> dict:
        use = resource.getrusage(resource.RUSAGE_SELF)
        return {
            "t": time.perf_counter(),
            "cpu": time.process_time(),
            "sys": use.ru_stime,
            "faults": use.ru_minflt,
            "rows": sched.stats.row_evals,
            "ticks": sched.stats.ticks,
            "router": timed.cpu_now(),
            **packed,
        }

    progress = Progress(args.warmup + args.duration, not args.no_progress, desc="bench engine")
    try:
        top_up()
        start = time.perf_counter()
        while (now := time.perf_counter()) - start < args.warmup:
            await asyncio.sleep(0.02)
            top_up()
            progress.advance(now - start, phase="warm-up")
        a = snapshot()
        engine.tick_ms.clear()
        while (now := time.perf_counter()) - a["t"] < args.duration:
            await asyncio.sleep(0.02)
            top_up()
            if task.done():
                break
            if now - a["t"] >= 0.5:
                progress.advance(
                    args.warmup + now - a["t"], rows_s=f"{(sched.stats.row_evals - a['rows']) / (now - a['t']):,.0f}"
                )
        b = snapshot()
        ticks_ms = list(engine.tick_ms)
    finally:
        progress.close()
        await engine.stop()
        try:
            await asyncio.wait_for(task, 30)
        except Exception as err:  # a dead engine is reported below, not hidden
            if not isinstance(err, asyncio.CancelledError):
                raise RuntimeError(f"the engine stopped with {type(err).__name__}: {err}") from None
    if engine.dead:
        raise RuntimeError(engine.dead)
    window = b["t"] - a["t"]
    rows = b["rows"] - a["rows"]
    if rows <= 0:
        raise RuntimeError("no rows were stepped in the window")
    cpu, router_cpu = b["cpu"] - a["cpu"], b["router"] - a["router"]
    return {
        "setup": {
            "router": router_path(args),
            "experts": k,
            "jobs": args.jobs,
            "images_per_job": args.images_per_job,
            "steps": args.steps,
            "strategy": args.strategy,
            "stream": not args.no_stream,
            "cohorts": args.cohorts,
            "route_every": args.route_every,
            "speculate": "on" if args.speculate else "off",
            "duration_s": args.duration,
            "warmup_s": args.warmup,
            "cpus": os.cpu_count(),
            "load_avg": list(os.getloadavg()),
        },
        "window_s": round(window, 3),
        "rows_per_s": round(rows / window, 1),
        "cpu_s_per_1000_rows": round(1000 * cpu / rows, 4),
        "cpu_share": round(cpu / window, 3),
        "kernel_share_of_cpu": round((b["sys"] - a["sys"]) / cpu, 3) if cpu > 0 else None,
        "page_faults_per_1000_rows": round(1000 * (b["faults"] - a["faults"]) / rows, 1),
        "router_cpu_s_per_1000_rows": round(1000 * router_cpu / rows, 4),
        "router_share_of_cpu": round(router_cpu / cpu, 3) if cpu > 0 else None,
        "rows_routed": engine.rows_routed,
        "rows_guessed": engine.rows_guessed,  # over the whole run, warm-up included
        "rows_guessed_unused": engine.rows_guessed_unused,
        "events_per_s": round((b["events"] - a["events"]) / window, 1),
        "event_mb_per_s": round((b["bytes"] - a["bytes"]) / window / 1e6, 2),
        "ticks_per_s": round((b["ticks"] - a["ticks"]) / window, 1),
        "tick_ms_p50": round(float(np.median(ticks_ms)), 2) if ticks_ms else None,
        "cohorts_used": engine.cohorts_now(),
    }


def format_table(r: dict) -> str:
    s = r["setup"]
    return "\n".join(
        [
            f"bench engine: {s['experts']} experts, {s['router']}; {s['jobs']} jobs of {s['images_per_job']} image(s), "
            f"{s['steps']} steps, {s['strategy']}, stream={s['stream']}, cohorts={s['cohorts']} "
            f"({r['cohorts_used']} used), route-every {s['route_every']}, speculate {s.get('speculate', 'on')}; "
            "instant in-process experts; "
            f"{s['cpus']} cpus, load avg {' '.join(f'{v:.2f}' for v in s['load_avg'])}",
            f"rows/s {r['rows_per_s']:,.0f} over {r['window_s']:.1f} s  |  "
            f"CPU {r['cpu_s_per_1000_rows']:.3f} s per 1000 rows "
            f"({100 * r['cpu_share']:.0f}% of a core), the router {r['router_cpu_s_per_1000_rows']:.3f} s "
            f"({100 * (r['router_share_of_cpu'] or 0):.0f}% of it); "
            f"in the kernel {100 * (r.get('kernel_share_of_cpu') or 0):.0f}%, "
            f"{r.get('page_faults_per_1000_rows', 0):,.0f} page faults per 1000 rows",
            f"events {r['events_per_s']:,.0f}/s ({r['event_mb_per_s']:.1f} MB/s packed)  |  "
            f"ticks {r['ticks_per_s']:.1f}/s, "
            f"median tick {r['tick_ms_p50']} ms  |  rows guessed {r.get('rows_guessed', 0):,} "
            f"({r.get('rows_guessed_unused', 0):,} unused)",
        ]
    )


def run(args: argparse.Namespace) -> int:
    return run_bench("engine", args, check_args, bench, format_table)
