"""Model runtimes for expert workers: one file per backend, imported only when asked for.

    from workers.backends import get_backend
    be = get_backend("torch", device="cpu", dtype="auto")   # or "xla", "jax", "sim" (simulated expert)
    be.load(path); be.warmup([1, 2, 4]); v = be.forward(x, t, y)

See `workers.backends.base` for the `Backend` protocol.
"""

from __future__ import annotations

import importlib
from typing import Any

from .base import Backend, BackendBase, BackendError

#: name -> (module, class). Modules import torch / torch_xla / jax lazily; "sim" needs numpy only.
BACKENDS: dict[str, tuple[str, str]] = {
    "torch": ("workers.backends.torch_backend", "TorchBackend"),
    "xla": ("workers.backends.xla_backend", "XlaBackend"),
    "jax": ("workers.backends.jax_backend", "JaxBackend"),
    "sim": ("workers.backends.sim_backend", "SimBackend"),  # simulated expert: latency model, numpy only
}


def get_backend(name: str, **opts: Any) -> Backend:
    """A fresh, unloaded backend by name. opts: device=None, dtype="float32" ("auto" | "bfloat16",
    `models.precision`; bf16=True is the older spelling), plus backend extras."""
    if name not in BACKENDS:
        raise BackendError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")
    module, cls = BACKENDS[name]
    try:
        mod = importlib.import_module(module)
    except ImportError as err:
        raise BackendError(f"backend {name!r} is not usable here: {err}") from err
    return getattr(mod, cls)(**opts)


__all__ = ["Backend", "BackendBase", "BackendError", "BACKENDS", "get_backend"]
