"""`ddm-fleet bench worker`: Rows/s of one expert worker for each bucket size: the same loaded model called
in-process (backend.forward) and through NATS (StepRequest -> ExpertWorker -> StepReply, with
msgpack encode/decode, one request in flight), and their ratio. The two paths are timed
alternately and medians are reported, so background load hits both alike. Starts its own nats-server
unless --nats is given. Uses a random UNet of --widths when no --checkpoint is given. `--backend sim`
measures the simulated expert (`workers.backends.sim_backend`): its in-process column is the latency
model itself, so the NATS column shows what the wire adds to a worker of that speed.
`--wire-dtype float32,float16` measures the NATS path once per wire precision (x_t sent in it and
the velocity asked back in it, `StepRequest.reply_dtype`, widened to float32 as the coordinator
does), all paths alternating within each bucket, one row per bucket and precision.
"""

from __future__ import annotations

import argparse


#: `workers.backends.sim_backend.PRESETS` names (listed here so building the parser imports no numpy).
SIM_PRESETS = ("h200-torch", "h200-jax", "instant")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", default=None, metavar="PATH",
                        help="expert checkpoint; default: a randomly initialised UNet of --widths")
    parser.add_argument("--widths", default="32,64,128",
                        help="UNet widths for the random model when no --checkpoint (default 32,64,128 = SMALL)")
    parser.add_argument("--backend", choices=("torch", "xla", "jax", "sim"), default="torch",
                        help="model runtime (default torch); sim: the simulated expert of `ddm-fleet worker "
                             "--backend sim` (latency model, closed-form velocity, real wire work)")
    parser.add_argument("--sim-preset", choices=SIM_PRESETS, default=None,
                        help="sim backend latency preset: h200-torch (default), h200-jax, instant")
    parser.add_argument("--sim-batch-ms", type=float, default=None, metavar="MS",
                        help="sim backend: fixed milliseconds per batch (overrides the preset)")
    parser.add_argument("--sim-row-ms", type=float, default=None, metavar="MS",
                        help="sim backend: milliseconds per padded row (overrides the preset)")
    parser.add_argument("--device", default=None, help="backend device (see `ddm-fleet worker --help`)")
    parser.add_argument("--bf16", action="store_true", help="bfloat16 compute")
    parser.add_argument("--buckets", default="1,8,64", help="batch sizes to measure (default 1,8,64)")
    parser.add_argument("--nats", default=None, metavar="URL",
                        help="NATS server to use (it must have no other worker of this expert); "
                             "default: start a private nats-server on a free port")
    parser.add_argument("--min-time", type=float, default=2.0, metavar="S",
                        help="seconds to measure each bucket on each path (default 2; the paths alternate)")
    parser.add_argument("--min-iters", type=int, default=3, help="at least this many calls per bucket and path")
    parser.add_argument("--wire-dtype", default="float32", metavar="D[,D...]",
                        help="wire precision(s) of the NATS path, from float32, float16, bfloat16; several "
                             "(comma-separated) are measured side by side (default %(default)s)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON instead of a table")


def parse_wire_dtypes(text: str) -> tuple[str, ...]:
    """"float32,float16" -> ("float32", "float16"); ValueError naming the allowed ones."""
    allowed = ("float32", "float16", "bfloat16")
    names = tuple(dict.fromkeys(p.strip() for p in text.split(",") if p.strip()))
    if not names or any(n not in allowed for n in names):
        raise ValueError(f"--wire-dtype must be a comma-separated list of {', '.join(allowed)}, got {text!r}")
    return names


