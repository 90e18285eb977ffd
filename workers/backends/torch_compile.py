"""Whether the torch backend compiles its expert: `--compile auto|on|off`.

    from workers.backends.torch_compile import resolve_compile
    on, why = resolve_compile("auto", device="cpu")   # -> (True, "auto: CPU, C++ compiler /usr/bin/g++")

* `off`: the eager forward (channels-last on a CPU).
* `on`: `torch.compile` with inductor's freezing: the weights become constants, folded and prepacked for
  oneDNN, convolutions fused with their bias and activations. The batch dimension is dynamic, so one
  graph serves every row count above 1 and one more serves a single row: two compiles, at the worker's
  warm-up, before it subscribes. The images differ from the eager forward's in the last bits of the
  dtype's precision (seeded reproducibility holds per dtype and compile setting).
* `auto` (the worker's and `bench fleet`'s default): `on` for a CPU device where a C++ compiler is found
  (inductor generates C++), `off` elsewhere (CUDA: not measured here, eager stays). The environment
  variable `DDM_FLEET_COMPILE=off|on` sets what `auto` means on a host: the test suite sets `off`,
  so that the hundreds of workers it starts do not each spend the compile.

On the 2-core AMX CPU of docs/CAPACITY.md the compiled bfloat16 forward of the shipped MNIST expert runs
about 1.3x the rows per second of the eager one; a cold compile takes 20-40 s per worker there.

`choose_compile` is the decision, a pure function (unit-tested); `resolve_compile` probes this host.
"""

from __future__ import annotations

import os
import shutil

from ..choices import COMPILE_CHOICES

#: what `auto` means on this host ("on" / "off"; unset: decide from the device and the C++ compiler)
COMPILE_ENV = "DDM_FLEET_COMPILE"


def check_compile(requested: str | bool | None) -> str:
    """`requested` normalised to one of COMPILE_CHOICES (True / False / None are accepted)."""
    if requested is None:
        return "auto"
    if isinstance(requested, bool):
        return "on" if requested else "off"
    key = str(requested).strip().lower()
    key = {"true": "on", "1": "on", "yes": "on", "false": "off", "0": "off", "no": "off"}.get(key, key)
    if key not in COMPILE_CHOICES:
        raise ValueError(f"unknown compile setting {requested!r}: choose one of {', '.join(COMPILE_CHOICES)}")
    return key


def choose_compile(
    requested: str, *, device_kind: str, compiler: str | None, env: str | None = None
) -> tuple[bool, str]:
    """-> (compile?, reason). `device_kind` "cpu" | "cuda"; `compiler`: the C++ compiler found (None: none);
    `env`: the value of DDM_FLEET_COMPILE (None: unset). An explicit on / off is kept as asked."""
    requested = check_compile(requested)
    if requested == "on":
        return True, "asked for"
    if requested == "off":
        return False, "asked for"
    if env is not None and env.strip():
        value = check_compile(env)
        if value != "auto":
            return value == "on", f"auto: {COMPILE_ENV}={env.strip()}"
    if device_kind != "cpu":
        return False, f"auto: eager on {device_kind} (compiling is measured on CPUs only)"
    if compiler is None:
        return False, "auto: no C++ compiler found (inductor needs one: install g++)"
    return True, f"auto: CPU, C++ compiler {compiler}"


def find_compiler() -> str | None:
    """The C++ compiler inductor would use: $CXX, else g++, else c++, else clang++ (None: none found)."""
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name:
            path = shutil.which(name)
            if path:
                return path
    return None


def resolve_compile(requested: str | bool | None, *, device: str = "cpu") -> tuple[bool, str]:
    """`requested` ("auto" | "on" | "off") -> (compile on this host?, reason)."""
    kind = "cuda" if str(device).startswith("cuda") else "cpu"
    return choose_compile(requested, device_kind=kind, compiler=find_compiler(), env=os.environ.get(COMPILE_ENV))
