"""The order `make test` hands tests out in (tests/ordering.py): longest work unit first."""

from __future__ import annotations

import json

import pytest

from tests.ordering import DURATIONS, durations_from_timing, load_durations, longest_first, main


def test_units_go_longest_first_and_keep_their_tests_together_in_order():
    # (name, unit, seconds): unit "g" (3 + 1 s) outlasts "b" (3 s); equal units keep the order of their first test
    items = [("a", "a", 1.0), ("g1", "g", 3.0), ("b", "b", 3.0), ("c", "c", 1.0), ("g2", "g", 1.0), ("d", "d", 5.0)]
    got = longest_first(items, unit=lambda it: it[1], seconds=lambda it: it[2])
    assert [name for name, _, _ in got] == ["d", "g1", "g2", "b", "a", "c"]
    assert longest_first([], unit=str, seconds=len) == []


def test_durations_come_from_a_timing_file_without_xdist_group_suffixes_or_short_tests():
    timing = {
        "tests/a.py::test_long@tests/a.py": {"wall": 12.345, "cpu": 3.0},
        "tests/b.py::test_p[x@y]": {"wall": 2.0},  # an "@" inside the parameters is not a group
        "tests/b.py::test_q[x@y]@grp": {"wall": 1.5},
        "tests/c.py::test_short": {"wall": 0.2},
    }
    assert durations_from_timing(timing) == {
        "tests/a.py::test_long": 12.3,
        "tests/b.py::test_p[x@y]": 2.0,
        "tests/b.py::test_q[x@y]": 1.5,
    }


def test_the_cli_writes_what_load_reads(tmp_path, capsys):
    timing = tmp_path / "timing.json"
    timing.write_text(json.dumps({"tests/a.py::test_x": {"wall": 4.0}}))
    out = tmp_path / "durations.json"
    assert main([str(timing), "--out", str(out)]) == 0
    assert load_durations(out) == {"tests/a.py::test_x": 4.0} and "1 tests" in capsys.readouterr().out
    timing.write_text(json.dumps({"tests/a.py::test_x": {"wall": 0.1}}))
    with pytest.raises(SystemExit):
        main([str(timing), "--out", str(out)])


def test_a_missing_or_broken_file_means_no_durations(tmp_path):
    assert load_durations(tmp_path / "none.json") == {}
    (tmp_path / "bad.json").write_text("{not json")
    assert load_durations(tmp_path / "bad.json") == {}


def test_the_shipped_durations_name_this_suites_long_tests():
    walls = load_durations(DURATIONS)
    assert len(walls) > 100 and all(k.startswith("tests/") and "::" in k for k in walls)
    assert max(walls.values()) > 20
