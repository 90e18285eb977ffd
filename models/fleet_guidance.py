"""A fleet's default classifier-free guidance scale, kept in its router's JSON.

The scale a fleet's judges chose (docs/RESULTS.md) belongs to the checkpoints, not to each client: it
lives in `router.json` under "guidance", so `ddm-fleet up --checkpoints DIR` and a coordinator started
with `--router DIR/router.safetensors` serve it to every job that does not set `guidance_scale`, and
`ddm-fleet sample` uses it for experts in DIR. A job's own `guidance_scale` (1 included) overrides it.

    "guidance": {"default_scale": 2.0, "chosen_by": "judge accuracy and FID over s in 1, 1.5, 2, 3, 4"}

    fleet_default_guidance("checkpoints/router.safetensors")     # -> 2.0 (1.0 when the JSON has none)
    set_default_guidance("checkpoints/router.json", 2.0, chosen_by="...")
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from bus.json_file import read_json_file
from schemas.limits import MAX_GUIDANCE_SCALE

KEY = "guidance"


class GuidanceDefaultError(ValueError):
    """A router JSON whose guidance default is not a scale a job could ask for."""


def default_from_meta(meta: dict, where: str = "router JSON") -> float:
    """The default scale in a router's metadata dict: 1.0 (off) when it names none."""
    entry = meta.get(KEY)
    if entry is None:
        return 1.0
    value = entry.get("default_scale") if isinstance(entry, dict) else None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise GuidanceDefaultError(f"{where}: {KEY}.default_scale must be a number, got {value!r}")
    if not 0.0 <= value <= MAX_GUIDANCE_SCALE:
        raise GuidanceDefaultError(f"{where}: {KEY}.default_scale must lie in [0, {MAX_GUIDANCE_SCALE:g}], got {value}")
    return float(value)


def _json_of(path: str | os.PathLike) -> Path:
    p = Path(path)
    return p if p.suffix == ".json" else p.with_suffix(".json")


def fleet_default_guidance(router: str | os.PathLike) -> float:
    """The default scale of the fleet whose router is `router` (.safetensors or .json): 1.0 when its JSON
    is missing or names none. GuidanceDefaultError for a value out of range."""
    path = _json_of(router)
    try:
        meta = read_json_file(path, error=GuidanceDefaultError)
    except FileNotFoundError:
        return 1.0
    return default_from_meta(meta, str(path))


def default_beside(checkpoint: str | os.PathLike) -> float:
    """The default scale of the fleet directory holding `checkpoint` (its router.json), 1.0 if none."""
    return fleet_default_guidance(Path(checkpoint).parent / "router.json")


def set_default_guidance(router: str | os.PathLike, scale: float, **notes) -> Path:
    """Write `scale` (and `notes`, e.g. chosen_by=...) as the fleet's default into the router's JSON."""
    path = _json_of(router)
    meta = read_json_file(path, error=GuidanceDefaultError)
    meta[KEY] = {"default_scale": float(scale), **notes}
    default_from_meta(meta, str(path))  # refuse what a coordinator would refuse
    path.write_text(json.dumps(meta, indent=2) + "\n")
    return path
