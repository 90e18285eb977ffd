"""`ddm-fleet bench engine`: the coordinator's engine alone, as a real process with the shipped router."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.procs

ROOT = Path(__file__).resolve().parents[2]


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "infra.cli", "bench", "engine", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--jobs", "0"], "--jobs must be >= 1"),
        (["--route-every", "0"], "--route-every must be >= 1"),
        (["--duration", "0"], "--duration must be > 0"),
        (["--checkpoints", "/nonexistent"], "router.safetensors does not exist"),
        (["--router", "/nonexistent.safetensors"], "--router /nonexistent.safetensors does not exist"),
        (["--cohorts", "zero"], "must be 'auto' or an int >= 1"),
    ],
)
def test_bad_options_are_refused(argv, message):
    r = _cli(*argv, timeout=60)
    assert r.returncode == 2, r.stderr[-2000:]
    assert message in r.stderr


def test_bench_engine_measures_rows_cpu_and_events():
    from benchmarks.engine import format_table

    runs = {}
    for stream in (True, False):
        r = _cli(
            "--jobs",
            "64",
            "--steps",
            "8",
            "--duration",
            "1.5",
            "--warmup",
            "0.5",
            "--route-every",
            "2",
            "--no-progress",
            "--json",
            *([] if stream else ["--no-stream"]),
        )
        assert r.returncode == 0, r.stderr[-3000:]
        runs[stream] = res = json.loads(r.stdout)
        assert res["setup"]["jobs"] == 64 and res["setup"]["route_every"] == 2 and res["setup"]["cohorts"] == "auto"
        assert res["cohorts_used"] == 2  # instant in-process experts: no known workers, the floor
        assert res["rows_per_s"] > 0 and res["window_s"] >= 1.5
        assert 0 < res["router_cpu_s_per_1000_rows"] < res["cpu_s_per_1000_rows"]
        assert 0 < res["router_share_of_cpu"] < 1
        assert res["ticks_per_s"] > 0 and res["tick_ms_p50"] > 0
        assert 0 <= res["kernel_share_of_cpu"] < 1
        # the CLI keeps freed memory (infra/heap.py): a few hundred faults per 1000 rows while the
        # heap still grows in so short a run, against 4,000 - 40,000 with glibc's defaults
        assert 0 <= res["page_faults_per_1000_rows"] < 2000, res["page_faults_per_1000_rows"]
    # streamed 1-image jobs: a frame per row evaluation (plus a done per 8); without frames only the dones
    assert runs[True]["events_per_s"] == pytest.approx(runs[True]["rows_per_s"] * 9 / 8, rel=0.15)
    assert runs[False]["events_per_s"] == pytest.approx(runs[False]["rows_per_s"] / 8, rel=0.15)
    table = format_table(runs[True])
    assert (
        "rows/s" in table
        and "the router" in table
        and "route-every 2" in table
        and "page faults per 1000 rows" in table
    )


def test_bench_engine_runs_the_router_it_is_given():
    w16 = "checkpoints/router-w16.safetensors"
    r = _cli(
        "--jobs", "32", "--steps", "4", "--duration", "1", "--warmup", "0.3", "--router", w16, "--no-progress", "--json"
    )
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout)
    assert res["setup"]["router"] == w16
    assert res["rows_per_s"] > 0 and 0 < res["router_cpu_s_per_1000_rows"] < res["cpu_s_per_1000_rows"]
