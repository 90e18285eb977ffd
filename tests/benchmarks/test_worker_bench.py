"""`ddm-fleet bench worker` as a real process, and the bench registry."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "infra.cli", *args], capture_output=True, text=True, timeout=600,
                          cwd=ROOT)


def test_bench_worker_runs_and_reports_every_bucket():
    from benchmarks.worker import format_table

    r = _cli("bench", "worker", "--widths", "8,16", "--buckets", "1,4", "--min-time", "0", "--min-iters", "2", "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(r.stdout)
    assert [row["bucket"] for row in res["rows"]] == [1, 4]
    for row in res["rows"]:
        assert row["inprocess_rows_per_s"] > 0 and row["nats_rows_per_s"] > 0 and row["ratio"] > 0
        assert row["ratio"] == pytest.approx(row["nats_rows_per_s"] / row["inprocess_rows_per_s"], rel=0.01)
    assert res["setup"]["backend"] == "torch"
    table = format_table(res)
    assert "ratio" in table and len(table.splitlines()) == 4


def test_every_registered_bench_has_arguments_and_a_runner():
    import argparse

    from infra.cmd_bench import BENCHES, _resolve, add_arguments

    for name, target, _help in BENCHES:
        impl = _resolve(target)
        assert callable(impl.add_arguments) and callable(impl.run), name
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["worker", "--buckets", "1,2", "--min-time", "0"])
    assert args.bench == "worker" and args.buckets == "1,2"
