"""Fleet rows/s as sim workers and coordinators are added, against what they could do at most.

For each number of simulated workers per expert in --workers (W) and of coordinators in
--coordinators (C), the bench runs a real fleet on this machine: a private nats-server,
W `ddm-fleet worker --backend sim` processes per expert (one queue group per expert), C
`ddm-fleet coordinator` processes (one submit queue group: they share the jobs), and closed-loop
clients in this process. A sim worker does all the wire work of a real one (decode, validate,
batch, pad, encode) but its "forward pass" is a latency model: batch_ms + row_ms * rows. Each
worker gets `--max-batch R` (R = --request-rows, also the coordinator's `--request-rows`), so a
forward is at most R rows and one worker's capacity is exactly

    capacity(R) = R / (batch_ms + row_ms * R) * 1000  rows/s        (full R-row batches)

The clients keep `jobs` jobs running at all times (each finished job is replaced at once):

    jobs = ceil(K * W * R * (1 + queued) / images_per_job)

(K experts, queued = --queued-per-worker, default 2), i.e. enough rows for every worker to hold
one R-row request in its forward pass and `queued` more waiting, with top1 routing spreading the
rows evenly over the experts. After --warmup seconds, --duration seconds are measured:

* fleet rows/s: row evaluations applied, from each coordinator's /metrics
  (ddm_coordinator_rows_stepped_total deltas, summed over the coordinators);
* capacity: W * K * capacity(R), the most the workers could give;
* efficiency: fleet rows/s / min(capacity, C x the coordinator capacity when --coordinator-capacity
  measured it in the same run);
* coordinator CPU seconds per 1000 rows (utime + stime from /proc/<pid>/stat, summed over the
  coordinators), its minor page faults per 1000 rows (same file; thousands mean malloc is handing
  the router's freed activations back to the kernel, see infra/heap.py) and its peak RSS (VmHWM,
  reset at the start of the window via clear_refs);
* images/s and p50 / p99 job latency (submit -> final images) of the jobs finished in the window;
* the clients' (this process's) CPU share and the load average, since on a shared machine the
  clients, the workers, nats-server and the coordinators all compete for the same cores; the
  share of the machine's CPUs left idle (/proc/stat; `box_idle_share` in --json), and for the
  capacity level a line of where the CPU went: each kind of process's share of a core and CPU
  seconds per 1000 rows, and their sum (what one more row costs the whole machine).

--coordinator-capacity adds a first level that measures one coordinator process on its own:
instant sim workers (no latency), one coordinator, --capacity-jobs 1-image jobs of 40 steps with
frames streamed; its rows/s is what one coordinator process sustains on this machine (the issue's
target: >= 10,000 rows/s on the serving box). Levels of the scan are then also compared with it.

The router and partition are checkpoints/router.safetensors and checkpoints/partition.json when
present (--checkpoints), else a random tiny router and a 0-4 | 5-9 class partition; the sim
workers get tiny random checkpoints (the sim backend takes only shapes and the expert id from them).

examples:
  ddm-fleet bench scale                                          # workers 1,2,4,8 per expert, 1 coordinator
  ddm-fleet bench scale --coordinator-capacity --workers 1,2,4,8 --coordinators 1,2
  ddm-fleet bench scale --coordinator-capacity --workers none    # only the coordinator's own capacity
  ddm-fleet bench scale --workers 2,4 --sim-batch-ms 5 --sim-row-ms 0.01 --request-rows 64 --duration 30
  ddm-fleet bench scale --workers 1,2 --duration 3 --warmup 2 --no-stream --json
"""

from __future__ import annotations

import argparse
import math
import os

from workers.config import SIM_PRESETS  # the sim latency presets `--sim-preset` accepts

from .options import (
    ENGINE_OPTIONS,
    add_router_option,
    announce_defaults,
    coordinator_config,
    positive_ints,
    require_at_least_one,
    router_path,
)
from .processes import (
    Child,
    box_cpu,
    cli_argv,
    cpu_seconds,
    idle_share,
    page_faults,
    proc_memory,
    reset_peak,
    run_bench,
)

#: The default latency model: "GPU-like" (a large fixed cost per forward, a small one per row), but slow
#: enough that 16 workers (8 per expert, 2 experts) stay under one coordinator on a 2-core box.
DEFAULT_BATCH_MS = 250.0
DEFAULT_ROW_MS = 0.2
DEFAULT_REQUEST_ROWS = 32
#: Requests waiting at each worker beyond the one in its forward pass.
DEFAULT_QUEUED = 2

