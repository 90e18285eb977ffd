"""Split the training set into K disjoint expert partitions and record them in a JSON manifest.

Methods (all seeded and deterministic):

* ``classes``: each expert owns a list of digit classes (default for K=2: 0-4 / 5-9).
* ``kmeans``: the DDM paper's recipe on cheap features. Features = 4x4 average-pooled pixels
  (64 dims) projected on their top principal components; a *fine* k-means with many clusters,
  then a *coarse* k-means of the fine centroids (weighted by cluster size) into K experts.
  Every image goes to the expert of its nearest fine centroid, so the manifest can also assign
  images it never saw (``Manifest.assign``), which gives the router labels on the val split.
* ``features``: the same two-stage k-means, on a feature matrix the caller computes with a
  pretrained network trained for another purpose (the paper clusters DINOv2 features; ``ddm-fleet
  partition --method features`` passes judge 2's penultimate layer, see
  ``evaluation/features.py``). This layer cannot run that network (dataset/ may not import
  evaluation/), so the manifest records the extractor's name and ``Manifest.assign`` takes the
  features of unseen images from the caller too.
* ``random``: a seeded permutation cut into K near-equal parts.

The manifest records, per expert, its ``indices`` into the train split, its ``classes`` and a
class histogram, plus ``class_to_expert`` (majority owner of each class; the oracle strategy).

Any prepared dataset (dataset/prepared.py) can be partitioned: the manifest then records which one
under ``dataset`` (name, directory, content hash, sample shape, class count and names), and the
class lists have that dataset's class count (none for an unlabelled dataset: labels all -1, where
only kmeans and random apply). A manifest without ``dataset`` indexes MNIST's 50k train split with
10 classes (every manifest made before this field; MNIST manifests are still written without it).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from bus.json_file import read_json_file

METHODS = ("classes", "kmeans", "features", "random")
NUM_CLASSES = 10


class PartitionError(ValueError):
    """Bad partition request or malformed manifest; the message says how to fix it."""


class ExpertPart(BaseModel):
    """One expert's share of the train split."""

    id: int = Field(ge=0)
    classes: list[int]  # classes this expert is meant for (classes method) or that it holds (others)
    class_counts: list[int] = Field(default_factory=list)  # images per class 0..num_classes-1
    indices: list[int]  # sorted indices into the train split

    @property
    def num_images(self) -> int:
        return len(self.indices)


class DatasetRef(BaseModel):
    """Which prepared dataset a partition was made from (absent in MNIST manifests)."""

    name: str
    path: str  # the directory it was read from (a hint: the content hash identifies it)
    content_hash: str  # the prepared manifest's content_hash
    sample_shape: list[int]  # [C, S, S]
    num_classes: int = Field(ge=0)  # 0 = unlabelled (conditioning none)
    class_names: list[str] = Field(default_factory=list)
    # A latent cache (`ddm-fleet data encode`): the model spec's decoder string, the latents' value
    # range, the content hash of the image dataset they encode and the autoencoder's path (a hint).
    # All None for images.
    space: Literal["pixels", "latent"] | None = None
    decoder: str | None = None
    value_range: list[float] | None = None
    source_hash: str | None = None
    autoencoder: str | None = None

    @classmethod
    def from_prepared(cls, prepared_manifest: dict, path: str | os.PathLike) -> DatasetRef:
        """The reference to a prepared dataset from its manifest (`dataset.prepared.read_manifest`)."""
        names = list(prepared_manifest.get("class_names") or [])
        c, s = int(prepared_manifest["channels"]), int(prepared_manifest["size"])
        latent = {}
        if prepared_manifest.get("space") == "latent":
            lat = prepared_manifest.get("latent") or {}
            latent = {
                "space": "latent",
                "decoder": lat.get("decoder"),
                "value_range": [float(v) for v in prepared_manifest["value_range"]],
                "source_hash": (lat.get("source") or {}).get("content_hash"),
                "autoencoder": lat.get("autoencoder"),
            }
        return cls(
            name=str(prepared_manifest["name"]),
            path=str(path),
            content_hash=str(prepared_manifest["content_hash"]),
            sample_shape=[c, s, s],
            num_classes=len(names),
            class_names=names,
            **latent,
        )

    @property
    def is_latent(self) -> bool:
        return self.space == "latent"

    def describe(self) -> str:
        """'<name>' (<path>, 3x32x32, content sha256 1234abcd...) for error messages; a latent cache
        also names its autoencoder."""
        shape = "x".join(str(v) for v in self.sample_shape)
        what = f"{shape}, content sha256 {self.content_hash[:12]}..."
        if self.is_latent:
            by = self.decoder or "an unnamed autoencoder"
            what = f"{shape} latents of {by}, content sha256 {self.content_hash[:12]}..."
        return f"dataset {self.name!r} ({self.path}, {what})"


