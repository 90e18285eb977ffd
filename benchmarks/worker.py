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
`--in-flight 1,2,4` keeps N requests outstanding on the NATS path (pipelined: a new request goes out
as soon as one is answered, as the coordinator's cohorts and split requests do), measured side by
side with the other settings; each NATS sample is then a burst of 8 x N requests and its time per
request is the burst's wall time / 8N. With N > 1 the worker may batch queued requests together (up
to its largest bucket): `worker_batch` is the mean forward size the replies report.
`--worker-procs M` serves the NATS path from M `ddm-fleet worker` processes of the same expert,
backend and device in the queue group (several instances per GPU, as docs/DEPLOYMENT.md suggests)
instead of a worker inside this process (0, the default).
"""

from __future__ import annotations

import argparse

from workers.choices import SIM_PRESETS  # noqa: F401 (the presets `--sim-preset` accepts)

#: Worker options this bench serves with instead of `ddm-fleet worker`'s (said in its output): buckets
#: to measure, and queue limits high enough that pipelined requests are never answered `overloaded`.
BENCH_WORKER_DEFAULTS = {"buckets": "1,8,64", "max_queue_rows": 1 << 20, "max_inflight": 1 << 16}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from bus.options import add_nats_option
    from workers.config import WorkerConfig

    parser.add_argument(
        "--checkpoint",
        default=None,
        metavar="PATH",
        help="expert checkpoint; default: a randomly initialised UNet of --widths",
    )
    parser.add_argument(
        "--widths",
        default="32,64,128",
        help="UNet widths for the random model when no --checkpoint (default 32,64,128 = SMALL)",
    )
    add_nats_option(
        parser,
        default=None,
        help="NATS server to use (it must have no other worker of this expert; "
        "default: start a private nats-server on a free port)",
    )
    parser.add_argument(
        "--min-time",
        type=float,
        default=2.0,
        metavar="S",
        help="seconds to measure each bucket on each path (default 2; the paths alternate)",
    )
    parser.add_argument(
        "--min-iters",
        type=int,
        default=3,
        metavar="N",
        help="at least N calls per bucket and path (default %(default)s)",
    )
    parser.add_argument(
        "--wire-dtype",
        default="float32",
        metavar="D[,D...]",
        help="wire precision(s) of the NATS path, from float32, float16, bfloat16; several "
        "(comma-separated) are measured side by side (default %(default)s)",
    )
    parser.add_argument(
        "--in-flight",
        default="1",
        metavar="N[,N...]",
        help="requests kept outstanding on the NATS path (pipelined); several (comma-separated) "
        "are measured side by side, each with every --wire-dtype (default %(default)s)",
    )
    parser.add_argument(
        "--worker-procs",
        type=int,
        default=0,
        metavar="M",
        help="serve the NATS path from M `ddm-fleet worker` processes of the same expert, backend "
        "and device (queue group); 0 (default): one worker inside this process",
    )
    parser.add_argument("--json", action="store_true", help="print the results as JSON instead of a table")
    WorkerConfig.add_arguments(parser, defaults=BENCH_WORKER_DEFAULTS)  # --buckets: the batch sizes measured


def parse_wire_dtypes(text: str) -> tuple[str, ...]:
    """ "float32,float16" -> ("float32", "float16"); ValueError naming the allowed ones."""
    allowed = ("float32", "float16", "bfloat16")
    names = tuple(dict.fromkeys(p.strip() for p in text.split(",") if p.strip()))
    if not names or any(n not in allowed for n in names):
        raise ValueError(f"--wire-dtype must be a comma-separated list of {', '.join(allowed)}, got {text!r}")
    return names


def parse_in_flight(text: str) -> tuple[int, ...]:
    """ "1,2,4" -> (1, 2, 4) (order kept, duplicates dropped); ValueError unless positive integers."""
    try:
        values = tuple(dict.fromkeys(int(p) for p in str(text).split(",") if p.strip()))
    except ValueError:
        values = ()
    if not values or any(v < 1 for v in values):
        raise ValueError(f"--in-flight must be a comma-separated list of positive integers like 1,2,4, got {text!r}")
    return values


#: An in-flight-N sample on the NATS path is a burst of BURST_ROUNDS x N requests.
BURST_ROUNDS = 8


def run(args: argparse.Namespace) -> int:
    import asyncio
    import json
    import sys

    from workers.backends import BackendError
    from workers.config import WorkerConfig

    try:
        config = WorkerConfig.from_args(args)
        if args.worker_procs > 1 and config.metrics_port is not None:
            raise ValueError(
                "--metrics-port with --worker-procs > 1: the worker processes would share one port; drop --metrics-port"
            )
        args.wire_dtypes = parse_wire_dtypes(args.wire_dtype)
        args.in_flights = parse_in_flight(args.in_flight)
        if args.worker_procs < 0:
            raise ValueError(f"--worker-procs must be >= 0, got {args.worker_procs}")
    except ValueError as err:
        print(f"ddm-fleet bench worker: {err}", file=sys.stderr)
        return 2
    if args.min_time < 0 or args.min_iters < 1:
        print("ddm-fleet bench worker: --min-time must be >= 0 and --min-iters >= 1", file=sys.stderr)
        return 2
    try:
        results = asyncio.run(bench_worker(args, config))
    except (ValueError, OSError, ConnectionError, RuntimeError, TimeoutError, BackendError) as err:
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
    return str(
        make_tiny_expert(
            f"{directory}/bench-expert",
            expert_id=0,
            seed=0,
            widths=parse_widths(widths),
            time_dim=full.time_dim,
            class_dim=full.class_dim,
            groups=full.groups,
        )
    )


async def _alternating(local, remotes, min_time: float, min_iters: int) -> tuple[list[float], list[list[float]]]:
    """Time blocking `local()` (in a thread) and each awaitable `remotes[i]()` in turn, one warm
    call each first; returns per-call seconds of local and per-request seconds of each remote (a
    remote returns how many requests it completed, None meaning one: a burst of n requests counts
    its wall time / n). Alternating keeps every path under the same background load, which matters
    on a shared machine."""
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
            n = await remote()
            b.append((time.perf_counter() - t0) / max(1, n or 1))
    return a, bs


def _worker_pid(worker_id: str) -> str:
    """The pid in a worker id `<host>-<pid>-<hex6>` ("" when it has another form)."""
    parts = str(worker_id).rsplit("-", 2)
    return parts[1] if len(parts) == 3 else ""


async def _start_worker_procs(config, ckpt: str, expert: int, url: str, procs: int) -> list:
    """Start `procs` `ddm-fleet worker` processes of this expert serving as `config` (a `WorkerConfig`);
    wait until each says ready (RuntimeError with its last lines if one exits or takes over 10 minutes)."""
    import asyncio
    import os

    from benchmarks.processes import Child, cli_argv

    cmd = ["worker", "--expert", expert, "--checkpoint", ckpt, "--nats", url, *config.to_argv()]
    env = dict(os.environ)
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # several jax processes share one GPU
    children = []
    try:
        for i in range(procs):
            children.append(await Child.start(f"worker{i}", cli_argv(*cmd), env=env))
        await asyncio.gather(*(c.wait_ready(600) for c in children))
    except BaseException:
        await asyncio.gather(*(c.stop() for c in children), return_exceptions=True)
        raise
    return children


async def bench_worker(args: argparse.Namespace, config) -> dict:
    """Measure every bucket of `config` (a `WorkerConfig`, the worker's serving options) on both paths;
    returns {"setup": {...}, "rows": [...]}, one row per bucket, wire precision and in-flight count."""
    buckets, _ = config.plan()
    import asyncio
    import contextlib
    import os
    import statistics
    import tempfile

    import numpy as np

    from bus.connect import connect
    from bus.nats_server import NatsServer
    from schemas import StepReply, StepRequest, StepResult, pack, subjects, unpack
    from schemas.tensor import to_wire_dtype
    from workers.backends import get_backend
    from workers.service import ExpertWorker

    wires = getattr(args, "wire_dtypes", ("float32",))
    in_flights = getattr(args, "in_flights", (1,))
    procs = int(getattr(args, "worker_procs", 0) or 0)
    if procs and config.backend == "jax":  # this process's model shares the GPU with the worker processes
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    with contextlib.ExitStack() as stack:
        ckpt = args.checkpoint
        if ckpt is None:
            ckpt = _random_checkpoint(
                args.widths, stack.enter_context(tempfile.TemporaryDirectory(prefix="ddm-bench-"))
            )
        backend = get_backend(config.backend, device=config.device, dtype=config.dtype, **config.backend_options())
        await asyncio.to_thread(backend.load, ckpt)
        expert = backend.expert if backend.expert is not None else 0
        url = args.nats or stack.enter_context(NatsServer()).url

        async with contextlib.AsyncExitStack() as serving:
            if procs:
                children = await _start_worker_procs(config, ckpt, expert, url, procs)
                serving.push_async_callback(
                    lambda: asyncio.gather(*(c.stop() for c in children), return_exceptions=True)
                )
                pids = {str(c.pid) for c in children}

                def ours(worker_id: str) -> bool:
                    return _worker_pid(worker_id) in pids
            else:
                worker = await serving.enter_async_context(
                    ExpertWorker(expert, ckpt, backend, config=config, nats_url=url)
                )

                def ours(worker_id: str) -> bool:
                    return worker_id == worker.worker_id

            nc = await connect(url, name="ddm-bench", reconnect=60)
            serving.push_async_callback(nc.close)
            rng = np.random.default_rng(0)
            c, h, w = backend.input_shape
            rows = []
            for b in buckets:
                x = rng.standard_normal((b, c, h, w)).astype(np.float32)
                t = rng.uniform(0, 1, b).astype(np.float32)
                y = rng.integers(0, backend.num_classes, b).astype(np.int64)

                def make_call(wire: str, n: int, forwards: list, x=x, t=t, y=y):
                    async def one() -> None:  # what the coordinator's transport does per request
                        reply_dtype = None if wire == "float32" else wire
                        req = StepRequest(expert=expert, x_t=to_wire_dtype(x, wire), t=t, y=y, reply_dtype=reply_dtype)
                        msg = await nc.request(subjects.expert_velocity(expert), pack(req), timeout=120)
                        reply = unpack(msg.data, StepResult)
                        if not isinstance(reply, StepReply):
                            raise RuntimeError(f"worker answered {reply.code.value}: {reply.message}")
                        if not ours(reply.worker_id):
                            raise ValueError(
                                f"another worker of expert {expert} on {url} answered; bench "
                                "against a server without workers of that expert, or omit --nats"
                            )
                        v = reply.velocity.astype(np.float32, copy=False)
                        if not np.isfinite(v).all():
                            raise RuntimeError(f"the {wire} velocity has NaN/Inf values")
                        forwards.append(reply.batch_rows)

                    async def call() -> int:
                        if n == 1:
                            await one()
                            return 1
                        total, issued = BURST_ROUNDS * n, 0

                        async def lane() -> None:  # one of n pipelined slots: next request as soon as answered
                            nonlocal issued
                            while issued < total:
                                issued += 1
                                await one()

                        await asyncio.gather(*(lane() for _ in range(n)))
                        return total

                    return call

                settings = [(wd, n) for n in in_flights for wd in wires]
                forwards: list[list[int]] = [[] for _ in settings]
                local, buses = await _alternating(
                    lambda x=x, t=t, y=y: backend.forward(x, t, y),
                    [make_call(wd, n, f) for (wd, n), f in zip(settings, forwards)],
                    args.min_time,
                    args.min_iters,
                )
                local_s = statistics.median(local)
                for (wire, n), bus, fw in zip(settings, buses, forwards):
                    bus_s = statistics.median(bus)
                    rows.append(
                        {
                            "bucket": b,
                            "wire_dtype": wire,
                            "in_flight": n,
                            "inprocess_ms": round(local_s * 1000, 3),
                            "inprocess_rows_per_s": round(b / local_s, 1),
                            "nats_ms": round(bus_s * 1000, 3),
                            "nats_rows_per_s": round(b / bus_s, 1),
                            "ratio": round(local_s / bus_s, 3),
                            "iters": len(local),
                            "worker_batch": round(statistics.fmean(fw), 1) if fw else None,
                        }
                    )
        setup = {
            "backend": backend.name,
            "device": backend.device,
            "precision": backend.precision,
            "checkpoint": args.checkpoint or f"random UNet widths={args.widths}",
            "nats": url,
            "in_flight": list(in_flights) if len(in_flights) > 1 else in_flights[0],
            "worker_procs": procs,
            "statistic": "median",
            "worker_defaults_changed": _defaults_in_use(config),
        }
    return {"setup": setup, "rows": rows}


def _defaults_in_use(config) -> dict:
    """{option: {"bench": value, "worker": value}} for each `BENCH_WORKER_DEFAULTS` entry this run kept."""

    def show(v):
        return ",".join(map(str, v)) if isinstance(v, tuple) else v

    out = {}
    for name, (ours, workers) in config.changed_defaults(BENCH_WORKER_DEFAULTS).items():
        if getattr(config, name) == ours:  # not overridden on the command line
            out["--" + name.replace("_", "-")] = {"bench": show(ours), "worker": show(workers)}
    return out


def format_table(results: dict) -> str:
    """One line per bucket, wire precision and in-flight count; `nats ms` is the time per request
    (a burst's wall time / its requests when more than one is in flight)."""
    s = results["setup"]
    flights = s.get("in_flight", 1)
    flights = ",".join(map(str, flights)) if isinstance(flights, list) else str(flights)
    procs = s.get("worker_procs", 0)
    where = f"{procs} worker process(es)" if procs else "worker in this process"
    lines = [
        f"bench worker: backend={s['backend']} device={s['device']} precision={s['precision']} "
        f"model={s['checkpoint']} ({where}; {flights} request(s) in flight; median of alternating calls)"
        + "".join(
            f"; {k} {v['bench']} (ddm-fleet worker: {v['worker']})"
            for k, v in s.get("worker_defaults_changed", {}).items()
        ),
        f"{'bucket':>6} {'wire':>8} {'flight':>6} {'in-proc ms':>11} {'in-proc rows/s':>15} {'nats ms':>9} "
        f"{'nats rows/s':>12} {'ratio':>6} {'fwd rows':>8}",
    ]
    for r in results["rows"]:
        fwd = r.get("worker_batch")
        lines.append(
            f"{r['bucket']:>6} {r.get('wire_dtype', 'float32'):>8} {r.get('in_flight', 1):>6} "
            f"{r['inprocess_ms']:>11.2f} {r['inprocess_rows_per_s']:>15.1f} {r['nats_ms']:>9.2f} "
            f"{r['nats_rows_per_s']:>12.1f} {r['ratio']:>6.3f} {'-' if fwd is None else f'{fwd:g}':>8}"
        )
    return "\n".join(lines)
