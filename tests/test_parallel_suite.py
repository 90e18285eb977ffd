"""The suite's side-by-side rules (tests/conftest.py) hold under the pytest and pytest-xdist installed here.

`make test` runs on pytest-xdist workers with `--dist loadgroup`; tests that share a module-scoped fixture are
grouped onto one worker by tests/conftest.py. A pytest or xdist upgrade has broken that grouping silently
before (pytest 9.2 with xdist 3.8: every test scheduled alone, each worker building its own fleets), so this
runs a small suite of its own, with the suite's rule, on two workers and reads where each test ran.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SHARED = """
import os
import pytest

@pytest.fixture(scope="module")
def made_once():
    return os.getpid()

""" + "".join(f"def test_shared_{i}(made_once):\n    assert made_once == os.getpid()\n\n" for i in range(6))

FREE = "".join(f"def test_free_{i}():\n    pass\n\n" for i in range(6))


@pytest.mark.procs
def test_tests_sharing_a_module_fixture_run_on_one_worker(tmp_path):
    (tmp_path / "conftest.py").write_text("from tests.conftest import pytest_collection_modifyitems  # noqa: F401\n")
    (tmp_path / "test_shared.py").write_text(SHARED)
    (tmp_path / "test_free.py").write_text(FREE)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DDM_TIMING_REPORT": "0"}
    argv = [sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup", "-v", "-p", "no:cacheprovider"]
    out = subprocess.run(
        [*argv, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env=env,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    ran = re.findall(r"\[(gw\d+)\].*PASSED \S*::(test_\w+)(@\S+)?", out.stdout)
    assert len(ran) == 12, out.stdout[-3000:]
    shared = {(gw, group) for gw, name, group in ran if name.startswith("test_shared")}
    assert len(shared) == 1, f"the module fixture's tests ran on {shared}: not grouped"
    ((_, group),) = shared
    assert group == "@test_shared.py"
    # the rest are free to go anywhere (and are not grouped)
    assert all(not group for _, name, group in ran if name.startswith("test_free"))
