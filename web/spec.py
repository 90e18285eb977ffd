"""The fleet's model spec as the viewer uses it: fetched from the coordinator, sent to the page.

The web server asks the coordinator for the fleet's spec (`client.jobs.fleet_status(nc, spec=True)`) with
every fleet snapshot. A coordinator older than specs answers without one: its fleet is the MNIST fleet,
`schemas.spec.legacy_spec()` (1x32x32 pixels in [-1, 1], ten classes "0"-"9"). No answer keeps the spec
the viewer had (at start: the legacy spec, `known` false).

The page gets it as one message, on connect and whenever it changes:

    {"type": "spec", "known": true,            # false: assumed (no coordinator has answered yet)
     "sample_shape": [3, 32, 32], "channels": 3, "size": [32, 32],
     "tile_channels": 3,                       # what each tile carries: 1 (grey) or 3 (RGB), web/frames.py
     "value_range": [-1.0, 1.0], "space": "pixels",
     "conditioning": "class", "num_classes": 10, "null_label": false,
     "class_names": ["airplane", ...],         # always num_classes names ("0", "1", ... when the spec has none)
     "digits": false,                          # true for the MNIST fleet: the page says "digit 3"
     "decoder": null,                          # a latent fleet's autoencoder, "autoencoder@sha256:<hash>"
     "default_guidance_scale": 2.0}            # what a job that names no scale gets (null: not said)

A latent fleet (`space: "latent"`): `sample_shape` is the latents' shape; the page draws the decoder's
images (previews and final images, web/frames.py), not the latents, and says which decoder the fleet uses.

Which field a job request names its labels with (`wire_label_field`): `digits` for a fleet of ten classes
(every label fits the v1 field, and a coordinator older than `labels` refuses unknown keys), `labels`
for any other class count (only a coordinator that knows `labels` serves such a fleet).
"""

from __future__ import annotations

import logging
from typing import Any, NamedTuple

from schemas.spec import ModelSpec, legacy_spec

log = logging.getLogger(__name__)

#: The class names of the MNIST fleet: its labels are digits, and the page says "digit 3".
DIGIT_NAMES = [str(i) for i in range(10)]


def class_names(spec: ModelSpec) -> list[str]:
    """The spec's class names; "0", "1", ... for a class spec without names; [] when unconditional."""
    cond = spec.conditioning
    if cond.kind != "class":
        return []
    return list(cond.class_names) if cond.class_names is not None else [str(i) for i in range(cond.num_classes)]


def is_digit_fleet(spec: ModelSpec) -> bool:
    """True when the fleet's classes are the ten digits "0"-"9" (the MNIST fleet)."""
    return spec.conditioning.kind == "class" and class_names(spec) == DIGIT_NAMES


def wire_label_field(spec: ModelSpec) -> str:
    """ "digits" for a fleet of ten classes (v1-compatible), else "labels" (see the module docstring)."""
    return "digits" if spec.conditioning.kind == "class" and spec.num_classes == 10 else "labels"


class FleetSpec(NamedTuple):
    """What the coordinator said of its fleet: the model spec, and the guidance scale a job that names
    none gets (None: a coordinator that does not say)."""

    spec: ModelSpec
    default_guidance_scale: float | None = None


def spec_message(spec: ModelSpec, *, known: bool = True, default_guidance_scale: float | None = None) -> dict[str, Any]:
    """The page's `spec` message (see the module docstring)."""
    from .frames import tile_channels

    c, h, w = spec.sample_shape
    return {
        "type": "spec",
        "known": known,
        "sample_shape": [c, h, w],
        "channels": c,
        "size": [h, w],
        "tile_channels": tile_channels(c),
        "value_range": list(spec.value_range),
        "space": spec.space,
        "conditioning": spec.conditioning.kind,
        "num_classes": spec.num_classes,
        "null_label": spec.conditioning.null_label,
        "class_names": class_names(spec),
        "digits": is_digit_fleet(spec),
        "decoder": spec.decoder,
        "default_guidance_scale": default_guidance_scale,
    }


async def fetch_spec(nc, *, timeout: float = 0.5) -> FleetSpec | None:
    """The fleet's spec from the coordinator: its `spec` (or `legacy_spec()` from a coordinator older than
    specs) and its default guidance scale; None when no coordinator answers (or its answer does not
    decode): keep the one you have."""
    from client.jobs import JobFailed, fleet_status
    from schemas import ProtocolError

    try:
        status = await fleet_status(nc, timeout=timeout, spec=True)
    except JobFailed:
        return None
    except ProtocolError as err:
        log.warning("the coordinator's fleet status does not decode: %s", err.message)
        return None
    spec = status.spec if status.spec is not None else legacy_spec()
    return FleetSpec(spec, status.default_guidance_scale)
