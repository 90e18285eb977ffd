"""`ddm-fleet bench worker` as a real process, and the bench registry."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "infra.cli", *args], capture_output=True, text=True, timeout=600, cwd=ROOT
    )


@pytest.mark.procs
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


@pytest.mark.procs
def test_in_flight_list_gives_one_row_per_bucket_wire_and_setting():
    from benchmarks.worker import format_table

    r = _cli(
        "bench",
        "worker",
        "--widths",
        "8,16",
        "--buckets",
        "1,4",
        "--min-time",
        "0",
        "--min-iters",
        "2",
        "--in-flight",
        "1,2",
        "--wire-dtype",
        "float32,float16",
        "--json",
    )
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(r.stdout)
    assert res["setup"]["in_flight"] == [1, 2] and res["setup"]["worker_procs"] == 0
    assert [(row["bucket"], row["in_flight"], row["wire_dtype"]) for row in res["rows"]] == [
        (b, n, w) for b in (1, 4) for n in (1, 2) for w in ("float32", "float16")
    ]
    for row in res["rows"]:
        assert row["nats_rows_per_s"] > 0 and row["worker_batch"] >= row["bucket"]
        assert row["ratio"] == pytest.approx(row["nats_rows_per_s"] / row["inprocess_rows_per_s"], rel=0.01)
    table = format_table(res)
    assert "flight" in table and len(table.splitlines()) == 2 + 8


@pytest.mark.procs
def test_pipelined_requests_batch_on_the_worker_and_raise_rows_per_second():
    """A sim worker whose forward takes 20 ms whatever its size: with 4 one-row requests in flight
    the worker runs them in one pass (its largest bucket is 4), so rows/s rise ~4x over one in flight
    (asserted: over 2x, a wide margin since the 20 ms dwarf the wire on any machine)."""
    r = _cli(
        "bench",
        "worker",
        "--backend",
        "sim",
        "--sim-batch-ms",
        "20",
        "--sim-row-ms",
        "0",
        "--buckets",
        "1,4",
        "--min-time",
        "0.3",
        "--min-iters",
        "3",
        "--in-flight",
        "1,4",
        "--json",
    )
    assert r.returncode == 0, r.stderr[-2000:]
    rows = {(row["bucket"], row["in_flight"]): row for row in json.loads(r.stdout)["rows"]}
    one, four = rows[(1, 1)], rows[(1, 4)]
    assert one["worker_batch"] == 1 and four["worker_batch"] > 2
    assert four["nats_rows_per_s"] > 2 * one["nats_rows_per_s"]
    assert four["ratio"] > 1.5  # beats one in-process call of a single row: the worker batched them


@pytest.mark.procs
def test_worker_procs_serve_the_nats_path_from_worker_processes():
    r = _cli(
        "bench",
        "worker",
        "--backend",
        "sim",
        "--sim-preset",
        "instant",
        "--widths",
        "8",
        "--buckets",
        "2",
        "--min-time",
        "0",
        "--min-iters",
        "2",
        "--in-flight",
        "2",
        "--worker-procs",
        "2",
        "--json",
    )
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(r.stdout)
    assert res["setup"]["worker_procs"] == 2 and res["setup"]["in_flight"] == 2
    assert [(row["bucket"], row["in_flight"]) for row in res["rows"]] == [(2, 2)]
    assert res["rows"][0]["nats_rows_per_s"] > 0


@pytest.mark.parametrize("flag", [["--in-flight", "0"], ["--in-flight", "1,x"], ["--worker-procs", "-1"]])
@pytest.mark.procs
def test_bad_in_flight_or_worker_procs_is_a_clear_error(flag):
    r = _cli("bench", "worker", "--backend", "sim", *flag)
    assert r.returncode == 2
    assert flag[0] in r.stderr and "Traceback" not in r.stderr