#: How error messages name the dataset of a manifest without a `dataset` block.
MNIST_DESCRIPTION = "MNIST (the built-in train split, 1x32x32, 10 classes; no --data)"


class KMeansAssigner(BaseModel):
    """What it takes to assign any image to a k-means expert: features -> nearest fine centroid."""

    pool: int  # average-pool factor on the S x S image
    mean: list[float]  # [D] feature mean
    components: list[list[float]]  # [P, D] principal directions
    fine_centroids: list[list[float]]  # [F, P]
    fine_to_expert: list[int]  # [F]


class FeatureAssigner(BaseModel):
    """The features method's assigner: caller-computed features [N, D] -> nearest fine centroid.

    ``extractor`` names the network and layer that made the features (e.g. judge 2's ``embed``
    layer); :meth:`Manifest.assign` must be given features from that same extractor.
    """

    extractor: str
    dim: int = Field(ge=1)  # D, the feature width the extractor produces
    mean: list[float]  # [D]
    components: list[list[float]]  # [P, D]
    fine_centroids: list[list[float]]  # [F, P]
    fine_to_expert: list[int]  # [F]


class Manifest(BaseModel):
    """A partition of the train split into ``num_experts`` disjoint parts (JSON on disk)."""

    model_config = ConfigDict(populate_by_name=True)

    method: Literal["classes", "kmeans", "features", "random"]
    num_experts: int = Field(ge=1)
    seed: int = 0
    split: str = "train"
    num_images: int  # size of the split the indices point into
    class_owner: list[int] = Field(alias="class_to_expert")  # [num_classes] majority expert per class
    experts: list[ExpertPart]
    kmeans: KMeansAssigner | None = None
    features: FeatureAssigner | None = None
    dataset: DatasetRef | None = None  # the prepared dataset it indexes; None = MNIST

    @property
    def num_classes(self) -> int:
        """Classes of the dataset it indexes (10 for MNIST, 0 for an unlabelled dataset)."""
        return self.dataset.num_classes if self.dataset is not None else NUM_CLASSES

    def dataset_description(self) -> str:
        """The dataset it was made from, for messages."""
        return self.dataset.describe() if self.dataset is not None else MNIST_DESCRIPTION

    @model_validator(mode="after")
    def _consistent(self) -> Manifest:
        if len(self.experts) != self.num_experts:
            raise ValueError(f"num_experts={self.num_experts} but {len(self.experts)} experts listed")
        if [e.id for e in self.experts] != list(range(self.num_experts)):
            raise ValueError("expert ids must be 0..K-1 in order")
        nc = self.num_classes
        if len(self.class_owner) != nc or any(not 0 <= k < self.num_experts for k in self.class_owner):
            raise ValueError(f"class_to_expert must list {nc} expert ids in 0..{self.num_experts - 1}")
        total = sum(len(e.indices) for e in self.experts)
        all_idx = (
            np.concatenate([np.asarray(e.indices, dtype=np.int64) for e in self.experts])
            if total
            else np.zeros(0, np.int64)
        )
        if total and (all_idx.min() < 0 or all_idx.max() >= self.num_images):
            raise ValueError(f"indices must lie in 0..{self.num_images - 1}")
        if len(np.unique(all_idx)) != total:
            raise ValueError("expert partitions overlap: an index appears in two experts")
        return self

    def class_to_expert(self, y: int) -> int:
        """Expert that holds most images of class ``y`` (the oracle route)."""
        if not 0 <= int(y) < self.num_classes:
            raise PartitionError(f"class {y} outside 0..{self.num_classes - 1}")
        return self.class_owner[int(y)]

    def expert_of_index(self) -> np.ndarray:
        """int64 [num_images]: expert id of each train index (-1 where no expert holds it)."""
        out = np.full(self.num_images, -1, dtype=np.int64)
        for e in self.experts:
            out[np.asarray(e.indices, dtype=np.int64)] = e.id
        return out

    def assign(
        self, images: np.ndarray, labels: np.ndarray, seed: int = 0, features: np.ndarray | None = None
    ) -> np.ndarray:
        """Expert of images not in the manifest (e.g. the val split), int64 [N].

        images float32 [N, C, S, S], labels int64 [N]. classes: by label; kmeans: nearest fine
        centroid; features: nearest fine centroid of ``features`` float32 [N, D] (required, made by
        the extractor named in ``self.features.extractor``); random: a seeded random draw (there is
        nothing to learn).
        """
        labels = np.asarray(labels, dtype=np.int64)
        if self.method == "classes":
            return np.asarray(self.class_owner, dtype=np.int64)[labels]
        if self.method == "kmeans":
            if self.kmeans is None:
                raise PartitionError("kmeans manifest has no assigner block; regenerate it")
            return _assign_kmeans(self.kmeans, images)
        if self.method == "features":
            if self.features is None:
                raise PartitionError("features manifest has no assigner block; regenerate it")
            if features is None:
                raise PartitionError(
                    f"this partition clusters {self.features.extractor} features: pass the "
                    "features of the images to assign (evaluation.features.partition_features)"
                )
            return _assign_features(self.features, features, n=len(labels))
        return np.random.default_rng(seed).integers(0, self.num_experts, size=len(labels)).astype(np.int64)

    def summary(self) -> str:
        """A text table: images and class histogram per expert (the histogram up to 20 classes)."""
        nc = self.num_classes
        hist = 0 < nc <= 20
        head = f"{'expert':>6} {'images':>7} " + (" ".join(f"{c:>5}" for c in range(nc)) if hist else "") + "  classes"
        lines = [f"partition method={self.method} K={self.num_experts} seed={self.seed} split={self.split}"]
        if self.dataset is not None:
            lines.append(f"dataset: {self.dataset.describe()}")
        if self.features is not None:
            lines.append(f"features: {self.features.extractor} ({self.features.dim} dims)")
        lines.append(head)
        for e in self.experts:
            counts = e.class_counts or [0] * nc
            cells = " ".join(f"{c:>5}" for c in counts) if hist else ""
            lines.append(f"{e.id:>6} {e.num_images:>7} " + cells + "  " + _fmt_classes(e.classes))
        if nc:
            lines.append("class_to_expert: " + " ".join(f"{c}->{k}" for c, k in enumerate(self.class_owner)))
        return "\n".join(lines)


