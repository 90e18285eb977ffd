"""A small KL autoencoder in PyTorch, and its numpy API (`LatentCodec`) for encoding data and decoding samples.

Layout (widths w = (w0, ..., w_L), 32x32 RGB input, 4 latent channels; (16, 32) gives 16x16 latents,
(16, 32, 64) 8x8; with patch p > 1 the encoder starts with a p x p space-to-depth fold and the decoder ends
with its inverse, so patch 8 and widths (64,) map 3x256x256 to 4x32x32):

    encoder: conv_in(C -> w0) ; per level i: ResBlock(-> w_i), then a stride-2 conv (all but the last level)
             ; mid ResBlock ; GroupNorm, SiLU, conv(-> 2c) = posterior mean and log-variance   [B, 2c, h, w]
    decoder: conv_in(c -> w_L) ; mid ResBlock ; per level from the last: ResBlock(-> w_i), then nearest x2
             upsample + conv (all but the first level) ; GroupNorm, SiLU, conv(-> C)           [B, C, 32, 32]

ResBlock(cin, cout): GroupNorm -> SiLU -> conv3x3 -> GroupNorm -> SiLU -> conv3x3, plus a 1x1 shortcut
when cin != cout. Training samples z = mean + exp(logvar / 2) * eps (`posterior`); encoding data for
the latent experts uses the mean (deterministic, so a latent cache is reproducible).

`LatentCodec` is what the rest of the project calls (numpy in, numpy out):

    codec = LatentCodec.load("runs/colour/ae.safetensors")
    z = codec.encode(images)     # float32 [N, C, H, W] in [-1, 1] -> scaled latents float32 [N, c, h, w]
    x = codec.decode(z)          # scaled latents -> float32 images [N, C, H, W] clipped to the spec's range
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from models.autoencoder import AutoencoderConfig, AutoencoderError, load_autoencoder
from models.checkpoint import checkpoint_paths
from models.codec_types import CodecInfo, check_array, info_from_meta

LOGVAR_RANGE = (-30.0, 20.0)


def _norm(cfg: AutoencoderConfig, ch: int) -> nn.GroupNorm:
    return nn.GroupNorm(cfg.groups, ch)


class ResBlock(nn.Module):
    def __init__(self, cfg: AutoencoderConfig, cin: int, cout: int):
        super().__init__()
        self.norm1 = _norm(cfg, cin)
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1)
        self.norm2 = _norm(cfg, cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1)
        self.skip = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x):
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(F.silu(self.norm2(h)))
        return self.skip(x) + h


class Encoder(nn.Module):
    def __init__(self, cfg: AutoencoderConfig):
        super().__init__()
        w = cfg.widths
        self.patch = cfg.patch
        self.conv_in = nn.Conv2d(cfg.in_channels * cfg.patch**2, w[0], 3, padding=1)
        self.blocks = nn.ModuleList()
        self.down = nn.ModuleList()
        prev = w[0]
        for i, wi in enumerate(w):
            self.blocks.append(ResBlock(cfg, prev, wi))
            prev = wi
            if i < len(w) - 1:
                self.down.append(nn.Conv2d(wi, wi, 3, stride=2, padding=1))
        self.mid = ResBlock(cfg, w[-1], w[-1])
        self.norm_out = _norm(cfg, w[-1])
        self.conv_out = nn.Conv2d(w[-1], 2 * cfg.latent_channels, 3, padding=1)

    def forward(self, x):
        if self.patch > 1:
            x = F.pixel_unshuffle(x, self.patch)
        h = self.conv_in(x)
        for i, block in enumerate(self.blocks):
            h = block(h)
            if i < len(self.down):
                h = self.down[i](h)
        h = self.mid(h)
        return self.conv_out(F.silu(self.norm_out(h)))


class Decoder(nn.Module):
    def __init__(self, cfg: AutoencoderConfig):
        super().__init__()
        w = cfg.widths
        self.conv_in = nn.Conv2d(cfg.latent_channels, w[-1], 3, padding=1)
        self.mid = ResBlock(cfg, w[-1], w[-1])
        self.blocks = nn.ModuleList()
        self.up = nn.ModuleList()
        prev = w[-1]
        for i in reversed(range(len(w))):
            self.blocks.append(ResBlock(cfg, prev, w[i]))
            prev = w[i]
            if i > 0:
                self.up.append(nn.Conv2d(w[i], w[i], 3, padding=1))
        self.norm_out = _norm(cfg, w[0])
        self.patch = cfg.patch
        self.conv_out = nn.Conv2d(w[0], cfg.in_channels * cfg.patch**2, 3, padding=1)

    def forward(self, z):
        h = self.mid(self.conv_in(z))
        for i, block in enumerate(self.blocks):
            h = block(h)
            if i < len(self.up):
                h = self.up[i](F.interpolate(h, scale_factor=2.0, mode="nearest"))
        out = self.conv_out(F.silu(self.norm_out(h)))
        return F.pixel_shuffle(out, self.patch) if self.patch > 1 else out


class Autoencoder(nn.Module):
    """encoder -> (mean, logvar) of a diagonal Gaussian over latents [c, h, w] -> decoder."""

    def __init__(self, cfg: AutoencoderConfig):
        super().__init__()
        self.cfg = cfg
        self.encoder = Encoder(cfg)
        self.decoder = Decoder(cfg)

    def posterior(self, x):
        """(mean, logvar) [B, c, h, w] of images x [B, C, H, W]."""
        mean, logvar = self.encoder(x).chunk(2, dim=1)
        return mean, logvar.clamp(*LOGVAR_RANGE)

    def forward(self, x, generator=None):
        """-> (reconstruction, mean, logvar): decodes a sample of the posterior (the training pass)."""
        mean, logvar = self.posterior(x)
        eps = torch.randn(mean.shape, generator=generator, device=mean.device, dtype=mean.dtype)
        return self.decoder(mean + torch.exp(0.5 * logvar) * eps), mean, logvar


def kl_loss(mean, logvar):
    """KL(N(mean, exp(logvar)) || N(0, 1)), averaged over every latent element."""
    return 0.5 * (mean.pow(2) + logvar.exp() - 1.0 - logvar).mean()


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def psnr_db(x, y, value_range=(-1.0, 1.0)) -> float:
    """PSNR in dB of y against x (numpy or torch, same shape), with the peak the value range's width."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    mse = float(np.mean((x - y) ** 2))
    peak = value_range[1] - value_range[0]
    return float("inf") if mse == 0 else 10.0 * np.log10(peak * peak / mse)