def run(args: argparse.Namespace) -> int:
    import asyncio
    import json
    import sys

    from workers.backends import BackendError
    from workers.batcher import parse_buckets

    try:
        buckets = parse_buckets(args.buckets)
        args.wire_dtypes = parse_wire_dtypes(args.wire_dtype)
    except ValueError as err:
        print(f"ddm-fleet bench worker: {err}", file=sys.stderr)
        return 2
    if args.min_time < 0 or args.min_iters < 1:
        print("ddm-fleet bench worker: --min-time must be >= 0 and --min-iters >= 1", file=sys.stderr)
        return 2
    try:
        results = asyncio.run(bench_worker(args, buckets))
    except (ValueError, OSError, ConnectionError, BackendError) as err:
        print(f"ddm-fleet bench worker: {err}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        print(format_table(results))
    return 0




def _random_checkpoint(widths: str, directory: str) -> str:
    from models.config import UNetConfig, parse_widths
    from models.tiny import make_tiny_expert

    # A random UNet of `widths` with the default (full-size) embeddings: the shape a trained expert has.
    full = UNetConfig()
    return str(make_tiny_expert(f"{directory}/bench-expert", expert_id=0, seed=0, widths=parse_widths(widths),
                                time_dim=full.time_dim, class_dim=full.class_dim, groups=full.groups))


async def _alternating(local, remotes, min_time: float, min_iters: int) -> tuple[list[float], list[list[float]]]:
    """Time blocking `local()` (in a thread) and each awaitable `remotes[i]()` in turn, one warm
    call each first; returns per-call seconds of local and of each remote. Alternating keeps every
    path under the same background load, which matters on a shared machine."""
    import asyncio
    import time

    await asyncio.to_thread(local)
    for remote in remotes:
        await remote()
    a: list[float] = []
    bs: list[list[float]] = [[] for _ in remotes]
    start = time.perf_counter()
    while len(a) < min_iters or time.perf_counter() - start < (1 + len(remotes)) * min_time:
        t0 = time.perf_counter()
        await asyncio.to_thread(local)
        a.append(time.perf_counter() - t0)
        for remote, b in zip(remotes, bs):
            t0 = time.perf_counter()
            await remote()
            b.append(time.perf_counter() - t0)
    return a, bs


async def bench_worker(args: argparse.Namespace, buckets: tuple[int, ...]) -> dict:
    """Measure every bucket on both paths; returns {"setup": {...}, "rows": [...]}."""
    import asyncio
    import contextlib
    import statistics
    import tempfile

    import numpy as np

    from bus.nats_server import NatsServer
    from schemas import StepReply, StepRequest, StepResult, pack, subjects, unpack
    from schemas.tensor import to_wire_dtype
    from workers.backends import get_backend
    from workers.service import ExpertWorker

    with contextlib.ExitStack() as stack:
        ckpt = args.checkpoint
        if ckpt is None:
            ckpt = _random_checkpoint(args.widths, stack.enter_context(tempfile.TemporaryDirectory(prefix="ddm-bench-")))
        opts = {}
        if args.backend == "sim":
            opts = {k: v for k, v in (("preset", args.sim_preset), ("batch_ms", args.sim_batch_ms),
                                      ("row_ms", args.sim_row_ms)) if v is not None}
        backend = get_backend(args.backend, device=args.device, bf16=args.bf16, **opts)
        await asyncio.to_thread(backend.load, ckpt)
        expert = backend.expert if backend.expert is not None else 0
        url = args.nats or stack.enter_context(NatsServer()).url

        import nats

        async with ExpertWorker(expert, ckpt, backend, nats_url=url, buckets=buckets) as worker:
            nc = await nats.connect(url, name="ddm-bench")
            try:
                rng = np.random.default_rng(0)
                c, h, w = backend.input_shape
                rows = []
                for b in buckets:
                    x = rng.standard_normal((b, c, h, w)).astype(np.float32)
                    t = rng.uniform(0, 1, b).astype(np.float32)
                    y = rng.integers(0, backend.num_classes, b).astype(np.int64)

                    def make_call(wire: str):
                        async def call() -> None:  # what the coordinator's transport does per request
                            reply_dtype = None if wire == "float32" else wire
                            req = StepRequest(expert=expert, x_t=to_wire_dtype(x, wire), t=t, y=y,
                                              reply_dtype=reply_dtype)
                            msg = await nc.request(subjects.expert_velocity(expert), pack(req), timeout=120)
                            reply = unpack(msg.data, StepResult)
                            if not isinstance(reply, StepReply):
                                raise RuntimeError(f"worker answered {reply.code.value}: {reply.message}")
                            if reply.worker_id != worker.worker_id:
                                raise ValueError(f"another worker of expert {expert} on {url} answered; bench "
                                                 "against a server without workers of that expert, or omit --nats")
                            v = reply.velocity.astype(np.float32, copy=False)
                            if not np.isfinite(v).all():
                                raise RuntimeError(f"the {wire} velocity has NaN/Inf values")

                        return call

                    wires = getattr(args, "wire_dtypes", ("float32",))
                    local, buses = await _alternating(lambda: backend.forward(x, t, y),
                                                      [make_call(wd) for wd in wires], args.min_time,
                                                      args.min_iters)
                    local_s = statistics.median(local)
                    for wire, bus in zip(wires, buses):
                        bus_s = statistics.median(bus)
                        rows.append({
                            "bucket": b, "wire_dtype": wire,
                            "inprocess_ms": round(local_s * 1000, 3), "inprocess_rows_per_s": round(b / local_s, 1),
                            "nats_ms": round(bus_s * 1000, 3), "nats_rows_per_s": round(b / bus_s, 1),
                            "ratio": round(local_s / bus_s, 3), "iters": len(local),
                        })
            finally:
                await nc.close()
        setup = {"backend": backend.name, "device": backend.device, "precision": backend.precision,
                 "checkpoint": args.checkpoint or f"random UNet widths={args.widths}", "nats": url,
                 "in_flight": 1, "statistic": "median"}
    return {"setup": setup, "rows": rows}


def format_table(results: dict) -> str:
    s = results["setup"]
    lines = [f"bench worker: backend={s['backend']} device={s['device']} precision={s['precision']} "
             f"model={s['checkpoint']} (1 request in flight, median of alternating calls)",
             f"{'bucket':>6} {'wire':>8} {'in-proc ms':>11} {'in-proc rows/s':>15} {'nats ms':>9} {'nats rows/s':>12} "
             f"{'ratio':>6}"]
    for r in results["rows"]:
        lines.append(f"{r['bucket']:>6} {r.get('wire_dtype', 'float32'):>8} {r['inprocess_ms']:>11.2f} "
                     f"{r['inprocess_rows_per_s']:>15.1f} {r['nats_ms']:>9.2f} {r['nats_rows_per_s']:>12.1f} "
                     f"{r['ratio']:>6.3f}")
    return "\n".join(lines)
