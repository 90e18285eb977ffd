"""DINOv2 features for the `features` partition: `--features dinov2:DIR`, the DDM paper's feature space.

DIR is a transformers DINOv2 model saved with `save_pretrained` (config.json with model_type `dinov2`
and the weights, optionally a `preprocessor_config.json`), loaded by transformers' own
`Dinov2Model.from_pretrained(DIR, local_files_only=True)`: local files only, never the network.

Preprocessing, per chunk of images float32 [N, C, H, W] in [-1, 1]:

* grey images (C = 1) are repeated to the model's channel count (3);
* resized (bilinear, antialiased when shrinking) to S x S: the preprocessor config's crop size when
  there is one, else the model config's `image_size`, rounded to a multiple of the patch size;
* mapped to [0, 1] and normalised with the preprocessor config's `image_mean` / `image_std`, else
  ImageNet's (0.485, 0.456, 0.406) / (0.229, 0.224, 0.225).

The features are the CLS token after the final layer norm (`pooler_output`, [N, hidden_size]), so the
partition manifest records the extractor as `dinov2-cls:<DIR>@<sha256 prefix>`, the hash over the
weights files, config.json and preprocessor_config.json. Needs the `pretrained` extra (transformers);
torch and transformers are imported inside functions.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np

KIND = "dinov2-cls"  # the recorded name's kind: DINOv2's CLS token (pooler_output)
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
WEIGHT_SUFFIXES = (".safetensors", ".bin")
EXTRA = "pip install 'ddm-fleet[pretrained]'"


class Dinov2Error(ValueError):
    """A DINOv2 directory that cannot be used; the message says what to do."""


def _read_json(path: Path) -> dict | None:
    if not path.is_file():
        return None
    try:
        out = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise Dinov2Error(f"{path} is not valid JSON: {exc}") from None
    return out if isinstance(out, dict) else None


def weights_digest(d: Path) -> str:
    """sha256 prefix (12 hex) over the weights files (name + bytes), config.json and preprocessor_config.json."""
    weights = sorted(p for p in d.iterdir() if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES))
    if not weights:
        raise Dinov2Error(f"--features dinov2:{d}: no weights file (*.safetensors or *.bin) next to config.json")
    h = hashlib.sha256()
    for p in [*weights, d / "config.json", d / "preprocessor_config.json"]:
        if p.is_file():
            h.update(p.name.encode() + b"\n")
            with open(p, "rb") as f:
                for block in iter(lambda: f.read(1 << 22), b""):
                    h.update(block)
    return h.hexdigest()[:12]


def _size(value) -> int | None:
    """A crop/resize size from a preprocessor config: int, {"height", "width"} or {"shortest_edge"}."""
    if isinstance(value, int) and value > 0:
        return value
    if isinstance(value, dict):
        for key in ("height", "shortest_edge"):
            if isinstance(value.get(key), int) and value[key] > 0:
                return value[key]
    return None


def preprocessing(config: dict, pre: dict | None) -> tuple[int, tuple[float, ...], tuple[float, ...]]:
    """(side S, mean, std) the images are brought to before the model."""
    patch = int(config.get("patch_size", 14))
    side = None
    if pre is not None:
        side = _size(pre.get("crop_size")) if pre.get("do_center_crop", True) else None
        side = side or _size(pre.get("size"))
    side = side or int(config.get("image_size", 224))
    side = max(patch, round(side / patch) * patch)
    mean = tuple(pre.get("image_mean", IMAGENET_MEAN)) if pre else IMAGENET_MEAN
    std = tuple(pre.get("image_std", IMAGENET_STD)) if pre else IMAGENET_STD
    return side, mean, std


def load(directory: str) -> tuple[str, Callable[[np.ndarray], np.ndarray]]:
    """(recorded name, run(x [n, C, H, W] in [-1, 1]) -> float32 [n, hidden]) of the DINOv2 at `directory`."""
    d = Path(directory)
    config = _read_json(d / "config.json") if d.is_dir() else None
    if config is None or config.get("model_type") != "dinov2":
        raise Dinov2Error(
            f"--features dinov2:{directory}: not a transformers DINOv2 directory (config.json with model_type "
            "'dinov2'); save one with `Dinov2Model.from_pretrained(...).save_pretrained(DIR)`"
        )
    name = f"{KIND}:{directory}@{weights_digest(d)}"
    side, mean, std = preprocessing(config, _read_json(d / "preprocessor_config.json"))
    try:
        import torch
        import torch.nn.functional as F
        from transformers import Dinov2Model
    except ImportError as exc:
        raise Dinov2Error(f"--features dinov2:{directory} needs the pretrained extra ({EXTRA}): {exc}") from None
    try:
        model = Dinov2Model.from_pretrained(str(d), local_files_only=True).float().eval()
    except (OSError, ValueError, RuntimeError, KeyError, TypeError) as exc:
        raise Dinov2Error(f"transformers could not load the DINOv2 model at {directory}: {exc}") from None
    channels = int(model.config.num_channels)
    m = torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1)
    s = torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1)

    def run(x: np.ndarray) -> np.ndarray:
        t = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
        if t.shape[1] == 1 and channels != 1:
            t = t.expand(-1, channels, -1, -1)
        if t.shape[1] != channels:
            raise Dinov2Error(f"--features dinov2:{directory} takes {channels}-channel images, not {list(x.shape)}")
        if tuple(t.shape[2:]) != (side, side):
            shrink = t.shape[2] > side or t.shape[3] > side
            t = F.interpolate(t, size=(side, side), mode="bilinear", align_corners=False, antialias=shrink)
        t = ((t + 1.0) / 2.0 - m) / s
        with torch.inference_mode():
            out = model(pixel_values=t).pooler_output
        return out.float().numpy()

    return name, run
