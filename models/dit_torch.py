"""DiT (diffusion transformer with adaLN-Zero blocks) in PyTorch: the DDM paper's expert architecture.

Same call as `unet_torch.UNet`: forward(x [B, C, H, W] float32, t [B] float32 in [0, 1] (t=0 noise, t=1 data),
y [B] int64, -1 = unknown with cfg.null_label) -> velocity [B, C, H, W]. Layout (D = hidden_size, p = patch_size,
T = (H / p)**2 tokens):

    tokens = patch_embed(x)  (conv p x p, stride p)  flattened row-major      [B, T, D]
             + pos_embed     (fixed 2-D sin-cos, not a parameter)             [1, T, D]
    c      = time_fc2(SiLU(time_fc1(sinusoid(t, time_freq_dim))))             [B, D]
             + class_emb(y)  (row num_classes = unknown label with null_label)
    blocks.i (adaLN-Zero): shift/scale/gate x 2 = ada(SiLU(c)) [B, 6D];
             h += gate_a * attn(LN(h) * (1 + scale_a) + shift_a)
             h += gate_m * mlp(LN(h) * (1 + scale_m) + shift_m)      (mlp: fc1 -> GELU(tanh) -> fc2)
    final:   shift/scale = final.ada(SiLU(c)); final.linear(LN(h) * (1 + scale) + shift)  [B, T, p*p*C]
    unpatchify -> [B, C, H, W]

LayerNorms have no parameters (eps 1e-6). `ada` and the final layer start at zero, so a freshly initialised
DiT outputs exactly zero (adaLN-Zero). The sinusoid is `unet_torch.timestep_embedding` (t scaled by 1000), so
both architectures read time the same way.

Parameter names (`state_dict`) map 1:1 to `dit_flax.DiT` by `models.checkpoint.torch_to_flax_params`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import DiTConfig
from .dit_common import LN_EPS, sincos_pos_embed
from .unet_torch import NullLabelError, map_labels, timestep_embedding  # noqa: F401  (NullLabelError re-exported)


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [B, T, D], shift/scale [B, D] -> x * (1 + scale) + shift."""
    return x * (1 + scale[:, None, :]) + shift[:, None, :]


class Attention(nn.Module):
    """Multi-head self-attention: [B, T, D] -> [B, T, D] (qkv Linear D -> 3D, heads split, proj Linear D -> D)."""

    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, self.num_heads, d // self.num_heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2])  # [B, heads, T, D / heads]
        return self.proj(out.transpose(1, 2).reshape(b, n, d))


class Mlp(nn.Module):
    """[B, T, D] -> fc1 (D -> hidden) -> GELU (tanh approximation) -> fc2 (hidden -> D)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class DiTBlock(nn.Module):
    """adaLN-Zero transformer block: h [B, T, D], c [B, D] -> [B, T, D]."""

    def __init__(self, dim: int, num_heads: int, mlp_hidden: int):
        super().__init__()
        self.attn = Attention(dim, num_heads)
        self.mlp = Mlp(dim, mlp_hidden)
        self.ada = nn.Linear(dim, 6 * dim)

    def forward(self, h: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        shift_a, scale_a, gate_a, shift_m, scale_m, gate_m = self.ada(F.silu(c)).chunk(6, dim=1)
        d = h.shape[-1]
        h = h + gate_a[:, None, :] * self.attn(modulate(F.layer_norm(h, (d,), eps=LN_EPS), shift_a, scale_a))
        return h + gate_m[:, None, :] * self.mlp(modulate(F.layer_norm(h, (d,), eps=LN_EPS), shift_m, scale_m))


class FinalLayer(nn.Module):
    """h [B, T, D], c [B, D] -> per-token patch pixels [B, T, p * p * C] (adaLN, then Linear)."""

    def __init__(self, dim: int, out: int):
        super().__init__()
        self.ada = nn.Linear(dim, 2 * dim)
        self.linear = nn.Linear(dim, out)

    def forward(self, h: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        shift, scale = self.ada(F.silu(c)).chunk(2, dim=1)
        return self.linear(modulate(F.layer_norm(h, (h.shape[-1],), eps=LN_EPS), shift, scale))


class DiT(nn.Module):
    """Class-conditional velocity model v(x_t, t, y) as a diffusion transformer (see the module docstring).

    forward(x [B, C, H, W] float, t [B] float in [0, 1], y [B] int64 class ids, -1 = unknown (needs
    cfg.null_label; refused with NullLabelError otherwise, on CPU tensors)) -> v [B, C, H, W].
    """

    def __init__(self, cfg: DiTConfig):
        super().__init__()
        self.cfg = cfg
        d, p = cfg.hidden_size, cfg.patch_size
        self.patch_embed = nn.Conv2d(cfg.in_channels, d, p, stride=p)
        self.register_buffer("pos_embed", torch.from_numpy(sincos_pos_embed(d, cfg.grid))[None], persistent=False)
        self.time_fc1 = nn.Linear(cfg.time_freq_dim, d)
        self.time_fc2 = nn.Linear(d, d)
        self.class_emb = nn.Embedding(cfg.num_classes + int(cfg.null_label), d)  # + null row
        self.blocks = nn.ModuleList([DiTBlock(d, cfg.num_heads, cfg.mlp_hidden) for _ in range(cfg.depth)])
        self.final = FinalLayer(d, p * p * cfg.in_channels)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """DiT's initialisation: xavier-uniform Linear / patch kernels with zero bias, N(0, 0.02) class and
        time-MLP weights, and zero adaLN modulation and final layer (so the initial output is exactly 0)."""
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
                nn.init.zeros_(m.bias)
        w = self.patch_embed.weight
        nn.init.xavier_uniform_(w.view(w.shape[0], -1))
        nn.init.zeros_(self.patch_embed.bias)
        nn.init.normal_(self.class_emb.weight, std=0.02)
        nn.init.normal_(self.time_fc1.weight, std=0.02)
        nn.init.normal_(self.time_fc2.weight, std=0.02)
        for lin in [b.ada for b in self.blocks] + [self.final.ada, self.final.linear]:
            nn.init.zeros_(lin.weight)
            nn.init.zeros_(lin.bias)

    def embed(self, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """t [B], y [B] (-1 = unknown, with cfg.null_label) -> conditioning vector c [B, hidden_size]."""
        te = self.time_fc2(F.silu(self.time_fc1(timestep_embedding(t, self.cfg.time_freq_dim))))
        return te + self.class_emb(map_labels(y, self.cfg))

    def unpatchify(self, h: torch.Tensor) -> torch.Tensor:
        """[B, T, p * p * C] (per token: p rows x p columns x C channels) -> [B, C, H, W]."""
        cfg = self.cfg
        g, p, c = cfg.grid, cfg.patch_size, cfg.in_channels
        h = h.reshape(h.shape[0], g, g, p, p, c)
        return torch.einsum("bhwpqc->bchpwq", h).reshape(h.shape[0], c, g * p, g * p)

    def forward(self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        c = self.embed(t, y)
        h = self.patch_embed(x).flatten(2).transpose(1, 2) + self.pos_embed  # [B, T, D]
        for block in self.blocks:
            h = block(h, c)
        return self.unpatchify(self.final(h, c))
