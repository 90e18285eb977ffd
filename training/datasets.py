"""The data a training run reads, and the model spec it implies.

A run reads either MNIST (the built-in default: `dataset.mnist.load_mnist`, 1x32x32, 10 classes "0"-"9")
or a prepared dataset directory (`--data DIR`, `dataset.prepared.load_prepared`: any [C, S, S] uint8
images, any class count, or unlabelled), or a latent cache of one (`ddm-fleet data encode`: float
latents [c, h, w] of an autoencoder, scaled to unit variance, used as they are; the spec then says
`space: latent` and names the autoencoder as its decoder). A partition made from an image dataset
also trains on the latent cache of that same dataset (same images, same order). A partition manifest
records which one it indexes (`dataset.partition.DatasetRef`, absent = MNIST); `resolve_data` refuses
data other than that, naming both, and, without --data, takes the prepared dataset the partition names.

    path, ref = resolve_data(manifest, data, partition_file)     # path None = MNIST
    images, labels, ref = load_split(path, "train", data_dir=None, limit=None)
        # images float32 [N, C, S, S] in [-1, 1] (a latent cache: its latents), labels int64 [N] (-1 = unlabelled)
    spec = spec_for(ref, null_label=True, arch="dit")            # schemas.spec.ModelSpec
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from dataset.partition import DatasetRef, Manifest, PartitionError, check_same_dataset
from schemas.spec import Conditioning, ModelSpec, legacy_spec

#: The MNIST dataset's description inside a checkpoint's "partition" block (for spec_for / messages).
MNIST_SHAPE = (1, 32, 32)
MNIST_CLASSES = 10


def dataset_ref(path: str | os.PathLike) -> DatasetRef:
    """The reference to the prepared dataset at `path` (its manifest read and checked)."""
    from dataset.prepared import read_manifest

    return DatasetRef.from_prepared(read_manifest(path), path)


def resolve_data(
    manifest: Manifest, data: str | os.PathLike | None, partition_file: str | os.PathLike = "the partition"
) -> tuple[str | None, DatasetRef | None]:
    """(prepared dataset path or None for MNIST, its DatasetRef) for training on `manifest`'s experts.

    `data` (--data) must be the dataset the partition was made from (PartitionError naming both
    otherwise); None takes the prepared dataset the manifest names (or MNIST when it names none).
    """
    where = f"partition {partition_file}"
    if data is None:
        if manifest.dataset is None:
            return None, None
        path = manifest.dataset.path
        if not Path(path).is_dir():
            raise PartitionError(
                f"{where} was made from {manifest.dataset.describe()}, which is not at {path} any more; "
                "pass --data DIR with that dataset"
            )
        data = path
    ref = dataset_ref(data)
    check_same_dataset(manifest, ref, where)
    return str(data), ref


def load_split(
    path: str | os.PathLike | None, split: str, *, data_dir=None, limit: int | None = None
) -> tuple[np.ndarray, np.ndarray, DatasetRef | None]:
    """(images float32 [N, C, S, S] in [-1, 1], labels int64 [N], ref) of one split of a prepared
    dataset at `path`, or of MNIST (`data_dir`: its cache) when `path` is None (ref None). A latent
    cache gives its latents as float32 (already scaled: roughly mean 0, variance 1)."""
    if path is None:
        from dataset.mnist import load_mnist

        images, labels = load_mnist(split, data_dir, limit=limit)
        return images, labels, None
    from dataset.prepared import is_latent, load_prepared, to_model_range

    images, labels, manifest = load_prepared(path, split, limit=limit)
    ref = DatasetRef.from_prepared(manifest, path)
    # a latent cache holds the model's inputs already (scaled latents, float16 or float32)
    x = np.asarray(images, dtype=np.float32) if is_latent(manifest) else to_model_range(images)
    return x, np.asarray(labels, dtype=np.int64), ref


def has_split(path: str | os.PathLike | None, split: str) -> bool:
    """Whether the dataset has `split` (MNIST: train, val and test)."""
    if path is None:
        return split in ("train", "val", "test")
    from dataset.prepared import read_manifest

    return split in read_manifest(path)["splits"]


def shape_of(ref: DatasetRef | None) -> tuple[int, int, int]:
    """[C, S, S] of the dataset's samples."""
    return MNIST_SHAPE if ref is None else tuple(int(v) for v in ref.sample_shape)


def num_classes_of(ref: DatasetRef | None) -> int:
    """The dataset's class count (0 = unlabelled)."""
    return MNIST_CLASSES if ref is None else ref.num_classes


def spec_for(ref: DatasetRef | None, *, null_label: bool, arch: str) -> ModelSpec:
    """The model spec of a model trained on this dataset: its sample shape, its classes (names from
    the prepared manifest; "0"-"9" for MNIST) or conditioning none (unlabelled: every label is the
    null label, so null_label is True), pixels in [-1, 1] (a latent cache: space latent, the
    cache's value range, decoder = its autoencoder), velocity, `arch`."""
    if ref is None:
        return legacy_spec(null_label=null_label, arch=arch)
    c, h, w = shape_of(ref)
    if ref.num_classes == 0:
        cond = Conditioning(kind="none", num_classes=0, null_label=True)
    else:
        cond = Conditioning(
            kind="class", num_classes=ref.num_classes, class_names=list(ref.class_names) or None, null_label=null_label
        )
    if ref.is_latent:
        return ModelSpec(
            sample_shape=(c, h, w),
            value_range=tuple(ref.value_range),
            space="latent",
            decoder=ref.decoder,
            conditioning=cond,
            arch=arch,
        )
    return ModelSpec(sample_shape=(c, h, w), conditioning=cond, arch=arch)


def describe(ref: DatasetRef | None) -> dict:
    """The dataset block stored in a checkpoint's "partition" info (MNIST: name "mnist")."""
    if ref is None:
        return {"name": "mnist", "sample_shape": list(MNIST_SHAPE), "num_classes": MNIST_CLASSES}
    return ref.model_dump()
