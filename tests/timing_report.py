"""Where the suite's time went: wall and CPU seconds per marker tier, and the tests that cost the most CPU.

Loaded by tests/conftest.py. Each test process (the only one, or each pytest-xdist worker) measures every
test from the start of its setup to the end of its teardown: wall seconds, and CPU seconds of the process
itself plus the children it waited for (the workers, coordinators and ddm-fleet commands a test starts and
stops; a child still running when the test ends, like the session's nats-server, is not counted). The
numbers travel to the controller on the teardown report (`user_properties`), which prints at the end:

    time per tier (a test counts in each tier it is marked with; 'fast' = none of them; spans overlap
    because tests run side by side)
    tier       tests   test-s   cpu-s   span-s
    bus          612    901.2   388.0    512.3
    ...

`test-s` sums the tests' own wall time (side by side, the tiers' test-s add up to more than the run);
`span-s` is the wall time from the first of the tier's tests starting to the last one ending.
`DDM_TIMING_REPORT=0` leaves the section out; `DDM_TIMING_JSON=<path>` writes every test's numbers there.
"""

from __future__ import annotations

import json
import os
import resource
import time
from collections import defaultdict

import pytest

#: the markers that make the tiers (pyproject.toml); a test with none of them is in `fast`
TIERS = ("slow", "bus", "procs", "browser", "train")
#: how many of the costliest tests by CPU the summary names
TOP_CPU = 15

_CPU_KEY = "timing_cpu_s"
_WALL_KEY = "timing_wall_s"


def _cpu_now() -> float:
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    item._timing_start = (time.monotonic(), _cpu_now())


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    start = getattr(item, "_timing_start", None)
    if call.when == "teardown" and start is not None:
        wall0, cpu0 = start
        report.user_properties.append((_WALL_KEY, time.monotonic() - wall0))
        report.user_properties.append((_CPU_KEY, _cpu_now() - cpu0))


class _Totals:
    """The controller's books: one record per test id, printed at the end of the run."""

    def __init__(self) -> None:
        self.tests: dict[str, dict] = {}

    def pytest_runtest_logreport(self, report) -> None:
        rec = self.tests.setdefault(report.nodeid, {"tiers": set(), "wall": 0.0, "cpu": 0.0, "start": None, "stop": 0})
        rec["tiers"] |= {t for t in TIERS if t in report.keywords}
        start, stop = getattr(report, "start", None), getattr(report, "stop", None)
        if start is not None:
            rec["start"] = start if rec["start"] is None else min(rec["start"], start)
            rec["stop"] = max(rec["stop"], stop or start)
        props = dict(report.user_properties)
        if _WALL_KEY in props:
            rec["wall"], rec["cpu"] = float(props[_WALL_KEY]), float(props[_CPU_KEY])
        elif report.when != "teardown":
            rec["wall"] += report.duration  # no teardown report with our numbers (yet): the phases' own

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if not self.tests or os.environ.get("DDM_TIMING_REPORT", "1") == "0":
            return
        terminalreporter.section("where the time went")
        for line in self.lines():
            terminalreporter.write_line(line)

    def pytest_sessionfinish(self) -> None:
        path = os.environ.get("DDM_TIMING_JSON")  # every test's numbers, for a closer look
        if path and self.tests:
            rows = {k: {**v, "tiers": sorted(v["tiers"])} for k, v in self.tests.items()}
            with open(path, "w") as f:
                json.dump(rows, f, indent=0)

    def lines(self) -> list[str]:
        rows: dict[str, list] = defaultdict(lambda: [0, 0.0, 0.0, None, 0.0])
        for rec in self.tests.values():
            for tier in sorted(rec["tiers"]) or ["fast"]:
                row = rows[tier]
                row[0] += 1
                row[1] += rec["wall"]
                row[2] += rec["cpu"]
                if rec["start"] is not None:
                    row[3] = rec["start"] if row[3] is None else min(row[3], rec["start"])
                    row[4] = max(row[4], rec["stop"])
        out = [
            "time per tier (a test counts in each tier it is marked with; 'fast' = none of them; tests run side "
            "by side, so test-s add up to more than the run and spans overlap)",
            f"{'tier':<9} {'tests':>6} {'test-s':>8} {'cpu-s':>8} {'span-s':>8}",
        ]
        for tier in (*TIERS, "fast"):
            if tier in rows:
                n, wall, cpu, t0, t1 = rows[tier]
                span = (t1 - t0) if t0 is not None else 0.0
                out.append(f"{tier:<9} {n:>6} {wall:>8.1f} {cpu:>8.1f} {span:>8.1f}")
        wall = sum(r["wall"] for r in self.tests.values())
        cpu = sum(r["cpu"] for r in self.tests.values())
        out.append(f"{'all':<9} {len(self.tests):>6} {wall:>8.1f} {cpu:>8.1f}")
        top = sorted(self.tests.items(), key=lambda kv: kv[1]["cpu"], reverse=True)[:TOP_CPU]
        out.append(f"costliest {len(top)} by CPU (cpu-s / wall-s, the test's process and the children it waited for)")
        out += [f"{r['cpu']:8.1f} {r['wall']:8.1f}  {nodeid}" for nodeid, r in top]
        return out


def pytest_configure(config):
    if not hasattr(config, "workerinput"):  # the controller (or a run without xdist) keeps the books
        config.pluginmanager.register(_Totals(), "timing-report-totals")
