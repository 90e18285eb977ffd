"""Images/s and job latency through the whole fleet, next to the in-process ceiling.

For each --concurrency C, C clients each run --jobs-per-client jobs back to back (a closed
loop) and we report images/s and p50/p99 job latency (submit -> final images at the client):

* fleet:   client -> NATS -> coordinator (router, scheduler) -> NATS -> one worker process per
           expert (`ddm-fleet worker`, batching, bucket padding) and back, frames streamed;
* ceiling: the same scheduler, router and models in one process, experts called directly
           (no NATS, no msgpack, no worker processes), same continuous batching;

and the ratio fleet / ceiling of images/s. Uses checkpoints/ (expert<k>, router, partition)
when present, else random UNets of --widths with a label router (say so in the report).
A private nats-server on a free port is started and stopped.

examples:
  ddm-fleet bench fleet --concurrency 1,8,64 --steps 40
  ddm-fleet bench fleet --widths 32,64,128 --concurrency 1,8 --steps 10 --json
"""

from __future__ import annotations

import argparse
import os


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--concurrency", default="1,8,64", metavar="C,C,...",
                        help="concurrent clients to measure (default %(default)s)")
    parser.add_argument("--steps", type=int, default=40, help="solver steps per job (default %(default)s)")
    parser.add_argument("--images-per-job", type=int, default=1, metavar="N", help="images per job (default 1)")
    parser.add_argument("--jobs-per-client", type=int, default=2, metavar="N",
                        help="jobs each client runs back to back (default %(default)s)")
    parser.add_argument("--strategy", choices=("top1", "topk", "full", "oracle"), default="top1")
    parser.add_argument("--solver", choices=("euler", "heun"), default="euler")
    parser.add_argument("--no-stream", action="store_true", help="jobs do not stream frames (only final images)")
    parser.add_argument("--checkpoints", default="checkpoints", metavar="DIR",
                        help="expert<k>.safetensors, router.safetensors, partition.json (default %(default)s)")
    parser.add_argument("--widths", default="32,64,128",
                        help="UNet widths of the random experts used when --checkpoints has none (default %(default)s)")
    parser.add_argument("--bf16", action="store_true", help="bfloat16 compute in workers and in the ceiling")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads per expert, both paths (default: torch's choice)")
    parser.add_argument("--buckets", default="1,2,4,8,16,32,64,128", help="worker batch buckets (default %(default)s)")
    parser.add_argument("--only", choices=("fleet", "ceiling"), default=None, help="measure one path only")
    parser.add_argument("--json", action="store_true", help="print the results as JSON instead of a table")


def _ints(text: str, what: str) -> list[int]:
    try:
        vals = [int(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise ValueError(f"{what} must be comma-separated positive integers, got {text!r}") from None
    if not vals or any(v < 1 for v in vals):
        raise ValueError(f"{what} must be comma-separated positive integers, got {text!r}")
    return vals


def run(args: argparse.Namespace) -> int:
    import asyncio
    import json
    import sys

    try:
        args.concurrency_list = _ints(args.concurrency, "--concurrency")
        _ints(args.buckets, "--buckets")
        for name in ("steps", "images_per_job", "jobs_per_client"):
            if getattr(args, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    except ValueError as err:
        print(f"ddm-fleet bench fleet: {err}", file=sys.stderr)
        return 2
    async def main():
        import signal

        task = asyncio.current_task()
        # SIGTERM unwinds like Ctrl-C, so the worker processes and nats-server are stopped
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
        return await bench_fleet(args)

    try:
        results = asyncio.run(main())
    except asyncio.CancelledError:
        print("ddm-fleet bench fleet: stopped", file=sys.stderr)
        return 130
    except (ValueError, OSError, RuntimeError, TimeoutError) as err:
        print(f"ddm-fleet bench fleet: {type(err).__name__}: {err}", file=sys.stderr)
        return 1
    print(json.dumps(results, indent=2) if args.json else format_table(results))
    return 0


# ----------------------------------------------------------------------------- models


def _models(args, tmpdir: str):
    """(expert paths, router, num_experts, class_to_expert, description)."""
    from coordinator.local_fleet import LabelRouter, shipped_paths

    try:
        paths = shipped_paths(args.checkpoints)
    except FileNotFoundError:
        paths = None
    if paths is not None:
        from coordinator.service import load_router_and_partition

        router, k, c2e = load_router_and_partition(paths["router"], paths["partition"])
        return [str(p) for p in paths["experts"][:k]], router, k, c2e, f"checkpoints in {args.checkpoints}/"
    import torch

    from workers.checkpoint import save_checkpoint, torch_state_to_numpy
    from workers.models.config import UNetConfig, parse_widths
    from workers.models.unet_torch import UNet

    cfg = UNetConfig(widths=parse_widths(args.widths))
    out = []
    for k in range(2):
        torch.manual_seed(k)
        state = torch_state_to_numpy(UNet(cfg).state_dict())
        out.append(str(save_checkpoint(os.path.join(tmpdir, f"expert{k}"), state,
                                       {"config": cfg.to_dict(), "expert_id": k})))
    c2e = [0] * 5 + [1] * 5
    return out, LabelRouter(c2e, 2), 2, c2e, f"random UNets widths={args.widths}, label router"


def _requests(args, c: int, tag: str):
    from schemas import JobRequest

    return [[JobRequest(job_id=f"b{tag}{c}x{i}x{j}", count=args.images_per_job, steps=args.steps,
                        strategy=args.strategy, solver=args.solver, seed=i * 1000 + j, stream=not args.no_stream)
             for j in range(args.jobs_per_client)] for i in range(c)]


async def _closed_loop(run_one, per_client) -> dict:
    """Run each client's jobs back to back, all clients concurrently; latency stats."""
    import asyncio
    import time

    import numpy as np

    lat: list[float] = []
    images = 0

    async def client(jobs):
        nonlocal images
        for req in jobs:
            t0 = time.perf_counter()
            done = await run_one(req)
            lat.append(time.perf_counter() - t0)
            images += len(done.digits)

    start = time.perf_counter()
    await asyncio.gather(*(client(j) for j in per_client))
    wall = time.perf_counter() - start
    return {"images": images, "jobs": len(lat), "wall_s": round(wall, 3), "images_per_s": round(images / wall, 2),
            "p50_s": round(float(np.percentile(lat, 50)), 4), "p99_s": round(float(np.percentile(lat, 99)), 4)}


# ----------------------------------------------------------------------------- the two paths


async def _ceiling(args, experts, router, k, c2e) -> dict:
    import asyncio

    from coordinator.engine import Engine
    from coordinator.local_fleet import InProcessTransport, load_backends
    from coordinator.scheduler import Scheduler, SchedulerConfig

    buckets = _ints(args.buckets, "--buckets")
    backends = await asyncio.to_thread(load_backends, experts, bf16=args.bf16, buckets=buckets)
    waiting: dict[str, asyncio.Future] = {}

    def emit(ev):
        fut = waiting.get(ev.job_id)
        if fut is None or fut.done():
            return
        if ev.kind == "done":
            fut.set_result(ev)
        elif ev.kind == "failed":
            fut.set_exception(RuntimeError(f"job {ev.job_id} failed: {ev.code.value}: {ev.reason}"))

    engine = Engine(Scheduler(SchedulerConfig(num_experts=k, max_rows=4096, max_queued_jobs=4096, class_to_expert=c2e)),
                    router, InProcessTransport(backends), emit)
    task = asyncio.create_task(engine.run())

    async def run_one(req):
        waiting[req.job_id] = asyncio.get_running_loop().create_future()
        engine.submit(req)
        try:
            return await waiting[req.job_id]
        finally:
            waiting.pop(req.job_id, None)

    try:
        await _closed_loop(run_one, _requests(args, 1, "w"))  # warm-up
        return {c: await _closed_loop(run_one, _requests(args, c, "c")) for c in args.concurrency_list}
    finally:
        await engine.stop()
        await task


async def _start_worker(k: int, path: str, url: str, args):
    import asyncio
    import sys

    cmd = [sys.executable, "-m", "infra.cli", "worker", "--expert", str(k), "--checkpoint", path, "--nats", url,
           "--buckets", args.buckets, "--max-batch", str(max(_ints(args.buckets, "--buckets")))]
    if args.bf16:
        cmd.append("--bf16")
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    proc = await asyncio.create_subprocess_exec(*cmd, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        while True:
            line = await asyncio.wait_for(proc.stdout.readline(), 600)
            if not line:
                err = (await proc.stderr.read()).decode(errors="replace")[-2000:]
                raise RuntimeError(f"worker for expert {k} exited before ready:\n{err}")
            if line.startswith(b"ready"):
                return proc
    except BaseException:
        proc.kill()
        await proc.wait()
        raise


async def _fleet(args, experts, router, k, c2e) -> dict:
    import asyncio

    import nats

    from coordinator.client import run_job
    from coordinator.service import Coordinator
    from infra.nats_server import NatsServer

    with NatsServer() as srv:
        procs = []
        try:
            procs = list(await asyncio.gather(*(_start_worker(i, p, srv.url, args) for i, p in enumerate(experts))))
            nc = await nats.connect(srv.url, name="ddm-bench-clients")
            try:
                async with Coordinator(router, num_experts=k, class_to_expert=c2e, nats_url=srv.url,
                                       max_rows=4096, max_queued_jobs=4096, step_timeout=60, retries=1):
                    async def run_one(req):
                        return await run_job(nc, req, timeout=3600)

                    await _closed_loop(run_one, _requests(args, 1, "w"))  # warm-up
                    return {c: await _closed_loop(run_one, _requests(args, c, "f")) for c in args.concurrency_list}
            finally:
                await nc.drain()
        finally:
            for p in procs:
                if p.returncode is None:
                    p.terminate()
            for p in procs:
                try:
                    await asyncio.wait_for(p.wait(), 30)
                except asyncio.TimeoutError:
                    p.kill()


async def bench_fleet(args) -> dict:
    import tempfile

    with tempfile.TemporaryDirectory(prefix="ddm-bench-fleet-") as tmp:
        experts, router, k, c2e, described = _models(args, tmp)
        if args.threads:
            import torch

            torch.set_num_threads(args.threads)
        ceiling = await _ceiling(args, experts, router, k, c2e) if args.only != "fleet" else {}
        fleet = await _fleet(args, experts, router, k, c2e) if args.only != "ceiling" else {}
    rows = []
    for c in args.concurrency_list:
        row = {"concurrency": c}
        if c in fleet:
            row["fleet"] = fleet[c]
        if c in ceiling:
            row["ceiling"] = ceiling[c]
        if c in fleet and c in ceiling:
            row["ratio"] = round(fleet[c]["images_per_s"] / max(ceiling[c]["images_per_s"], 1e-9), 3)
        rows.append(row)
    setup = {"models": described, "experts": k, "steps": args.steps, "images_per_job": args.images_per_job,
             "jobs_per_client": args.jobs_per_client, "strategy": args.strategy, "solver": args.solver,
             "stream": not args.no_stream, "bf16": args.bf16, "threads": args.threads, "cpus": os.cpu_count()}
    return {"setup": setup, "rows": rows}


def format_table(results: dict) -> str:
    s = results["setup"]
    lines = [f"bench fleet: {s['models']}; {s['experts']} experts, {s['steps']} {s['solver']} steps, {s['strategy']}, "
             f"{s['images_per_job']} image(s)/job, {s['jobs_per_client']} jobs/client, stream={s['stream']}, "
             f"bf16={s['bf16']}, {s['cpus']} cpus",
             f"{'conc':>5} | {'fleet img/s':>11} {'p50 s':>7} {'p99 s':>7} | {'ceil img/s':>10} {'p50 s':>7} "
             f"{'p99 s':>7} | {'ratio':>5}"]
    for r in results["rows"]:
        f, c = r.get("fleet"), r.get("ceiling")
        fs = f"{f['images_per_s']:>11.1f} {f['p50_s']:>7.3f} {f['p99_s']:>7.3f}" if f else f"{'-':>11} {'-':>7} {'-':>7}"
        cs = f"{c['images_per_s']:>10.1f} {c['p50_s']:>7.3f} {c['p99_s']:>7.3f}" if c else f"{'-':>10} {'-':>7} {'-':>7}"
        ratio = f"{r['ratio']:>5.2f}" if "ratio" in r else f"{'-':>5}"
        lines.append(f"{r['concurrency']:>5} | {fs} | {cs} | {ratio}")
    return "\n".join(lines)
