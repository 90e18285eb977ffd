"""The KL autoencoder's config and checkpoint format (numpy only; the network is models/autoencoder_torch.py).

An autoencoder maps images [C, H, W] (the prepared dataset's model range, [-1, 1]) to latents
[c, H/f, W/f] and back. Latent experts train on its *scaled* latents

    z = (mean(x) - shift_factor) * scale_factor        # mean of the encoder's posterior

with `shift_factor` / `scale_factor` measured on the train data so that z has mean 0 and variance 1
(the flow's noise is N(0, I)); decoding undoes the scaling first.

A checkpoint is a pair of files, like the experts':

* `<name>.safetensors`  the encoder's and decoder's weights (float32 torch state_dict names);
* `<name>.json`:
    {"format": "ddm-fleet-autoencoder/1",
     "config": AutoencoderConfig.to_dict(),
     "spec": {"image_shape": [3, 32, 32], "value_range": [-1, 1], "latent_shape": [4, 8, 8],
              "downsample": 4, "scale_factor": 1.23, "shift_factor": 0.01, "latent_range": [-5, 5]},
     "dataset": {...},                          # the prepared dataset it was trained on
     "training": {"steps": ..., "val_psnr_db": ..., ...},
     "weights_sha256": "...",                   # of the .safetensors file
     "content_hash": "..."}                     # of the weights + config + spec: names this autoencoder

`content_hash` identifies the latent space: a latent cache and every latent expert name it (the experts'
spec says `"decoder": "autoencoder@sha256:<content_hash>"`), so latents of one autoencoder are never
decoded by another.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np

from models.checkpoint import checkpoint_paths, read_meta_json

FORMAT = "ddm-fleet-autoencoder/1"
DECODER_PREFIX = "autoencoder@sha256:"


class AutoencoderError(ValueError):
    """An autoencoder checkpoint or config is missing, malformed or does not fit the data."""


@dataclass(frozen=True)
class AutoencoderConfig:
    """The network's shape. `widths`: channels per resolution level; each level after the first halves
    the size, so the downsampling factor is patch * 2 ** (len(widths) - 1): (16, 32) maps 32x32 to 16x16,
    (16, 32, 64) to 8x8. `patch` (default 1): the encoder first folds each patch x patch block of pixels
    into channels (space-to-depth) and the decoder unfolds its output the same way, so large images cost
    convolutions at 1/patch of their side: patch 8, widths (64,) maps 3x256x256 to 4x32x32 (the 8x
    geometry of Stable Diffusion's autoencoder)."""

    in_channels: int = 3
    image_size: int = 32
    latent_channels: int = 4
    widths: tuple[int, ...] = (16, 32)
    groups: int = 8
    patch: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "widths", tuple(int(w) for w in self.widths))
        if not self.widths:
            raise AutoencoderError("widths must list at least one width, e.g. 32,64,64")
        for name in ("in_channels", "image_size", "latent_channels", "groups", "patch"):
            if int(getattr(self, name)) < 1:
                raise AutoencoderError(f"{name} must be positive, got {getattr(self, name)}")
        bad = [w for w in self.widths if w < 1 or w % self.groups]
        if bad:
            raise AutoencoderError(f"every width must be a positive multiple of {self.groups} (GroupNorm), got {bad}")
        if self.image_size % self.downsample:
            raise AutoencoderError(
                f"patch {self.patch} and {len(self.widths)} widths downsample by {self.downsample}, which must "
                f"divide the image size {self.image_size}; give fewer widths or a smaller patch"
            )

    @property
    def downsample(self) -> int:
        return self.patch * 2 ** (len(self.widths) - 1)

    @property
    def latent_shape(self) -> tuple[int, int, int]:
        s = self.image_size // self.downsample
        return (self.latent_channels, s, s)

    @property
    def image_shape(self) -> tuple[int, int, int]:
        return (self.in_channels, self.image_size, self.image_size)

    def to_dict(self) -> dict:
        """The JSON form; `patch` appears only when it is not 1, so an autoencoder made before it existed
        keeps its content hash."""
        d = {
            f.name: (list(getattr(self, f.name)) if f.name == "widths" else getattr(self, f.name)) for f in fields(self)
        }
        if d["patch"] == 1:
            del d["patch"]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> AutoencoderConfig:
        known = {f.name for f in fields(cls)}
        if not isinstance(d, dict) or set(d) - known:
            raise AutoencoderError(f"bad autoencoder config {d!r}; known keys are {sorted(known)}")
        try:
            return cls(**d)
        except TypeError as exc:
            raise AutoencoderError(f"bad autoencoder config {d!r}: {exc}") from None


def decoder_name(content_hash: str) -> str:
    """The model spec's `decoder` string for latents of the autoencoder with `content_hash`."""
    return DECODER_PREFIX + content_hash


