"""Expert models: one UNet architecture in two frameworks.

* `config.UNetConfig`  architecture hyper-parameters (`DEFAULT` 6.7M params, `SMALL` 1.8M).
* `unet_torch.UNet`    PyTorch reference implementation.
* `unet_flax.UNet`     flax.linen implementation with 1:1 parameter names.

Framework modules are not imported here, so `import models` stays light (no torch, no jax).
"""

from .config import DEFAULT, SMALL, UNetConfig

__all__ = ["DEFAULT", "SMALL", "UNetConfig"]
