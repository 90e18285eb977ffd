"""PyTorch backend (CPU or CUDA) for the expert model (UNet or DiT, `models.arch`).

Options: device "cpu" | "cuda" | "cuda:N" (default: cpu); dtype "float32" (default) | "bfloat16" | "auto"
(`models.precision`): bfloat16 runs under bfloat16 autocast (inputs and outputs stay float32);
channels_last (default on CPU in eager mode, where it is ~2x faster with bf16 on this box's AVX-512).
compile "off" (default) | "on" | "auto" (`workers.backends.torch_compile`): torch.compile with inductor's
freezing, ~1.3x the eager forward on an AMX CPU; the worker's --compile defaults to auto.
On CUDA, inputs and outputs go through pinned host memory with non-blocking copies. On a CPU the
worker does not pad batches to its buckets (`pads_to_buckets` False).
"""

from __future__ import annotations

import logging

import numpy as np

from .base import BackendBase, BackendError

log = logging.getLogger(__name__)


class TorchBackend(BackendBase):
    name = "torch"

    def __init__(
        self,
        device: str | None = None,
        dtype: str = "float32",
        bf16: bool | None = None,
        channels_last: bool | None = None,
        threads: int | None = None,
        compile: str | bool | None = "off",
    ):
        super().__init__(device=device or "cpu", dtype=dtype, bf16=bf16)
        import torch

        try:
            self._device = torch.device(self.device)
        except RuntimeError as err:
            raise BackendError(f"torch backend: bad device {self.device!r}: {err}") from None
        if self._device.type == "cuda" and not torch.cuda.is_available():
            raise BackendError(f"torch backend: device {self.device!r} asked for but CUDA is not available here")
        if self._device.type not in ("cpu", "cuda"):
            raise BackendError(f"torch backend serves on cpu or cuda, not {self.device!r} (use --backend xla for XLA)")
        from .torch_compile import resolve_compile

        self.compiled, self.compile_reason = resolve_compile(compile, device=self._device.type)
        # a compiled graph picks its own layouts (and channels-last trips inductor's freezing with a
        # dynamic batch in torch 2.13)
        if channels_last is None:
            channels_last = self._device.type == "cpu" and not self.compiled
        self.channels_last = bool(channels_last)
        if threads:
            torch.set_num_threads(int(threads))
        self._model = None
        self._threads: int | None = None  # pinned by make_batch_invariant: set on each forward's thread

    @property
    def pads_to_buckets(self) -> bool:
        """Eager torch runs any batch size; on a CPU, whose cost grows with the rows, padding a
        17-row batch to 32 would nearly double the work, so only CUDA keeps the bucket shapes."""
        return self._device.type != "cpu"

    def describe(self) -> dict[str, str]:
        d = super().describe()
        d["channels_last"] = str(self.channels_last).lower()
        d["compiled"] = str(self.compiled).lower()
        return d

    def _pin_threads(self) -> int:
        """On a CPU the forward's rows are split over torch's intra-op threads: keep today's count."""
        import torch

        if self._device.type != "cpu":
            return 1
        self._threads = torch.get_num_threads()
        return self._threads

    def _build(self, cfg, state: dict[str, np.ndarray]) -> None:
        import torch

        from models.arch import build_torch

        model = build_torch(cfg)
        tensors = {k: torch.from_numpy(np.ascontiguousarray(v, dtype=np.float32)) for k, v in state.items()}
        missing, unexpected = model.load_state_dict(tensors, strict=False)
        if missing or unexpected:
            raise BackendError(
                f"torch backend: checkpoint does not match the model: missing {missing[:5]}, "
                f"unexpected {unexpected[:5]}"
            )
        model = model.eval().to(self._device)
        if self.channels_last:
            model = model.to(memory_format=torch.channels_last)
        for p in model.parameters():
            p.requires_grad_(False)
        log.info(
            "torch backend: %s (%s)",
            "compiling the expert at warm-up" if self.compiled else "eager forward, not compiled",
            self.compile_reason,
        )
        if self.compiled:
            import torch._inductor.config as inductor_config

            # freezing: weights as constants, folded and prepacked for oneDNN (the gain; without it
            # inductor is within noise of eager here). Process-wide: a worker holds one expert.
            inductor_config.freezing = True
            _allow_compiled_models(torch)
            model = torch.compile(model, dynamic=False)  # the batch dimension is marked dynamic per call
        self._model = model
        if self._device.type == "cuda":
            self.device = f"cuda:{self._device.index or 0}"

    def _forward(self, x: np.ndarray, t: np.ndarray, y: np.ndarray) -> np.ndarray:
        import torch

        dev = self._device
        if dev.type == "cuda":
            return self._forward_cuda(x, t, y)
        if self._threads is not None and torch.get_num_threads() != self._threads:
            torch.set_num_threads(self._threads)  # torch's setting is per thread: this one runs as checked
        with torch.inference_mode(), torch.autocast(dev.type, dtype=torch.bfloat16, enabled=self.bf16):
            # np.require copies only read-only views (wire-decoded arrays), which torch cannot wrap.
            xt = torch.from_numpy(np.require(x, np.float32, ["C", "W"])).to(dev, non_blocking=True)
            if self.channels_last:
                xt = xt.contiguous(memory_format=torch.channels_last)
            tt = torch.from_numpy(np.require(t, np.float32, ["C", "W"])).to(dev)
            yt = torch.from_numpy(np.require(y, np.int64, ["C", "W"])).to(dev)
            if self.compiled and xt.shape[0] > 1:  # one graph for any batch > 1 (a batch of 1 gets its own)
                for a in (xt, tt, yt):
                    torch._dynamo.mark_dynamic(a, 0)
            out = self._model(xt, tt, yt)
        return out.float().contiguous().cpu().numpy()

    def _forward_cuda(self, x: np.ndarray, t: np.ndarray, y: np.ndarray) -> np.ndarray:
        """CUDA: inputs staged in pinned host memory (the one copy a read-only wire view needs
        anyway) and copied with non_blocking=True; the output comes back into a fresh pinned
        buffer, so the returned array [B, C, H, W] float32 is never reused by a later call (torch's
        caching host allocator keeps pinned blocks until their copies are done)."""
        import torch

        dev = self._device
        with torch.inference_mode(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.bf16):
            xt = _pinned(x, torch.float32).to(dev, non_blocking=True)
            if self.channels_last:
                xt = xt.contiguous(memory_format=torch.channels_last)
            tt = _pinned(t, torch.float32).to(dev, non_blocking=True)
            yt = _pinned(y, torch.int64).to(dev, non_blocking=True)
            out = self._model(xt, tt, yt)
            host = torch.empty(tuple(out.shape), dtype=torch.float32, pin_memory=True)
            host.copy_(out, non_blocking=True)
        torch.cuda.current_stream(dev).synchronize()
        return host.numpy()


#: compiled graphs per model code (UNet.forward, DiT.forward) one process may hold: two per expert (a batch of 1,
#: any other), and an in-process fleet or a bench holds several experts of one architecture
RECOMPILE_LIMIT = 64


def _allow_compiled_models(torch) -> None:
    """Dynamo keeps at most `recompile_limit` graphs (8 by default) per function and runs the rest eager,
    silently: each expert's frozen weights make its own two graphs, so five experts in one process would
    leave the fifth uncompiled. Raise it (never lower it)."""
    cfg = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):  # the newer name, the older
        if hasattr(cfg, name):
            setattr(cfg, name, max(int(getattr(cfg, name)), RECOMPILE_LIMIT))
    for name in ("accumulated_recompile_limit", "accumulated_cache_size_limit"):
        if hasattr(cfg, name):
            setattr(cfg, name, max(int(getattr(cfg, name)), 4 * RECOMPILE_LIMIT))


def _pinned(a: np.ndarray, dtype):
    """A pinned (page-locked) host tensor holding a copy of `a` (any shape), as `dtype`."""
    import torch

    host = torch.empty(tuple(a.shape), dtype=dtype, pin_memory=True)
    host.numpy()[...] = a
    return host
