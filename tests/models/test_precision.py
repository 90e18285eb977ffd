"""`models.precision`: the `--dtype auto` decision from device facts (pure), and this host's probe."""

from __future__ import annotations

import pytest

from models.precision import (
    DeviceFacts,
    check_dtype,
    choose_dtype,
    cpu_flags,
    device_facts,
    native_bf16,
    resolve_dtype,
)

AMX_CPU = DeviceFacts("cpu", cpu_flags=frozenset({"avx512f", "amx_tile", "amx_bf16", "avx512_bf16"}))
AVX512BF16_CPU = DeviceFacts("cpu", cpu_flags=frozenset({"avx2", "avx512f", "avx512_bf16"}))
OLD_AVX512_CPU = DeviceFacts("cpu", cpu_flags=frozenset({"avx2", "avx512f", "avx512bw"}))  # Skylake: emulated


@pytest.mark.parametrize(
    "facts, want",
    [
        (AMX_CPU, "bfloat16"),
        (AVX512BF16_CPU, "bfloat16"),
        (DeviceFacts("cpu", cpu_flags=frozenset({"amx_bf16"})), "bfloat16"),
        (OLD_AVX512_CPU, "float32"),
        (DeviceFacts("cpu"), "float32"),  # no flags known (no /proc/cpuinfo)
        (DeviceFacts("cuda", cuda_capability=(8, 0)), "bfloat16"),  # A100
        (DeviceFacts("cuda", cuda_capability=(9, 0)), "bfloat16"),  # H100 / H200
        (DeviceFacts("cuda", cuda_capability=(8, 6)), "bfloat16"),
        (DeviceFacts("cuda", cuda_capability=(7, 5)), "float32"),  # T4
        (DeviceFacts("cuda", cuda_capability=(7, 0)), "float32"),  # V100
        (DeviceFacts("cuda"), "float32"),  # capability unknown
        (DeviceFacts("xla"), "bfloat16"),  # TPU / Trainium
        (DeviceFacts("sim"), "float32"),  # nothing computed
        (DeviceFacts("npu"), "float32"),  # a kind it does not know
    ],
)
def test_auto_picks_bfloat16_only_where_the_device_computes_it_natively(facts, want):
    got, reason = choose_dtype("auto", facts)
    assert got == want
    assert reason.startswith("auto: ") and len(reason) > len("auto: ")
    assert native_bf16(facts)[0] is (want == "bfloat16")


@pytest.mark.parametrize("asked", ["float32", "bfloat16"])
@pytest.mark.parametrize("facts", [AMX_CPU, OLD_AVX512_CPU, DeviceFacts("cuda", cuda_capability=(7, 0))])
def test_an_explicit_dtype_is_kept_whatever_the_device(asked, facts):
    assert choose_dtype(asked, facts) == (asked, "asked for")


def test_dtype_spellings_and_a_clear_error():
    assert check_dtype(" BF16 ") == "bfloat16" and check_dtype("fp32") == "float32" and check_dtype("Auto") == "auto"
    with pytest.raises(ValueError, match=r"unknown dtype 'float16': choose one of auto, float32, bfloat16"):
        check_dtype("float16")
    with pytest.raises(ValueError):
        choose_dtype("half", AMX_CPU)


def test_cpu_flags_reads_the_flags_line(tmp_path):
    f = tmp_path / "cpuinfo"
    f.write_text("processor\t: 0\nmodel name\t: X\nflags\t\t: fpu sse2 avx512_bf16 amx_bf16\n\nprocessor\t: 1\n")
    assert cpu_flags(str(f)) == frozenset({"fpu", "sse2", "avx512_bf16", "amx_bf16"})
    assert cpu_flags(str(tmp_path / "missing")) == frozenset()


def test_this_host_is_probed_consistently():
    """The probe of this machine feeds the same decision: auto on the CPU is bfloat16 exactly when
    /proc/cpuinfo lists amx_bf16 or avx512_bf16; sim never computes in bfloat16; xla always does."""
    native = bool({"amx_bf16", "avx512_bf16"} & cpu_flags())
    assert device_facts("torch", "cpu").kind == "cpu"
    assert resolve_dtype("auto", backend="torch", device="cpu") == ("bfloat16" if native else "float32")
    assert resolve_dtype("auto", backend="sim", device=None) == "float32"
    assert device_facts("xla", None).kind == "xla"
    assert resolve_dtype("float32", backend="torch", device="cpu") == "float32"
