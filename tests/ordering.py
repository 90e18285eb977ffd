"""The order `make test` hands tests out in: longest work unit first, from the wall seconds of a past run.

pytest-xdist (`--dist loadgroup`) hands out work units (an `xdist_group`: the tests sharing a module's
fixture, or the compiling tests; else one test) in the order of the collection, to whichever worker is
free. A long unit handed out late is the run's tail, with the other workers idle beside it; a run of short
tests at the end leaves the cores half idle (most of them wait on servers). So the units go longest first
(the classic "longest processing time" rule), by the seconds tests/durations.json records for their tests.
A test the file does not know (new, or renamed) counts `UNKNOWN_S`, or `UNKNOWN_LONG_S` when it is marked
slow or train. `make test` passes `--no-loadscope-reorder`, so that xdist keeps this order instead of
sorting the units by their number of tests.

Refresh the file from a run's timings (a run of the whole suite, side by side as `make test` runs it):

    DDM_TIMING_JSON=/tmp/timing.json make test
    .venv/bin/python -m tests.ordering /tmp/timing.json      # rewrites tests/durations.json
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

#: the wall seconds per test of a past run (`python -m tests.ordering TIMING.json` writes it)
DURATIONS = Path(__file__).with_name("durations.json")
#: seconds counted for a test the file does not know (most are the tests under MIN_RECORDED_S, left out
#: of it: 0.07 s on average), and for an unknown one marked slow or train
UNKNOWN_S, UNKNOWN_LONG_S = 0.1, 20.0
#: tests shorter than this are left out of the file (they count UNKNOWN_S)
MIN_RECORDED_S = 1.0

T = TypeVar("T")


def load_durations(path: Path = DURATIONS) -> dict[str, float]:
    """{test node id: wall seconds} from `path`; {} when it is missing or unreadable (the order then
    falls back to the markers: slow and train first)."""
    try:
        data = json.loads(Path(path).read_text())
        return {str(k): float(v) for k, v in data["wall_s"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


def longest_first(items: Sequence[T], *, unit: Callable[[T], str], seconds: Callable[[T], float]) -> list[T]:
    """`items` ordered by their work unit's total seconds, longest first; a unit's items stay together in
    their own order, and units of equal length keep the order of their first item (a stable, deterministic
    order: every xdist worker must compute the same one)."""
    totals: dict[str, float] = {}
    first: dict[str, int] = {}
    for i, item in enumerate(items):
        key = unit(item)
        totals[key] = totals.get(key, 0.0) + seconds(item)
        first.setdefault(key, i)
    order = {key: rank for rank, key in enumerate(sorted(totals, key=lambda k: (-totals[k], first[k])))}
    return sorted(items, key=lambda it: order[unit(it)])


def durations_from_timing(timing: dict[str, dict]) -> dict[str, float]:
    """A DDM_TIMING_JSON file's records ({node id[@group]: {"wall": s, ...}}) -> {node id: s} of the tests
    that took at least MIN_RECORDED_S, rounded to 0.1 s."""
    out = {}
    for nodeid, rec in timing.items():
        wall = float(rec.get("wall") or 0.0)
        if wall >= MIN_RECORDED_S:
            grouped = "@" in nodeid.rsplit("]", 1)[-1]  # xdist's "@<group>" suffix
            out[nodeid.rsplit("@", 1)[0] if grouped else nodeid] = round(wall, 1)
    return dict(sorted(out.items()))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m tests.ordering",
        description="Rewrite tests/durations.json (the order `make test` hands tests out in) from the per-test "
        "timings of a run: DDM_TIMING_JSON=FILE make test.",
    )
    p.add_argument("timing", type=Path, help="the DDM_TIMING_JSON file of a run of the whole suite")
    p.add_argument("--out", type=Path, default=DURATIONS, help=f"where to write (default {DURATIONS})")
    args = p.parse_args(argv)
    walls = durations_from_timing(json.loads(args.timing.read_text()))
    if not walls:
        p.error(f"{args.timing} holds no test that took {MIN_RECORDED_S:g} s or more")
    args.out.write_text(json.dumps({"wall_s": walls}, indent=0, sort_keys=True) + "\n")
    print(f"wrote {len(walls)} tests' wall seconds ({sum(walls.values()):.0f} s in all) to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
