"""Tiny random-init checkpoints in the shipped formats, for exercising the serving path cheaply.

One factory for tests, the fuzzer and the benchmarks: real model code and real files (the same
safetensors + JSON a trained expert ships as), small enough that a forward pass costs microseconds
to milliseconds. They are NOT for quality: the weights are random.

    make_tiny_expert(path, expert_id=0)              -> Path of <path>.safetensors
    make_tiny_experts(directory, num_experts=2)      -> [Path, ...] named expert0, expert1, ...
    make_tiny_router(path, num_experts=2)            -> Path of <path>.safetensors (in_channels=3, ...)
    make_tiny_dit(path, expert_id=0)                 -> Path of <path>.safetensors (a DiT expert, "arch": "dit")
    make_tiny_autoencoder(path, seed=0)              -> Path of <path>.safetensors (3x16x16 images <-> 4x8x8 latents)
    make_tiny_latent_fleet(directory)                -> TinyLatentFleet: an autoencoder + experts whose spec names it

Every call with the same arguments writes the same weights (seeded), so two processes that build
"the same" tiny fleet serve identical velocities.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from schemas.spec import ModelSpec

TINY_WIDTHS = (8, 16)


def tiny_config(
    widths: Sequence[int] = TINY_WIDTHS,
    *,
    time_dim: int = 16,
    class_dim: int = 16,
    groups: int = 4,
    null_label: bool = False,
    **shape: int,
):
    """The UNetConfig the factory uses: channel `widths` per level, small embeddings; `null_label`
    adds the unknown-label row (y = -1), as `train-expert --label-dropout` does; `shape` overrides
    in_channels / image_size / num_classes (default 1 x 32 x 32, 10 classes)."""
    from .config import UNetConfig

    return UNetConfig(
        widths=tuple(int(w) for w in widths),
        time_dim=time_dim,
        class_dim=class_dim,
        groups=groups,
        null_label=null_label,
        **shape,
    )


def make_tiny_expert(
    path: str | os.PathLike,
    *,
    expert_id: int = 0,
    widths: Sequence[int] = TINY_WIDTHS,
    seed: int | None = None,
    jitter: float = 0.0,
    classes: Sequence[int] | None = None,
    dtype: str = "float32",
    **config: Any,
) -> Path:
    """Write one random-init expert checkpoint and return its ``.safetensors`` path.

    ``seed`` defaults to ``100 + expert_id``; ``jitter`` adds ``jitter * N(0, 1)`` to every
    parameter (random-init UNets output near-constant velocities; jitter makes experts differ
    visibly); ``classes`` goes into the meta's partition summary (what the oracle strategy and
    evaluation read); ``config`` overrides `tiny_config` keywords (time_dim, class_dim, groups).
    """
    import torch

    from .checkpoint import save_checkpoint, torch_state_to_numpy
    from .unet_torch import UNet

    cfg = tiny_config(widths, **config)
    torch.manual_seed(100 + expert_id if seed is None else seed)
    model = UNet(cfg)
    if jitter:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(jitter * torch.randn_like(p))
    meta: dict[str, Any] = {"config": cfg.to_dict(), "expert_id": int(expert_id)}
    if classes is not None:
        meta["partition"] = {"classes": [int(c) for c in classes]}
    return save_checkpoint(path, torch_state_to_numpy(model.state_dict()), meta, dtype=dtype)


def tiny_dit_config(
    *,
    image_size: int = 32,
    patch_size: int = 4,
    hidden_size: int = 32,
    depth: int = 2,
    num_heads: int = 2,
    null_label: bool = False,
    **config: Any,
):
    """The DiTConfig `make_tiny_dit` uses: 8x8 tokens of width 32, two blocks (keywords override, e.g.
    in_channels=3, mlp_ratio=2.0)."""
    from .config import DiTConfig

    return DiTConfig(
        image_size=image_size,
        patch_size=patch_size,
        hidden_size=hidden_size,
        depth=depth,
        num_heads=num_heads,
        null_label=null_label,
        **config,
    )


def make_tiny_dit(
    path: str | os.PathLike,
    *,
    expert_id: int = 0,
    seed: int | None = None,
    jitter: float = 0.05,
    classes: Sequence[int] | None = None,
    dtype: str = "float32",
    **config: Any,
) -> Path:
    """Write one random-init DiT expert checkpoint ("arch": "dit") and return its ``.safetensors`` path.

    As `make_tiny_expert`, except ``jitter`` defaults to 0.05: a freshly initialised DiT outputs exactly zero
    (adaLN-Zero), so the jitter is what makes its velocity non-trivial; ``config`` overrides `tiny_dit_config`.
    """
    import torch

    from .checkpoint import save_checkpoint, torch_state_to_numpy
    from .dit_torch import DiT

    cfg = tiny_dit_config(**config)
    torch.manual_seed(100 + expert_id if seed is None else seed)
    model = DiT(cfg)
    if jitter:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(jitter * torch.randn_like(p))
    meta: dict[str, Any] = {"arch": "dit", "config": cfg.to_dict(), "expert_id": int(expert_id)}
    if classes is not None:
        meta["partition"] = {"classes": [int(c) for c in classes]}
    return save_checkpoint(path, torch_state_to_numpy(model.state_dict()), meta, dtype=dtype)


def class_block(k: int, num_experts: int) -> list[int]:
    """The ten digits dealt out in contiguous blocks, expert ``k``'s share (2 experts: 0-4 | 5-9), as the
    shipped partition."""
    return list(range((10 * k) // num_experts, (10 * (k + 1)) // num_experts))


def make_tiny_experts(
    directory: str | os.PathLike,
    num_experts: int = 2,
    *,
    prefix: str = "expert",
    split_classes: bool = True,
    **kwargs: Any,
) -> list[Path]:
    """``num_experts`` tiny experts ``<directory>/<prefix><k>``; with ``split_classes`` the ten
    digits are dealt out in contiguous blocks (2 experts: 0-4 | 5-9), as the shipped partition."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    out = []
    for k in range(num_experts):
        classes = class_block(k, num_experts) if split_classes else None
        out.append(make_tiny_expert(directory / f"{prefix}{k}", expert_id=k, classes=classes, **kwargs))
    return out


