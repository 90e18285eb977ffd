"""The installed `ddm-fleet` console script runs as a real subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.procs

SCRIPT = Path(sys.executable).with_name("ddm-fleet")


def _run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run([str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout, env=env)


@pytest.fixture(scope="module", autouse=True)
def _script_installed():
    assert SCRIPT.exists(), f"console script missing at {SCRIPT}: run `make install`"


def test_help_lists_every_registered_command():
    from infra.cli import COMMANDS

    out = _run("--help")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: ddm-fleet")
    for name, _module, help_text in COMMANDS:
        assert name in out.stdout
    assert "version" in out.stdout


def test_no_command_prints_help_and_fails():
    out = _run()
    assert out.returncode == 2
    assert "usage: ddm-fleet" in out.stdout


def test_unknown_command_is_a_usage_error():
    out = _run("no-such-command")
    assert out.returncode == 2
    assert "invalid choice" in out.stderr


def test_version_prints_package_protocol_and_time_convention():
    from schemas import PROTOCOL_VERSION, TIME_CONVENTION

    out = _run("version")
    assert out.returncode == 0, out.stderr
    assert f"v{PROTOCOL_VERSION}" in out.stdout and TIME_CONVENTION in out.stdout
    data = json.loads(_run("version", "--json").stdout)
    assert data["protocol"] == f"v{PROTOCOL_VERSION}" and data["time_convention"] == TIME_CONVENTION
    assert data["ddm-fleet"] and data["msgpack"] != "not installed"


def test_version_help_explains_itself():
    out = _run("version", "--help")
    assert out.returncode == 0 and "--json" in out.stdout


def test_help_does_not_import_heavy_frameworks():
    """`--help` must stay fast: nothing it imports may pull in torch, jax, flax or nats."""
    probe = (
        "import sys, contextlib, io\n"
        "from infra.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    try:\n"
        "        main(['--help'])\n"
        "    except SystemExit:\n"
        "        pass\n"
        "heavy = sorted(m for m in ('torch', 'jax', 'flax', 'nats', 'optax') if m in sys.modules)\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"--help imported {out.stdout.strip()}"


def test_version_flag_prints_package_and_protocol_versions():
    from importlib import metadata

    from schemas import PROTOCOL_VERSION

    out = _run("--version")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"ddm-fleet {metadata.version('ddm-fleet')} (wire protocol v{PROTOCOL_VERSION})"
    assert "--version" in _run("--help").stdout


def test_global_options_are_accepted_after_the_command_too():
    from infra.cli import parse_args

    assert parse_args(["version"]).verbose == 0
    assert parse_args(["-v", "version"]).verbose == 1
    assert parse_args(["version", "-v"]).verbose == 1
    assert parse_args(["-v", "worker", "--expert", "0", "--checkpoint", "x", "-vv"]).verbose == 3
    assert not hasattr(parse_args(["version", "--verbose"]), "_verbose_after")
    out = _run("version", "-vv", "--json")
    assert out.returncode == 0 and json.loads(out.stdout)["protocol"], out.stderr
    assert "-v, --verbose" in _run("worker", "--help").stdout


def test_up_takes_child_options_that_start_with_a_dash(tmp_path):
    """The form `up --worker-args`'s help shows gets past argparse (to the checkpoint check here)."""
    out = _run("up", "--checkpoints", str(tmp_path), "--worker-args", "--bf16", "--no-web")
    assert "expected one argument" not in out.stderr
    assert out.returncode == 2 and "missing checkpoint files" in out.stderr, out.stderr
