"""The types both latent codec backends share: `CodecInfo` (what names and shapes a latent space), the
`Codec` protocol (a loaded codec), `check_array` (their input check) and `info_from_meta` (the
CodecInfo of our autoencoder's checkpoint JSON).

The backends (models/autoencoder_torch.py, models/vae_diffusers.py) import these from here, and
models/codec.py, which loads either backend, re-exports them: `from models.codec import CodecInfo` works.
"""

from __future__ import annotations

from dataclasses import dataclass
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
