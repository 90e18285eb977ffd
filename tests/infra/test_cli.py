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
    for name, _module, _help_text in COMMANDS:
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
    out = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[2],
    )
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


# --- one help layout, one spelling per concept -------------------------------------------------------------

WORKFLOW = [
    ("data", ["data"]),
    ("partition", ["partition"]),
    ("train", ["train-autoencoder", "train-expert", "train-router", "distill"]),
    ("serve", ["worker", "decoder", "coordinator", "web", "up", "nats"]),
    ("generate", ["generate", "sample"]),
    ("evaluate, benchmark, fuzz", ["eval", "bench", "fuzz", "probe"]),
    ("version and helpers", ["version", "status", "wait-ready"]),
]


def test_help_lists_the_commands_grouped_by_workflow_one_line_each():
    """data -> partition -> train -> serve -> generate -> eval/bench/fuzz -> helpers: each group's title on
    its own line, then its commands in order, each `name  help` on one line of at most 80 columns."""
    from infra.cli import COMMANDS

    out = _run("--help")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    titles = [lines.index(f"{title}:") for title, _ in WORKFLOW]
    assert titles == sorted(titles), "groups out of workflow order"
    helps = {name: help_text for name, _m, help_text in COMMANDS}
    assert sorted(helps) == sorted(n for _, names in WORKFLOW for n in names), "a command is in no group"
    for (title, names), start in zip(WORKFLOW, titles):
        rows = lines[start + 1 : start + 1 + len(names)]
        assert [r.split()[0] for r in rows] == names, (title, rows)
        for name, row in zip(names, rows):
            assert row.split(None, 1)[1] == helps[name] and len(row) <= 80, row
        assert lines[start + 1 + len(names)] == "", f"group {title}: more rows than commands"
    assert "usage: ddm-fleet [-h] [--version] [-v] <command> ..." in out.stdout


def test_help_and_command_help_spell_distill_one_way():
    import re

    for argv in (["--help"], ["distill", "--help"]):
        out = _run(*argv)
        assert out.returncode == 0 and not re.search(r"\b[Dd]istils?\b", out.stdout), out.stdout


def test_bench_help_lists_every_bench_on_one_line():
    from infra.cmd_bench import BENCHES

    out = _run("bench", "--help")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    first = lines.index("benches:") + 1
    rows = lines[first : first + len(BENCHES)]
    assert [r.split(None, 1) for r in rows] == [[name, help_text] for name, _t, help_text in BENCHES]
    assert all(len(r) <= 80 for r in rows), rows
    assert lines[first + len(BENCHES)] == ""
    for name, _t, _h in BENCHES:  # and each bench still answers its own --help
        sub = _run("bench", name, "--help")
        assert sub.returncode == 0 and sub.stdout.startswith(f"usage: ddm-fleet bench {name}"), sub.stderr


def _sample_inprocess_parser():
    from evaluation.sample_inprocess import build_parser

    return build_parser()


def _ddm_fleet_parser():
    from infra.cli import build_parser

    return build_parser()


# (parser, the arguments every parse needs, old spelling, new spelling, value, destination, parsed value)
RENAMED = [
    (_ddm_fleet_parser, ["sample"], "--method", "--solver", "heun", "solver", "heun"),
    (
        _ddm_fleet_parser,
        ["generate", "--count", "3"],
        "--max-images-per-job",
        "--images-per-job",
        "2",
        "images_per_job",
        2,
    ),
    (_ddm_fleet_parser, ["eval"], "--job-size", "--images-per-job", "7", "images_per_job", 7),
    (_sample_inprocess_parser, ["--out", "x"], "--job-size", "--images-per-job", "9", "images_per_job", 9),
    (_ddm_fleet_parser, ["partition", "--out", "x"], "--num-experts", "--experts", "3", "experts", 3),
    (_ddm_fleet_parser, ["coordinator"], "--step-timeout", "--step-timeout-s", "5", "step_timeout", 5.0),
    (_ddm_fleet_parser, ["coordinator"], "--wait-experts", "--wait-experts-s", "30", "wait_experts", 30.0),
]


@pytest.mark.parametrize("make, base, old, new, value, dest, parsed", RENAMED, ids=[r[2] for r in RENAMED])
def test_an_old_spelling_still_works_and_warns_the_new_one_is_silent(make, base, old, new, value, dest, parsed, capsys):
    args = make().parse_args([*base, old, value])
    assert getattr(args, dest) == parsed
    err = capsys.readouterr().err
    assert f"warning: {old} is deprecated" in err and f"use {new}" in err, err
    args = make().parse_args([*base, new, value])
    assert getattr(args, dest) == parsed
    assert "deprecated" not in capsys.readouterr().err


def test_a_deprecated_spelling_works_through_the_console_script():
    out = _run("sample", "--method", "heun", "--checkpoint", "/nonexistent.safetensors", "--classes", "3")
    assert "warning: --method is deprecated and will be removed; use --solver" in out.stderr
    assert out.returncode == 2 and "sample: error:" in out.stderr  # got past argparse to the missing file


def test_up_switches_take_both_forms():
    from infra.cli import parse_args

    assert (parse_args(["up"]).web, parse_args(["up"]).durable) == (True, True)
    args = parse_args(["up", "--no-web", "--no-durable"])
    assert (args.web, args.durable) == (False, False)
    assert parse_args(["up", "--no-web", "--web"]).web is True