class LatentCodec:
    """A loaded autoencoder behind a numpy API: `encode` images to scaled latents, `decode` them back
    (the `autoencoder` backend of models/codec.py's `Codec` protocol).

    Scaled latents are z = (mean - shift_factor) * scale_factor (unit variance on the train data);
    `decode` undoes the scaling, runs the decoder and clips to the spec's value range."""

    def __init__(self, model: Autoencoder, meta: dict, device: str = "cpu", path: str = ""):
        self.model = model.to(device).eval()
        self.meta = meta
        self.device = device
        self.cfg: AutoencoderConfig = model.cfg
        spec = meta["spec"]
        self.scale = float(spec["scale_factor"])
        self.shift = float(spec["shift_factor"])
        self.value_range = tuple(float(v) for v in spec.get("value_range", (-1.0, 1.0)))
        self.content_hash: str = meta.get("content_hash", "")
        self.info: CodecInfo = info_from_meta(meta, path)

    @classmethod
    def load(cls, path, device: str = "cpu") -> LatentCodec:
        meta, state = load_autoencoder(path)
        model = Autoencoder(AutoencoderConfig.from_dict(meta["config"]))
        try:
            model.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()})
        except RuntimeError as exc:
            raise AutoencoderError(f"{path}: weights do not match its config: {exc}") from None
        return cls(model, meta, device, str(checkpoint_paths(path)[0]))

    @property
    def latent_shape(self) -> tuple[int, int, int]:
        return self.cfg.latent_shape

    @property
    def image_shape(self) -> tuple[int, int, int]:
        return self.cfg.image_shape

    def latent_shape_error(self, shape) -> str | None:
        """None when latents [c, h, w] of this shape can be decoded, else what is expected."""
        if tuple(shape) == tuple(self.latent_shape):
            return None
        return f"latents must be [B, {', '.join(map(str, self.latent_shape))}]"

    def _check(self, x: np.ndarray, shape: tuple[int, int, int], what: str) -> np.ndarray:
        wanted = f"[N, {', '.join(map(str, shape))}]"
        return check_array(x, lambda s: s == tuple(shape), wanted, what)

    @torch.no_grad()
    def encode(self, images: np.ndarray, batch_size: int = 256) -> np.ndarray:
        """images float [N, C, H, W] in the value range -> scaled latents float32 [N, c, h, w] (posterior mean)."""
        x = self._check(images, self.image_shape, "images")
        out = np.empty((len(x), *self.latent_shape), np.float32)
        for i in range(0, len(x), batch_size):
            xb = torch.from_numpy(np.ascontiguousarray(x[i : i + batch_size], dtype=np.float32)).to(self.device)
            mean, _ = self.model.posterior(xb)
            out[i : i + len(xb)] = ((mean - self.shift) * self.scale).float().cpu().numpy()
        return out

    @torch.no_grad()
    def decode(self, latents: np.ndarray, batch_size: int = 256) -> np.ndarray:
        """scaled latents float [N, c, h, w] -> images float32 [N, C, H, W] clipped to the value range."""
        z = self._check(latents, self.latent_shape, "latents")
        out = np.empty((len(z), *self.image_shape), np.float32)
        lo, hi = self.value_range
        for i in range(0, len(z), batch_size):
            zb = torch.from_numpy(np.ascontiguousarray(z[i : i + batch_size], dtype=np.float32)).to(self.device)
            xb = self.model.decoder(zb / self.scale + self.shift)
            out[i : i + len(zb)] = xb.clamp(lo, hi).float().cpu().numpy()
        return out
