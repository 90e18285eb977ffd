"""Encode a prepared image dataset once into a latent cache: the input of latent-space experts.

    result = encode_dataset("runs/ae.safetensors", "data/colour-mnist", out=None)   # -> data/colour-mnist-latents
    result = encode_dataset("vae/sd-vae", "data/colour-mnist")   # a diffusers AutoencoderKL directory works too

The autoencoder is either backend of models/codec.py: a `ddm-fleet train-autoencoder` checkpoint or a
diffusers `AutoencoderKL` saved with `save_pretrained` (the `pretrained` extra).

A latent cache is a prepared dataset (dataset/prepared.py: shards + manifest, checked on load) whose
"images" are the autoencoder's scaled latents (float16 by default, or float32) [N, c, h, w], with the
labels and any other per-image arrays of the source copied as they are, for every split of the source.
Its manifest says `"space": "latent"` and holds a `"latent"` block naming the autoencoder (path and
content hash, the model spec's decoder string, its scale and shift, the image shape) and the source
dataset (name, path, content hash); `value_range` is [-r, r] with r the larger of the autoencoder's
measured latent range and the train latents' largest |z| (rounded up to 0.5).

Encoding is cached: the same source, autoencoder and dtype again do nothing. An `--out` that holds the
cache of another autoencoder (or of another dataset) is refused unless `force`: latents of two
autoencoders never mix, and the message names both.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np

from dataset.mnist import DataError

DTYPES = ("float16", "float32")


class LatentCacheError(DataError):
    """A latent cache cannot be made or used with this autoencoder; the message says what to do."""


def default_out(data: str | os.PathLike) -> Path:
    """`<data>-latents` next to the source dataset."""
    p = Path(data)
    return p.with_name(p.name + "-latents")


def _describe_cache(manifest: dict, where: Path) -> str:
    lat = manifest.get("latent") or {}
    src = lat.get("source") or {}
    return (
        f"{where} holds latents of {src.get('name', '?')} made by autoencoder {lat.get('autoencoder', '?')} "
        f"(content sha256 {str(lat.get('autoencoder_hash', '?'))[:16]}...)"
    )


def check_autoencoder(cache: str | os.PathLike, autoencoder_hash: str) -> dict:
    """The manifest of the latent cache at `cache` when it was made by the autoencoder with
    `autoencoder_hash`; LatentCacheError naming both autoencoders otherwise."""
    from dataset.prepared import is_latent, read_manifest

    manifest = read_manifest(cache)
    if not is_latent(manifest):
        raise LatentCacheError(
            f"{cache} is an image dataset, not a latent cache; make one with `ddm-fleet data encode`"
        )
    have = (manifest.get("latent") or {}).get("autoencoder_hash")
    if have != autoencoder_hash:
        raise LatentCacheError(
            f"{_describe_cache(manifest, Path(cache))}, not by this autoencoder (content sha256 "
            f"{autoencoder_hash[:16]}...); latents of two autoencoders do not mix: encode the data with this "
            "one (`ddm-fleet data encode --autoencoder PATH --data DIR --out NEW_DIR`)"
        )
    return manifest


def _refuse_foreign(out: Path, ae_hash: str, source_hash: str, force: bool) -> None:
    """Refuse to overwrite an image dataset, or (without force) another autoencoder's or dataset's cache."""
    from dataset.prepared import PreparedDataError, is_latent, read_manifest

    try:
        existing = read_manifest(out)
    except PreparedDataError:
        return  # nothing (or nothing of ours) there: write_prepared refuses a non-empty foreign directory
    if not is_latent(existing):
        raise LatentCacheError(f"{out} is an image dataset; the latent cache needs another --out")
    if force:
        return
    lat = existing.get("latent") or {}
    if lat.get("autoencoder_hash") != ae_hash:
        raise LatentCacheError(
            f"{_describe_cache(existing, out)}, not by this autoencoder (content sha256 {ae_hash[:16]}...); "
            "choose another --out, or pass --force to replace it"
        )
    if (lat.get("source") or {}).get("content_hash") != source_hash:
        raise LatentCacheError(
            f"{_describe_cache(existing, out)} of another version of the dataset; choose another --out, or pass "
            "--force to replace it"
        )


def encode_dataset(
    autoencoder: str | os.PathLike,
    data: str | os.PathLike,
    out: str | os.PathLike | None = None,
    *,
    dtype: str = "float16",
    batch_size: int = 256,
    force: bool = False,
    progress: bool = True,
    device: str = "cpu",
):
    """Encode every split of the prepared dataset `data` with `autoencoder` into a latent cache at
    `out` (default `<data>-latents`); returns a `dataset.prepared.PrepareResult` (`built` False when
    the cache was already up to date)."""
    from tqdm import tqdm

    from dataset.prepared import (
        PrepareResult,
        inputs_key,
        is_latent,
        load_prepared,
        load_prepared_extra,
        read_manifest,
        to_model_range,
        up_to_date,
        write_prepared,
    )
    from models.autoencoder import AutoencoderError, decoder_name
    from models.codec import codec_info, load_codec

    if dtype not in DTYPES:
        raise LatentCacheError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    ae = codec_info(autoencoder)
    ae_hash = ae.content_hash
    src = read_manifest(data)
    if is_latent(src):
        raise LatentCacheError(f"{data} is a latent cache already; encode the image dataset it came from")
    shape = (int(src["channels"]), int(src["size"]), int(src["size"]))
    try:
        latent_shape = ae.latent_shape_for(shape)
    except AutoencoderError as exc:
        raise LatentCacheError(f"{data} holds {'x'.join(map(str, shape))} images: {exc}") from None
    out = Path(out) if out is not None else default_out(data)
    if out.resolve() == Path(data).resolve():
        raise LatentCacheError(f"--out {out} is the source dataset itself; choose another directory")
    key = inputs_key({"kind": "latents", "source": src["content_hash"], "autoencoder": ae_hash, "dtype": dtype})
    _refuse_foreign(out, ae_hash, src["content_hash"], force)
    if not force:
        manifest = up_to_date(out, key)
        if manifest is not None:
            return PrepareResult(out, manifest, built=False)

    codec = load_codec(autoencoder, device=device, image_shape=shape)
    total = sum(int(info["count"]) for info in src["splits"].values())
    splits: dict[str, dict[str, np.ndarray]] = {}
    with tqdm(total=total, disable=not progress, desc="encode", unit="img", dynamic_ncols=True) as bar:
        for split, info in src["splits"].items():
            images, labels, _ = load_prepared(data, split, mmap=True)
            z = np.empty((len(images), *latent_shape), dtype=dtype)
            for i in range(0, len(images), batch_size):
                chunk = to_model_range(np.asarray(images[i : i + batch_size]))
                z[i : i + len(chunk)] = codec.encode(chunk, batch_size=batch_size).astype(dtype)
                bar.update(len(chunk))
            arrays = {"images": z, "labels": np.asarray(labels, dtype=np.int64)}
            for name in info.get("files", {}):
                if name not in arrays:
                    arrays[name] = np.asarray(load_prepared_extra(data, split, name))
            splits[split] = arrays
    first = splits["train"]["images"] if "train" in splits else next(iter(splits.values()))["images"]
    measured = math.ceil(float(np.abs(first.astype(np.float32)).max(initial=0.0)) * 2) / 2
    r = max(ae.latent_range or 0.0, measured, 0.5)
    latent = {
        "autoencoder": ae.path,
        "autoencoder_backend": ae.backend,
        "autoencoder_hash": ae_hash,
        "decoder": decoder_name(ae_hash),
        "scale_factor": ae.scale_factor,
        "shift_factor": ae.shift_factor,
        "image_shape": list(shape),
        "downsample": ae.downsample,
        "dtype": dtype,
        "value_range": [-r, r],
        "source": {"name": src["name"], "path": str(data), "content_hash": src["content_hash"]},
    }
    manifest = write_prepared(
        out,
        splits,
        name=f"{src['name']}-latents",
        source={"kind": "latents", "dataset": src["name"], "path": str(data)},
        class_names=list(src.get("class_names") or []) or None,
        made={"autoencoder": ae.path, "dtype": dtype},
        key=key,
        latent=latent,
    )
    return PrepareResult(out, manifest, built=True)
