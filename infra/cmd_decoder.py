"""Serve an autoencoder's decoder over NATS (a `nats.micro` service in the decoder's queue group).

A latent fleet's coordinator asks a decoder for the pixels of each job's final latents (and of its
preview frames). Loads the autoencoder checkpoint (or a diffusers AutoencoderKL directory, --vae DIR),
then subscribes to
ddm.v1.decoder.<content hash>.decode in queue group ddm.v1.decoder.<content hash>.workers: start the
same command again (on any host) to add capacity. SIGTERM / Ctrl-C: answer what is held, exit 0.

examples:
  ddm-fleet decoder --checkpoint runs/colour-latent/autoencoder.safetensors
  ddm-fleet decoder --checkpoint checkpoints/colour-latent/autoencoder.safetensors --nats nats://10.0.0.5:4222
  ddm-fleet decoder --vae vae/sd-vae-ft-mse      # a diffusers AutoencoderKL saved with save_pretrained
"""

from __future__ import annotations

import argparse
import os


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from bus.options import add_device_option, add_nats_option, add_threads_option
    from schemas.limits import MAX_STEP_ROWS

    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument(
        "--checkpoint",
        "--vae",
        dest="checkpoint",
        required=True,
        metavar="PATH",
        help="autoencoder checkpoint (.safetensors with its .json), or a diffusers AutoencoderKL directory "
        "(save_pretrained; the pretrained extra)",
    )
    add_device_option(parser, help_suffix=", of the decoder")
    add_threads_option(parser, default=None)
    parser.add_argument(
        "--max-request-rows",
        type=int,
        default=MAX_STEP_ROWS,
        metavar="N",
        help=f"refuse decode requests with more latent rows (too_large); default {MAX_STEP_ROWS}, the protocol's "
        "limit (as `ddm-fleet worker --max-request-rows`). The coordinator sends up to 256 rows in one request",
    )
    add_nats_option(
        parser,
        help="NATS server (default: $NATS_URL, else the URL in the file $NATS_URL_FILE, else nats://127.0.0.1:4222)",
    )


def run(args: argparse.Namespace) -> int:
    import asyncio
    import logging
    import signal
    import sys

    from models.autoencoder import AutoencoderError

    log = logging.getLogger("ddm.decoder")
    if not os.path.exists(args.checkpoint):
        print(f"ddm-fleet decoder: checkpoint {args.checkpoint!r} not found", file=sys.stderr)
        return 2
    if args.max_request_rows < 1:
        print("ddm-fleet decoder: --max-request-rows must be >= 1", file=sys.stderr)
        return 2
    if args.threads is not None:
        if args.threads < 1:
            print("ddm-fleet decoder: --threads must be >= 1", file=sys.stderr)
            return 2
        import torch

        torch.set_num_threads(args.threads)

    async def main() -> int:
        from bus.exit_watch import watch_exit
        from workers.decoder_service import DecoderWorker

        worker = DecoderWorker(
            args.checkpoint, nats_url=args.nats, device=args.device, max_request_rows=args.max_request_rows
        )
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await worker.start()
        print(
            f"ready: decoder on {worker.subject} device={args.device} worker_id={worker.worker_id} "
            f"service_id={worker.service_id}",
            flush=True,
        )
        await stop.wait()
        log.info("signal received: finishing held requests")
        watch_exit(what="ddm-fleet decoder")  # a stop that hangs says on what (stderr: the log)
        await worker.stop()
        print(f"stopped: {worker.requests} replies, {worker.errors} errors", flush=True)
        return 0

    try:
        return asyncio.run(main())
    except (AutoencoderError, ValueError, ConnectionError, OSError) as err:
        print(f"ddm-fleet decoder: {err}", file=sys.stderr)
        return 1
