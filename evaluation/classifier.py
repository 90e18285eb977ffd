"""A small MNIST CNN used as the judge of generated digits (and as FID's feature extractor).

Input: float32 [N, 1, 32, 32] in [-1, 1] (our image convention). Output: logits [N, 10];
`features()` returns the 256-d penultimate activations [N, 256] used for FID.
Trained once on the 50k training split (random shifts of up to 2 px), cached as
safetensors under the data dir, and refused if its test accuracy is below 99%.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

MIN_TEST_ACCURACY = 0.99
CACHE_NAME = "mnist-classifier-v1"
SHIPPED_DIRS = ("checkpoints/judges",)  # relative to the working directory, then to the repository


def shipped_judge(name: str) -> Path | None:
    """The judge `<name>.safetensors` shipped in checkpoints/judges/ (the exact judges behind
    docs/RESULTS.md), if this checkout has it; None otherwise (then the judge is trained)."""
    repo = Path(__file__).resolve().parents[2]
    for rel in SHIPPED_DIRS:
        for base in (Path.cwd(), repo):
            w = base / rel / f"{name}.safetensors"
            if w.exists() and w.with_suffix(".json").exists():
                return w
    return None


def find_judge(name: str, data_dir: str | Path | None = None) -> Path | None:
    """A trained judge's weights: cached in the data dir first, else shipped; None: train one."""
    from dataset.mnist import resolve_data_dir

    cached = resolve_data_dir(data_dir) / f"{name}.safetensors"
    if cached.exists() and cached.with_suffix(".json").exists():
        return cached
    return shipped_judge(name)


def _build(in_channels: int = 1, num_classes: int = 10):
    import torch
    from torch import nn

    class MnistCNN(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(
                nn.Conv2d(in_channels, 32, 3, padding=1),
                nn.BatchNorm2d(32),
                nn.ReLU(),
                nn.Conv2d(32, 32, 3, padding=1),
                nn.BatchNorm2d(32),
                nn.ReLU(),
                nn.MaxPool2d(2),  # 16
                nn.Conv2d(32, 64, 3, padding=1),
                nn.BatchNorm2d(64),
                nn.ReLU(),
                nn.Conv2d(64, 64, 3, padding=1),
                nn.BatchNorm2d(64),
                nn.ReLU(),
                nn.MaxPool2d(2),  # 8
                nn.Conv2d(64, 128, 3, padding=1),
                nn.BatchNorm2d(128),
                nn.ReLU(),
                nn.MaxPool2d(2),  # 4
                nn.Flatten(),
                nn.Linear(128 * 16, 256),
                nn.ReLU(),
            )
            self.head = nn.Sequential(nn.Dropout(0.3), nn.Linear(256, num_classes))

        def features(self, x: torch.Tensor) -> torch.Tensor:
            return self.body(x)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.body(x))

    return MnistCNN()


def fit_input(x):
    """The CNN's body reads 32x32: other sizes are resized (area average down, bilinear up)."""
    if x.shape[-2:] == (32, 32):
        return x
    import torch.nn.functional as F

    mode = "area" if x.shape[-1] > 32 else "bilinear"
    return F.interpolate(x, size=(32, 32), mode=mode, **({"align_corners": False} if mode == "bilinear" else {}))


def _random_shift(x: np.ndarray, rng: np.random.Generator, max_shift: int = 2, edge: bool = False) -> np.ndarray:
    """Shift each image [N,C,H,W] by up to max_shift px (background -1 fills; `edge`: the border pixels
    repeat, for data whose background is not -1)."""
    n, _, h, w = x.shape
    pad = ((0, 0), (0, 0), (max_shift,) * 2, (max_shift,) * 2)
    padded = np.pad(x, pad, mode="edge") if edge else np.pad(x, pad, constant_values=-1.0)
    dy = rng.integers(0, 2 * max_shift + 1, n)
    dx = rng.integers(0, 2 * max_shift + 1, n)
    out = np.empty_like(x)
    for i in range(n):
        out[i] = padded[i, :, dy[i] : dy[i] + h, dx[i] : dx[i] + w]
    return out


