"""`ddm-fleet data encode`: cache the latents of a prepared dataset (needs torch: the training extra).

  ddm-fleet data encode --autoencoder PATH --data DIR [--out DIR] [--dtype float16|float32] [--force]
  ddm-fleet data encode --vae DIR --data DIR ...       (a diffusers AutoencoderKL, the pretrained extra)

Encodes every split of DIR once with a `ddm-fleet train-autoencoder` checkpoint (or a diffusers
AutoencoderKL saved with `save_pretrained`, models/vae_diffusers.py) into a latent cache
(default `<DIR>-latents`; training/encode_latents.py), which partition, train-expert and train-router
take as `--data`. The same data and autoencoder again do nothing; an --out holding another
autoencoder's cache is refused (--force replaces it). The options are parsed by infra/cmd_data.py.
"""

from __future__ import annotations

import argparse
import sys


def _usage(msg: str) -> int:
    print(f"ddm-fleet data: error: {msg}", file=sys.stderr)
    return 2


def run_encode(args: argparse.Namespace) -> int:
    if args.autoencoder is None or args.data is None:
        return _usage("encode needs --autoencoder PATH (or --vae DIR) and --data DIR")
    if args.batch_size < 1:
        return _usage(f"--batch-size must be positive, got {args.batch_size}")
    try:
        import safetensors  # noqa: F401
        import torch
    except ImportError as exc:  # a base install
        print(
            f"error: `data encode` needs the training extra (pip install 'ddm-fleet[training]'): {exc}", file=sys.stderr
        )
        return 1
    from models.autoencoder import AutoencoderError
    from training.encode_latents import encode_dataset

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    try:
        result = encode_dataset(
            args.autoencoder, args.data, args.out, dtype=args.dtype, batch_size=args.batch_size, force=args.force
        )
    except AutoencoderError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    m = result.manifest
    counts = ", ".join(f"{s} {i['count']}" for s, i in m["splits"].items())
    shape = f"{m['channels']}x{m['size']}x{m['size']}"
    if result.built:
        print(f"encoded {args.data} into {result.path}: {shape} {args.dtype} latents, {counts}")
    else:
        print(f"latent cache is up to date at {result.path} (same data and autoencoder; nothing to do): {counts}")
    print(f"decoder: {m['latent']['decoder']}")
    print(f"content hash: {m['content_hash']}")
    return 0
