"""`ddm-fleet bench scale` as a real process (nats-server, sim workers, a coordinator), and its arithmetic."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "infra.cli", *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )


def test_worker_capacity_and_derived_jobs():
    from benchmarks.scale import derive_jobs, worker_capacity

    # 40 ms + 0.2 ms/row at 32 rows: 32 rows per 46.4 ms
    assert worker_capacity(40, 0.2, 32) == pytest.approx(32 / 0.0464)
    assert math.isinf(worker_capacity(0, 0, 32))
    # 2 experts x 4 workers x 32 rows x (1 running + 2 queued), 1 image per job
    assert derive_jobs(2, 4, 32, 1, 2) == 768
    assert derive_jobs(2, 4, 32, 5, 2) == 154  # ceil(768 / 5)
    assert derive_jobs(2, 2, 32, 1, 2) == 2 * derive_jobs(2, 1, 32, 1, 2)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--workers", "2,-1"], "--workers must be comma-separated positive integers"),
        (["--workers", "none"], "nothing to measure"),
        (["--request-rows", "513"], "--request-rows must be an integer in 1-512"),
        (["--sim-batch-ms", "-1"], "--sim-batch-ms must be a finite number >= 0"),
        (["--duration", "0"], "--duration and --job-timeout must be > 0"),
        (
            ["--workers", "1", "--router", "/nonexistent.safetensors"],
            "--router /nonexistent.safetensors does not exist",
        ),
    ],
)
@pytest.mark.procs
def test_bad_options_are_refused_before_anything_starts(argv, message):
    r = _cli("bench", "scale", *argv, timeout=60)
    assert r.returncode == 2, r.stderr[-2000:]
    assert message in r.stderr


@pytest.mark.procs
def test_bench_scale_runs_two_levels_and_reports_them(tmp_path):
    from benchmarks.scale import format_table

    # no router in tmp_path: the bench makes a tiny random one (fast to load); 8-step jobs, 8-row requests
    r = _cli(
        "bench",
        "scale",
        "--workers",
        "1,2",
        "--duration",
        "3",
        "--warmup",
        "1",
        "--steps",
        "8",
        "--request-rows",
        "8",
        "--sim-batch-ms",
        "20",
        "--sim-row-ms",
        "0.5",
        "--checkpoints",
        str(tmp_path),
        "--no-progress",
        "--json",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout)
    s = res["setup"]
    assert s["sim"] == {
        "model": "custom",
        "batch_ms": 20.0,
        "row_ms": 0.5,
        "worker_rows_per_s": pytest.approx(8 / 0.024, rel=1e-3),
    }
    assert s["experts"] == 2 and s["request_rows"] == 8 and "random tiny router" in s["router"]
    assert res["coordinator_capacity"] is None
    one, two = res["levels"]
    assert (one["workers_per_expert"], two["workers_per_expert"]) == (1, 2)
    assert (one["workers"], two["workers"]) == (2, 4)
    assert (one["jobs"], two["jobs"]) == (48, 96)  # ceil(2 experts * W * 8 rows * 3 / 1 image)
    assert two["capacity_rows_per_s"] == pytest.approx(2 * one["capacity_rows_per_s"], rel=1e-3)
    assert one["capacity_rows_per_s"] == pytest.approx(2 * 8 / 0.024, rel=1e-3)
    for level in (one, two):
        assert level["rows_per_s"] > 0
        assert 0 < level["efficiency"] <= 1.5
        assert level["efficiency"] == pytest.approx(level["rows_per_s"] / level["capacity_rows_per_s"], abs=2e-3)
        assert level["rows_per_s_per_coordinator"] == [level["rows_per_s"]]
        assert level["coordinator_cpu_s_per_1000_rows"] > 0
        assert level["coordinator_page_faults_per_1000_rows"] >= 0
        assert all(v > 0 for v in level["coordinator_peak_rss_mib"].values())
        assert level["outcomes"]["failed"] == 0 and level["outcomes"]["lost"] == 0
        assert level["window_s"] >= 3
        _check_cpu_shares(level, s["cpus"])
    assert (one["cohorts"], two["cohorts"]) == ([2], [2])  # --cohorts auto: 2 below 4 workers per expert
    table = format_table(res)
    assert "20 ms + 0.5 ms/row" in table and "eff" in table
    assert len([line for line in table.splitlines() if line.startswith("    1 ")]) == 2


def _check_cpu_shares(level: dict, cpus: int) -> None:
    """What the processes of a level used and what the machine left idle cannot add up to more than
    its CPUs (other tenants may take the rest)."""
    coordinators = len(level["rows_per_s_per_coordinator"])  # coordinator_cpu_share is per coordinator
    shares = [
        level["coordinator_cpu_share"] * coordinators,
        level["clients_cpu_share"],
        level["workers_cpu_share"],
        level["nats_cpu_share"],
    ]
    assert all(v is not None and v >= 0 for v in shares), shares
    assert 0 <= level["box_idle_share"] <= 1
    assert sum(shares) / cpus + level["box_idle_share"] <= 1.05, (shares, level["box_idle_share"])


@pytest.mark.procs
def test_the_coordinator_capacity_level_says_where_the_cpu_went(tmp_path):
    from benchmarks.scale import format_table

    r = _cli(
        "bench",
        "scale",
        "--coordinator-capacity",
        "--workers",
        "none",
        "--capacity-jobs",
        "32",
        "--duration",
        "3",
        "--warmup",
        "1",
        "--checkpoints",
        str(tmp_path),
        "--no-progress",
        "--json",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout)
    cap = res["coordinator_capacity"]
    assert res["levels"] == [] and cap["jobs"] == 32 and cap["rows_per_s"] > 0
    assert cap["outcomes"]["failed"] == 0 and cap["outcomes"]["lost"] == 0
    _check_cpu_shares(cap, res["setup"]["cpus"])
    line = next(x for x in format_table(res).splitlines() if "where the CPU went" in x)
    coordinator = cap["coordinator_cpu_s_per_1000_rows"]
    assert f"coordinator {100 * coordinator * cap['rows_per_s'] / 1000:.0f}% ({coordinator:.3f} s)" in line
    total = (
        sum(cap[k] for k in ("clients_cpu_share", "workers_cpu_share", "nats_cpu_share"))
        + coordinator * cap["rows_per_s"] / 1000
    )
    assert f"all {100 * total:.0f}% ({1000 * total / cap['rows_per_s']:.3f} s)" in line
    assert f"the machine's {res['setup']['cpus']} cpus {100 * cap['box_idle_share']:.0f}% idle" in line


def test_idle_share_reads_two_snapshots_of_the_machine():
    from benchmarks.processes import box_cpu, idle_share

    a = box_cpu()
    assert a is not None and 0 <= a[0] <= a[1]
    assert idle_share((100, 1000), (190, 1100)) == pytest.approx(0.9)
    assert idle_share((100, 1000), (100, 1000)) is None  # no time between them
    assert idle_share(None, a) is None
