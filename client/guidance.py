"""A job's classifier-free guidance scale on the client side: the `--guidance S` option of `ddm-fleet generate`
and `ddm-fleet bench fleet` (JobRequest.guidance_scale: 1 = off). Needs only `schemas`."""

from __future__ import annotations

import argparse
import math

from schemas.limits import MAX_GUIDANCE_SCALE


def guidance_scale(text: str) -> float:
    """argparse type of `--guidance S`: a finite number in [0, MAX_GUIDANCE_SCALE] (what a job's
    guidance_scale allows), else an ArgumentTypeError saying the range."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a number is needed, got {text!r}") from None
    if not (math.isfinite(v) and 0.0 <= v <= MAX_GUIDANCE_SCALE):
        raise argparse.ArgumentTypeError(f"a guidance scale lies in [0, {MAX_GUIDANCE_SCALE:g}] (1 = off), got {text}")
    return v
