"""Bytes on the bus per image: the expert step request and reply for images of a given shape, as the
coordinator and workers pack them (`schemas.wire.pack`), per image and per job of S steps, and for a
latent fleet the one decode request and reply at the end.

    python -m benchmarks.wire_bytes                      # grey 1x32x32, RGB 3x32x32, latent 4x16x16
    python -m benchmarks.wire_bytes --shape latent:4x32x32 --image 3x256x256 --steps 50 --wire-dtype float16
"""

from __future__ import annotations

import argparse

import numpy as np

from schemas.messages import DecodeReply, DecodeRequest, StepReply, StepRequest
from schemas.wire import pack

DEFAULT_SHAPES = ("1x32x32", "3x32x32", "latent:4x16x16")


def step_bytes(shape: tuple[int, ...], batch: int, wire_dtype: str = "float32") -> float:
    """Request + reply bytes of one batched expert call, per row."""
    x = np.random.default_rng(0).standard_normal((batch, *shape)).astype(wire_dtype)
    rows = [f"job-{i}" for i in range(batch)]
    req = StepRequest(expert=0, x_t=x, t=np.full(batch, 0.5, np.float32), y=np.zeros(batch, np.int64), row_ids=rows)
    rep = StepReply(expert=0, velocity=x, row_ids=rows)
    return (len(pack(req)) + len(pack(rep))) / batch


def decode_bytes(latent: tuple[int, ...], image: tuple[int, ...], batch: int) -> float:
    """Decode request (latents) + reply (images) bytes per image."""
    z = np.zeros((batch, *latent), np.float32)
    x = np.zeros((batch, *image), np.float32)
    req = DecodeRequest(decoder="0" * 64, latents=z)
    rep = DecodeReply(decoder="0" * 64, images=x)
    return (len(pack(req)) + len(pack(rep))) / batch


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.wire_bytes",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--shape",
        action="append",
        help="CxHxW of pixel samples, latent:CxHxW of latents decoded to --image (repeatable; default: "
        + ", ".join(DEFAULT_SHAPES)
        + ")",
    )
    p.add_argument("--steps", type=int, default=40, help="solver steps per job (default %(default)s)")
    p.add_argument("--batch", type=int, default=64, help="rows per expert call (default %(default)s)")
    p.add_argument("--wire-dtype", default="float32", choices=("float32", "float16"), help="tensor dtype on the wire")
    p.add_argument("--image", default="3x32x32", help="a latent shape's decoded image, CxHxW (default %(default)s)")
    args = p.parse_args(argv)
    image = tuple(int(v) for v in args.image.split("x"))
    print(f"| sample shape | bytes per image per step | MB per image, {args.steps} steps | decode, bytes per image |")
    print("|---|---:|---:|---:|")
    for text in args.shape or DEFAULT_SHAPES:
        latent = text.startswith("latent:")
        shape = tuple(int(v) for v in text.removeprefix("latent:").split("x"))
        per_step = step_bytes(shape, args.batch, args.wire_dtype)
        dec = decode_bytes(shape, image, args.batch) if latent else None
        total = per_step * args.steps + (dec or 0)
        print(f"| {text} | {per_step:,.0f} | {total / 1e6:.2f} | {'-' if dec is None else f'{dec:,.0f}'} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
