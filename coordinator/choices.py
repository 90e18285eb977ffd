"""The choice lists of the coordinator's settings, in one module that imports nothing (building
`ddm-fleet coordinator`'s parser imports no numpy): `coordinator.config` declares its flags and range
checks with them."""

#: Precisions of x_t and the velocity on the coordinator<->worker wire (`--wire-dtype`).
WIRE_DTYPES = ("float32", "float16", "bfloat16")
#: `--hedge`: hedged expert requests (coordinator.transport) on, or off.
HEDGE_MODES = ("auto", "off")
#: `--dispatch`: how expert requests reach workers (coordinator.dispatch).
DISPATCH_MODES = ("direct", "queue")
