"""Size limits. Enforced before publishing and after receiving."""

from __future__ import annotations

#: Largest message we publish or accept (bytes). The shipped nats-server
#: config sets `max_payload: 8MB`; keep this at or below the server's value.
MAX_PAYLOAD_BYTES = 8 * 1024 * 1024

#: Most rows (images) in one expert step request.
MAX_STEP_ROWS = 512

#: Most further steps one expert step request may ask a worker to run ahead (`StepRequest.ahead_t`).
MAX_RUN_AHEAD = 16

#: Largest classifier-free guidance scale a job may ask for (`JobRequest.guidance_scale`; 1 = off).
MAX_GUIDANCE_SCALE = 20.0

#: Largest tensor rank accepted on the wire.
MAX_TENSOR_NDIM = 8

#: Most images one generation job may ask for.
MAX_JOB_IMAGES = 256

#: Most `done_part` events one job's `done` may come in (`JobRequest.image_parts`): its images, then its latents,
#: each in parts of at least one image.
MAX_DONE_PARTS = 2 * MAX_JOB_IMAGES

#: Most sampling steps one generation job may ask for.
MAX_JOB_STEPS = 1000

#: Longest id string (job ids, row ids, worker ids).
MAX_ID_LEN = 128

#: Most items in one msgpack array on the wire. The longest lists a message carries are
#: `row_ids` (<= MAX_STEP_ROWS) and a frame's `experts` / `notes` (a few per image); a longer
#: array is refused by its header, before anything is allocated for it.
MAX_WIRE_ARRAY_LEN = 4096

#: Most entries in one msgpack map (the largest message, `fleet_status`, has 21 fields).
MAX_WIRE_MAP_LEN = 64

#: Most arrays + maps in one message (a message needs about a dozen). Bounds the memory an
#: 8 MiB message can turn into (an empty array is 1 byte on the wire but ~60 in Python).
MAX_WIRE_CONTAINERS = 4096

#: Deepest nesting of arrays / maps: msgpack's C decoder refuses more (no message needs > 3).
MAX_WIRE_DEPTH = 1024
