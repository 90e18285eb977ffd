"""Serve one expert model over NATS (a `nats.micro` service in the expert's queue group).

Loads the checkpoint with the chosen backend, warms every bucket size, then subscribes to
ddm.v1.expert.<K>.velocity in queue group ddm.v1.expert.<K>.workers: start the same command on
another host to add capacity. Concurrent requests are batched, padded to a bucket size and run in
one forward pass. SIGTERM / Ctrl-C: stop taking work, answer what is held, drain, exit 0
(a second signal exits at once).

examples:
  ddm-fleet worker --expert 0 --checkpoint checkpoints/expert0.safetensors
  ddm-fleet worker --expert 1 --checkpoint checkpoints/expert1.safetensors --backend jax
  ddm-fleet worker --expert 0 --checkpoint ck/expert0.safetensors --backend xla   # PJRT_DEVICE=CPU|NEURON
  ddm-fleet worker --expert 0 --checkpoint ... --bf16 --metrics-port 9477 --nats nats://10.0.0.5:4222
  ddm-fleet worker --expert 0 --checkpoint ck/expert0.safetensors --backend sim --sim-preset h200-jax  # no model
  NATS_URL_FILE=/etc/ddm-fleet/worker.url ddm-fleet worker --expert 0 --checkpoint ...   # URL with a password

Metrics bind 127.0.0.1 unless --metrics-host says otherwise. Replies go only to `_INBOX` reply
subjects; at most --max-inflight requests are held (then `overloaded`).
"""

from __future__ import annotations

import argparse
import os


#: `workers.backends.sim_backend.PRESETS` names (listed here so building the parser imports no numpy).
SIM_PRESETS = ("h200-torch", "h200-jax", "instant")


def sim_options(args: argparse.Namespace) -> dict:
    """Backend options for `--backend sim` from --sim-preset / --sim-batch-ms / --sim-row-ms."""
    opts = {"preset": args.sim_preset, "batch_ms": args.sim_batch_ms, "row_ms": args.sim_row_ms}
    return {k: v for k, v in opts.items() if v is not None}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from bus.nats_server import default_nats_url

    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--expert", type=int, required=True, metavar="K", help="expert id this worker serves")
    parser.add_argument("--checkpoint", required=True, metavar="PATH",
                        help="expert checkpoint (.safetensors with its .json next to it)")
    parser.add_argument("--backend", choices=("torch", "xla", "jax", "sim"), default="torch",
                        help="model runtime (default: torch). sim: a simulated expert, no model: it sleeps "
                             "batch_ms + row_ms * padded rows per batch and returns a closed-form velocity "
                             "toward a fixed per-class image; decoding, validation, batching and replies stay "
                             "real (the checkpoint still gives shape, classes and expert id), so dozens of "
                             "'GPU' workers fit on one CPU box")
    parser.add_argument("--sim-preset", choices=SIM_PRESETS, default=None,
                        help="sim backend latency: h200-torch (3.33 ms + 0.00575 ms/row, the default), h200-jax "
                             "(2.20 ms + 0.0165 ms/row; both fitted to the H200 table in docs/DEPLOYMENT.md), "
                             "instant (0 + 0)")
    parser.add_argument("--sim-batch-ms", type=float, default=None, metavar="MS",
                        help="sim backend: fixed milliseconds per batch (overrides the preset)")
    parser.add_argument("--sim-row-ms", type=float, default=None, metavar="MS",
                        help="sim backend: milliseconds per padded row (overrides the preset)")
    parser.add_argument("--device", default=None,
                        help="torch: cpu | cuda[:N] (default cpu); xla: xla[:N]; jax: cpu | gpu[:N] | tpu[:N]")
    parser.add_argument("--nats", default=default_nats_url(), metavar="URL",
                        help="NATS server, or a comma-separated list of a cluster's nodes (default: $NATS_URL, else "
                             "the URL in the file $NATS_URL_FILE, else nats://127.0.0.1:4222). Prefer the environment "
                             "or the file for URLs with a password: the command line is visible in `ps`; a shipped "
                             "example password (change-me) is refused")
    parser.add_argument("--buckets", default="1,2,4,8,16,32,64,128",
                        help="batch sizes compiled and padded to (default: 1,2,4,8,16,32,64,128)")
    parser.add_argument("--max-batch", type=int, default=None, metavar="N",
                        help="most rows per forward pass (default: the largest bucket, 128; must fit a bucket)")
    parser.add_argument("--merge", choices=("auto", "always"), default="auto",
                        help="merging queued requests into one forward pass: auto (default) merges where the warm "
                             "forward times say one bigger pass is at least 10%% cheaper than two (a GPU/XLA device, "
                             "whose cost is mostly fixed, merges; a CPU, whose cost grows with the rows, runs them "
                             "one after another so each answer goes back sooner); always: fill every pass up to "
                             "--max-batch")
    parser.add_argument("--max-request-rows", type=int, default=None, metavar="N",
                        help="refuse requests with more rows (too_large); default: the protocol limit 512")
    parser.add_argument("--max-queue-rows", type=int, default=4096, metavar="N",
                        help="answer `overloaded` when this many rows already wait (default 4096)")
    parser.add_argument("--bf16", action="store_true", help="bfloat16 compute (torch autocast / xla autocast / jax cast)")
    parser.add_argument("--metrics-port", type=int, default=None, metavar="P",
                        help="also serve Prometheus text metrics on http://HOST:P/metrics (conventional port: "
                             "9477; default and 0: off)")
    parser.add_argument("--metrics-host", default=None, metavar="HOST",
                        help="interface the metrics bind (default 127.0.0.1, loopback only; 0.0.0.0 for a "
                             "Prometheus on another machine)")
    parser.add_argument("--max-inflight", type=int, default=None, metavar="N",
                        help="answer `overloaded` while this many requests are held (default 4096)")
    parser.add_argument("--xla-cache", default=None, metavar="DIR",
                        help="xla backend: persistent compile cache directory (or $XLA_PERSISTENT_CACHE_PATH)")
    parser.add_argument("--connect-attempts", type=int, default=10, metavar="N",
                        help="tries for the first connection (reconnects after that are unlimited; default 10)")
    parser.add_argument("--threads", type=int, default=None, help="torch backend: intra-op CPU threads")


