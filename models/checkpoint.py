"""The one expert checkpoint format, shared by every backend (torch, torch_xla, jax/flax).

A checkpoint is a pair of files next to each other:

* `<name>.safetensors`  weights under torch `state_dict` names, stored fp16 (shipping) or fp32;
* `<name>.json`         metadata:
    {"format": "ddm-fleet-expert/1",
     "arch": "unet",                            # or "dit"; absent = "unet" (checkpoints made before DiT)
     "config": UNetConfig.to_dict(),            # or DiTConfig.to_dict(); checked against the weights on load
     "expert_id": 0,
     "partition": {"file": "checkpoints/partition.json", "classes": [0, 1, 2, 3, 4], ...},
     "time_convention": "t0_noise_t1_data",
     "weights_dtype": "float16",
     "weights_sha256": "...",                   # of the .safetensors file, catches mismatched pairs
     "training": {"steps": ..., "final_loss": ..., ...}}

`save_checkpoint(path, state, meta)` / `load_checkpoint(path) -> (meta, state)` work on numpy only; weights
always come back as float32. `torch_to_flax_params` / `flax_to_torch_state` map parameter names 1:1.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from bus.json_file import read_json_file
from models.arch import ModelConfig, arch_name, config_from_meta
from models.config import DiTConfig

FORMAT = "ddm-fleet-expert/1"
TIME_CONVENTION = "t0_noise_t1_data"  # same string as schemas.TIME_CONVENTION


class CheckpointError(ValueError):
    """A checkpoint is missing, malformed, or does not match the expected architecture."""


# ----------------------------------------------------------------------------------------------- shapes
def _resblock_shapes(prefix: str, cin: int, cout: int, emb: int) -> dict[str, tuple[int, ...]]:
    s = {
        f"{prefix}.norm1.weight": (cin,),
        f"{prefix}.norm1.bias": (cin,),
        f"{prefix}.conv1.weight": (cout, cin, 3, 3),
        f"{prefix}.conv1.bias": (cout,),
        f"{prefix}.emb_proj.weight": (cout, emb),
        f"{prefix}.emb_proj.bias": (cout,),
        f"{prefix}.norm2.weight": (cout,),
        f"{prefix}.norm2.bias": (cout,),
        f"{prefix}.conv2.weight": (cout, cout, 3, 3),
        f"{prefix}.conv2.bias": (cout,),
    }
    if cin != cout:
        s[f"{prefix}.skip.weight"] = (cout, cin, 1, 1)
        s[f"{prefix}.skip.bias"] = (cout,)
    return s


def state_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Expected torch state_dict name -> shape for `UNet(cfg)` or `DiT(cfg)`, computed without importing torch."""
    if isinstance(cfg, DiTConfig):
        return _dit_state_shapes(cfg)
    w, e, td = cfg.widths, cfg.emb_dim, cfg.time_dim
    s: dict[str, tuple[int, ...]] = {
        "time_fc1.weight": (td, td),
        "time_fc1.bias": (td,),
        "time_fc2.weight": (td, td),
        "time_fc2.bias": (td,),
        "class_emb.weight": (cfg.num_classes + int(cfg.null_label), cfg.class_dim),  # + null row
        "conv_in.weight": (w[0], cfg.in_channels, 3, 3),
        "conv_in.bias": (w[0],),
    }
    prev = w[0]
    for i, wi in enumerate(w):
        s.update(_resblock_shapes(f"enc.{i}", prev, wi, e))
        prev = wi
    for i in range(2):
        s.update(_resblock_shapes(f"mid.{i}", w[-1], w[-1], e))
    for i, wi in enumerate(w):
        above = w[i + 1] if i + 1 < len(w) else w[-1]
        s.update(_resblock_shapes(f"dec.{i}", above + wi, wi, e))
    s.update(
        {
            "norm_out.weight": (w[0],),
            "norm_out.bias": (w[0],),
            "conv_out.weight": (cfg.in_channels, w[0], 3, 3),
            "conv_out.bias": (cfg.in_channels,),
        }
    )
    return s