def content_hash_of(decoder: str) -> str | None:
    """The autoencoder content hash a spec's `decoder` names (None when it names no autoencoder of ours)."""
    return decoder[len(DECODER_PREFIX) :] if decoder and decoder.startswith(DECODER_PREFIX) else None


def _canonical(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def compute_content_hash(weights_sha256: str, config: dict, spec: dict) -> str:
    """sha256 over the weights' sha256, the config and the spec (scale and shift included)."""
    return hashlib.sha256(weights_sha256.encode() + b"\n" + _canonical(config) + b"\n" + _canonical(spec)).hexdigest()


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def make_spec(cfg: AutoencoderConfig, *, scale_factor: float, shift_factor: float, latent_range: float) -> dict:
    """The checkpoint's spec block (image and latent shapes, downsampling, the latent scaling)."""
    return {
        "image_shape": list(cfg.image_shape),
        "value_range": [-1.0, 1.0],
        "latent_shape": list(cfg.latent_shape),
        "downsample": cfg.downsample,
        "scale_factor": float(scale_factor),
        "shift_factor": float(shift_factor),
        "latent_range": [-float(latent_range), float(latent_range)],
    }


def save_autoencoder(path: str | os.PathLike, state: dict, meta: dict) -> Path:
    """Write `<path>.safetensors` + `<path>.json` atomically; `meta` holds "config" (dict) and "spec".
    Returns the .safetensors path; the JSON gets format, weights_sha256 and content_hash."""
    from safetensors.numpy import save_file

    st_path, json_path = checkpoint_paths(path)
    st_path.parent.mkdir(parents=True, exist_ok=True)
    arrays = {k: np.ascontiguousarray(np.asarray(v, dtype=np.float32)) for k, v in state.items()}
    tmp = st_path.with_name(st_path.name + f".tmp{os.getpid()}")
    save_file(arrays, str(tmp), metadata={"format": FORMAT})
    os.replace(tmp, st_path)
    weights_sha = _sha256(st_path)
    meta = {
        "format": FORMAT,
        **meta,
        "weights_sha256": weights_sha,
        "content_hash": compute_content_hash(weights_sha, meta["config"], meta["spec"]),
    }
    tmp = json_path.with_name(json_path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(meta, indent=2) + "\n")
    os.replace(tmp, json_path)
    return st_path


def load_autoencoder_meta(path: str | os.PathLike) -> dict:
    """The JSON half of an autoencoder checkpoint, checked (format, config, spec, content hash fields)."""
    st_path, json_path = checkpoint_paths(path)
    if not json_path.is_file():
        raise AutoencoderError(
            f"autoencoder metadata {json_path} not found; train one with `ddm-fleet train-autoencoder`"
        )
    meta = read_meta_json(json_path, FORMAT, "an autoencoder", AutoencoderError)
    for key in ("config", "spec", "weights_sha256", "content_hash"):
        if key not in meta:
            raise AutoencoderError(f"{json_path}: missing {key!r}; retrain or re-save it")
    cfg = AutoencoderConfig.from_dict(meta["config"])
    spec = meta["spec"]
    if not isinstance(spec, dict) or list(spec.get("latent_shape", [])) != list(cfg.latent_shape):
        raise AutoencoderError(
            f"{json_path}: spec {spec!r} does not match its config's latent shape {cfg.latent_shape}"
        )
    for key in ("scale_factor", "shift_factor"):
        if not isinstance(spec.get(key), (int, float)) or not np.isfinite(spec[key]):
            raise AutoencoderError(f"{json_path}: spec.{key} must be a finite number, got {spec.get(key)!r}")
    if compute_content_hash(meta["weights_sha256"], meta["config"], spec) != meta["content_hash"]:
        raise AutoencoderError(f"{json_path}: content_hash does not match its weights, config and spec (edited?)")
    return meta


def load_autoencoder(path: str | os.PathLike, verify_hash: bool = True) -> tuple[dict, dict[str, np.ndarray]]:
    """(meta, float32 state) of an autoencoder checkpoint; AutoencoderError on any mismatch."""
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    st_path, json_path = checkpoint_paths(path)
    if not st_path.is_file():
        raise AutoencoderError(f"autoencoder weights {st_path} not found")
    meta = load_autoencoder_meta(st_path)
    if verify_hash and _sha256(st_path) != meta["weights_sha256"]:
        raise AutoencoderError(
            f"{st_path} does not match the sha256 in {json_path.name}: the two files come from different saves"
        )
    try:
        raw = load_file(str(st_path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise AutoencoderError(f"{st_path}: cannot read safetensors: {exc}") from None
    return meta, {k: v.astype(np.float32) for k, v in raw.items()}