def run(args: argparse.Namespace) -> int:
    import asyncio
    import logging
    import signal
    import sys

    from workers.backends import BackendError
    from workers.batcher import parse_buckets

    log = logging.getLogger("ddm.worker")
    try:
        buckets = parse_buckets(args.buckets)
    except ValueError as err:
        print(f"ddm-fleet worker: {err}", file=sys.stderr)
        return 2
    if not os.path.exists(args.checkpoint):
        print(f"ddm-fleet worker: checkpoint {args.checkpoint!r} not found", file=sys.stderr)
        return 2
    opts: dict = {}
    if args.backend == "xla" and args.xla_cache:
        opts["cache_path"] = args.xla_cache
    if args.backend == "torch" and args.threads:
        opts["threads"] = args.threads
    if args.backend == "sim":
        opts.update(sim_options(args))
    elif any(v is not None for v in (args.sim_preset, args.sim_batch_ms, args.sim_row_ms)):
        print("ddm-fleet worker: --sim-preset / --sim-batch-ms / --sim-row-ms need --backend sim", file=sys.stderr)
        return 2

    async def main() -> int:
        from workers.service import ExpertWorker

        from schemas.limits import MAX_STEP_ROWS

        worker = ExpertWorker(
            args.expert, args.checkpoint, args.backend, device=args.device, bf16=args.bf16, nats_url=args.nats,
            buckets=buckets, max_batch=args.max_batch, metrics_port=args.metrics_port or None,
            max_request_rows=args.max_request_rows or MAX_STEP_ROWS, backend_options=opts,
            connect_attempts=args.connect_attempts, max_queue_rows=args.max_queue_rows, merge=args.merge,
            **({"metrics_host": args.metrics_host} if args.metrics_host else {}),
            **({"max_inflight": args.max_inflight} if args.max_inflight is not None else {}),
        )
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()

        def on_signal() -> None:
            if stop.is_set():  # a second signal: give up on the graceful drain
                print("second signal: exiting now without draining", file=sys.stderr, flush=True)
                os._exit(130)
            stop.set()

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_signal)
        start = asyncio.create_task(worker.start())
        waiter = asyncio.create_task(stop.wait())
        await asyncio.wait({start, waiter}, return_when=asyncio.FIRST_COMPLETED)
        if not start.done():  # signal during load / warm-up: abandon start
            start.cancel()
            await asyncio.gather(start, return_exceptions=True)
            await worker.stop()
            return 0
        start.result()  # raises start-up errors
        meta = worker.metadata()
        print(f"ready: expert {args.expert} on {meta['subject']} backend={meta['backend']} device={meta['device']} "
              f"buckets={meta['buckets']} service_id={worker.service_id}"
              + (f" metrics={worker.metrics_host}:{args.metrics_port}/metrics" if args.metrics_port else ""), flush=True)
        await waiter
        log.info("signal received: finishing held requests and draining")
        await worker.stop()
        print(f"stopped: {worker.metrics.replies} replies, {worker.metrics.error_total} errors", flush=True)
        return 0

    try:
        return asyncio.run(main())
    except (ValueError, ConnectionError, OSError, BackendError) as err:
        print(f"ddm-fleet worker: {err}", file=sys.stderr)
        return 1
