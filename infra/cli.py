"""`ddm-fleet` command line: one entry point, one module per subcommand.

Each subcommand module defines `add_arguments(parser)` and `run(args) -> int`, and
keeps heavy imports (torch, jax, nats) inside `run`, so `ddm-fleet --help` is fast.
To add a command, add a row to its workflow group in COMMAND_GROUPS.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from bus.options import show_switches

# The commands by workflow, in the order `ddm-fleet --help` lists them: (group title, [(name, module,
# one-line help), ...]). Keep each help short enough for one line of an 80-column terminal.
COMMAND_GROUPS: list[tuple[str, list[tuple[str, str, str]]]] = [
    (
        "data",
        [
            ("data", "infra.cmd_data", "prepare datasets (image folders, MNIST); cache latents"),
        ],
    ),
    (
        "partition",
        [
            ("partition", "infra.cmd_partition", "split the train set into K expert partitions (JSON)"),
        ],
    ),
    (
        "train",
        [
            ("train-autoencoder", "infra.cmd_train_autoencoder", "train a KL autoencoder for latent-space experts"),
            ("train-expert", "infra.cmd_train_expert", "train one expert UNet on its partition only (torch or jax)"),
            ("train-router", "infra.cmd_train_router", "train the router that picks a noisy image's experts"),
            ("distill", "infra.cmd_distill", "distill the experts + router into one dense UNet"),
        ],
    ),
    (
        "serve",
        [
            ("worker", "infra.cmd_worker", "serve one expert model over NATS (torch, xla, jax or sim)"),
            ("decoder", "infra.cmd_decoder", "serve an autoencoder's decoder over NATS (latent fleets)"),
            ("coordinator", "infra.cmd_coordinator", "route and batch every job's steps over the experts' workers"),
            ("web", "infra.cmd_web", "serve the web viewer: watch images denoise live"),
            ("up", "infra.cmd_up", "run the local fleet: nats-server, workers, coordinator, web"),
            ("nats", "infra.cmd_nats", "NATS tools: check the configs, run a loopback cluster"),
        ],
    ),
    (
        "generate",
        [
            ("generate", "infra.cmd_generate", "generate images via the fleet (or --local) to PNG or .npz"),
            ("sample", "infra.cmd_sample", "sample in-process from expert checkpoints to a PNG grid"),
        ],
    ),
    (
        "evaluate, benchmark, fuzz",
        [
            ("eval", "infra.cmd_eval", "quality: monolith vs DDM routings (accuracy, FID)"),
            ("bench", "infra.cmd_bench", "benchmarks: bench worker | fleet | scale | engine"),
            ("fuzz", "infra.cmd_fuzz", "throw hostile input at decoders, worker, coordinator, web"),
            ("probe", "infra.cmd_probe", "rerun attacks on quotas, status, cancel, discovery"),
        ],
    ),
    (
        "version and helpers",
        [
            ("version", "infra.cmd_version", "print the package, protocol and library versions"),
            ("status", "infra.cmd_status", "the running fleet: coordinator, experts' workers, rates"),
            ("wait-ready", "infra.cmd_wait_ready", "wait until a worker / web / coordinator is ready"),
        ],
    ),
]

# Every command: (name, module, one-line help), in the help's order.
COMMANDS: list[tuple[str, str, str]] = [cmd for _title, cmds in COMMAND_GROUPS for cmd in cmds]


def format_command_table(groups: list[tuple[str | None, list[tuple[str, str]]]], indent: int = 2) -> str:
    """Grouped (name, one-line help) rows as help text: each group's title on its own line (none when
    the title is None), then one line per row, the helps aligned in one column. Never wrapped, so
    that a row stays one line (argparse's RawDescriptionHelpFormatter keeps it as is)."""
    width = max(len(name) for _title, rows in groups for name, _help in rows) + 2
    lines: list[str] = []
    for title, rows in groups:
        if lines:
            lines.append("")
        if title is not None:
            lines.append(f"{title}:")
        lines += [f"{' ' * indent}{name.ljust(width)}{help_text}" for name, help_text in rows]
    return "\n".join(lines)


class _VersionAction(argparse.Action):
    """`ddm-fleet --version`: the package and wire protocol versions, then exit 0 (imports on use only)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        from infra.cmd_version import version_line

        print(version_line())
        parser.exit()


def _global_options(parser: argparse.ArgumentParser, after_command: bool) -> None:
    """Options every command takes, before or after the command name (`ddm-fleet -v worker` or
    `ddm-fleet worker -v`). After the command they count into `_verbose_after` (absent unless
    given), which `main` adds to `verbose`: a subparser's defaults would otherwise overwrite the
    value given before the command."""
    if after_command:
        parser.add_argument(
            "-v",
            "--verbose",
            action="count",
            dest="_verbose_after",
            default=argparse.SUPPRESS,
            help="more logging (-vv for debug); also accepted before the command",
        )
    else:
        parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv for debug)")


def passthrough_options() -> tuple[str, ...]:
    """Options whose value is a whole command line for a child (`up --worker-args "--bf16"`), from
    each command module's VALUE_OPTIONS."""
    out: list[str] = []
    for _name, module, _help in COMMANDS:
        out += getattr(importlib.import_module(module), "VALUE_OPTIONS", ())
    return tuple(out)


def join_option_values(argv: list[str], options: tuple[str, ...]) -> list[str]:
    """`--worker-args --bf16` -> `--worker-args=--bf16` for the given options, so that argparse takes
    a value that starts with '-' (it would refuse it as "expected one argument")."""
    out, i = [], 0
    while i < len(argv):
        if argv[i] == "--":
            return out + argv[i:]
        if argv[i] in options and i + 1 < len(argv):
            out.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
            continue
        out.append(argv[i])
        i += 1
    return out


def build_parser() -> argparse.ArgumentParser:
    table = format_command_table(
        [(title, [(name, help_text) for name, _m, help_text in cmds]) for title, cmds in COMMAND_GROUPS]
    )
    parser = argparse.ArgumentParser(
        prog="ddm-fleet",
        usage="%(prog)s [-h] [--version] [-v] <command> ...",
        description="Serve and train Decentralized Diffusion Model ensembles over NATS. The commands, by "
        "workflow:\n\n" + table,
        epilog="Run `ddm-fleet <command> --help` for a command's options. The bus URL of every command\n"
        "defaults to $NATS_URL (else nats://127.0.0.1:4222).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action=_VersionAction, help="print the package and protocol versions and exit")
    _global_options(parser, after_command=False)
    common = argparse.ArgumentParser(add_help=False)
    _global_options(common, after_command=True)
    # The grouped table above lists the commands; the subparsers' own flat list is hidden.
    sub = parser.add_subparsers(dest="command", metavar="<command>", help=argparse.SUPPRESS, prog="ddm-fleet")
    for name, module, help_text in COMMANDS:
        mod = importlib.import_module(module)
        p = sub.add_parser(name, description=(mod.__doc__ or help_text).strip(), parents=[common])
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    show_switches(parser)
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse a `ddm-fleet` command line (sys.argv[1:] when None); global options may come after the
    command too, and `verbose` is their total."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(join_option_values(argv, passthrough_options()))
    args.verbose = args.verbose + getattr(args, "_verbose_after", 0)
    if hasattr(args, "_verbose_after"):
        del args._verbose_after
    args._parser = parser
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not getattr(args, "_run", None):
        args._parser.print_help()
        return 2
    level = logging.WARNING - 10 * min(args.verbose + 1, 2)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from infra.heap import keep_freed_memory

    keep_freed_memory()  # torch forwards re-fault their activations without it (infra/heap.py)
    try:
        return int(args._run(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
