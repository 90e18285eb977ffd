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
  ddm-fleet worker --expert 0 --checkpoint ... --dtype float32 --metrics-port 9477 --nats nats://10.0.0.5:4222
  ddm-fleet worker --expert 0 --checkpoint ck/expert0.safetensors --backend sim --sim-preset h200-jax  # no model
  NATS_URL_FILE=/etc/ddm-fleet/worker.url ddm-fleet worker --expert 0 --checkpoint ...   # URL with a password

Metrics bind 127.0.0.1 unless --metrics-host says otherwise. Replies go only to `_INBOX` reply
subjects; at most --max-inflight requests are held (then `overloaded`).
"""

from __future__ import annotations

import argparse
import os

from workers.choices import SIM_PRESETS  # noqa: F401 (the presets `--sim-preset` accepts)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from bus.options import add_nats_option
    from workers.config import WorkerConfig

    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--expert", type=int, required=True, metavar="K", help="expert id this worker serves")
    parser.add_argument(
        "--checkpoint", required=True, metavar="PATH", help="expert checkpoint (.safetensors with its .json next to it)"
    )
    add_nats_option(
        parser,
        help="NATS server, or a comma-separated list of a cluster's nodes (default: $NATS_URL, "
        "else the URL in the file $NATS_URL_FILE, else nats://127.0.0.1:4222). Prefer the "
        "environment or the file for URLs with a password: the command line is visible in "
        "`ps`; a shipped example password (change-me) is refused",
    )
    WorkerConfig.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    import asyncio
    import logging
    import signal
    import sys

    from workers.backends import BackendError
    from workers.config import WorkerConfig

    log = logging.getLogger("ddm.worker")
    try:
        config = WorkerConfig.from_args(args)
    except ValueError as err:
        print(f"ddm-fleet worker: {err}", file=sys.stderr)
        return 2
    if not os.path.exists(args.checkpoint):
        print(f"ddm-fleet worker: checkpoint {args.checkpoint!r} not found", file=sys.stderr)
        return 2

    async def main() -> int:
        from bus.exit_watch import watch_exit
        from workers.service import ExpertWorker

        worker = ExpertWorker(args.expert, args.checkpoint, config=config, nats_url=args.nats)
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
            # the load / warm-up thread cannot be interrupted (a --compile warm-up runs for tens of
            # seconds) and asyncio.run would wait for it: nothing is subscribed yet, so leave now
            print("stopped during start-up", flush=True)
            sys.stderr.flush()
            os._exit(0)
        start.result()  # raises start-up errors
        meta = worker.metadata()
        print(
            f"ready: expert {args.expert} on {meta['subject']} backend={meta['backend']} device={meta['device']} "
            f"buckets={meta['buckets']} service_id={worker.service_id}"
            + (f" metrics={worker.metrics_host}:{config.metrics_port}/metrics" if config.metrics_port else ""),
            flush=True,
        )
        await waiter
        log.info("signal received: finishing held requests and draining")
        watch_exit(what="ddm-fleet worker")  # a stop that hangs says on what (stderr: the log)
        await worker.stop()
        print(f"stopped: {worker.metrics.replies} replies, {worker.metrics.error_total} errors", flush=True)
        return 0

    try:
        return asyncio.run(main())
    except (ValueError, ConnectionError, OSError, BackendError) as err:
        print(f"ddm-fleet worker: {err}", file=sys.stderr)
        return 1
