"""The choice lists of a worker's options, in a module that imports nothing heavy (no numpy, no model code).

A command that only builds its parser (`ddm-fleet worker --help`, `bench worker`) or re-exports a list
(`infra.cmd_worker.SIM_PRESETS`) imports them from here; `workers.config` declares the flags with them and
the code that acts on a choice checks it against the same list (`workers.batcher`, the torch backend's
`workers.backends.torch_compile`). Tests check them against what they name (`SIM_PRESETS` against
`workers.backends.sim_backend.PRESETS`).
"""

from __future__ import annotations

from bus.options import DTYPES  # noqa: F401 (re-exported: `--dtype`, the choice list every command shares)

#: Model runtimes a worker can load (`workers.backends.get_backend`); sim: a simulated expert, no model.
BACKENDS = ("torch", "xla", "jax", "sim")
#: `workers.backends.sim_backend.PRESETS` names.
SIM_PRESETS = ("h200-torch", "h200-jax", "instant")
#: How queued requests merge into one forward pass (`workers.batcher.Batcher`).
MERGE_MODES = ("auto", "always")
#: Whether the torch backend compiles its expert (`workers.backends.torch_compile`).
COMPILE_CHOICES = ("auto", "on", "off")
