"""SmallConditionalUNet in PyTorch (the reference implementation of the expert model).

Layout (widths w = (w0, w1, w2), 32x32 input):

    emb   = concat(MLP(sinusoid(t, time_dim)), class_emb(y))            [B, time_dim + class_dim]
    h     = conv_in(x)                                                    [B, w0, 32, 32]
    enc.i : ResBlock(-> w_i) at 32/2**i, skip_i saved, then 2x2 average pool to half size
    mid.0, mid.1 : ResBlock(w2 -> w2) at 4x4
    for i = 2, 1, 0: nearest-neighbour x2 upsample, concat skip_i, dec.i : ResBlock(-> w_i)

Resampling has no parameters, so almost all weights sit in the ResBlocks: 6.69M parameters at
widths (64, 128, 256), 1.79M at (32, 64, 128).
    out   = conv_out(SiLU(norm_out(h)))                                   [B, in_channels, 32, 32]

Unknown label: with `cfg.null_label` the class embedding has num_classes + 1 rows and y = -1 selects
the last one (trained by label dropout, classifier-free style); without it y = -1 is refused
(`NullLabelError`) where the check is free (labels on the CPU; the worker validates y before that).

ResBlock(cin, cout): GroupNorm -> SiLU -> conv3x3 -> + Linear(SiLU(emb)) -> GroupNorm -> SiLU -> conv3x3,
plus a 1x1 conv shortcut when cin != cout.

Parameter names (`state_dict`) map 1:1 to the flax version in `unet_flax.py`; see
`models.checkpoint.torch_to_flax_params` for the rule.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .config import UNetConfig

UNKNOWN_LABEL = -1


class NullLabelError(ValueError):
    """y = -1 (label unknown) given to a model trained without a null label."""


def map_labels(y: torch.Tensor, cfg: UNetConfig) -> torch.Tensor:
    """y [B] int in 0..num_classes-1 or -1 -> embedding rows [B] int64 (-1 -> num_classes with null_label).

    Raises NullLabelError for -1 when the model has no null label, checked only on CPU tensors in eager
    mode (a check on a GPU / XLA tensor would stall the device, one in a compiled graph would break it
    in two; serving validates labels before the model).
    """
    y = y.long()
    if cfg.null_label:
        return torch.where(y < 0, torch.full_like(y, cfg.num_classes), y)
    if y.device.type == "cpu" and not torch.compiler.is_compiling() and y.numel() and int(y.min()) < 0:
        raise NullLabelError(
            "this model was trained without a null label, so it cannot generate with an unknown "
            "label (y = -1); train one with --label-dropout > 0"
        )
    return y


def timestep_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Sinusoidal embedding of t in [0, 1]: t [B] -> [B, dim] (sin half then cos half), fp32."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = t.float()[:, None] * 1000.0 * freqs[None, :]
    return torch.cat([torch.sin(args), torch.cos(args)], dim=1)


class ResBlock(nn.Module):
    """x [B, cin, H, W], emb [B, emb_dim] -> [B, cout, H, W]."""

    def __init__(self, cin: int, cout: int, emb_dim: int, groups: int):
        super().__init__()
        self.norm1 = nn.GroupNorm(groups, cin)
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1)
        self.emb_proj = nn.Linear(emb_dim, cout)
        self.norm2 = nn.GroupNorm(groups, cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1)
        self.skip = nn.Conv2d(cin, cout, 1) if cin != cout else None

    def forward(self, x: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        h = h + self.emb_proj(F.silu(emb))[:, :, None, None]
        h = self.conv2(F.silu(self.norm2(h)))
        return h + (self.skip(x) if self.skip is not None else x)


class UNet(nn.Module):
    """Class-conditional velocity model v(x_t, t, y).

    forward(x [B, C, H, W] float, t [B] float in [0, 1], y [B] int64 class ids, -1 = unknown (needs
    cfg.null_label)) -> v [B, C, H, W].
    """

    def __init__(self, cfg: UNetConfig):
        super().__init__()
        self.cfg = cfg
        w, g, e = cfg.widths, cfg.groups, cfg.emb_dim
        self.time_fc1 = nn.Linear(cfg.time_dim, cfg.time_dim)
        self.time_fc2 = nn.Linear(cfg.time_dim, cfg.time_dim)
        self.class_emb = nn.Embedding(cfg.num_classes + int(cfg.null_label), cfg.class_dim)  # + null row
        self.conv_in = nn.Conv2d(cfg.in_channels, w[0], 3, padding=1)
        self.enc = nn.ModuleList()
        prev = w[0]
        for wi in w:
            self.enc.append(ResBlock(prev, wi, e, g))
            prev = wi
        self.mid = nn.ModuleList([ResBlock(w[-1], w[-1], e, g), ResBlock(w[-1], w[-1], e, g)])
        self.dec = nn.ModuleList()
        for i, wi in enumerate(w):
            above = w[i + 1] if i + 1 < len(w) else w[-1]
            self.dec.append(ResBlock(above + wi, wi, e, g))
        self.norm_out = nn.GroupNorm(g, w[0])
        self.conv_out = nn.Conv2d(w[0], cfg.in_channels, 3, padding=1)

    def embed(self, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """t [B], y [B] (-1 = unknown, with cfg.null_label) -> conditioning vector [B, time_dim + class_dim]."""
        te = self.time_fc2(F.silu(self.time_fc1(timestep_embedding(t, self.cfg.time_dim))))
        return torch.cat([te, self.class_emb(map_labels(y, self.cfg))], dim=1)

    def forward(self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        emb = self.embed(t, y)
        h = self.conv_in(x)
        skips = []
        for enc in self.enc:
            h = enc(h, emb)
            skips.append(h)
            h = F.avg_pool2d(h, 2)
        for mid in self.mid:
            h = mid(h, emb)
        for i in reversed(range(len(self.cfg.widths))):
            h = F.interpolate(h, scale_factor=2, mode="nearest")
            h = self.dec[i](torch.cat([h, skips[i]], dim=1), emb)
        return self.conv_out(F.silu(self.norm_out(h)))


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
