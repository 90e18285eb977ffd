"""The latent codec protocol: what `data encode`, the decoder service and `up` need of an autoencoder.

Two backends, one file each, behind the same small API:

* our KL autoencoder (`ddm-fleet train-autoencoder`, models/autoencoder_torch.py `LatentCodec`): a
  checkpoint `<name>.safetensors` + `<name>.json`;
* a diffusers `AutoencoderKL` saved with `save_pretrained` (models/vae_diffusers.py `DiffusersVAE`): a
  directory with `config.json` and the weights (or a pipeline directory with such a `vae/`); needs the
  `pretrained` extra.

    info = codec_info(path)                 # cheap: config + weights hash, no network built (no torch)
    codec = load_codec(path, image_shape=(3, 32, 32))
    z = codec.encode(images)                # float [N, C, H, W] in [-1, 1] -> scaled latents float32
    x = codec.decode(z)                     # scaled latents -> float32 images clipped to [-1, 1]

Scaled latents are z = (posterior mean - shift_factor) * scale_factor for both. `info.content_hash`
names the latent space: a latent cache, every latent expert's spec (`decoder:
autoencoder@sha256:<content hash>`) and the decoder's subject carry it, whatever the backend.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from models.autoencoder import AutoencoderError


@dataclass(frozen=True)
class CodecInfo:
    """What names and shapes a codec's latent space, read without building the network.

    `image_shape` is the codec's default (our autoencoder's only) image shape; `fixed_size` False means
    any image whose sides are multiples of `downsample` is accepted (a convolutional VAE)."""

    backend: str
    path: str
    content_hash: str
    image_shape: tuple[int, int, int]
    latent_channels: int
    downsample: int
    scale_factor: float
    shift_factor: float
    latent_range: float | None = None  # |z| bound measured when it was made (None: not known)
    fixed_size: bool = True
    value_range: tuple[float, float] = (-1.0, 1.0)

    def latent_shape_for(self, image_shape) -> tuple[int, int, int]:
        """Latent [c, h, w] of images [C, H, W]; AutoencoderError when this codec cannot take them."""
        c, h, w = (int(v) for v in image_shape)
        shown = "x".join(map(str, (c, h, w)))
        if self.fixed_size and (c, h, w) != tuple(self.image_shape):
            raise AutoencoderError(
                f"autoencoder {self.path} takes {'x'.join(map(str, self.image_shape))} images, not {shown}; "
                "train an autoencoder on this dataset (`ddm-fleet train-autoencoder`)"
            )
        if c != self.image_shape[0]:
            raise AutoencoderError(f"VAE {self.path} takes {self.image_shape[0]}-channel images, not {shown}")
        if h % self.downsample or w % self.downsample:
            raise AutoencoderError(
                f"VAE {self.path} downsamples by {self.downsample}, which must divide the image sides ({shown})"
            )
        return (self.latent_channels, h // self.downsample, w // self.downsample)

    @property
    def latent_shape(self) -> tuple[int, int, int]:
        return self.latent_shape_for(self.image_shape)

    def spec(self) -> dict:
        """The spec dict a latent cache and the decoder describe this codec with."""
        return {
            "backend": self.backend,
            "image_shape": list(self.image_shape),
            "value_range": list(self.value_range),
            "latent_shape": list(self.latent_shape),
            "downsample": self.downsample,
            "scale_factor": self.scale_factor,
            "shift_factor": self.shift_factor,
            "latent_range": None if self.latent_range is None else [-self.latent_range, self.latent_range],
            "fixed_size": self.fixed_size,
        }


class Codec(Protocol):
    """A loaded codec (numpy in, numpy out). `image_shape` / `latent_shape`: the shapes it was loaded for."""

    info: CodecInfo
    image_shape: tuple[int, int, int]
    latent_shape: tuple[int, int, int]
    value_range: tuple[float, float]

    @property
    def content_hash(self) -> str: ...

    def encode(self, images: np.ndarray, batch_size: int = 256) -> np.ndarray: ...

    def decode(self, latents: np.ndarray, batch_size: int = 256) -> np.ndarray: ...

    def latent_shape_error(self, shape) -> str | None: ...


def check_array(x, shape_ok, wanted: str, what: str) -> np.ndarray:
    """`x` as a float array [N, ...] whose item shape passes `shape_ok`; AutoencoderError saying what
    was expected otherwise (wrong shape, integers, NaN or inf). Shared by both backends."""
    x = np.asarray(x)
    if x.ndim != 4 or not shape_ok(tuple(x.shape[1:])):
        raise AutoencoderError(f"{what} must be {wanted}, got {list(x.shape)}")
    if not np.issubdtype(x.dtype, np.floating):
        raise AutoencoderError(f"{what} must be float (images in [-1, 1], latents scaled), got {x.dtype}")
    if not np.isfinite(x).all():
        raise AutoencoderError(f"{what} hold non-finite values (NaN or inf)")
    return x


def codec_info(path: str | os.PathLike) -> CodecInfo:
    """The CodecInfo of an autoencoder checkpoint or a diffusers VAE directory (checked; no torch)."""
    if Path(path).is_dir():
        from models.vae_diffusers import read_info

        return read_info(path)
    from models.autoencoder import checkpoint_paths, load_autoencoder_meta

    return info_from_meta(load_autoencoder_meta(path), str(checkpoint_paths(path)[0]))


def info_from_meta(meta: dict, path: str) -> CodecInfo:
    """The CodecInfo of our autoencoder from its checkpoint JSON (models/autoencoder.py)."""
    spec = meta["spec"]
    image_shape = tuple(int(v) for v in spec["image_shape"])
    lr = spec.get("latent_range")
    return CodecInfo(
        backend="autoencoder",
        path=path,
        content_hash=meta["content_hash"],
        image_shape=image_shape,
        latent_channels=int(spec["latent_shape"][0]),
        downsample=int(spec["downsample"]),
        scale_factor=float(spec["scale_factor"]),
        shift_factor=float(spec["shift_factor"]),
        latent_range=float(lr[1]) if lr else None,
        fixed_size=True,
        value_range=tuple(float(v) for v in spec.get("value_range", (-1.0, 1.0))),
    )


def codec_in(directory: str | os.PathLike) -> Path | None:
    """The autoencoder a fleet directory holds: `autoencoder.safetensors`, else a diffusers VAE
    directory `vae/`; None when it holds neither."""
    d = Path(directory)
    if (d / "autoencoder.safetensors").exists():
        return d / "autoencoder.safetensors"
    if (d / "vae" / "config.json").exists():
        return d / "vae"
    return None


def fleet_codec(spec, directories, given: str | os.PathLike | None = None) -> Path | None:
    """For a model spec with `space: latent`, the autoencoder that decodes its samples: `given`, else the
    first of `directories` that holds one (`codec_in`), checked to be the one the spec names. None for a
    pixel spec. AutoencoderError (a ValueError) saying what is missing or which autoencoder differs."""
    if getattr(spec, "space", "pixel") != "latent":
        return None
    from models.autoencoder import content_hash_of

    want = content_hash_of(spec.decoder or "")
    if want is None:
        raise AutoencoderError(f"the spec says space latent with decoder {spec.decoder!r}, which names no autoencoder")
    if given is not None:
        path = Path(given)
    else:
        dirs = [Path(d) for d in directories if d]
        path = next((p for p in map(codec_in, dirs) if p is not None), None)
        if path is None:
            where = " or ".join(str(d / "autoencoder.safetensors") for d in dirs) or "no directory"
            raise AutoencoderError(
                f"these checkpoints make latents of {spec.decoder}: their autoencoder is needed as {where} "
                "(or a diffusers VAE directory vae/ there)"
            )
    got = codec_info(path).content_hash
    if got != want:
        raise AutoencoderError(f"{path} is autoencoder {got[:12]}…, but the spec names {want[:12]}…")
    return path


def load_codec(path: str | os.PathLike, device: str = "cpu", image_shape=None) -> Codec:
    """Load the codec at `path` (either backend). `image_shape`: the images it will see (a diffusers VAE
    takes any size its downsampling divides; default: its config's sample_size)."""
    if Path(path).is_dir():
        from models.vae_diffusers import DiffusersVAE

        return DiffusersVAE.load(path, device=device, image_shape=image_shape)
    from models.autoencoder_torch import LatentCodec

    codec = LatentCodec.load(path, device=device)
    if image_shape is not None:
        codec.info.latent_shape_for(image_shape)  # refuses another shape, with the message users act on
    return codec
