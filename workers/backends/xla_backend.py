"""torch_xla backend: the torch UNet on an XLA device (XLA:CPU, XLA:GPU, or Trainium via torch-neuronx).

XLA compiles one graph per input shape, so the worker pads every batch to a bucket size and warms
every bucket before it advertises itself. Options:

* device: None (torch_xla's default device) or "xla" / "xla:N".
* dtype "bfloat16" (or "auto", which is bfloat16 on an XLA device; bf16=True is the older spelling):
  bfloat16 autocast on the device (inputs and outputs float32).
* cache_path: persistent compilation cache directory (also read from $XLA_PERSISTENT_CACHE_PATH),
  set up with `torch_xla.runtime.initialize_cache` before the first compilation, so a restarted
  worker skips recompiling its buckets.

On a Trainium host, `torch_neuronx` is imported when installed so its PJRT plugin registers; run
with PJRT_DEVICE=NEURON there, PJRT_DEVICE=CPU for XLA's CPU device (what the tests use).
"""

from __future__ import annotations

import logging
import os

import numpy as np

from .base import BackendBase, BackendError

log = logging.getLogger(__name__)

_cache_ready: str | None = None


def init_persistent_cache(path: str) -> None:
    """Point torch_xla's persistent compile cache at `path` (once per process; must precede compiles)."""
    global _cache_ready
    if _cache_ready == path:
        return
    if _cache_ready is not None:
        raise BackendError(f"xla compile cache already set to {_cache_ready!r}; cannot switch to {path!r}")
    import torch_xla.runtime as xr

    os.makedirs(path, exist_ok=True)
    try:
        xr.initialize_cache(path, readonly=False)
    except Exception as err:  # raised if a computation already ran in this process
        raise BackendError(f"cannot enable the xla compile cache at {path!r}: {err}") from err
    _cache_ready = path
    log.info("xla persistent compile cache: %s", path)


class XlaBackend(BackendBase):
    name = "xla"

    def __init__(
        self, device: str | None = None, dtype: str = "float32", bf16: bool | None = None, cache_path: str | None = None
    ):
        super().__init__(device=device, dtype=dtype, bf16=bf16)
        try:
            import torch_xla  # noqa: F401
            import torch_xla.core.xla_model as xm
        except ImportError as err:
            raise BackendError(
                f"xla backend needs torch_xla ({err}); install torch-xla matching torch "
                "(e.g. `make test-xla` builds .venv-xla with torch 2.9.0 + torch-xla 2.9.0)"
            ) from None
        try:  # Trainium: importing torch_neuronx registers the Neuron PJRT plugin
            import torch_neuronx  # noqa: F401

            self.neuron = True
        except ImportError:
            self.neuron = False
        self.cache_path = cache_path or os.environ.get("XLA_PERSISTENT_CACHE_PATH") or None
        if self.cache_path:
            init_persistent_cache(self.cache_path)
        self._xm = xm
        self._model = None
        if device and device != "xla" and not device.startswith("xla:"):
            raise BackendError(f"xla backend: device must be 'xla' or 'xla:N', got {device!r}")
        self._dev = None

    def _sync(self) -> None:
        import torch_xla

        sync = getattr(torch_xla, "sync", None)  # torch_xla >= 2.6; mark_step before
        sync() if sync is not None else self._xm.mark_step()

    def _resolve_device(self):
        import torch_xla

        if self.requested_device and ":" in self.requested_device:
            import torch

            return torch.device(self.requested_device)
        return torch_xla.device()

    def describe(self) -> dict[str, str]:
        d = super().describe()
        d["neuron"] = str(self.neuron).lower()
        d["compile_cache"] = self.cache_path or ""
        return d

    def _build(self, cfg, state: dict[str, np.ndarray]) -> None:
        import torch

        from models.arch import build_torch

        self._dev = self._resolve_device()
        try:
            hw = self._xm.xla_device_hw(self._dev)
        except Exception:  # pragma: no cover - older torch_xla
            hw = "?"
        self.device = f"{self._dev}:{hw}" if hw != "?" else str(self._dev)
        model = build_torch(cfg)
        model.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(v, np.float32)) for k, v in state.items()})
        model = model.eval()
        for p in model.parameters():
            p.requires_grad_(False)
        self._model = model.to(self._dev)

    def _forward(self, x: np.ndarray, t: np.ndarray, y: np.ndarray) -> np.ndarray:
        import torch

        with torch.no_grad(), torch.autocast("xla", dtype=torch.bfloat16, enabled=self.bf16):
            xt = torch.from_numpy(np.require(x, np.float32, ["C", "W"])).to(self._dev)
            tt = torch.from_numpy(np.require(t, np.float32, ["C", "W"])).to(self._dev)
            yt = torch.from_numpy(np.require(y, np.int64, ["C", "W"])).to(self._dev)
            out = self._model(xt, tt, yt)
            self._sync()
            return out.float().cpu().numpy()