def _dit_state_shapes(cfg: DiTConfig) -> dict[str, tuple[int, ...]]:
    d, m, p = cfg.hidden_size, cfg.mlp_hidden, cfg.patch_size
    s: dict[str, tuple[int, ...]] = {
        "patch_embed.weight": (d, cfg.in_channels, p, p),
        "patch_embed.bias": (d,),
        "time_fc1.weight": (d, cfg.time_freq_dim),
        "time_fc1.bias": (d,),
        "time_fc2.weight": (d, d),
        "time_fc2.bias": (d,),
        "class_emb.weight": (cfg.num_classes + int(cfg.null_label), d),  # + null row
    }
    for i in range(cfg.depth):
        b = f"blocks.{i}"
        s.update(
            {
                f"{b}.attn.qkv.weight": (3 * d, d),
                f"{b}.attn.qkv.bias": (3 * d,),
                f"{b}.attn.proj.weight": (d, d),
                f"{b}.attn.proj.bias": (d,),
                f"{b}.mlp.fc1.weight": (m, d),
                f"{b}.mlp.fc1.bias": (m,),
                f"{b}.mlp.fc2.weight": (d, m),
                f"{b}.mlp.fc2.bias": (d,),
                f"{b}.ada.weight": (6 * d, d),
                f"{b}.ada.bias": (6 * d,),
            }
        )
    s.update(
        {
            "final.ada.weight": (2 * d, d),
            "final.ada.bias": (2 * d,),
            "final.linear.weight": (p * p * cfg.in_channels, d),
            "final.linear.bias": (p * p * cfg.in_channels,),
        }
    )
    return s


def _describe(cfg: ModelConfig) -> str:
    if isinstance(cfg, DiTConfig):
        return (
            f"DiT config hidden_size={cfg.hidden_size} depth={cfg.depth} patch_size={cfg.patch_size} "
            f"mlp_ratio={cfg.mlp_ratio} in_channels={cfg.in_channels}"
        )
    return f"config widths={list(cfg.widths)} time_dim={cfg.time_dim} class_dim={cfg.class_dim}"


def check_state(state: dict[str, np.ndarray], cfg: ModelConfig) -> None:
    """Raise CheckpointError naming every missing, unexpected or mis-shaped tensor."""
    want = state_shapes(cfg)
    problems = []
    missing = sorted(set(want) - set(state))
    extra = sorted(set(state) - set(want))
    if missing:
        problems.append(f"missing {len(missing)} tensors (e.g. {missing[:3]})")
    if extra:
        problems.append(f"unexpected {len(extra)} tensors (e.g. {extra[:3]})")
    bad = [
        f"{k}: {tuple(state[k].shape)} != {want[k]}"
        for k in sorted(set(want) & set(state))
        if tuple(state[k].shape) != want[k]
    ]
    if bad:
        problems.append(f"{len(bad)} shape mismatches (e.g. {bad[:3]})")
    if problems:
        raise CheckpointError(f"weights do not match {_describe(cfg)}: " + "; ".join(problems))


# ------------------------------------------------------------------------------------------- save / load
def checkpoint_paths(path: str | os.PathLike) -> tuple[Path, Path]:
    """(.safetensors, .json) of a two-file checkpoint path given with either suffix or none.

    The one helper for the expert, router and autoencoder checkpoints (all the same two-file shape)."""
    p = Path(path)
    if p.suffix == ".json":
        p = p.with_suffix(".safetensors")
    elif p.suffix != ".safetensors":
        p = p.with_name(p.name + ".safetensors")
    return p, p.with_suffix(".json")