#: The `ddm-fleet coordinator` settings this bench passes to its coordinators (--request-rows is also
#: the sim workers' --max-batch), and the default it changes: small requests, so that a few requests
#: queue at every worker of a small box.
COORDINATOR_OPTIONS = ("request_rows", *ENGINE_OPTIONS, "hedge", "dispatch")
COORDINATOR_DEFAULTS = {"request_rows": DEFAULT_REQUEST_ROWS}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from coordinator.config import CoordinatorConfig

    parser.add_argument(
        "--workers",
        default="1,2,4,8",
        metavar="W,W,...",
        help="sim workers per expert to measure (default %(default)s; 'none': no scan, e.g. with "
        "--coordinator-capacity alone)",
    )
    parser.add_argument(
        "--coordinators",
        default="1",
        metavar="C,C,...",
        help="coordinator processes sharing the submit queue group (default %(default)s; e.g. 1,2)",
    )
    # --request-rows (also the workers' --max-batch), --cohorts, --route-every, --speculate, --hedge, --dispatch
    CoordinatorConfig.add_arguments(parser, only=COORDINATOR_OPTIONS, defaults=COORDINATOR_DEFAULTS)
    parser.add_argument(
        "--sim-preset",
        choices=SIM_PRESETS,
        default=None,
        help="sim latency preset instead of the default model (h200-torch: 3.33 ms + 0.00575 ms/row, "
        "h200-jax: 2.20 ms + 0.0165 ms/row, instant: 0 + 0)",
    )
    parser.add_argument(
        "--sim-batch-ms",
        type=float,
        default=None,
        metavar="MS",
        help=f"fixed milliseconds per forward (default {DEFAULT_BATCH_MS:g}, or the preset's)",
    )
    parser.add_argument(
        "--sim-row-ms",
        type=float,
        default=None,
        metavar="MS",
        help=f"milliseconds per padded row (default {DEFAULT_ROW_MS:g}, or the preset's)",
    )
    parser.add_argument(
        "--queued-per-worker",
        type=int,
        default=DEFAULT_QUEUED,
        metavar="N",
        help="requests kept waiting at each worker beyond the one it runs; sets the number of "
        "concurrent jobs (default %(default)s)",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=None,
        metavar="N",
        help="concurrent jobs at every level instead of the derived number",
    )
    parser.add_argument("--images-per-job", type=int, default=1, metavar="N", help="images per job (default 1)")
    parser.add_argument("--steps", type=int, default=40, help="solver steps per job (default %(default)s)")
    parser.add_argument(
        "--strategy",
        choices=("top1", "topk", "full", "oracle"),
        default="top1",
        help="combination strategy (default top1: one expert evaluation per row and step)",
    )
    parser.add_argument("--no-stream", action="store_true", help="jobs do not stream frames (only final images)")
    parser.add_argument(
        "--duration", type=float, default=30.0, metavar="S", help="measured seconds per level (default %(default)s)"
    )
    parser.add_argument(
        "--warmup",
        type=float,
        default=10.0,
        metavar="S",
        help="seconds of load before each level's window (default %(default)s)",
    )
    parser.add_argument(
        "--coordinator-capacity",
        action="store_true",
        help="first measure one coordinator alone: instant sim workers, 1-image jobs of 40 steps, frames streamed",
    )
    parser.add_argument(
        "--capacity-jobs",
        type=int,
        default=512,
        metavar="N",
        help="concurrent jobs of the --coordinator-capacity level (default %(default)s)",
    )
    parser.add_argument(
        "--capacity-request-rows",
        type=int,
        default=512,
        metavar="N",
        help="--request-rows of the --coordinator-capacity level (default %(default)s, the "
        "coordinator's default; one instant worker per expert)",
    )
    parser.add_argument(
        "--checkpoints",
        default="checkpoints",
        metavar="DIR",
        help="router.safetensors and partition.json for the coordinators (default %(default)s; "
        "a random tiny router when absent)",
    )
    add_router_option(parser)
    parser.add_argument(
        "--job-timeout",
        type=float,
        default=300.0,
        metavar="S",
        help="a job with neither images nor a failure after S seconds counts as lost (default %(default)s)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    parser.add_argument("--json", action="store_true", help="print the results as JSON instead of a table")


def latency_model(args: argparse.Namespace) -> tuple[str, float, float]:
    """(name, batch_ms, row_ms) of the sim workers of the scan, from --sim-preset / -batch-ms / -row-ms."""
    presets = {"h200-torch": (3.33, 0.00575), "h200-jax": (2.20, 0.0165), "instant": (0.0, 0.0)}
    if args.sim_preset:
        name, (batch, row) = args.sim_preset, presets[args.sim_preset]
    else:
        name, batch, row = "default", DEFAULT_BATCH_MS, DEFAULT_ROW_MS
    if args.sim_batch_ms is not None or args.sim_row_ms is not None:
        name = "custom"
    batch = batch if args.sim_batch_ms is None else args.sim_batch_ms
    row = row if args.sim_row_ms is None else args.sim_row_ms
    return name, float(batch), float(row)


def worker_capacity(batch_ms: float, row_ms: float, rows: int) -> float:
    """Rows/s of one sim worker running full `rows`-row forwards back to back (inf for instant)."""
    ms = batch_ms + row_ms * rows
    return math.inf if ms <= 0 else rows * 1000.0 / ms


def derive_jobs(experts: int, workers: int, request_rows: int, images_per_job: int, queued: int) -> int:
    """Concurrent jobs that give every worker one full request running and `queued` waiting:
    ceil(experts * workers * request_rows * (1 + queued) / images_per_job)."""
    return -(-experts * workers * request_rows * (1 + queued) // images_per_job)


def check_args(args: argparse.Namespace) -> None:
    """Raise ValueError naming the first bad option; sets args.workers_list, args.coordinators_list."""
    args.workers_list = positive_ints(args.workers, "--workers", allow_none=True)
    args.coordinators_list = positive_ints(args.coordinators, "--coordinators")
    if not args.workers_list and not args.coordinator_capacity:
        raise ValueError("nothing to measure: give --workers or --coordinator-capacity")
    require_at_least_one(args, ("images_per_job", "steps", "capacity_jobs", "capacity_request_rows"))
    if args.capacity_request_rows > 512:
        raise ValueError("--capacity-request-rows must be <= 512 (the protocol's most rows per request)")
    coordinator_config(args)  # the coordinators' settings: ValueError naming the flag
    if args.queued_per_worker < 0:
        raise ValueError("--queued-per-worker must be >= 0")
    if args.jobs is not None and args.jobs < 1:
        raise ValueError("--jobs must be >= 1")
    if not args.duration > 0 or args.warmup < 0 or not args.job_timeout > 0:
        raise ValueError("--duration and --job-timeout must be > 0 seconds, --warmup >= 0")
    router_path(args)  # --router, when given, must exist
    _, batch, row = latency_model(args)
    for label, v in (("--sim-batch-ms", batch), ("--sim-row-ms", row)):
        if not math.isfinite(v) or v < 0:
            raise ValueError(f"{label} must be a finite number >= 0, got {v}")


def run(args: argparse.Namespace) -> int:
    announce_defaults(args, COORDINATOR_DEFAULTS)
    return run_bench("scale", args, check_args, bench_scale, format_table)


# ----------------------------------------------------------------------------- models and processes


def _models(args, tmpdir: str) -> dict:
    """Router and partition for the coordinators, one tiny checkpoint per expert for the sim workers."""
    from coordinator.startup import router_spec
    from dataset.partition import load_manifest
    from models.tiny import make_tiny_experts

    router = router_path(args)
    partition = os.path.join(args.checkpoints, "partition.json")
    if args.router is not None and not os.path.exists(partition):
        raise ValueError(f"--router needs the partition it was trained with: {partition} does not exist")
    if os.path.exists(router) and os.path.exists(partition):
        k = load_manifest(partition).num_experts
        described = (
            f"router and partition from {args.checkpoints}/"
            if args.router is None
            else f"router {router}, partition from {args.checkpoints}/"
        )
    else:
        import numpy as np

        from dataset.partition import partition_by_classes, save_manifest
        from models.tiny import make_tiny_router

        k = 2
        router = str(
            make_tiny_router(
                os.path.join(tmpdir, "router"),
                k,
                seed=2,
                meta={"note": "random, untrained: for `bench scale` without checkpoints"},
            )
        )
        partition = str(
            save_manifest(
                partition_by_classes(np.arange(10), [list(range(5)), list(range(5, 10))]),
                os.path.join(tmpdir, "partition.json"),
            )
        )
        described = "random tiny router, classes 0-4 | 5-9"
    # the sim workers serve the router's sample shape and class count (the sim backend reads them from here)
    spec = router_spec(router)
    c, size, _ = spec.sample_shape
    shape = {"in_channels": c, "image_size": size, "num_classes": max(1, spec.num_classes)}
    experts = [
        str(p) for p in make_tiny_experts(os.path.join(tmpdir, "sim"), k, split_classes=spec.num_classes == 10, **shape)
    ]
    return {"router": str(router), "partition": str(partition), "k": k, "experts": experts, "described": described}


def _buckets(rows: int) -> str:
    """Powers of two below `rows`, and `rows`: every forward pads to at most `rows`."""
    out, b = [], 1
    while b < rows:
        out.append(b)
        b *= 2
    return ",".join(map(str, out + [rows]))


class Fleet:
    """The processes of the bench on one private nats-server: sim workers per expert, coordinators."""

    def __init__(self, url: str, models: dict):
        self.url = url
        self.models = models
        self.workers: list[list[Child]] = [[] for _ in range(models["k"])]
        self.coordinators: list[Child] = []
        self.metrics_ports: list[int] = []
        self.worker_setup: tuple | None = None
        self.nats_pid: int | None = None

    def children(self) -> list[Child]:
        return [*self.coordinators, *(w for ws in self.workers for w in ws)]

    async def set_workers(self, per_expert: int, sim: tuple[float, float], request_rows: int) -> None:
        """Exactly `per_expert` sim workers per expert with latency `sim` (batch_ms, row_ms) and
        --max-batch request_rows; workers of another setting are replaced."""
        import asyncio

        setup = (sim, request_rows)
        if setup != self.worker_setup:
            await self._stop([w for ws in self.workers for w in ws])
            self.workers = [[] for _ in self.workers]
            self.worker_setup = setup
        started: list[Child] = []
        extra: list[Child] = []
        for k, ws in enumerate(self.workers):
            while len(ws) > per_expert:
                extra.append(ws.pop())
            while len(ws) < per_expert:
                cmd = cli_argv(
                    "worker",
                    "--expert",
                    k,
                    "--checkpoint",
                    self.models["experts"][k],
                    "--nats",
                    self.url,
                    "--backend",
                    "sim",
                    "--sim-batch-ms",
                    sim[0],
                    "--sim-row-ms",
                    sim[1],
                    "--buckets",
                    _buckets(request_rows),
                    "--max-batch",
                    request_rows,
                    "--max-queue-rows",
                    65536,
                    "--max-inflight",
                    65536,
                )
                child = await Child.start(f"worker{k}.{len(ws)}", cmd)
                ws.append(child)
                started.append(child)
        await self._stop(extra)
        await asyncio.gather(*(c.wait_ready(300) for c in started))

    async def set_coordinators(self, n: int, args, request_rows: int, max_rows: int) -> None:
        """Start `n` coordinators (after stopping the ones running) with these limits."""
        import asyncio

        from bus.nats_server import free_port

        await self._stop(self.coordinators)
        self.coordinators, self.metrics_ports = [], []
        for i in range(n):
            port = free_port()
            cfg = coordinator_config(args).replace(
                name=f"scale-coord-{i}",
                request_rows=request_rows,
                max_rows=max_rows,
                max_queued_jobs=max(256, max_rows),
                max_client_queued_jobs=max(64, max_rows),
                max_client_rows=max_rows,  # the clients share one NATS client
                submit_rate=None,
                status_rate=None,
            )
            cmd = cli_argv(
                "coordinator",
                "--router",
                self.models["router"],
                "--partition",
                self.models["partition"],
                "--nats",
                self.url,
                "--metrics-port",
                port,
                "--wait-experts-s",
                120,
                *cfg.to_argv(
                    only=(
                        "name",
                        "max_rows",
                        "max_queued_jobs",
                        "max_client_rows",
                        "max_client_queued_jobs",
                        "submit_rate",
                        "status_rate",
                        *COORDINATOR_OPTIONS,
                    )
                ),
            )
            self.coordinators.append(await Child.start(f"coordinator{i}", cmd))
            self.metrics_ports.append(port)
        await asyncio.gather(*(c.wait_ready(300) for c in self.coordinators))

    def check_alive(self) -> None:
        dead = [c for c in self.children() if not c.alive()]
        if dead:
            raise RuntimeError(
                "; ".join(f"{c.name} exited with {c.proc.returncode} during the bench:\n{c.last_lines()}" for c in dead)
            )

    @staticmethod
    async def _stop(children: list[Child]) -> None:
        import asyncio

        await asyncio.gather(*(c.stop() for c in children), return_exceptions=True)

    async def close(self) -> None:
        await self._stop(self.coordinators)  # first: their running jobs fail, then the workers go
        await self._stop([w for ws in self.workers for w in ws])


async def scrape(port: int) -> dict[str, float] | None:
    """{"rows": rows stepped, "done": jobs done, "hedges": hedged copies sent, "cohorts": batches out
    at once (None from a coordinator without that gauge)} from a coordinator's /metrics; None if unreadable."""
    import asyncio
    import urllib.request

    def get() -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            return r.read().decode()

    try:
        text = await asyncio.to_thread(get)
    except OSError:
        return None
    out = {"rows": 0.0, "done": 0.0, "hedges": 0.0, "cohorts": None}
    for line in text.splitlines():
        if line.startswith("ddm_coordinator_rows_stepped_total "):
            out["rows"] = float(line.rsplit(" ", 1)[1])
        elif line.startswith("ddm_coordinator_jobs_finished_total{") and 'outcome="done"' in line:
            out["done"] = float(line.rsplit(" ", 1)[1])
        elif line.startswith("ddm_coordinator_expert_hedges_total{"):
            out["hedges"] += float(line.rsplit(" ", 1)[1])
        elif line.startswith("ddm_coordinator_cohorts "):
            out["cohorts"] = int(float(line.rsplit(" ", 1)[1]))
    return out


# ----------------------------------------------------------------------------- one level


class Progress:
    """A tqdm bar over the seconds of load of all levels, on stderr (disabled: does nothing)."""

    def __init__(self, total_s: float, enabled: bool, desc: str = "bench scale"):
        import sys

        from tqdm import tqdm

        self.bar = tqdm(
            total=round(total_s),
            unit="s",
            desc=desc,
            file=sys.stderr,
            disable=not enabled,
            bar_format="{desc}: {percentage:3.0f}%|{bar}| {n:.0f}/{total_fmt} s [{elapsed}<{remaining}]{postfix}",
        )
        self.done = 0.0

    def advance(self, to_s: float, **postfix) -> None:
        if postfix:
            self.bar.set_postfix(postfix, refresh=False)
        if to_s >= self.done + 1:  # whole seconds: one redraw per second at most
            self.bar.update(int(to_s - self.done))
            self.done += int(to_s - self.done)

    def close(self) -> None:
        self.bar.close()


async def measure(
    fleet: Fleet,
    args,
    *,
    jobs: int,
    steps: int,
    images: int,
    stream: bool,
    tag: str,
    progress: Progress,
    progress_base: float,
) -> dict:
    """Keep `jobs` jobs running for warmup + duration seconds; measure the window after the warm-up."""
    import asyncio
    import time

    import numpy as np

    from bus.connect import connect
    from client.jobs import client_connect_options, client_from_url
    from schemas import JobRequest

    from .fleet import fleet_job

    nc = await connect(
        fleet.url,
        name="ddm-bench-scale-clients",
        reconnect="forever",
        pending_size=256 * 1024 * 1024,
        **client_connect_options(client_from_url(fleet.url)),
    )
    finished: list[tuple[float, float, str, int]] = []  # (end time, latency s, outcome, images)
    stop = asyncio.Event()

    async def client(i: int) -> None:
        # starts spread over most of the warm-up, so that jobs do not all finish in the same wave
        await asyncio.sleep(0.8 * args.warmup * i / jobs)
        n = 0
        while not stop.is_set():
            req = JobRequest(
                job_id=f"s{tag}x{i}x{n}",
                count=images,
                steps=steps,
                strategy=args.strategy,
                seed=i * 100_003 + n,
                stream=stream,
                session=f"scale-{i % 4096}",
            )
            n += 1
            t0 = time.perf_counter()
            outcome, detail, _ = await fleet_job(nc, req, args.job_timeout)
            t1 = time.perf_counter()
            finished.append((t1, t1 - t0, outcome, len(detail.classes) if outcome == "completed" else 0))

    pids = {c.name: c.pid for c in fleet.coordinators}
    worker_pids = [w.pid for ws in fleet.workers for w in ws]
    tasks = [asyncio.create_task(client(i)) for i in range(jobs)]
    progress.advance(progress_base, level=tag, rows_s="warm-up")
    try:
        start = time.perf_counter()
        while time.perf_counter() - start < args.warmup:
            await asyncio.sleep(0.25)
            fleet.check_alive()
            progress.advance(progress_base + time.perf_counter() - start)
        before = [await scrape(p) for p in fleet.metrics_ports]
        for pid in pids.values():
            reset_peak(pid)
        cpu0 = {n: cpu_seconds(p) for n, p in pids.items()}
        faults0 = {n: page_faults(p) for n, p in pids.items()}
        me0 = cpu_seconds(os.getpid())
        wk0 = [cpu_seconds(p) for p in worker_pids]
        nats0 = cpu_seconds(fleet.nats_pid) if fleet.nats_pid else None
        load0 = os.getloadavg()[0]
        box0 = box_cpu()
        t_window = time.perf_counter()
        last_rows, last_t = sum(b["rows"] for b in before if b), t_window
        while (now := time.perf_counter()) - t_window < args.duration:
            await asyncio.sleep(min(1.0, max(0.01, args.duration - (now - t_window))))
            fleet.check_alive()
            cur = [await scrape(p) for p in fleet.metrics_ports]
            rows_now, t_now = sum(c["rows"] for c in cur if c), time.perf_counter()
            rate = (rows_now - last_rows) / max(t_now - last_t, 1e-9)
            last_rows, last_t = rows_now, t_now
            progress.advance(
                progress_base + args.warmup + min(t_now - t_window, args.duration), rows_s=f"{rate:,.0f}", level=tag
            )
        after = [await scrape(p) for p in fleet.metrics_ports]
        cpu1 = {n: cpu_seconds(p) for n, p in pids.items()}
        faults1 = {n: page_faults(p) for n, p in pids.items()}
        me1 = cpu_seconds(os.getpid())
        wk1 = [cpu_seconds(p) for p in worker_pids]
        nats1 = cpu_seconds(fleet.nats_pid) if fleet.nats_pid else None
        box1 = box_cpu()
        t_end = time.perf_counter()  # after the readings, as t_window came after the first ones
        memory = {n: proc_memory(p) for n, p in pids.items()}
        load1 = os.getloadavg()[0]
    finally:
        stop.set()
        # let each client's current job end (bounded), so the next level starts on an idle fleet
        _, pending = await asyncio.wait(tasks, timeout=120)
        for t in pending:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        from bus.connect import drain_or_close

        await drain_or_close(nc)
    fleet.check_alive()
    if any(b is None for b in before) or any(a is None for a in after):
        raise RuntimeError("could not read a coordinator's /metrics")
    window = t_end - t_window
    rows = sum(a["rows"] - b["rows"] for a, b in zip(after, before))
    per_coord = [round((a["rows"] - b["rows"]) / window, 1) for a, b in zip(after, before)]
    in_window = [f for f in finished if t_window <= f[0] <= t_end]
    lat = [f[1] for f in in_window if f[2] == "completed"]
    outcomes = {o: sum(1 for f in in_window if f[2] == o) for o in ("completed", "rejected", "failed", "lost")}
    cpu = sum(cpu1[n] - cpu0[n] for n in pids if cpu0[n] is not None and cpu1[n] is not None)
    faults = sum(faults1[n] - faults0[n] for n in pids if faults0[n] is not None and faults1[n] is not None)

    def pct(q):
        return round(float(np.percentile(lat, q)), 4) if lat else None

    return {
        "jobs": jobs,
        "window_s": round(window, 3),
        "rows_per_s": round(rows / window, 1),
        "rows_per_s_per_coordinator": per_coord,
        "images_per_s": round(sum(f[3] for f in in_window) / window, 2),
        "p50_s": pct(50),
        "p99_s": pct(99),
        "outcomes": outcomes,
        "hedges": int(sum(a["hedges"] - b["hedges"] for a, b in zip(after, before))),
        "cohorts": [a.get("cohorts") for a in after],  # each coordinator's, at the window's end
        "coordinator_cpu_s_per_1000_rows": round(1000 * cpu / rows, 4) if rows else None,
        "coordinator_cpu_share": round(cpu / window / max(len(pids), 1), 3),
        # minor page faults: high when malloc hands freed activations back (DDM_FLEET_MALLOC_TUNING=0)
        "coordinator_page_faults_per_1000_rows": round(1000 * faults / rows, 1) if rows else None,
        "coordinator_peak_rss_mib": {n: round(m["peak"] / 2**20, 1) if m else None for n, m in memory.items()},
        "coordinator_rss_mib": {n: round(m["rss"] / 2**20, 1) if m else None for n, m in memory.items()},
        "clients_cpu_share": round((me1 - me0) / window, 3) if me0 is not None and me1 is not None else None,
        "workers_cpu_share": round(sum(b - a for a, b in zip(wk0, wk1) if a is not None and b is not None) / window, 3),
        "nats_cpu_share": round((nats1 - nats0) / window, 3) if nats0 is not None and nats1 is not None else None,
        # the share of all the machine's CPUs left idle in the window (None without /proc/stat)
        "box_idle_share": None if (idle := idle_share(box0, box1)) is None else round(idle, 3),
        "load1": [round(load0, 2), round(load1, 2)],
    }


# ----------------------------------------------------------------------------- the run


async def bench_scale(args) -> dict:
    import tempfile

    from bus.nats_server import NatsServer

    if not hasattr(args, "workers_list"):
        check_args(args)
    model_name, batch_ms, row_ms = latency_model(args)
    r = args.request_rows
    per_worker = worker_capacity(batch_ms, row_ms, r)
    load_start = os.getloadavg()
    levels_n = len(args.workers_list) * len(args.coordinators_list) + int(args.coordinator_capacity)
    progress = Progress(levels_n * (args.warmup + args.duration), not args.no_progress)
    out: dict = {}
    try:
        with tempfile.TemporaryDirectory(prefix="ddm-bench-scale-") as tmp:
            models = _models(args, tmp)
            k = models["k"]
            jobs_for = {
                w: args.jobs or derive_jobs(k, w, r, args.images_per_job, args.queued_per_worker)
                for w in args.workers_list
            }
            with NatsServer() as srv:
                fleet = Fleet(srv.url, models)
                fleet.nats_pid = srv.proc.pid
                base = 0.0
                try:
                    capacity = None
                    if args.coordinator_capacity:
                        await fleet.set_workers(1, (0.0, 0.0), args.capacity_request_rows)
                        await fleet.set_coordinators(1, args, args.capacity_request_rows, max(1024, args.capacity_jobs))
                        capacity = await measure(
                            fleet,
                            args,
                            jobs=args.capacity_jobs,
                            steps=40,
                            images=1,
                            stream=True,
                            tag="cap",
                            progress=progress,
                            progress_base=base,
                        )
                        capacity.update(
                            {
                                "workers_per_expert": 1,
                                "coordinators": 1,
                                "sim": "instant",
                                "request_rows": args.capacity_request_rows,
                                "steps": 40,
                                "images_per_job": 1,
                                "stream": True,
                            }
                        )
                        base += args.warmup + args.duration
                    levels = []
                    max_rows = max([1024, *(j * args.images_per_job for j in jobs_for.values())])
                    for c in args.coordinators_list:
                        for i, w in enumerate(args.workers_list):
                            await fleet.set_workers(w, (batch_ms, row_ms), r)
                            if i == 0:  # after the workers: a coordinator waits for every expert to have one
                                await fleet.set_coordinators(c, args, r, max_rows)
                            res = await measure(
                                fleet,
                                args,
                                jobs=jobs_for[w],
                                steps=args.steps,
                                images=args.images_per_job,
                                stream=not args.no_stream,
                                tag=f"c{c}w{w}",
                                progress=progress,
                                progress_base=base,
                            )
                            base += args.warmup + args.duration
                            cap_sum = w * k * per_worker
                            bound = cap_sum
                            if capacity is not None and capacity["rows_per_s"] > 0:
                                bound = min(cap_sum, c * capacity["rows_per_s"])
                            res.update(
                                {
                                    "workers_per_expert": w,
                                    "workers": w * k,
                                    "coordinators": c,
                                    "capacity_rows_per_s": round(cap_sum, 1),
                                    "bound_rows_per_s": round(bound, 1),
                                    "efficiency": round(res["rows_per_s"] / bound, 3) if bound > 0 else None,
                                }
                            )
                            levels.append(res)
                finally:
                    await fleet.close()
    finally:
        progress.close()
    cfg = coordinator_config(args)
    out["setup"] = {
        "router": models["described"],
        "experts": k,
        "strategy": args.strategy,
        "steps": args.steps,
        "images_per_job": args.images_per_job,
        "stream": not args.no_stream,
        "cohorts": cfg.cohorts,
        "route_every": cfg.route_every,
        "speculate": "on" if cfg.speculate else "off",
        "request_rows": r,
        "hedge": cfg.hedge,
        "dispatch": cfg.dispatch,
        "queued_per_worker": args.queued_per_worker,
        "jobs_rule": (
            "--jobs"
            if args.jobs
            else f"ceil(K * W * R * (1 + queued) / images_per_job) = ceil({k} * W * {r} * "
            f"{1 + args.queued_per_worker} / {args.images_per_job})"
        ),
        "sim": {
            "model": model_name,
            "batch_ms": batch_ms,
            "row_ms": row_ms,
            "worker_rows_per_s": round(per_worker, 1) if math.isfinite(per_worker) else None,
        },
        "duration_s": args.duration,
        "warmup_s": args.warmup,
        "cpus": os.cpu_count(),
        "load_avg_start": [round(v, 2) for v in load_start],
        "load_avg_end": [round(v, 2) for v in os.getloadavg()],
    }
    out["coordinator_capacity"] = capacity
    out["levels"] = levels
    return out


# ----------------------------------------------------------------------------- report


def _n(v, fmt: str, width: int) -> str:
    return f"{v:>{width}{fmt}}" if v is not None else f"{'-':>{width}}"


def _cpu(x: dict) -> str:
    return " ".join(
        _n(v, ".2f", 5)
        for v in (
            x["coordinator_cpu_share"],
            x.get("workers_cpu_share"),
            x.get("nats_cpu_share"),
            x["clients_cpu_share"],
        )
    )


def _cpu_budget(x: dict, cpus: int) -> str:
    """One level's CPU, process by process, per 1000 rows and as shares of a core, and what the
    machine left idle: the arithmetic of what one more row costs the whole box."""
    rate = x["rows_per_s"]
    per_row = x.get("coordinator_cpu_s_per_1000_rows")
    shares = {
        "coordinator": per_row * rate / 1000 if per_row is not None else None,  # all of them
        "clients": x.get("clients_cpu_share"),
        "sim workers": x.get("workers_cpu_share"),
        "nats-server": x.get("nats_cpu_share"),
    }
    parts = [
        f"{name} {100 * v:.0f}%" + (f" ({1000 * v / rate:.3f} s)" if rate else "")
        for name, v in shares.items()
        if v is not None
    ]
    total = sum(v for v in shares.values() if v is not None)
    out = "; ".join(parts) + f"; all {100 * total:.0f}%" + (f" ({1000 * total / rate:.3f} s)" if rate else "")
    idle = x.get("box_idle_share")
    if idle is not None:
        out += f"; the machine's {cpus} cpus {100 * idle:.0f}% idle"
    return out


def format_table(results: dict) -> str:
    s = results["setup"]
    sim = s["sim"]
    per = f"{sim['worker_rows_per_s']:,.0f}" if sim["worker_rows_per_s"] else "unbounded"
    lines = [
        f"bench scale: {s['experts']} experts, {s['router']}; {s['strategy']}, {s['steps']} steps, "
        f"{s['images_per_job']} image(s)/job, stream={s['stream']}, cohorts={s['cohorts']}, "
        f"speculate={s.get('speculate', 'on')}, request rows R={s['request_rows']}, hedge={s['hedge']}, "
        f"dispatch={s.get('dispatch', 'direct')}; "
        f"{s['cpus']} cpus",
        f"sim latency model ({sim['model']}): {sim['batch_ms']:g} ms + {sim['row_ms']:g} ms/row per forward of at "
        f"most R rows -> one worker's capacity R / (batch + row*R) = {per} rows/s; "
        f"jobs = {s['jobs_rule']}; {s['warmup_s']:g} s warm-up + {s['duration_s']:g} s measured per level",
        f"load avg (1/5/15 min) at start {' '.join(map(str, s['load_avg_start']))}, at end "
        f"{' '.join(map(str, s['load_avg_end']))}",
    ]
    cap = results.get("coordinator_capacity")
    if cap:
        peak = ", ".join(f"{v:.0f}" for v in cap["coordinator_peak_rss_mib"].values() if v is not None)
        lines.append(
            f"coordinator capacity (1 coordinator, instant sim workers x1/expert, R={cap['request_rows']}, "
            f"{cap['jobs']} 1-image 40-step jobs, frames streamed): {cap['rows_per_s']:,.0f} rows/s, "
            f"{cap['images_per_s']:.1f} images/s, job p50/p99 {cap['p50_s']}/{cap['p99_s']} s, "
            f"coordinator CPU {cap['coordinator_cpu_s_per_1000_rows']} "
            f"s/1000 rows ({100 * cap['coordinator_cpu_share']:.0f}% of a core, "
            f"{cap.get('coordinator_page_faults_per_1000_rows') or 0:,.0f} page faults / 1000 rows), "
            f"peak RSS {peak} MiB, clients "
            f"{100 * (cap['clients_cpu_share'] or 0):.0f}% of a core, load1 {cap['load1'][0]}>{cap['load1'][1]}"
        )
        lines.append("  where the CPU went (share of a core, CPU s per 1000 rows): " + _cpu_budget(cap, s["cpus"]))
    if results["levels"]:
        lines.append(
            f"{'coord':>5} {'W/exp':>5} {'coh':>3} {'jobs':>5} | {'fleet rows/s':>12} {'per coord':>15} | "
            f"{'capacity':>9} {'eff':>5} | {'img/s':>7} {'p50 s':>6} {'p99 s':>6} | {'cpu s/1k':>8} "
            f"{'peak MiB':>9} | {'cpu: coord wrk nats cli':>23} | {'hedges':>6} {'lost/fail':>9} | load1"
        )
        for x in results["levels"]:
            per_c = "/".join(f"{v:,.0f}" for v in x["rows_per_s_per_coordinator"])
            peak = "/".join(f"{v:.0f}" for v in x["coordinator_peak_rss_mib"].values() if v is not None)
            o = x["outcomes"]
            coh = "/".join("-" if c is None else str(c) for c in x.get("cohorts") or [None])
            lines.append(
                f"{x['coordinators']:>5} {x['workers_per_expert']:>5} {coh:>3} {x['jobs']:>5} | "
                f"{x['rows_per_s']:>12,.0f} "
                f"{per_c:>15} | {x['capacity_rows_per_s']:>9,.0f} {_n(x['efficiency'], '.2f', 5)} | "
                f"{x['images_per_s']:>7.1f} {_n(x['p50_s'], '.2f', 6)} {_n(x['p99_s'], '.2f', 6)} | "
                f"{_n(x['coordinator_cpu_s_per_1000_rows'], '.3f', 8)} {peak:>9} | "
                f"{_cpu(x):>23} | {x['hedges']:>6} "
                f"{o['lost'] + o['failed'] + o['rejected']:>9} | {x['load1'][0]}>{x['load1'][1]}"
            )
        lines.append(
            "coh = each coordinator's cohorts (batches out at once) at the window's end; "
            "eff = fleet rows/s / min(capacity, coordinators x coordinator capacity when measured); "
            "cpu s/1k = coordinator CPU seconds per 1000 rows (all coordinators); peak = VmHWM over the "
            "window; cpu = CPU of the coordinators (each), all workers, nats-server and the clients (this "
            "process), in cores"
        )
    return "\n".join(lines)
