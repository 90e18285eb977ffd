"""GPU backend check: torch CUDA (fp32, bf16) and JAX GPU (fp32, bf16) against the torch CPU reference.

Loads checkpoints/expert0 into each backend, runs the same inputs at batch 1, 64 and 256, and writes
max |difference| to the CPU output, finiteness and ms per call to the JSON path given as argv[1].
Run from the repository root on a GPU host: python3 infra/gpu/backend_check.py out.json
"""

import json
import sys
import time

import numpy as np

from workers.backends import get_backend

ck = "checkpoints/expert0.safetensors"
rng = np.random.default_rng(0)
out = {}
for n in (1, 64, 256):
    x = rng.standard_normal((n, 1, 32, 32)).astype(np.float32)
    t = rng.uniform(0, 1, n).astype(np.float32)
    y = rng.integers(0, 10, n).astype(np.int64)
    ref = None
    for name, dev, bf16 in (
        ("torch", "cpu", False),
        ("torch", "cuda", False),
        ("torch", "cuda", True),
        ("jax", "gpu", False),
        ("jax", "gpu", True),
    ):
        key = f"{name}:{dev}:{'bf16' if bf16 else 'fp32'}:n{n}"
        try:
            b = get_backend(name, device=dev, bf16=bf16)
            b.load(ck)
            b.warmup([n])
            v = b.forward(x, t, y)
            t0 = time.perf_counter()
            reps = 3 if dev == "cpu" else 20
            for _ in range(reps):
                b.forward(x, t, y)
            dt = (time.perf_counter() - t0) / reps
            if ref is None:
                ref = v
            err = float(np.abs(v - ref).max())
            out[key] = {
                "device": getattr(b, "device", dev),
                "max_abs_diff_vs_cpu": err,
                "finite": bool(np.isfinite(v).all()),
                "ms_per_call": round(dt * 1e3, 3),
                "rows_per_s": round(n / dt, 1),
            }
        except Exception as e:  # report, keep going
            out[key] = {"error": f"{type(e).__name__}: {e}"}
        print(key, out[key], flush=True)
json.dump(out, open(sys.argv[1], "w"), indent=1)
