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

The types both backends share (`CodecInfo`, `Codec`, `check_array`, `info_from_meta`) live in
models/codec_types.py, which the backends import; this module loads them and re-exports those types.
"""

from __future__ import annotations

import os
from pathlib import Path

from models.autoencoder import AutoencoderError
from models.codec_types import Codec, CodecInfo, check_array, info_from_meta  # noqa: F401 (re-exported)


def codec_info(path: str | os.PathLike) -> CodecInfo:
    """The CodecInfo of an autoencoder checkpoint or a diffusers VAE directory (checked; no torch)."""
    if Path(path).is_dir():
        from models.vae_diffusers import read_info

        return read_info(path)
    from models.autoencoder import load_autoencoder_meta
    from models.checkpoint import checkpoint_paths

    return info_from_meta(load_autoencoder_meta(path), str(checkpoint_paths(path)[0]))


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
        dirs = list(dict.fromkeys(Path(d) for d in directories if d))  # each place named once in the message
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
