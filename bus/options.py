"""Command-line conventions every ddm-fleet process shares.

* `add_nats_option`: `--nats URL`, defaulting to $NATS_URL, spelled and explained the same everywhere;
* `add_switch`: an on/off setting is `--name` / `--no-name` (argparse's BooleanOptionalAction); the
  older `--name on|off` spelling is still accepted with a deprecation warning;
* `add_deprecated_alias`: an old option name that still works, warns once, and stores into the new one
  (a flag that took no value, e.g. `--bf16`, stores a fixed value: `const="bfloat16"`);
* `add_dtype_option`: `--dtype auto|float32|bfloat16` (`models.precision`), with `--bf16` / `--no-bf16`
  kept as deprecated spellings of `--dtype bfloat16` / `--dtype float32`;
* `add_solver_option`: `--solver euler|heun`;
* `add_threads_option`: `--threads N`, torch's intra-op CPU threads (`torch.set_num_threads`);
* `add_device_option`: `--device`, the torch device (cpu, cuda[:N]).

Warnings go to stderr as ``ddm-fleet: warning: ...`` so scripts that parse stdout are unaffected.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from bus.nats_server import default_nats_url

_LEGACY_SWITCH_VALUES = {"on": True, "off": False, "true": True, "false": False, "yes": True, "no": False}


def warn_deprecated(old: str, new: str) -> None:
    print(f"ddm-fleet: warning: {old} is deprecated and will be removed; use {new}", file=sys.stderr)


def add_nats_option(parser: argparse.ArgumentParser, *, default: str | None = "env", help: str | None = None) -> None:
    """`--nats URL`. `default="env"`: $NATS_URL, else nats://127.0.0.1:4222 (read when the parser is
    built); `default=None`: no bus unless given (commands that start their own)."""
    value = default_nats_url() if default == "env" else default
    parser.add_argument(
        "--nats",
        default=value,
        metavar="URL",
        help=help
        or "NATS server, or a comma-separated list of a cluster's nodes "
        "(default: $NATS_URL, else nats://127.0.0.1:4222)",
    )


class _Switch(argparse.Action):
    """`--name` sets True, `--no-name` False; `--name on|off` (deprecated) still works."""

    def __init__(self, option_strings, dest, default=None, help=None, **kwargs):
        names = []
        for opt in option_strings:
            names.append(opt)
            if opt.startswith("--"):
                names.append("--no-" + opt[2:])
        super().__init__(names, dest, nargs="?", default=default, help=help, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        negative = option_string.startswith("--no-")
        if values is None:
            setattr(namespace, self.dest, not negative)
            return
        if negative:
            parser.error(f"{option_string} takes no value")
        key = str(values).lower()
        if key not in _LEGACY_SWITCH_VALUES:
            parser.error(f"{option_string}: expected no value (or the deprecated on|off), got {values!r}")
        on = _LEGACY_SWITCH_VALUES[key]
        base = option_string[2:]
        warn_deprecated(f"{option_string} {values}", f"--{base}" if on else f"--no-{base}")
        setattr(namespace, self.dest, on)


def _switch_aware(formatter_class: type) -> type:
    """`formatter_class` showing a switch as `--x, --no-x` (no value placeholder: the on|off value
    it still accepts is deprecated and not advertised)."""
    if getattr(formatter_class, "_shows_switches", False):
        return formatter_class

    class SwitchAwareFormatter(formatter_class):
        _shows_switches = True

        def _format_args(self, action, default_metavar):
            if isinstance(action, _Switch):
                return ""
            return super()._format_args(action, default_metavar)

        def _format_action_invocation(self, action):
            if isinstance(action, _Switch):
                return ", ".join(action.option_strings)
            return super()._format_action_invocation(action)

    SwitchAwareFormatter.__name__ = f"SwitchAware{formatter_class.__name__}"
    return SwitchAwareFormatter


def show_switches(parser: argparse.ArgumentParser) -> None:
    """Make `parser` and every sub-parser below it print switches as `--x, --no-x` in their help
    (call once on the top-level parser: switches added to argument groups cannot reach it)."""
    parser.formatter_class = _switch_aware(parser.formatter_class)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                show_switches(sub)


def add_switch(
    parser: argparse.ArgumentParser, name: str, *, default: bool, help: str, dest: str | None = None
) -> None:
    """Add `--name` / `--no-name` (default `default`, said in the help)."""
    if isinstance(parser, argparse.ArgumentParser):  # an argument group: show_switches on its parser
        parser.formatter_class = _switch_aware(parser.formatter_class)
    state = "on" if default else "off"
    parser.add_argument(f"--{name}", action=_Switch, default=default, dest=dest, help=f"{help} (default {state})")


class _DeprecatedAlias(argparse.Action):
    def __init__(self, option_strings, dest, new: str, **kwargs):
        self.new = new
        if "const" in kwargs:  # a flag without a value: stores `const` into the new option
            kwargs.setdefault("nargs", 0)
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        if self.nargs == 0:
            warn_deprecated(option_string, f"{self.new} {self.const}")
            setattr(namespace, self.dest, self.const)
            return
        warn_deprecated(option_string, self.new)
        setattr(namespace, self.dest, values)


def add_deprecated_alias(
    parser: argparse.ArgumentParser, old: str, new: str, *, dest: str | None = None, **kwargs: Any
) -> None:
    """Accept `old` (e.g. "--method") as a hidden spelling of the option `new` (e.g. "--solver"): same
    destination (`dest`, when `new` stores elsewhere than its name says), same type/choices (pass them
    in `kwargs`), a warning on stderr when used. With `const=VALUE` the old option takes no value and
    stores VALUE (`--bf16` -> `--dtype bfloat16`)."""
    dest = dest or new.lstrip("-").replace("-", "_")
    parser.add_argument(
        old, action=_DeprecatedAlias, new=new, dest=dest, default=argparse.SUPPRESS, help=argparse.SUPPRESS, **kwargs
    )


#: the `--dtype` choices (`models.precision` resolves them)
DTYPES = ("auto", "float32", "bfloat16")


def add_dtype_option(parser, *, default: str = "auto", help: str | None = None) -> None:
    """`--dtype auto|float32|bfloat16` into `dtype` (resolve it with `models.precision.resolve_dtype`),
    plus the deprecated `--bf16` (= `--dtype bfloat16`) and `--no-bf16` (= `--dtype float32`)."""
    parser.add_argument(
        "--dtype",
        choices=DTYPES,
        default=default,
        help=help
        or "the experts' compute type: auto = bfloat16 where the device computes it natively (CPU with AMX or "
        "AVX512-BF16, CUDA compute capability >= 8.0, TPU / Trainium), else float32; float32 for images "
        "identical bit for bit on every host of a kind (default %(default)s)",
    )
    add_deprecated_alias(parser, "--bf16", "--dtype", const="bfloat16")
    add_deprecated_alias(parser, "--no-bf16", "--dtype", const="float32")


#: The solvers (`flow.solver.METHODS`; spelled out here, below flow/ in the layering, and checked equal by a test).
SOLVERS = ("euler", "heun")


def add_solver_option(parser, *, deprecated_method: bool = False) -> None:
    """`--solver euler|heun` into `solver` (default euler), as every sampling command spells it; with
    `deprecated_method`, also the old `--method` spelling."""
    parser.add_argument(
        "--solver",
        choices=SOLVERS,
        default="euler",
        help="euler (1 expert call per step) or heun (2 per step, more accurate) (default %(default)s)",
    )
    if deprecated_method:
        add_deprecated_alias(parser, "--method", "--solver", choices=SOLVERS)


def _default_text(default: Any, default_help: str) -> str:
    """ "(default X)", "(default X: what it means)" or "(default: what it means)" for a help string."""
    if default is None:
        return f"(default: {default_help})"
    return f"(default {default}: {default_help})" if default_help else f"(default {default})"


def add_threads_option(
    parser, *, default: int | None = 0, help_suffix: str = "", default_help: str = "", metavar: str = "N"
) -> None:
    """`--threads N` into `threads` (an int): torch's intra-op CPU threads, as every torch command spells
    it. `default`: the command's (0 and None leave torch's own setting, every core, unless `default_help`
    says what the command does instead); `help_suffix`: what the command adds after "torch intra-op CPU
    threads" (", per expert"); `default_help`: what the default means, when the number alone does not say it."""
    if not default_help and default in (0, None):
        default_help = "torch's own"
    parser.add_argument(
        "--threads",
        type=int,
        default=default,
        metavar=metavar,
        help=f"torch intra-op CPU threads{help_suffix} {_default_text(default, default_help)}",
    )


def add_device_option(parser, *, default: str | None = "cpu", help_suffix: str = "", default_help: str = "") -> None:
    """`--device` into `device` (a str): the torch device, as every torch command spells it. `default`:
    the command's (None: the command's own choice, said by `default_help`, else "the CPU");
    `help_suffix`: what the command adds after "torch device: cpu or cuda[:N]" (", of the decoder")."""
    if default is None and not default_help:
        default_help = "the CPU"
    parser.add_argument(
        "--device",
        default=default,
        help=f"torch device: cpu or cuda[:N]{help_suffix} {_default_text(default, default_help)}",
    )