def make_tiny_router(
    path: str | os.PathLike,
    num_experts: int = 2,
    *,
    seed: int = 5,
    width: int = 8,
    emb_dim: int = 16,
    meta: dict[str, Any] | None = None,
    **shape: int,
) -> Path:
    """Write a random-init RouterNet in the shipped router format; returns the ``.safetensors`` path.
    ``shape`` overrides the RouterConfig's in_channels / image_size / num_classes (default 1 x 32 x 32,
    10 classes); ``meta`` adds to its JSON (e.g. ``{"spec": spec.to_json()}`` to name the classes)."""
    import torch

    from .router import RouterConfig, RouterNet, save_router

    torch.manual_seed(seed)
    net = RouterNet(cfg=RouterConfig(num_experts=num_experts, width=width, emb_dim=emb_dim, **shape))
    return save_router(path, net, {"tiny": True, **(meta or {})})


def make_tiny_autoencoder(
    path: str | os.PathLike,
    *,
    seed: int = 0,
    in_channels: int = 3,
    image_size: int = 16,
    latent_channels: int = 4,
    widths: Sequence[int] = (8, 16),
    scale_factor: float = 1.5,
    shift_factor: float = 0.1,
    latent_range: float = 4.0,
    patch: int = 1,
) -> Path:
    """Write a random-init autoencoder in the shipped format (`models.autoencoder`) and return its
    ``.safetensors`` path; its JSON holds the ``content_hash`` a latent spec's decoder names.

    The defaults map 3x16x16 images to 4x8x8 latents (each width after the first halves the size);
    ``scale_factor`` / ``shift_factor`` / ``latent_range`` go into its spec as a trained one's would;
    ``patch`` folds pixel blocks first (patch 8, widths (8,): 3x256x256 <-> 4x32x32, the seeds' geometry).
    Two seeds give two autoencoders (two content hashes)."""
    import torch

    from .autoencoder import AutoencoderConfig, make_spec, save_autoencoder
    from .autoencoder_torch import Autoencoder
    from .checkpoint import torch_state_to_numpy

    cfg = AutoencoderConfig(
        in_channels=in_channels,
        image_size=image_size,
        latent_channels=latent_channels,
        widths=tuple(widths),
        patch=patch,
    )
    torch.manual_seed(seed)
    meta = {
        "config": cfg.to_dict(),
        "spec": make_spec(cfg, scale_factor=scale_factor, shift_factor=shift_factor, latent_range=latent_range),
    }
    return save_autoencoder(path, torch_state_to_numpy(Autoencoder(cfg).state_dict()), meta)