def _every_option():
    """(command path, action) for every option of every `ddm-fleet` command and subcommand, and of
    `python -m evaluation.sample_inprocess`."""
    import argparse

    def walk(parser, path):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    yield from walk(sub, f"{path} {name}".strip())
            elif action.option_strings:
                yield path, action

    yield from walk(_ddm_fleet_parser(), "")
    yield from walk(_sample_inprocess_parser(), "sample_inprocess")


#: Old spellings that may live on only as hidden, warning aliases (bus.options.add_deprecated_alias).
OLD_SPELLINGS = {
    "--method": "--solver",
    "--max-images-per-job": "--images-per-job",
    "--job-size": "--images-per-job",
    "--num-experts": "--experts",
    "--bf16": "--dtype",
    "--no-bf16": "--dtype",
    "--step-timeout": "--step-timeout-s",
    "--wait-experts": "--wait-experts-s",
}
#: Options whose metavar must be the same wherever they appear (one concept, one spelling).
SAME_METAVAR = (
    "--nats",
    "--images-per-job",
    "--per-class",
    "--data-dir",
    "--checkpoints",
    "--partition",
    "--expert",
    "--steps",
    "--seed",
    "--timeout",
    "--router",
    "--device",
    "--threads",
    "--widths",
    "--limit",
)


def test_no_two_commands_spell_one_concept_differently():
    import argparse

    from bus.options import _DeprecatedAlias

    visible, metavars, problems = {}, {}, []
    for path, action in _every_option():
        hidden = action.help == argparse.SUPPRESS
        for opt in action.option_strings:
            if (
                opt in OLD_SPELLINGS
                and opt != "--method"
                or (opt == "--method" and set(action.choices or ()) & {"euler", "heun"})
            ):
                if not (hidden and isinstance(action, _DeprecatedAlias) and action.new == OLD_SPELLINGS[opt]):
                    problems.append(f"{path}: {opt} is visible; spell it {OLD_SPELLINGS[opt]}")
            if hidden:
                continue
            visible.setdefault(opt, []).append(path)
            if opt in SAME_METAVAR:
                metavars.setdefault(opt, {}).setdefault(action.metavar, []).append(path)
        if set(action.choices or ()) == {"euler", "heun"} and "--solver" not in action.option_strings and not hidden:
            problems.append(f"{path}: a solver option spelled {action.option_strings}")
        if set(action.choices or ()) == {"on", "off"}:
            problems.append(f"{path}: {action.option_strings[0]} on|off: use bus.options.add_switch")
    for opt, by_metavar in metavars.items():
        if len(by_metavar) > 1:
            problems.append(f"{opt} has metavars {by_metavar}")
    assert not problems, "\n".join(problems)
    assert len(visible["--images-per-job"]) >= 5 and len(visible["--solver"]) >= 4  # the walk saw the commands


#: Options several commands share, each declared once (bus.options.add_threads_option / add_device_option).
SHARED_OPTIONS = {"--threads": "add_threads_option", "--device": "add_device_option"}


def test_a_shared_option_is_declared_once_for_every_command():
    """`--threads` (torch's intra-op CPU threads) and `--device` (the torch device) are spelled,
    typed and explained by one helper; the worker's come from its WorkerConfig fields."""
    import re

    root = Path(__file__).resolve().parents[2]
    declared = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root).as_posix()
        if rel.startswith(("tests/", ".venv/", "bus/options.py")):
            continue
        text = path.read_text()
        for opt in SHARED_OPTIONS:
            if re.search(r"add_argument\(\s*" + re.escape(f'"{opt}"'), text):
                declared.append(f"{rel}: {opt} (use bus.options.{SHARED_OPTIONS[opt]})")
    assert not declared, "\n".join(declared)
    helps = {}
    for path, action in _every_option():
        for opt in SHARED_OPTIONS:
            if opt in action.option_strings and path.split()[-1] != "worker":
                helps.setdefault(opt, []).append((path, action.help, action.type))
    assert len(helps["--threads"]) >= 6 and len(helps["--device"]) >= 5, helps
    assert all(h.startswith("torch intra-op CPU threads") and t is int for _p, h, t in helps["--threads"]), helps
    assert all(h.startswith("torch device: cpu or cuda[:N]") and t is None for _p, h, t in helps["--device"]), helps


def test_the_shared_options_keep_each_commands_default():
    from infra.cli import parse_args

    threads = {("sample",): 0, ("train-router", "--partition", "p"): 1, ("train-autoencoder", "--data", "d"): 0}
    for command, default in {**threads, ("distill",): 0, ("data", "encode"): 0}.items():
        assert parse_args(list(command)).threads == default, command
    assert parse_args(["decoder", "--checkpoint", "x"]).threads is None
    assert parse_args(["decoder", "--checkpoint", "x"]).device == "cpu"
    assert parse_args(["eval"]).device is None
    assert parse_args(["train-expert", "--expert", "0"]).device == "cpu"
    assert parse_args(["train-expert", "--expert", "0", "--threads", "3"]).threads == 3


def test_sample_takes_several_checkpoints_after_one_flag():
    """`--checkpoint a b c` (what a shell makes of expert{0,1,2}.safetensors) and repeated flags both add up."""
    from infra.cli import build_parser

    args = build_parser().parse_args(["sample", "--checkpoint", "a", "b", "--checkpoint", "c"])
    assert args.checkpoint == ["a", "b", "c"]
    assert build_parser().parse_args(["sample"]).checkpoint is None  # the shipped experts
