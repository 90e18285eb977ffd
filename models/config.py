"""Architecture configuration shared by the torch and flax expert UNets.

`UNetConfig` is the single source of truth for the shape of an expert model; it is stored verbatim in
every checkpoint's JSON (`to_dict`) and checked again on load (`from_dict`).
"""

from __future__ import annotations

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
                f"UNetConfig: image_size {self.image_size} must be divisible by 2**len(widths)="
                f"{2 ** len(self.widths)}"
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
    def from_dict(cls, d: dict) -> "UNetConfig":
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
