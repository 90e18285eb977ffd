"""A checkpoint's model spec (`schemas.spec.ModelSpec`): read from its metadata, or implied for
checkpoints written before specs existed.

Every checkpoint kind (expert, router, monolith, distilled student) stores its spec under `"spec"` in
its JSON. `spec_of(meta)` returns it; a checkpoint without one gets the spec its `config` implies
(in_channels x image_size x image_size pixels, `num_classes` classes, the UNet; the shipped MNIST
checkpoints: 1x32x32, 10 classes). `with_spec(meta, spec)` writes it.
"""

from __future__ import annotations

from schemas.spec import ModelSpec, SpecError, legacy_spec


def spec_of(meta: dict, where: str = "checkpoint") -> ModelSpec:
    """The model spec of a checkpoint's metadata dict (expert, router, monolith or student).
    Raises SpecError (a ValueError) naming `where` when the stored spec is malformed, or when it
    contradicts the checkpoint's own config (sample shape or class count)."""
    if not isinstance(meta, dict):
        raise SpecError(f"{where}: metadata is not a JSON object")
    cfg = meta.get("config") if isinstance(meta.get("config"), dict) else {}
    if "spec" in meta:
        if not isinstance(meta["spec"], dict):
            raise SpecError(f"{where}: 'spec' must be a JSON object, got {type(meta['spec']).__name__}")
        spec = ModelSpec.from_json(meta["spec"], where=where)
        _check_against_config(spec, cfg, where)
        return spec
    try:
        return legacy_spec(
            in_channels=int(cfg.get("in_channels", 1)),
            image_size=int(cfg.get("image_size", 32)),
            num_classes=int(cfg.get("num_classes", 10)),
            null_label=bool(cfg.get("null_label", False)),
            arch=str(meta.get("arch", "unet")),
        )
    except (TypeError, ValueError) as err:
        raise SpecError(f"{where}: cannot imply a spec from its config {cfg}: {err}") from None


def with_spec(meta: dict, spec: ModelSpec) -> dict:
    """`meta` with `spec` stored under "spec" (a new dict; `meta` is not changed)."""
    return {**meta, "spec": spec.to_json()}


def _check_against_config(spec: ModelSpec, cfg: dict, where: str) -> None:
    c, h, w = spec.sample_shape
    problems = []
    if "in_channels" in cfg and int(cfg["in_channels"]) != c:
        problems.append(f"config in_channels {cfg['in_channels']} != spec channels {c}")
    if "image_size" in cfg and (int(cfg["image_size"]) != h or int(cfg["image_size"]) != w):
        problems.append(f"config image_size {cfg['image_size']} != spec sample size {h}x{w}")
    if "num_classes" in cfg and spec.conditioning.kind == "class" and int(cfg["num_classes"]) != spec.num_classes:
        problems.append(f"config num_classes {cfg['num_classes']} != spec num_classes {spec.num_classes}")
    if problems:
        raise SpecError(f"{where}: spec and config disagree: " + "; ".join(problems))
