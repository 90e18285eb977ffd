"""Which floating-point type an expert computes in: `--dtype auto|float32|bfloat16`.

    from models.precision import resolve_dtype
    dtype = resolve_dtype("auto", backend="torch", device="cpu")   # -> "bfloat16" or "float32"

* `float32`: bit-for-bit reproducible images for a seed on any host of the same kind;
* `bfloat16`: the expert's forward under bfloat16 autocast (inputs and outputs stay float32): about
  twice the rows per second where the hardware computes bfloat16 natively, images that differ from
  float32's in their last grey levels (seeded reproducibility holds per dtype);
* `auto` (the default): bfloat16 where the device computes it natively, float32 elsewhere:
  - a CPU with AMX (`amx_bf16`) or AVX-512 BF16 (`avx512_bf16`) in its flags,
  - a CUDA GPU of compute capability 8.0 or more (Ampere, Hopper, ...),
  - an XLA device (TPU, Trainium),
  and never for the simulated backend (`sim`: nothing is computed).

`choose_dtype` is the decision, a pure function of `DeviceFacts` (unit-tested with made-up facts);
`device_facts` probes this host for them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from bus.options import DTYPES  # noqa: F401  (the one list of choices; re-exported here)

#: the flags in /proc/cpuinfo that mean native bfloat16 arithmetic (AMX tiles, AVX-512 dot products)
BF16_CPU_FLAGS = frozenset({"amx_bf16", "avx512_bf16"})
#: CUDA compute capability from which tensor cores take bfloat16 (Ampere)
BF16_CUDA_CAPABILITY = (8, 0)


@dataclass(frozen=True)
class DeviceFacts:
    """What the dtype decision needs to know about one device.

    kind: "cpu", "cuda", "xla" (TPU / Trainium / any torch_xla or jax accelerator) or "sim";
    cpu_flags: the CPU's feature flags (kind "cpu"); cuda_capability: (major, minor) (kind "cuda")."""

    kind: str
    cpu_flags: frozenset[str] = field(default_factory=frozenset)
    cuda_capability: tuple[int, int] | None = None


def check_dtype(requested: str) -> str:
    """`requested` normalised ("bf16" and "fp32" are accepted spellings); ValueError names the choices."""
    key = str(requested).strip().lower()
    key = {"bf16": "bfloat16", "fp32": "float32"}.get(key, key)
    if key not in DTYPES:
        raise ValueError(f"unknown dtype {requested!r}: choose one of {', '.join(DTYPES)}")
    return key


def native_bf16(facts: DeviceFacts) -> tuple[bool, str]:
    """(does the device compute bfloat16 natively, why in a few words)."""
    if facts.kind == "cpu":
        found = sorted(BF16_CPU_FLAGS & set(facts.cpu_flags))
        return (True, f"CPU has {'/'.join(found)}") if found else (False, "CPU has neither amx_bf16 nor avx512_bf16")
    if facts.kind == "cuda":
        cap = facts.cuda_capability
        if cap is None:
            return False, "CUDA compute capability unknown"
        ok = tuple(cap) >= BF16_CUDA_CAPABILITY
        return ok, f"CUDA compute capability {cap[0]}.{cap[1]} {'>=' if ok else '<'} 8.0"
    if facts.kind == "xla":
        return True, "XLA device (TPU / Trainium) computes bfloat16 natively"
    if facts.kind == "sim":
        return False, "simulated backend computes nothing"
    return False, f"unknown device kind {facts.kind!r}"


def choose_dtype(requested: str, facts: DeviceFacts) -> tuple[str, str]:
    """-> (dtype "float32" | "bfloat16", reason). An explicit dtype is kept as asked; `auto` picks
    bfloat16 only where `native_bf16(facts)`."""
    requested = check_dtype(requested)
    if requested != "auto":
        return requested, "asked for"
    native, why = native_bf16(facts)
    return ("bfloat16" if native else "float32"), f"auto: {why}"


#: device files whose presence means the host has an accelerator its workers may use (NVIDIA, Neuron, TPU, ROCm)
ACCELERATOR_DEVICES = ("/dev/nvidiactl", "/dev/nvidia0", "/dev/neuron0", "/dev/accel0", "/dev/kfd")


def host_has_accelerator() -> bool:
    """Whether any of ACCELERATOR_DEVICES exists on this host."""
    return any(os.path.exists(dev) for dev in ACCELERATOR_DEVICES)


def cpu_flags(path: str = "/proc/cpuinfo") -> frozenset[str]:
    """This CPU's feature flags (empty where /proc/cpuinfo is missing, e.g. macOS)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("flags") and ":" in line:
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def device_facts(backend: str, device: str | None) -> DeviceFacts:
    """Probe this host for the facts about `device` as `backend` would use it (None: its default)."""
    dev = (device or "").lower()
    if backend == "sim":
        return DeviceFacts("sim")
    if backend == "xla" or dev.startswith(("xla", "tpu", "neuron")):
        return DeviceFacts("xla")
    if dev.startswith("cuda") or dev.startswith("gpu"):
        cap = None
        try:
            import torch

            if torch.cuda.is_available():
                index = int(dev.split(":")[1]) if ":" in dev else 0
                cap = tuple(torch.cuda.get_device_capability(index))
        except Exception:  # no torch, or a bad index: unknown capability -> float32
            cap = None
        return DeviceFacts("cuda", cuda_capability=cap)
    if backend == "jax" and not dev:
        try:
            import jax

            platform = jax.default_backend()
        except Exception:
            platform = "cpu"
        if platform == "tpu":
            return DeviceFacts("xla")
        if platform == "gpu":
            return DeviceFacts("cuda")  # capability not probed through jax: float32 unless asked
    return DeviceFacts("cpu", cpu_flags=cpu_flags())


def resolve_dtype(requested: str, *, backend: str = "torch", device: str | None = None) -> str:
    """`requested` ("auto" | "float32" | "bfloat16") -> the dtype this host computes in."""
    requested = check_dtype(requested)
    if requested != "auto":
        return requested
    return choose_dtype(requested, device_facts(backend, device))[0]
