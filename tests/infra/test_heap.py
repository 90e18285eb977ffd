"""infra/heap.py: with glibc's thresholds raised, freed activations stay in the process.

Each case runs in a fresh interpreter (mallopt settings are process-wide and last), allocates and
frees two 4 MiB arrays 40 times, the pattern of a forward's activations, and counts the minor page
faults that took."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def platform_is_glibc() -> bool:
    import platform

    return platform.libc_ver()[0] == "glibc"


PROBE = """
import json, resource, numpy as np
from infra.heap import keep_freed_memory
tuned = keep_freed_memory()
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
a = np.ones(1 << 19); b = a * 2; del a, b   # first touch: these pages are faulted in either way
f0 = faults()
for _ in range(40):
    a = np.ones(1 << 19); b = a * 2; del a, b   # 2 x 4 MiB, 2 x 1024 pages
print(json.dumps({"tuned": tuned, "faults_per_round": (faults() - f0) / 40}))
"""


def _probe(setting: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "DDM_FLEET_MALLOC_TUNING"}
    if setting is not None:
        env["DDM_FLEET_MALLOC_TUNING"] = setting
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.procs
def test_freed_memory_is_reused_instead_of_refaulted():
    assert platform_is_glibc(), "the fleet's hosts run glibc; this test is about its malloc"
    tuned = _probe(None)
    assert tuned["tuned"] is True
    # 2048 pages are freed and allocated again each round: kept, they fault almost never
    assert tuned["faults_per_round"] < 50, tuned


@pytest.mark.procs
def test_the_setting_can_be_turned_off_and_then_costs_the_faults():
    off = _probe("0")
    assert off["tuned"] is False
    # glibc's defaults hand freed blocks back, so every round faults many of its pages in again
    # (about half of them with glibc 2.36): the cost keep_freed_memory removes, measured here so
    # that the figure above means something
    assert off["faults_per_round"] > 500, off


def test_every_ddm_fleet_command_tunes_the_heap(monkeypatch):
    import infra.cli as cli
    import infra.heap as heap

    calls = []
    monkeypatch.setattr(heap, "keep_freed_memory", lambda: calls.append(1) or True)
    assert cli.main(["version"]) == 0
    assert calls == [1]