def read_meta_json(json_path: Path, fmt: str, kind: str, error: type[ValueError]) -> dict:
    """The parsed `.json` half of a two-file checkpoint, checked to be a JSON object whose "format" is `fmt`.

    kind names the checkpoint in the message ("an expert", "a router", "an autoencoder"); error is the
    caller's ValueError subclass, raised when the file cannot be read, is not valid JSON or has another format.
    The caller checks that the file exists first (its message says how to make one)."""
    try:
        meta = read_json_file(json_path, error=error)  # bounded size and depth: a fleet may be handed any file
    except OSError as exc:
        raise error(f"{json_path} cannot be read: {exc}") from None
    if not isinstance(meta, dict) or meta.get("format") != fmt:
        got = meta.get("format") if isinstance(meta, dict) else None
        raise error(f"{json_path}: not {kind} checkpoint (format {got!r}, expected {fmt!r})")
    return meta


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def save_checkpoint(path: str | Path, state: dict[str, Any], meta: dict, dtype: str = "float32") -> Path:
    """Write `<path>.safetensors` + `<path>.json`; returns the .safetensors path.

    state: torch state_dict names -> arrays (numpy or anything np.asarray accepts), float.
    meta: must hold "config" (a UNetConfig / DiTConfig, or its dict with "arch" beside it: "unet" when absent);
    "expert_id", "partition", "training" recommended. The JSON always records "arch".
    dtype: "float16" (shipping, half the size) or "float32".
    """
    from safetensors.numpy import save_file

    if dtype not in ("float16", "float32"):
        raise CheckpointError(f"dtype must be 'float16' or 'float32', got {dtype!r}")
    meta = dict(meta)
    if "config" not in meta:
        raise CheckpointError("meta must contain 'config' (the UNetConfig or DiTConfig of these weights)")
    try:
        cfg = config_from_meta(meta)
    except ValueError as e:
        raise CheckpointError(f"bad 'config' / 'arch' in meta: {e}") from None
    arrays = {k: np.ascontiguousarray(np.asarray(v, dtype=np.float32).astype(dtype)) for k, v in state.items()}
    check_state(arrays, cfg)
    st_path, json_path = checkpoint_paths(path)
    st_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = st_path.with_name(st_path.name + ".tmp")
    save_file(arrays, str(tmp), metadata={"format": FORMAT})
    tmp.replace(st_path)
    meta.update(
        format=FORMAT, arch=arch_name(cfg), config=cfg.to_dict(), weights_dtype=dtype, weights_sha256=_sha256(st_path)
    )
    meta.setdefault("time_convention", TIME_CONVENTION)
    tmp = json_path.with_name(json_path.name + ".tmp")
    tmp.write_text(json.dumps(meta, indent=2, sort_keys=False) + "\n")
    tmp.replace(json_path)
    return st_path


def load_meta(path: str | Path) -> dict:
    """Read and validate only the JSON half of a checkpoint."""
    st_path, json_path = checkpoint_paths(path)
    if not json_path.exists():
        raise CheckpointError(f"checkpoint metadata {json_path} not found (expected next to {st_path.name})")
    meta = read_meta_json(json_path, FORMAT, "an expert", CheckpointError)
    if meta.get("time_convention") != TIME_CONVENTION:
        raise CheckpointError(
            f"{json_path}: time_convention {meta.get('time_convention')!r} is not "
            f"{TIME_CONVENTION!r}; this fleet integrates from t=0 noise to t=1 data"
        )
    try:
        meta["config"] = config_from_meta(meta).to_dict()
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{json_path}: bad 'config': {e}") from None
    return meta


def load_checkpoint(
    path: str | Path, expect: ModelConfig | None = None, verify_hash: bool = True
) -> tuple[dict, dict[str, np.ndarray]]:
    """Load a checkpoint -> (meta, state) with every tensor float32 numpy.

    expect: if given, refuse a checkpoint whose config differs from it.
    Raises CheckpointError (a ValueError) with a message saying what does not match.
    """
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    st_path, json_path = checkpoint_paths(path)
    if not st_path.exists():
        raise CheckpointError(f"checkpoint weights {st_path} not found")
    meta = load_meta(st_path)
    cfg = config_from_meta(meta)
    if expect is not None and cfg != expect:
        raise CheckpointError(
            f"{json_path}: {arch_name(cfg)} config {cfg.to_dict()} does not match the expected "
            f"{arch_name(expect)} config {expect.to_dict()}"
        )
    if verify_hash and meta.get("weights_sha256") and meta["weights_sha256"] != _sha256(st_path):
        raise CheckpointError(
            f"{st_path} does not match the sha256 recorded in {json_path.name}: "
            "the .safetensors and .json come from different saves"
        )
    try:
        raw = load_file(str(st_path))
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{st_path}: cannot read safetensors: {e}") from None
    state = {k: v.astype(np.float32) for k, v in raw.items()}
    try:
        check_state(state, cfg)
    except CheckpointError as e:
        raise CheckpointError(f"{st_path}: {e}") from None
    return meta, state


