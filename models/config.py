"""Architecture configurations shared by the torch and flax expert models.

`UNetConfig` (the UNet) and `DiTConfig` (the DiT) are the single source of truth for the shape of an expert
model; one is stored verbatim in every checkpoint's JSON (`to_dict`), with "arch" naming which (`models.arch`),
and checked again on load (`from_dict`).
"""

from __future__ import annotations

import numbers
from dataclasses import asdict, dataclass, fields


@dataclass(frozen=True)
class UNetConfig:
    """SmallConditionalUNet hyper-parameters.

    widths: channel count at each encoder level, e.g. (64, 128, 256) for resolutions 32, 16, 8;
    the bottleneck runs at image_size / 2**len(widths) (4 for 32x32 with three levels).
    time_dim: size of the sinusoidal time embedding (and of its MLP output).
    class_dim: size of the learned class embedding; the conditioning vector is their concatenation.
    groups: GroupNorm groups; every width must be divisible by it.
    null_label: the class embedding has one more row, index num_classes, that label -1 ("unknown")
    maps to (trained with label dropout); False for checkpoints made before it, which refuse -1.
    """

    in_channels: int = 1
    image_size: int = 32
    num_classes: int = 10
    widths: tuple[int, ...] = (64, 128, 256)
    time_dim: int = 128
    class_dim: int = 128
    groups: int = 8
    null_label: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "widths", tuple(int(w) for w in self.widths))
        if not self.widths:
            raise ValueError("UNetConfig.widths must list at least one width, e.g. (32, 64, 128)")
        for w in self.widths:
            if w <= 0 or w % self.groups:
                raise ValueError(f"UNetConfig: width {w} must be positive and divisible by groups={self.groups}")
        if self.image_size % (2 ** len(self.widths)):
            raise ValueError(
                f"UNetConfig: image_size {self.image_size} must be divisible by 2**len(widths)={2 ** len(self.widths)}"
            )
        if self.time_dim % 2 or self.time_dim <= 0:
            raise ValueError(f"UNetConfig: time_dim must be a positive even number, got {self.time_dim}")
        for name in ("in_channels", "num_classes", "class_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"UNetConfig: {name} must be positive, got {getattr(self, name)}")

    @property
    def emb_dim(self) -> int:
        """Size of the conditioning vector fed to every ResBlock (time_dim + class_dim)."""
        return self.time_dim + self.class_dim

    def to_dict(self) -> dict:
        d = asdict(self)
        d["widths"] = list(self.widths)
        if not self.null_label:  # written only when set: other checkpoints keep their exact JSON
            del d["null_label"]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> UNetConfig:
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"UNetConfig: unknown keys {sorted(unknown)}; known keys are {sorted(known)}")
        return cls(**d)


DEFAULT = UNetConfig()
SMALL = UNetConfig(widths=(32, 64, 128))


def parse_widths(text: str) -> tuple[int, ...]:
    """Parse a CLI width list such as "32,64,128"."""
    try:
        widths = tuple(int(p) for p in text.split(",") if p.strip())
    except ValueError:
        raise ValueError(f"--widths must be comma-separated integers like 32,64,128, got {text!r}") from None
    if not widths:
        raise ValueError("--widths must not be empty")
    return widths


@dataclass(frozen=True)
class DiTConfig:
    """DiT (Peebles & Xie, "Scalable Diffusion Models with Transformers"; the DDM paper's experts) hyper-parameters.

    The image [in_channels, image_size, image_size] is cut into (image_size / patch_size)**2 patches of
    patch_size x patch_size pixels, each embedded to hidden_size (tokens [B, T, hidden_size]); `depth`
    adaLN-Zero transformer blocks with `num_heads` attention heads and an MLP of hidden_size * mlp_ratio run
    on them, conditioned on c = MLP(sinusoid(t, time_freq_dim)) + class_emb(y) [B, hidden_size].
    null_label: the class embedding has one more row, index num_classes, that label -1 ("unknown") maps to.
    Stored in a checkpoint's JSON as "config" beside "arch": "dit" (`models.arch`).
    """

    in_channels: int = 1
    image_size: int = 32
    patch_size: int = 2
    hidden_size: int = 128
    depth: int = 6
    num_heads: int = 4
    mlp_ratio: float = 4.0
    num_classes: int = 10
    time_freq_dim: int = 256
    null_label: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "mlp_ratio", float(self.mlp_ratio))
        for name in (
            "in_channels",
            "image_size",
            "patch_size",
            "hidden_size",
            "depth",
            "num_heads",
            "num_classes",
            "time_freq_dim",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
                raise ValueError(f"DiTConfig: {name} must be a positive integer, got {value!r}")
            object.__setattr__(self, name, int(value))  # numpy integers -> int (JSON-serialisable)
        if self.image_size % self.patch_size:
            divisors = [p for p in range(1, self.image_size + 1) if self.image_size % p == 0 and p <= 8]
            raise ValueError(
                f"DiTConfig: patch_size {self.patch_size} must divide image_size {self.image_size}; "
                f"choose one of {divisors}"
            )
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"DiTConfig: hidden_size {self.hidden_size} must be divisible by num_heads "
                f"{self.num_heads} (each head gets hidden_size / num_heads channels)"
            )
        if self.hidden_size % 4:
            raise ValueError(
                f"DiTConfig: hidden_size {self.hidden_size} must be a multiple of 4 (the 2-D sin-cos "
                "position embedding gives a quarter of it to each of sin/cos of row/column)"
            )
        if not self.mlp_ratio > 0 or int(self.hidden_size * self.mlp_ratio) <= 0:
            raise ValueError(f"DiTConfig: mlp_ratio must be positive (e.g. 4.0), got {self.mlp_ratio}")
        if self.time_freq_dim % 2:
            raise ValueError(f"DiTConfig: time_freq_dim must be a positive even number, got {self.time_freq_dim}")
        if not isinstance(self.null_label, bool):
            raise ValueError(f"DiTConfig: null_label must be true or false, got {self.null_label!r}")

    @property
    def grid(self) -> int:
        """Patches per side (image_size / patch_size); the sequence has grid**2 tokens."""
        return self.image_size // self.patch_size

    @property
    def mlp_hidden(self) -> int:
        """Hidden width of each block's MLP (int(hidden_size * mlp_ratio))."""
        return int(self.hidden_size * self.mlp_ratio)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> DiTConfig:
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"DiTConfig: unknown keys {sorted(unknown)}; known keys are {sorted(known)}")
        return cls(**d)