@dataclass(frozen=True)
class TinyLatentFleet:
    """What `make_tiny_latent_fleet` wrote (``.safetensors`` paths) and the latent spec every model carries."""

    autoencoder: Path
    spec: ModelSpec
    experts: list[Path] = field(default_factory=list)
    router: Path | None = None
    monolith: Path | None = None


def make_tiny_latent_fleet(
    directory: str | os.PathLike,
    num_experts: int = 2,
    *,
    image_size: int = 16,
    autoencoder_seed: int = 0,
    scale_factor: float = 1.5,
    shift_factor: float = 0.1,
    latent_range: float = 4.0,
    jitter: float = 0.05,
    router: bool = False,
    monolith: bool = False,
    autoencoder_patch: int = 1,
    autoencoder_widths: Sequence[int] = (8, 16),
) -> TinyLatentFleet:
    """A tiny latent fleet in ``directory``, laid out as `up`, the evaluation and the benchmarks find one:

    ``autoencoder`` (`make_tiny_autoencoder`: 3 x image_size^2 RGB <-> 4 x (image_size/2)^2 latents by default;
    ``autoencoder_patch`` 8 and ``autoencoder_widths`` (8,) make 256px images of 4x32x32 latents) and
    ``num_experts`` latent experts ``expert<k>`` (the ten classes dealt out as `make_tiny_experts` does,
    ``jitter`` as `make_tiny_expert`), each with a spec that says ``space: latent``, names the autoencoder as
    its decoder and has ``value_range`` +-``latent_range`` (as `ddm-fleet data encode` records); with
    ``router`` a `make_tiny_router` of that spec, with ``monolith`` a ``monolith`` expert of all ten classes."""
    from schemas.spec import ModelSpec, legacy_spec

    from .autoencoder import decoder_name

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    ae = make_tiny_autoencoder(
        directory / "autoencoder",
        seed=autoencoder_seed,
        image_size=image_size,
        scale_factor=scale_factor,
        shift_factor=shift_factor,
        latent_range=latent_range,
        patch=autoencoder_patch,
        widths=autoencoder_widths,
    )
    ae_meta = json.loads(ae.with_suffix(".json").read_text())
    channels, size, _ = ae_meta["spec"]["latent_shape"]
    spec = ModelSpec.from_json(
        {
            **legacy_spec(in_channels=channels, image_size=size).to_json(),
            "space": "latent",
            "decoder": decoder_name(ae_meta["content_hash"]),
            "value_range": [-float(latent_range), float(latent_range)],
        }
    )

    def expert(name: str, expert_id: int, classes: Sequence[int]) -> Path:
        path = make_tiny_expert(
            directory / name, expert_id=expert_id, in_channels=channels, image_size=size, jitter=jitter, classes=classes
        )
        js = path.with_suffix(".json")
        js.write_text(json.dumps({**json.loads(js.read_text()), "spec": spec.to_json()}))
        return path

    experts = [expert(f"expert{k}", k, class_block(k, num_experts)) for k in range(num_experts)]
    router_path = None
    if router:
        router_path = make_tiny_router(
            directory / "router", num_experts, in_channels=channels, image_size=size, meta={"spec": spec.to_json()}
        )
    mono = expert("monolith", 0, range(10)) if monolith else None
    return TinyLatentFleet(autoencoder=ae, spec=spec, experts=experts, router=router_path, monolith=mono)