# ------------------------------------------------------------------------------------ framework helpers
def torch_state_to_numpy(state_dict) -> dict[str, np.ndarray]:
    """torch state_dict -> {name: float32 numpy array} (detached, on CPU, contiguous NCHW)."""
    return {k: v.detach().float().cpu().contiguous().numpy() for k, v in state_dict.items()}


def _flax_leaf(name: str, value: np.ndarray) -> tuple[str, np.ndarray]:
    if name.startswith("class_emb."):
        return "embedding", value
    if value.ndim == 4:  # conv [O, I, kh, kw] -> [kh, kw, I, O]
        return "kernel", value.transpose(2, 3, 1, 0)
    if value.ndim == 2:  # linear [O, I] -> [I, O]
        return "kernel", value.T
    if name.endswith(".weight"):  # GroupNorm
        return "scale", value
    return "bias", value


def torch_to_flax_params(state: dict[str, np.ndarray], cfg: ModelConfig) -> dict:
    """torch state_dict names -> nested flax `params` dict for `unet_flax.UNet(cfg)` / `dit_flax.DiT(cfg)`
    (numpy leaves).

    `enc.0.conv1.weight` -> params["enc_0"]["conv1"]["kernel"] (transposed to HWIO), `blocks.0.attn.qkv.weight`
    -> params["blocks_0"]["attn"]["qkv"]["kernel"] (transposed to [in, out]), and so on.
    """
    check_state(state, cfg)
    params: dict = {}
    for name, value in state.items():
        parts = name.split(".")
        mods, out = [], parts[:-1]
        i = 0
        while i < len(out):
            if i + 1 < len(out) and out[i + 1].isdigit():
                mods.append(f"{out[i]}_{out[i + 1]}")
                i += 2
            else:
                mods.append(out[i])
                i += 1
        leaf, arr = _flax_leaf(name, np.asarray(value, dtype=np.float32))
        node = params
        for m in mods:
            node = node.setdefault(m, {})
        node[leaf] = np.ascontiguousarray(arr)
    return params


def flax_to_torch_state(params) -> dict[str, np.ndarray]:
    """Inverse of `torch_to_flax_params`: flax params tree -> torch state_dict names, float32 numpy."""
    out: dict[str, np.ndarray] = {}

    def walk(node, path):
        for key, val in node.items():
            if isinstance(val, dict) or hasattr(val, "items"):
                walk(val, path + [key])
                continue
            mods = []
            for p in path:
                head, _, idx = p.rpartition("_")
                mods.extend([head, idx] if idx.isdigit() and head else [p])
            arr = np.asarray(val, dtype=np.float32)
            if key == "kernel":
                arr = arr.transpose(3, 2, 0, 1) if arr.ndim == 4 else arr.T
            suffix = "bias" if key == "bias" else "weight"
            out[".".join(mods + [suffix])] = np.ascontiguousarray(arr)

    walk(params, [])
    return out


def load_torch_model(path: str | Path, device: str = "cpu"):
    """Convenience: build the checkpoint's torch model (`unet_torch.UNet` or `dit_torch.DiT`), eval mode, fp32.
    Returns (model, meta)."""
    import torch

    from models.arch import build_torch

    meta, state = load_checkpoint(path)
    model = build_torch(meta)
    model.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()})
    return model.to(device).eval(), meta
