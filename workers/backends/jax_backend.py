"""JAX / Flax backend for the expert model (UNet or DiT): one jax.jit, compiled once per bucket shape.

Options: device "cpu" | "gpu" | "cuda" | "tpu", optionally ":N" (default: jax's default device);
dtype="bfloat16" (bf16=True, the older spelling) casts weights and inputs to bfloat16 inside the
jitted function (outputs float32).
Full float32 matmul/conv precision otherwise, so fp32 results match the torch backend.
"""

from __future__ import annotations

import numpy as np

from .base import BackendBase, BackendError


class JaxBackend(BackendBase):
    name = "jax"

    def __init__(self, device: str | None = None, dtype: str = "float32", bf16: bool | None = None):
        super().__init__(device=device, dtype=dtype, bf16=bf16)
        import jax

        self._jax = jax
        self._dev = self._pick_device(device)
        self.device = f"jax:{self._dev.platform}:{self._dev.id}"
        self._fn = None
        self._params = None

    def _pick_device(self, spec: str | None):
        jax = self._jax
        if not spec:
            return jax.devices()[0]
        platform, _, index = spec.partition(":")
        platform = {"cuda": "gpu"}.get(platform.lower(), platform.lower())
        try:
            devices = jax.devices(platform)
        except RuntimeError as err:
            raise BackendError(
                f"jax backend: no {platform!r} devices here ({err}); available: {[d.platform for d in jax.devices()]}"
            ) from None
        try:
            return devices[int(index or 0)]
        except (ValueError, IndexError):
            raise BackendError(f"jax backend: device {spec!r} not found; {len(devices)} {platform} device(s)") from None

    def _build(self, cfg, state: dict[str, np.ndarray]) -> None:
        jax = self._jax
        import jax.numpy as jnp

        from models.arch_flax import build_flax
        from models.checkpoint import torch_to_flax_params

        model = build_flax(cfg)
        params = torch_to_flax_params(state, cfg)
        dtype = jnp.bfloat16 if self.bf16 else jnp.float32
        precision = "default" if self.bf16 else "highest"

        def apply(p, x, t, y):
            with jax.default_matmul_precision(precision):
                if self.bf16:
                    p = jax.tree_util.tree_map(lambda a: a.astype(dtype), p)
                    x = x.astype(dtype)
                out = model.apply({"params": p}, x, t, y)
            return out.astype(jnp.float32)

        self._params = jax.device_put(params, self._dev)
        self._fn = jax.jit(apply)

    def _forward(self, x: np.ndarray, t: np.ndarray, y: np.ndarray) -> np.ndarray:
        jax = self._jax
        args = jax.device_put(
            (
                np.ascontiguousarray(x, np.float32),
                np.ascontiguousarray(t, np.float32),
                np.ascontiguousarray(y, np.int32),
            ),
            self._dev,
        )
        return np.asarray(self._fn(self._params, *args))
