"""Size limits. Enforced before publishing and after receiving."""

from __future__ import annotations

#: Largest message we publish or accept (bytes). The shipped nats-server
#: config sets `max_payload: 8MB`; keep this at or below the server's value.
MAX_PAYLOAD_BYTES = 8 * 1024 * 1024

#: Most rows (images) in one expert step request.
MAX_STEP_ROWS = 512

#: Largest tensor rank accepted on the wire.
MAX_TENSOR_NDIM = 8

#: Most images one generation job may ask for.
MAX_JOB_IMAGES = 256

#: Most sampling steps one generation job may ask for.
MAX_JOB_STEPS = 1000

#: Longest id string (job ids, row ids, worker ids).
MAX_ID_LEN = 128
