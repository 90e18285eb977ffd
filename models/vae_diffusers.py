"""A diffusers `AutoencoderKL` as a latent codec (the `diffusers` backend of models/codec.py).

A user downloads a VAE once and saves it (`AutoencoderKL.from_pretrained(...).save_pretrained(DIR)`);
`--vae DIR` (or `--autoencoder DIR`, `decoder --checkpoint DIR`) then loads it with diffusers' own
`AutoencoderKL.from_pretrained(DIR, local_files_only=True)`: local files only, never the network. DIR
holds `config.json` (`_class_name: AutoencoderKL`) and the weights; a pipeline directory with such a
`vae/` folder works too.

    vae = DiffusersVAE.load("vae/sd-vae-ft-mse", image_shape=(3, 32, 32))
    z = vae.encode(images)   # float [N, 3, H, W] in [-1, 1] -> (posterior mean - shift_factor) * scaling_factor
    x = vae.decode(z)        # -> float32 [N, 3, H, W] clipped to [-1, 1]

The latent scaling is the config's `scaling_factor` and `shift_factor` (0 when unset), as diffusers'
pipelines apply them. The content hash that names the latent space is sha256 over the weights files
(name and sha256 of each) and the config (keys starting with `_`, such as the diffusers version that
saved it, left out; `_class_name` kept). diffusers and torch are imported inside functions: reading the
config and hash (`read_info`) needs neither, loading needs the `pretrained` extra.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np

from bus.json_file import read_json_file
from models.autoencoder import AutoencoderError
from models.codec_types import CodecInfo, check_array

CLASS_NAME = "AutoencoderKL"
WEIGHT_SUFFIXES = (".safetensors", ".bin")
EXTRA = "pip install 'ddm-fleet[pretrained]'"
DEFAULT_SCALING = 0.18215  # diffusers' AutoencoderKL default when a config has none


def _config_of(d: Path) -> dict | None:
    try:
        cfg = read_json_file(d / "config.json")  # bounded size and depth
    except (OSError, ValueError):
        return None
    return cfg if isinstance(cfg, dict) and cfg.get("_class_name") == CLASS_NAME else None


def vae_dir(path: str | os.PathLike) -> Path | None:
    """The directory holding the AutoencoderKL's config.json: `path`, or `path/vae` (a pipeline); None
    when neither is one."""
    p = Path(path)
    for d in (p, p / "vae"):
        if _config_of(d) is not None:
            return d
    return None


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def content_hash(d: Path, config: dict) -> str:
    """sha256 over each weights file (name + sha256) and the config (without `_` keys but `_class_name`)."""
    weights = sorted(p for p in d.iterdir() if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES))
    if not weights:
        raise AutoencoderError(f"VAE {d}: no weights file (*.safetensors or *.bin) next to its config.json")
    kept = {k: v for k, v in config.items() if not k.startswith("_") or k == "_class_name"}
    h = hashlib.sha256(b"diffusers-autoencoderkl\n")
    for p in weights:
        h.update(f"{p.name} {_sha256(p)}\n".encode())
    h.update(json.dumps(kept, sort_keys=True, separators=(",", ":")).encode())
    return h.hexdigest()


def _positive_int(cfg: dict, key: str, d: Path, default=None) -> int:
    v = cfg.get(key, default)
    if isinstance(v, (list, tuple)) and v and all(x == v[0] for x in v):
        v = v[0]  # sample_size may be [S, S]
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise AutoencoderError(f"VAE {d}/config.json: {key} must be a positive integer, got {v!r}")
    return v


def read_info(path: str | os.PathLike) -> CodecInfo:
    """The CodecInfo of the diffusers VAE at `path` (config read and checked, weights hashed; no torch)."""
    d = vae_dir(path)
    if d is None:
        raise AutoencoderError(
            f"{path} is not a diffusers AutoencoderKL directory (no config.json with _class_name "
            f"{CLASS_NAME!r}, here or in {Path(path) / 'vae'}); save one with `AutoencoderKL.save_pretrained(DIR)`, "
            "or give a `ddm-fleet train-autoencoder` checkpoint (.safetensors)"
        )
    cfg = _config_of(d)
    widths = cfg.get("block_out_channels")
    if not isinstance(widths, (list, tuple)) or not widths:
        raise AutoencoderError(f"VAE {d}/config.json: block_out_channels must list the widths, got {widths!r}")
    scale = cfg.get("scaling_factor", DEFAULT_SCALING)
    shift = cfg.get("shift_factor")
    shift = 0.0 if shift is None else shift
    for key, v in (("scaling_factor", scale), ("shift_factor", shift)):
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not np.isfinite(v):
            raise AutoencoderError(f"VAE {d}/config.json: {key} must be a finite number, got {v!r}")
    if scale == 0:
        raise AutoencoderError(f"VAE {d}/config.json: scaling_factor must not be 0")
    size = _positive_int(cfg, "sample_size", d, 32)
    return CodecInfo(
        backend="diffusers",
        path=str(d),
        content_hash=content_hash(d, cfg),
        image_shape=(_positive_int(cfg, "in_channels", d, 3), size, size),
        latent_channels=_positive_int(cfg, "latent_channels", d, 4),
        downsample=2 ** (len(widths) - 1),
        scale_factor=float(scale),
        shift_factor=float(shift),
        latent_range=None,
        fixed_size=False,
    )


class DiffusersVAE:
    """A diffusers AutoencoderKL behind the codec API (numpy in, numpy out). Encodes any image size whose
    sides its downsampling divides; decodes latents up to the size of its config's `sample_size` (or of
    the images it was loaded for); `image_shape` / `latent_shape` are the ones it was loaded for."""

    def __init__(self, model, info: CodecInfo, device: str = "cpu", image_shape=None):
        self.model = model
        self.info = info
        self.device = device
        self.image_shape: tuple[int, int, int] = tuple(int(v) for v in (image_shape or info.image_shape))
        self.latent_shape = info.latent_shape_for(self.image_shape)
        # the largest latents decoded: those of its config's sample size, or of the images it was loaded for
        # (a request for huge latents could take the decoder's memory)
        self.max_side = max(*info.latent_shape[1:], *self.latent_shape[1:])
        self.value_range = info.value_range
        self.scale, self.shift = info.scale_factor, info.shift_factor

    @property
    def content_hash(self) -> str:
        return self.info.content_hash

    @classmethod
    def load(cls, path: str | os.PathLike, device: str = "cpu", image_shape=None) -> DiffusersVAE:
        """`AutoencoderKL.from_pretrained(dir, local_files_only=True)`, in float32 on `device`, eval mode."""
        info = read_info(path)
        if image_shape is not None:
            info.latent_shape_for(image_shape)
        try:
            from diffusers import AutoencoderKL
        except ImportError as exc:
            raise AutoencoderError(f"a diffusers VAE ({path}) needs the pretrained extra ({EXTRA}): {exc}") from None
        try:
            model = AutoencoderKL.from_pretrained(info.path, local_files_only=True, low_cpu_mem_usage=False)
        except (OSError, ValueError, RuntimeError, KeyError, TypeError) as exc:
            raise AutoencoderError(f"diffusers could not load the VAE at {info.path}: {exc}") from None
        return cls(model.float().to(device).eval(), info, device, image_shape)

    def latent_shape_error(self, shape) -> str | None:
        """None when latents [c, h, w] of this shape can be decoded, else what is expected."""
        shape = tuple(shape)
        if len(shape) == 3 and shape[0] == self.info.latent_channels and 1 <= min(shape[1:]) <= max(shape[1:]):
            if max(shape[1:]) <= self.max_side:
                return None
        return f"latents must be {self._latents_wanted('B')}"

    def _images_ok(self, shape) -> bool:
        try:
            self.info.latent_shape_for(shape)
        except AutoencoderError:
            return False
        return True

    def encode(self, images: np.ndarray, batch_size: int = 64) -> np.ndarray:
        """images float [N, C, H, W] in [-1, 1] -> scaled latents float32 [N, c, H/f, W/f] (posterior mean)."""
        import torch

        c, f = self.info.image_shape[0], self.info.downsample
        x = check_array(images, self._images_ok, f"[N, {c}, H, W] with H and W multiples of {f}", "images")
        out = np.empty((len(x), *self.info.latent_shape_for(x.shape[1:])), np.float32)
        with torch.no_grad():
            for i in range(0, len(x), batch_size):
                xb = torch.from_numpy(np.ascontiguousarray(x[i : i + batch_size], dtype=np.float32)).to(self.device)
                mean = self.model.encode(xb).latent_dist.mean
                out[i : i + len(xb)] = ((mean - self.shift) * self.scale).float().cpu().numpy()
        return out

    def decode(self, latents: np.ndarray, batch_size: int = 64) -> np.ndarray:
        """scaled latents float [N, c, h, w] -> images float32 [N, C, h*f, w*f] clipped to [-1, 1] (C: the
        config's out_channels)."""
        import torch

        z = check_array(latents, lambda s: self.latent_shape_error(s) is None, self._latents_wanted("N"), "latents")
        lo, hi = self.value_range
        parts = []
        with torch.no_grad():
            for i in range(0, len(z), batch_size):
                zb = torch.from_numpy(np.ascontiguousarray(z[i : i + batch_size], dtype=np.float32)).to(self.device)
                xb = self.model.decode(zb / self.scale + self.shift).sample  # [b, out_channels, h*f, w*f]
                parts.append(xb.clamp(lo, hi).float().cpu().numpy())
        if not parts:  # no rows
            f = self.info.downsample
            return np.zeros((0, int(self.model.config.out_channels), z.shape[2] * f, z.shape[3] * f), np.float32)
        return np.concatenate(parts)

    def _latents_wanted(self, batch: str) -> str:
        return f"[{batch}, {self.info.latent_channels}, h, w] with h, w <= {self.max_side}"
