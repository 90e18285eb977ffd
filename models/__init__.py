"""Expert models: two architectures (UNet, DiT), each in two frameworks.

* `config.UNetConfig`  UNet hyper-parameters (`DEFAULT` 6.7M params, `SMALL` 1.8M).
* `unet_torch.UNet`    PyTorch reference implementation.
* `unet_flax.UNet`     flax.linen implementation with 1:1 parameter names.
* `config.DiTConfig`, `dit_torch.DiT`, `dit_flax.DiT`  the DiT (adaLN-Zero transformer) the same way.
* `arch` / `arch_flax` which architecture a checkpoint holds ("arch"), and the factories that build it.

Framework modules are not imported here, so `import models` stays light (no torch, no jax).
"""

from .config import DEFAULT, SMALL, DiTConfig, UNetConfig

__all__ = ["DEFAULT", "SMALL", "DiTConfig", "UNetConfig"]