class Classifier:
    """Wraps the trained CNN; numpy in, numpy out, CPU, no grad."""

    def __init__(self, model, meta: dict):
        self.model = model.eval()
        self.meta = meta

    @property
    def input_shape(self) -> tuple[int, int, int]:
        """[C, H, W] the judge reads: MNIST's 1x32x32 unless trained on a prepared dataset."""
        return tuple(self.meta.get("input_shape", (1, 32, 32)))

    @property
    def num_classes(self) -> int:
        return int(self.meta.get("num_classes", 10))

    def _run(self, images: np.ndarray, fn, batch: int = 512) -> np.ndarray:
        import torch

        x = np.asarray(images, np.float32)
        if x.ndim != 4 or x.shape[1:] != self.input_shape:
            want = ", ".join(map(str, self.input_shape))
            raise ValueError(f"this judge reads images [N, {want}], got {list(x.shape)}")
        outs = []
        with torch.inference_mode():
            for i in range(0, len(x), batch):
                xb = fit_input(torch.from_numpy(np.ascontiguousarray(x[i : i + batch])))
                outs.append(fn(xb).float().numpy())
        return np.concatenate(outs) if outs else np.zeros((0,), np.float32)

    def logits(self, images: np.ndarray) -> np.ndarray:
        """[N,1,32,32] -> [N,10]."""
        return self._run(images, self.model)

    def predict(self, images: np.ndarray) -> np.ndarray:
        """[N,1,32,32] -> int64 [N] predicted digit."""
        return self.logits(images).argmax(axis=1)

    def features(self, images: np.ndarray) -> np.ndarray:
        """[N,1,32,32] -> [N,256] penultimate features (for FID)."""
        return self._run(images, self.model.features)

    def logits_and_features(self, images: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """[N,1,32,32] -> ([N,10], [N,256]) in one pass through the body."""
        feats = self.features(images)
        return self._run_head(feats), feats

    def _run_head(self, feats: np.ndarray) -> np.ndarray:
        import torch

        with torch.inference_mode():
            return self.model.head(torch.from_numpy(np.ascontiguousarray(feats, np.float32))).float().numpy()

    # ------------------------------------------------------------ train / load
    @classmethod
    def load_or_train(
        cls, data_dir: str | Path | None = None, *, epochs: int = 3, seed: int = 0, progress: bool = True
    ) -> Classifier:
        from dataset.mnist import resolve_data_dir

        found = find_judge(CACHE_NAME, data_dir)
        if found is not None:
            return cls.load(found)
        root = resolve_data_dir(data_dir)
        clf = cls.train(root, epochs=epochs, seed=seed, progress=progress)
        clf.save(root / f"{CACHE_NAME}.safetensors")
        return clf

    @classmethod
    def load(cls, weights: str | Path) -> Classifier:
        from safetensors.torch import load_file

        weights = Path(weights)
        meta = json.loads(weights.with_suffix(".json").read_text())
        model = _build(int(meta.get("input_shape", (1,))[0]), int(meta.get("num_classes", 10)))
        model.load_state_dict(load_file(str(weights)))
        return cls(model, meta)

    def save(self, weights: str | Path) -> None:
        from safetensors.torch import save_file

        weights = Path(weights)
        weights.parent.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in self.model.state_dict().items()}, str(weights))
        weights.with_suffix(".json").write_text(json.dumps(self.meta, indent=2))

    @classmethod
    def train(
        cls,
        data_dir: str | Path | None = None,
        *,
        epochs: int = 3,
        batch_size: int = 128,
        seed: int = 0,
        limit: int | None = None,
        progress: bool = True,
        min_accuracy: float = MIN_TEST_ACCURACY,
        test_limit: int | None = None,
    ) -> Classifier:
        """Train on the training split (its first `limit` images); refuse (ValueError) below `min_accuracy`
        on the test split (its first `test_limit` images: a quick check of a throw-away judge; None, every
        one of the 10k, as a judge that scores anything must be measured)."""
        import torch

        from dataset.mnist import load_mnist

        from .fit_classifier import fit_classifier

        torch.manual_seed(seed)
        rng = np.random.default_rng(seed)
        x_train, y_train = load_mnist("train", data_dir, limit=limit or None)
        x_test, y_test = load_mnist("test", data_dir, limit=test_limit)
        model = _build()
        t0 = time.time()

        def batch(idx):
            return torch.from_numpy(_random_shift(x_train[idx], rng)), torch.from_numpy(y_train[idx])

        fit_classifier(
            model,
            len(x_train),
            batch,
            epochs=epochs,
            batch_size=batch_size,
            rng=rng,
            desc="classifier",
            progress=progress,
        )
        clf = cls(model, {})
        acc = float((clf.predict(x_test) == y_test).mean())
        clf.meta = {
            "test_accuracy": acc,
            "epochs": epochs,
            "train_images": int(len(x_train)),
            "test_images": int(len(x_test)),
            "seconds": round(time.time() - t0, 1),
            "seed": seed,
        }
        log.info("classifier test accuracy %.4f after %d epochs (%.0fs)", acc, epochs, time.time() - t0)
        if acc < min_accuracy:
            raise ValueError(f"classifier reached only {acc:.4f} test accuracy (< {min_accuracy}); train longer")
        return clf