def _fmt_classes(classes: list[int]) -> str:
    return ",".join(str(c) for c in classes) if classes else "-"


# --------------------------------------------------------------------------- save / load


def save_manifest(m: Manifest, path: str | os.PathLike) -> Path:
    """Write the manifest as JSON (atomic rename); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(m.model_dump_json(by_alias=True, exclude_none=True))
    os.replace(tmp, path)
    return path


def load_manifest(path: str | os.PathLike) -> Manifest:
    """Read a manifest written by :func:`save_manifest`; clear errors for a missing or bad file."""
    path = Path(path)
    if not path.is_file():
        raise PartitionError(f"no partition manifest at {path}; create one with `ddm-fleet partition --out {path}`")
    data = read_json_file(path, error=PartitionError)  # bounded size and depth
    try:
        return Manifest.model_validate(data)
    except ValueError as exc:
        raise PartitionError(f"{path} is not a valid partition manifest: {exc}") from exc


# --------------------------------------------------------------------------- methods


def parse_class_groups(text: str) -> list[list[int]]:
    """``"0-4,5-9"`` -> [[0..4], [5..9]]. Groups are comma-separated; inside a group use ranges
    ``a-b`` joined with ``+`` (``"0-2+7,3-6,8+9"``)."""
    groups: list[list[int]] = []
    for group in text.split(","):
        group = group.strip()
        if not group:
            raise PartitionError(f"empty class group in {text!r}")
        members: list[int] = []
        for part in group.split("+"):
            part = part.strip()
            try:
                if "-" in part:
                    lo, hi = (int(v) for v in part.split("-", 1))
                    if lo > hi:
                        raise PartitionError(f"class range {part!r} runs backwards")
                    members.extend(range(lo, hi + 1))
                else:
                    members.append(int(part))
            except ValueError:
                raise PartitionError(f"cannot parse class group {group!r} in {text!r}; use e.g. 0-4,5-9") from None
        groups.append(members)
    return groups


def default_class_groups(num_experts: int, num_classes: int = NUM_CLASSES) -> list[list[int]]:
    """Contiguous near-equal class ranges: K=2 -> [[0..4], [5..9]]."""
    bounds = np.linspace(0, num_classes, num_experts + 1).round().astype(int)
    return [list(range(bounds[k], bounds[k + 1])) for k in range(num_experts)]


def _class_hist(labels: np.ndarray, num_classes: int = NUM_CLASSES) -> list[int]:
    if not num_classes:
        return []
    labels = labels[labels >= 0]
    return np.bincount(labels, minlength=num_classes)[:num_classes].astype(int).tolist()


def _build(
    method: str,
    labels: np.ndarray,
    owner: np.ndarray,
    num_experts: int,
    seed: int,
    classes: list[list[int]] | None = None,
    kmeans: KMeansAssigner | None = None,
    features: FeatureAssigner | None = None,
    dataset: DatasetRef | None = None,
) -> Manifest:
    """owner int64 [N]: expert of each index."""
    nc = dataset.num_classes if dataset is not None else NUM_CLASSES
    experts = []
    counts = np.zeros((num_experts, nc), dtype=np.int64)
    for k in range(num_experts):
        idx = np.flatnonzero(owner == k)
        hist = _class_hist(labels[idx], nc)
        counts[k] = hist
        held = classes[k] if classes is not None else [c for c in range(nc) if hist[c] > 0]
        experts.append(ExpertPart(id=k, classes=sorted(held), class_counts=hist, indices=idx.tolist()))
    if classes is not None:
        class_owner = [next(k for k, g in enumerate(classes) if c in g) for c in range(nc)]
    else:
        class_owner = counts.argmax(axis=0).astype(int).tolist() if nc else []  # ties -> lowest expert id
    return Manifest(
        method=method,
        num_experts=num_experts,
        seed=seed,
        num_images=len(labels),
        class_to_expert=class_owner,
        experts=experts,
        kmeans=kmeans,
        features=features,
        dataset=dataset,
    )


def partition_by_classes(
    labels: np.ndarray, groups: list[list[int]], seed: int = 0, dataset: DatasetRef | None = None
) -> Manifest:
    """Each expert k gets every image whose label is in ``groups[k]``; groups must cover every class
    (0..9 for MNIST, the dataset's classes otherwise) once."""
    nc = dataset.num_classes if dataset is not None else NUM_CLASSES
    if nc == 0:
        raise PartitionError(
            f"{dataset.describe() if dataset else 'this dataset'} is unlabelled: the classes method needs "
            "labels; use --method kmeans or random"
        )
    flat = [c for g in groups for c in g]
    bad = sorted({c for c in flat if not 0 <= c < nc})
    if bad:
        raise PartitionError(f"classes {bad} outside 0..{nc - 1}")
    dup = sorted({c for c in flat if flat.count(c) > 1})
    if dup:
        raise PartitionError(f"classes {dup} are given to more than one expert; partitions must be disjoint")
    missing = sorted(set(range(nc)) - set(flat))
    if missing:
        raise PartitionError(f"classes {missing} belong to no expert; every class needs an owner")
    if any(not g for g in groups):
        raise PartitionError("every expert needs at least one class")
    lut = np.empty(nc, dtype=np.int64)
    for k, g in enumerate(groups):
        lut[g] = k
    return _build("classes", labels, lut[labels], len(groups), seed, classes=groups, dataset=dataset)


def partition_random(
    labels: np.ndarray, num_experts: int, seed: int = 0, dataset: DatasetRef | None = None
) -> Manifest:
    """A seeded permutation cut into ``num_experts`` near-equal parts."""
    perm = np.random.default_rng(seed).permutation(len(labels))
    owner = np.empty(len(labels), dtype=np.int64)
    for k, part in enumerate(np.array_split(perm, num_experts)):
        owner[part] = k
    return _build("random", labels, owner, num_experts, seed, dataset=dataset)


# --------------------------------------------------------------------------- k-means


def default_pool(size: int) -> int:
    """The average-pool factor that brings an S x S image to about 8 x 8 (4 for MNIST's 32):
    the largest divisor of S that is at most S / 8 (at least 1)."""
    target = max(1, size // 8)
    return max(p for p in range(1, target + 1) if size % p == 0)


def image_features(images: np.ndarray, pool: int = 4) -> np.ndarray:
    """float32 [N, C, H, W] -> float32 [N, C * (H/pool) * (W/pool)] average-pooled pixels
    (channel-major; [N, 64] for MNIST's [N, 1, 32, 32] with pool 4)."""
    x = np.asarray(images, dtype=np.float32)
    if x.ndim != 4 or x.shape[2] % pool or x.shape[3] % pool:
        raise PartitionError(f"images must be [N, C, H, W] with H, W divisible by {pool}; got {list(x.shape)}")
    n, c, h, w = x.shape
    return x.reshape(n, c, h // pool, pool, w // pool, pool).mean(axis=(3, 5)).reshape(n, -1)


def _sq_dists(x: np.ndarray, c: np.ndarray, xx: np.ndarray | None = None) -> np.ndarray:
    """[N, D], [M, D] -> [N, M] squared distances (dtype of x; pass ``xx`` = |x|^2 [N] to reuse)."""
    c = c.astype(x.dtype, copy=False)
    if xx is None:
        xx = (x * x).sum(1)
    d = xx[:, None] - 2 * (x @ c.T) + (c * c).sum(1)[None, :]
    return np.maximum(d, 0)


def kmeans(
    x: np.ndarray, k: int, seed: int, iters: int = 30, weights: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Weighted Lloyd's k-means with k-means++ seeding. x [N, D] -> (centroids [k, D], assign int64 [N]).

    Empty clusters are re-seeded at the point farthest from its centroid, so every cluster is used.
    """
    x = np.asarray(x, dtype=np.float32)
    xx = (x * x).sum(1)
    n = len(x)
    if not 1 <= k <= n:
        raise PartitionError(f"cannot make {k} clusters from {n} points")
    w = np.ones(n) if weights is None else np.asarray(weights, dtype=np.float64)
    rng = np.random.default_rng(seed)
    centroids = np.empty((k, x.shape[1]), dtype=np.float32)
    centroids[0] = x[rng.choice(n, p=w / w.sum())]
    d2 = _sq_dists(x, centroids[:1], xx)[:, 0].astype(np.float64)
    for j in range(1, k):
        p = w * d2
        centroids[j] = x[rng.choice(n, p=p / p.sum())] if p.sum() > 0 else x[rng.integers(n)]
        d2 = np.minimum(d2, _sq_dists(x, centroids[j : j + 1], xx)[:, 0])
    assign = np.full(n, -1, dtype=np.int64)
    for _ in range(iters):
        dist = _sq_dists(x, centroids, xx)
        new = dist.argmin(1)
        if np.array_equal(new, assign):
            break
        assign = new
        mass = np.bincount(assign, weights=w, minlength=k)
        for j in np.flatnonzero(mass == 0):  # empty cluster: take the worst-fit point
            far = int((dist[np.arange(n), assign] * (mass[assign] > 1)).argmax())
            assign[far] = j
            mass = np.bincount(assign, weights=w, minlength=k)
        sums = np.zeros((k, x.shape[1]))
        np.add.at(sums, assign, x * w[:, None])
        centroids = (sums / mass[:, None]).astype(np.float32)
    return centroids, assign


def _assign_kmeans(a: KMeansAssigner, images: np.ndarray) -> np.ndarray:
    feats = image_features(images, a.pool)
    z = (feats - np.asarray(a.mean, dtype=np.float32)) @ np.asarray(a.components, dtype=np.float32).T
    fine = _sq_dists(z, np.asarray(a.fine_centroids)).argmin(1)
    return np.asarray(a.fine_to_expert, dtype=np.int64)[fine]


def _two_stage(
    feats: np.ndarray, num_experts: int, seed: int, fine_clusters: int, pca_dims: int, desc: str, progress: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """PCA then fine k-means then coarse k-means of the fine centroids (weighted by size).

    feats [N, D] -> (mean [D], components [P, D], fine centroids [F, P], fine_to_expert int64 [F]).
    """
    from tqdm.auto import tqdm

    fine_clusters = max(num_experts, min(fine_clusters, len(feats) // 10 or 1))
    with tqdm(total=3, desc=desc, unit="stage", disable=not progress) as bar:
        feats = np.asarray(feats, dtype=np.float64)
        mean = feats.mean(0)
        _, _, vt = np.linalg.svd(feats - mean, full_matrices=False)
        vt = vt[:pca_dims]
        vt *= np.where(vt[np.arange(len(vt)), np.abs(vt).argmax(1)] < 0, -1.0, 1.0)[:, None]  # fix SVD sign
        z = (feats - mean) @ vt.T
        bar.update(1)
        fine_c, fine_a = kmeans(z, fine_clusters, seed)
        bar.update(1)
        sizes = np.bincount(fine_a, minlength=fine_clusters).astype(np.float64)
        _, coarse_a = kmeans(fine_c, num_experts, seed + 1, weights=sizes)
        bar.update(1)
    return mean, vt, fine_c, coarse_a


def _check_used(owner: np.ndarray, num_experts: int, method: str) -> None:
    empty = sorted(set(range(num_experts)) - set(np.unique(owner).tolist()))
    if empty:  # a fine centroid can own a coarse cluster yet win no image after the float32 re-assignment
        raise PartitionError(f"{method}: experts {empty} received no image; try another --seed or fewer experts")


def partition_kmeans(
    images: np.ndarray,
    labels: np.ndarray,
    num_experts: int,
    seed: int = 0,
    *,
    fine_clusters: int = 256,
    pca_dims: int = 32,
    pool: int | None = None,
    progress: bool = False,
    dataset: DatasetRef | None = None,
) -> Manifest:
    """Two-stage k-means (fine, then coarse on the fine centroids) on PCA'd pooled pixels.

    images float32 [N, C, S, S], labels int64 [N] (-1 = unlabelled); pool: the average-pool factor
    (default `default_pool(S)`: 4 for 32 x 32).
    """
    if len(images) != len(labels):
        raise PartitionError(f"{len(images)} images but {len(labels)} labels")
    pool = default_pool(int(np.shape(images)[-1])) if pool is None else pool
    mean, vt, fine_c, coarse_a = _two_stage(
        image_features(images, pool), num_experts, seed, fine_clusters, pca_dims, "kmeans", progress
    )
    assigner = KMeansAssigner(
        pool=pool,
        mean=mean.astype(np.float32).tolist(),
        components=vt.astype(np.float32).tolist(),
        fine_centroids=fine_c.astype(np.float32).tolist(),
        fine_to_expert=coarse_a.tolist(),
    )
    # assign through the stored float32 assigner, so train and unseen images follow one rule
    owner = _assign_kmeans(assigner, images)
    return _build(
        "kmeans", np.asarray(labels, dtype=np.int64), owner, num_experts, seed, kmeans=assigner, dataset=dataset
    )


def _assign_features(a: FeatureAssigner, feats: np.ndarray, n: int | None = None) -> np.ndarray:
    """features float32 [N, D] -> expert int64 [N] through the stored assigner."""
    f = np.asarray(feats, dtype=np.float32)
    if f.ndim != 2 or f.shape[1] != a.dim or (n is not None and len(f) != n):
        want = f"[{n if n is not None else 'N'}, {a.dim}]"
        raise PartitionError(f"features must be {want} ({a.extractor}); got {list(f.shape)}")
    z = (f - np.asarray(a.mean, dtype=np.float32)) @ np.asarray(a.components, dtype=np.float32).T
    fine = _sq_dists(z, np.asarray(a.fine_centroids)).argmin(1)
    return np.asarray(a.fine_to_expert, dtype=np.int64)[fine]


def partition_features(
    features: np.ndarray,
    labels: np.ndarray,
    num_experts: int,
    seed: int = 0,
    *,
    extractor: str = "unnamed",
    fine_clusters: int = 256,
    pca_dims: int = 32,
    progress: bool = False,
    dataset: DatasetRef | None = None,
) -> Manifest:
    """Two-stage k-means (as :func:`partition_kmeans`) on caller-computed features.

    features float32 [N, D] (one row per train image, e.g. a pretrained network's penultimate
    layer), labels int64 [N] (only for the class histograms and ``class_to_expert``);
    ``extractor`` names the network and layer, recorded in the manifest.
    """
    f = np.asarray(features, dtype=np.float32)
    if f.ndim != 2 or f.shape[1] < 1:
        raise PartitionError(f"features must be a 2-D array [N, D]; got shape {list(f.shape)}")
    if len(f) != len(labels):
        raise PartitionError(f"{len(f)} feature rows but {len(labels)} labels")
    if not np.isfinite(f).all():
        raise PartitionError("features contain NaN or inf")
    mean, vt, fine_c, coarse_a = _two_stage(
        f, num_experts, seed, fine_clusters, min(pca_dims, f.shape[1]), "features k-means", progress
    )
    assigner = FeatureAssigner(
        extractor=extractor,
        dim=int(f.shape[1]),
        mean=mean.astype(np.float32).tolist(),
        components=vt.astype(np.float32).tolist(),
        fine_centroids=fine_c.astype(np.float32).tolist(),
        fine_to_expert=coarse_a.tolist(),
    )
    owner = _assign_features(assigner, f)
    _check_used(owner, num_experts, "features")
    return _build(
        "features", np.asarray(labels, dtype=np.int64), owner, num_experts, seed, features=assigner, dataset=dataset
    )


def make_partition(
    method: str,
    labels: np.ndarray,
    images: np.ndarray | None,
    num_experts: int,
    seed: int = 0,
    classes: list[list[int]] | None = None,
    progress: bool = False,
    features: np.ndarray | None = None,
    extractor: str = "unnamed",
    dataset: DatasetRef | None = None,
) -> Manifest:
    """Build a manifest. labels int64 [N]; images float32 [N, C, S, S] (needed for kmeans only).

    ``classes`` (classes method): one list of classes per expert; default :func:`default_class_groups`.
    ``features`` float32 [N, D] (features method only) and ``extractor``, the name of what made them.
    ``dataset``: the prepared dataset the labels and images come from (recorded in the manifest; its
    class count bounds the labels, -1 everywhere for an unlabelled one); None = MNIST (10 classes).
    """
    labels = np.asarray(labels, dtype=np.int64)
    nc = dataset.num_classes if dataset is not None else NUM_CLASSES
    if labels.ndim != 1 or len(labels) == 0:
        raise PartitionError("labels must be a non-empty 1-D array")
    if nc == 0:
        if (labels != -1).any():
            raise PartitionError("an unlabelled dataset's labels must all be -1")
    elif labels.min() < 0 or labels.max() >= nc:
        raise PartitionError(f"labels must lie in 0..{nc - 1}")
    if num_experts < 1:
        raise PartitionError(f"need at least one expert, got {num_experts}")
    if method == "classes":
        groups = classes if classes is not None else default_class_groups(num_experts, nc)
        if len(groups) != num_experts:
            raise PartitionError(f"{len(groups)} class groups given for {num_experts} experts")
        return partition_by_classes(labels, groups, seed, dataset=dataset)
    if num_experts > len(labels):
        raise PartitionError(f"{num_experts} experts but only {len(labels)} images")
    if method == "random":
        return partition_random(labels, num_experts, seed, dataset=dataset)
    if method == "kmeans":
        if images is None:
            raise PartitionError("kmeans partitioning needs the images")
        return partition_kmeans(images, labels, num_experts, seed, progress=progress, dataset=dataset)
    if method == "features":
        if features is None:
            raise PartitionError("features partitioning needs a feature matrix [N, D] (one row per image)")
        return partition_features(
            features, labels, num_experts, seed, extractor=extractor, progress=progress, dataset=dataset
        )
    raise PartitionError(f"unknown partition method {method!r}; choose one of {', '.join(METHODS)}")


def check_same_dataset(manifest: Manifest, dataset: DatasetRef | None, where: str = "the partition") -> None:
    """Refuse (PartitionError naming both) to use a partition with data other than the dataset it was
    made from. ``dataset`` None = MNIST; prepared datasets are compared by content hash."""
    mine = manifest.dataset
    if mine is None and dataset is None:
        return
    if mine is not None and dataset is not None and mine.content_hash == dataset.content_hash:
        return
    if mine is not None and dataset is not None and dataset.is_latent and dataset.source_hash == mine.content_hash:
        return  # the latents of the very images the partition indexes (same order, same count)
    given = dataset.describe() if dataset is not None else MNIST_DESCRIPTION
    if mine is not None and dataset is not None and mine.is_latent and dataset.is_latent:
        if mine.source_hash == dataset.source_hash and mine.decoder != dataset.decoder:
            raise PartitionError(
                f"{where} was made from latents of {mine.decoder}, but the latent cache given ({dataset.path}) "
                f"holds latents of another autoencoder, {dataset.decoder}; latents of two autoencoders do not "
                f"mix: pass --data {mine.path}, or make a partition of this cache"
            )
    fix = f"pass --data {mine.path}" if mine is not None else "leave out --data (it indexes MNIST)"
    raise PartitionError(
        f"{where} was made from {manifest.dataset_description()}, but the data given is {given}; "
        f"{fix}, or make a partition of this data with `ddm-fleet partition --data DIR --out ...`"
    )
