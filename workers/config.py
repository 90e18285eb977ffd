"""How an expert worker serves: its runtime, batch sizes, limits, metrics and bus retries, in one place.

`WorkerConfig` holds every serving option of a worker (not which expert, which checkpoint or which bus:
those name *what* is served and *where*). Each option is declared once, as a field made by `option(...)`:
its default, help, choices or bounds, and any deprecated spelling (`Option`). From that one declaration
`WorkerConfig.add_arguments(parser, defaults=...)` makes the flag for every command that starts a worker
(`ddm-fleet worker`, `ddm-fleet bench worker`), `__post_init__` checks the value with an error that says
how to fix it, `WorkerConfig.from_args(args)` reads the flags back and `to_argv` writes them for a child
process, so a default, a range or a flag's spelling is written once; a command that changes a default
passes `defaults={...}` and can say so with `changed_defaults`. `workers.service.ExpertWorker` takes a
`WorkerConfig` (`config=`) or the same fields as keyword arguments. The choice lists live in
`workers.choices`.

Importing this module imports no torch, jax, nats or model code (building a command's parser stays cheap).
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from bus.options import add_deprecated_alias
from schemas.limits import MAX_STEP_ROWS

from .backends.base import DEFAULT_BATCH_QUANTUM, MAX_BATCH_QUANTUM
from .backends.torch_compile import check_compile
from .choices import BACKENDS, COMPILE_CHOICES, DTYPES, MERGE_MODES, SIM_PRESETS
from .metrics_http import DEFAULT_METRICS_HOST

DEFAULT_BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128)
#: Rows that may wait in a worker's queue before it answers `overloaded`.
DEFAULT_MAX_QUEUE_ROWS = 4096
#: Requests a worker holds at once (queued or computing, awaiting their reply) before it answers
#: `overloaded`: bounds the reply tasks whatever the row count of each request.
DEFAULT_MAX_INFLIGHT = 4096


def parse_buckets(text: str | Sequence[int]) -> tuple[int, ...]:
    """ "1,2,4,8" or [1, 2, 4, 8] -> sorted unique positive ints; ValueError with a hint otherwise."""
    if isinstance(text, str):
        try:
            values = [int(p) for p in text.split(",") if p.strip()]
        except ValueError:
            raise ValueError(f"buckets must be comma-separated positive integers like 1,2,4,8, got {text!r}") from None
    else:
        values = [int(v) for v in text]
    if not values:
        raise ValueError("buckets must list at least one batch size, e.g. 1,2,4,8")
    if any(v <= 0 for v in values):
        raise ValueError(f"bucket sizes must be positive, got {values}")
    return tuple(sorted(set(values)))


def plan_buckets(buckets: str | Sequence[int], max_batch: int | None) -> tuple[tuple[int, ...], int]:
    """Buckets actually used for a `max_batch` row limit, and that limit.

    Buckets above the smallest one that holds `max_batch` are never used and are dropped, so
    they are not compiled. `max_batch` larger than the largest bucket is an error.
    """
    buckets = parse_buckets(buckets)
    if max_batch is None:
        return buckets, buckets[-1]
    if max_batch <= 0:
        raise ValueError(f"max_batch must be positive, got {max_batch}")
    if max_batch > buckets[-1]:
        raise ValueError(
            f"max_batch {max_batch} is larger than the largest bucket {buckets[-1]}: add a bucket >= {max_batch} "
            f"or lower max_batch"
        )
    cap = min(b for b in buckets if b >= max_batch)
    return tuple(b for b in buckets if b <= cap), max_batch


def add_buckets_option(parser, *, default: Any = DEFAULT_BUCKETS, help: str | None = None) -> None:
    """`--buckets B,B,...` into `buckets` (a string, or None: the worker's own), as every command that starts
    or measures workers spells it (`parse_buckets` reads it)."""
    if isinstance(default, tuple):
        default = ",".join(map(str, default))
    parser.add_argument(
        "--buckets",
        default=default,
        metavar="B,B,...",
        help=help or "batch sizes compiled and padded to (default: %(default)s)",
    )


def add_batch_invariant_option(parser, *, default: int = 0, help: str | None = None) -> None:
    """`--batch-invariant` (a batch quantum of DEFAULT_BATCH_QUANTUM rows) and `--batch-quantum ROWS` (another
    one; 0: off) into `batch_quantum`, as every command that runs experts spells them
    (`workers.backends.base.BackendBase.make_batch_invariant`)."""
    parser.add_argument(
        "--batch-invariant",
        dest="batch_quantum",
        action="store_const",
        const=DEFAULT_BATCH_QUANTUM,
        default=default,
        help=help
        or "compute every forward at a multiple of %(const)s rows, as a `ddm-fleet worker --batch-invariant` "
        "does, so the images are such a fleet's bit for bit (same dtype and compile setting); checked at start",
    )
    parser.add_argument(
        "--batch-quantum",
        type=int,
        default=argparse.SUPPRESS,
        metavar="ROWS",
        help=f"--batch-invariant with another multiple of rows (default {DEFAULT_BATCH_QUANTUM}; 0: off), for a "
        "host whose kernels need a larger one",
    )


@dataclass(frozen=True)
class Option:
    """How one `WorkerConfig` field is spelled on the command line and which values it takes: the one
    declaration from which `WorkerConfig.add_arguments` makes its flag, `__post_init__` its check and
    `to_argv` its argument. The flag is the field's name spelled `--like-this`; its type is the field's
    annotation (int, float; anything else is passed on as the string given), and None is a valid value
    when the annotation allows it.

    help: the flag's help (`%(default)s` shows the default of the command that declares it).
    cli: False for a field set only in code (no flag).
    choices: the allowed values (the flag's choices; the error lists them).
    lo / hi: inclusive bounds (None: unbounded); `must` is what the error says a value must be, with
    `{lo}` / `{hi}` filled in (default ">= {lo}" or "{lo} to {hi}").
    normalise: value -> the value kept, applied first (a spelling the config accepts, a parse, a clamp;
    ValueError saying what to fix).
    off: the flag's value that means None (`--max-queue-rows 0`: no limit); `to_argv` writes it for None.
    deprecated: (old flag, the value it stands for) pairs, still accepted with a warning (`--bf16`).
    declare: `f(parser, default=, help=)` that declares the flag(s), when other commands spell them the
    same way (`add_batch_invariant_option`).
    """

    help: str
    cli: bool = True
    metavar: str | None = None
    choices: tuple | None = None
    lo: float | None = None
    hi: float | None = None
    must: str | None = None
    normalise: Callable[[Any], Any] | None = None
    off: Any = None
    deprecated: tuple[tuple[str, Any], ...] = ()
    declare: Callable[..., None] | None = None

    def check(self, field: dataclasses.Field, value: Any) -> Any:
        """`value` for `field` as the config keeps it; ValueError saying what to fix when out of range."""
        if self.normalise is not None:
            value = self.normalise(value)
        if value is None and _nullable(field):
            return value
        if self.choices is not None and value not in self.choices:
            raise ValueError(f"{field.name} must be one of {', '.join(self.choices)}, got {value!r}")
        if (self.lo is not None and value < self.lo) or (self.hi is not None and value > self.hi):
            must = self.must or (">= {lo}" if self.hi is None else "{lo} to {hi}")
            raise ValueError(f"{field.name} must be {must.format(lo=self.lo, hi=self.hi)}, got {value}")
        return value

    def to_cli(self, value: Any) -> Any:
        """`value` as the flag spells it: None as `off`, a tuple comma-separated."""
        if value is None:
            return self.off
        return ",".join(map(str, value)) if isinstance(value, tuple) else value

    def add(self, parser, field: dataclasses.Field, default: Any) -> None:
        """Declare the flag of `field` on `parser`, with `default` (a value of the field) as its default."""
        if self.declare is not None:
            self.declare(parser, default=self.to_cli(default), help=self.help)
            return
        flag = _flag(field)
        parser.add_argument(
            flag,
            type=_TYPES.get(str(field.type).split(" | ")[0]),
            choices=self.choices,
            default=self.to_cli(default),
            metavar=self.metavar,
            help=self.help,
        )
        for old, value in self.deprecated:
            add_deprecated_alias(parser, old, flag, const=value)


#: Flag types by field annotation (the module's annotations are strings: `from __future__ import annotations`).
_TYPES: dict[str, type] = {"int": int, "float": float}


def _flag(field: dataclasses.Field) -> str:
    return "--" + field.name.replace("_", "-")


def _nullable(field: dataclasses.Field) -> bool:
    return str(field.type).endswith("| None")


def option(default: Any, help: str, **spec: Any) -> Any:
    """A `WorkerConfig` field: its default and its `Option` (help, choices, bounds, ...)."""
    return dataclasses.field(default=default, metadata={"option": Option(help=help, **spec)})


def _an_interface(host: str) -> str:
    if not host:
        raise ValueError("metrics_host must name an interface, e.g. 127.0.0.1 or 0.0.0.0")
    return host


def _a_scope(scope: str | None) -> str | None:
    """A direct scope must be one subject token (`schemas.subjects.scoped_worker_id`); "" means none."""
    if not scope:
        return None
    from schemas.subjects import is_token

    if not is_token(scope):
        raise ValueError(f"direct_scope must be 1-64 of [A-Za-z0-9_-] (one subject token), got {scope!r:.80}")
    return scope


def _known_dtype(dtype: str) -> str:
    """`models.precision.check_dtype`, imported when a config is made (not when a parser is built)."""
    from models.precision import check_dtype

    return check_dtype(dtype)


def _protocol_rows(rows: int) -> int:
    """More rows than the protocol allows are never sent: the limit is the protocol's."""
    return min(int(rows), MAX_STEP_ROWS)


@dataclass(frozen=True)
class WorkerConfig:
    """Serving options of one expert worker (see each field's help). Units: rows are batch rows (images);
    seconds are `_s`, milliseconds `_ms`. None means what the flag's 0 means where it has one (no queue
    limit, no metrics), else the default the help names; `buckets` may also be given as "1,2,4".
    `plan()` gives the buckets actually compiled, `backend_options()` the backend's own options."""

    backend: str = option(
        "torch",
        "model runtime (default: %(default)s). sim: a simulated expert, no model: it sleeps "
        "batch_ms + row_ms * padded rows per batch and returns a closed-form velocity toward a "
        "fixed per-class image; decoding, validation, batching and replies stay real (the "
        "checkpoint still gives shape, classes and expert id), so dozens of 'GPU' workers fit on "
        "one CPU box",
        choices=BACKENDS,
    )
    sim_preset: str | None = option(
        None,
        "sim backend latency: h200-torch (3.33 ms + 0.00575 ms/row, the default), h200-jax "
        "(2.20 ms + 0.0165 ms/row; both fitted to the H200 table in docs/DEPLOYMENT.md), "
        "instant (0 + 0)",
        choices=SIM_PRESETS,
    )
    sim_batch_ms: float | None = option(
        None,
        "sim backend: fixed milliseconds per batch (overrides the preset)",
        metavar="MS",
        lo=0,
        must=">= {lo} milliseconds",
    )
    sim_row_ms: float | None = option(
        None,
        "sim backend: milliseconds per padded row (overrides the preset)",
        metavar="MS",
        lo=0,
        must=">= {lo} milliseconds",
    )
    device: str | None = option(None, "torch: cpu | cuda[:N] (default cpu); xla: xla[:N]; jax: cpu | gpu[:N] | tpu[:N]")
    dtype: str = option(
        "auto",
        "the expert's compute type: auto = bfloat16 where the device computes it natively (CPU with "
        "AMX or AVX512-BF16, CUDA compute capability >= 8.0, XLA: TPU / Trainium), else float32; bfloat16 "
        "(torch / xla autocast, jax cast; inputs and outputs stay float32); float32 for images identical "
        "bit for bit across hosts. The worker advertises the dtype it computes in (default %(default)s)",
        choices=DTYPES,
        normalise=_known_dtype,
        deprecated=(("--bf16", "bfloat16"), ("--no-bf16", "float32")),
    )
    buckets: tuple[int, ...] = option(
        DEFAULT_BUCKETS,
        "batch sizes compiled and padded to (default: %(default)s)",
        normalise=parse_buckets,
        declare=add_buckets_option,
    )
    max_batch: int | None = option(
        None,
        "most rows per forward pass (default: the largest bucket; must fit a bucket)",
        metavar="N",  # checked against the buckets in __post_init__ (`plan_buckets`)
    )
    merge: str = option(
        "auto",
        "merging queued requests into one forward pass: auto (default) merges where the warm "
        "forward times say one bigger pass is at least 10%% cheaper than two (a GPU/XLA device, "
        "whose cost is mostly fixed, merges; a CPU, whose cost grows with the rows, runs them "
        "one after another so each answer goes back sooner); always: fill every pass up to "
        "--max-batch",
        choices=MERGE_MODES,
    )
    inline_forward_ms: float = option(
        20.0,
        "a pass of at most 4 rows with nothing queued behind it, whose forward the worker's running "
        "estimate puts under this many ms, runs on the event loop instead of the model thread (one "
        "client's steps: the hand-off costs more than the loop waits; default %(default)s; 0: every "
        "pass in the model thread, so the loop answers even during a forward that runs far over its "
        "estimate)",
        metavar="MS",
        lo=0,
        must=">= {lo} milliseconds (0: off)",
    )
    max_request_rows: int = option(
        MAX_STEP_ROWS,
        f"refuse requests with more rows (too_large); default %(default)s, the protocol limit is {MAX_STEP_ROWS}",
        metavar="N",
        lo=1,
        must="positive",
        normalise=_protocol_rows,
    )
    max_queue_rows: int | None = option(
        DEFAULT_MAX_QUEUE_ROWS,
        "answer `overloaded` when this many rows already wait (default %(default)s; 0: no limit)",
        metavar="N",
        lo=1,
        must="positive or None (no limit)",
        off=0,
    )
    max_inflight: int = option(
        DEFAULT_MAX_INFLIGHT,
        "answer `overloaded` while this many requests are held (default %(default)s)",
        metavar="N",
        lo=1,
    )
    metrics_port: int | None = option(
        None,
        "also serve Prometheus text metrics on http://HOST:P/metrics (conventional port: 9477; default and 0: off)",
        metavar="P",
        lo=1,
        hi=65535,
        must="a TCP port {lo}-{hi} (or None / 0: no metrics)",
        normalise=lambda port: port or None,  # 0 means off, here as on the command line
    )
    metrics_host: str = option(
        DEFAULT_METRICS_HOST,
        "interface the metrics bind (default %(default)s, loopback only; 0.0.0.0 for a Prometheus on another machine)",
        metavar="HOST",
        normalise=_an_interface,
    )
    connect_attempts: int = option(
        10,
        "tries for the first connection to NATS (reconnects after that are unlimited; default %(default)s)",
        metavar="N",
        lo=1,
        must=">= {lo} (tries for the first bus connection)",
    )
    reconnect_wait_s: float = option(
        1.0, "seconds between tries of the bus connection", cli=False, lo=0, must=">= {lo} seconds"
    )
    threads: int | None = option(
        None,
        "torch backend: intra-op CPU threads",
        metavar="N",
        lo=1,
        must=">= {lo} (or None: torch's default)",
    )
    compile: str = option(
        "auto",
        "torch backend: torch.compile the expert with inductor's freezing (~1.3x the rows/s of the "
        "eager forward on an AMX CPU; 20-40 s of compiling at start-up, before the worker subscribes). "
        "auto: on for a CPU where a C++ compiler is found, off on CUDA; $DDM_FLEET_COMPILE=on|off sets "
        "what auto means on a host (default %(default)s)",
        choices=COMPILE_CHOICES,
        normalise=check_compile,
    )
    batch_quantum: int = option(
        0,
        "compute every forward at a multiple of %(const)s rows, so that an image's velocities do not "
        "depend on the other jobs' rows batched beside it: a seeded job's images repeat bit for bit however "
        "busy the fleet, and match `ddm-fleet sample --batch-invariant`. Checked at start; costs the padding "
        "(a lone row costs what %(const)s do; 0.6-0.75x the images/s at 64 clients on the shipped MNIST fleet)",
        lo=0,
        hi=MAX_BATCH_QUANTUM,
        must="{lo} (off) to {hi} rows",
        declare=add_batch_invariant_option,  # --batch-invariant, and --batch-quantum ROWS
    )
    xla_cache: str | None = option(
        None,
        "xla backend: persistent compile cache directory (or $XLA_PERSISTENT_CACHE_PATH)",
        metavar="DIR",
    )
    direct_scope: str | None = option(
        None,
        "serve the worker's own direct subject under this scope, ddm.v1.expert.<K>.velocity.<scope>.<token>, "
        "so that the NATS permissions of this host's user (its leaf user's name, e.g. leaf-expert-0) can keep "
        "every other host from receiving the requests a coordinator sends this worker (infra/nats/"
        "permissions.conf); the worker id becomes <scope>:<id> (default: none, ddm.v1.expert.<K>.velocity.<token>)",
        metavar="NAME",
        normalise=_a_scope,
    )

    def __post_init__(self) -> None:
        for f in fields(self):
            object.__setattr__(self, f.name, f.metadata["option"].check(f, getattr(self, f.name)))
        plan_buckets(self.buckets, self.max_batch)  # max_batch fits a bucket (the error says which to add)
        if self.backend != "sim" and (self.sim_preset, self.sim_batch_ms, self.sim_row_ms) != (None, None, None):
            raise ValueError("--sim-preset / --sim-batch-ms / --sim-row-ms need --backend sim")

    def plan(self) -> tuple[tuple[int, ...], int]:
        """(the buckets a worker compiles, its most rows per forward pass): `plan_buckets`."""
        return plan_buckets(self.buckets, self.max_batch)

    def backend_options(self) -> dict:
        """Keyword arguments for `workers.backends.get_backend(self.backend, ...)` beyond device and dtype:
        threads (torch), cache_path (xla), preset / batch_ms / row_ms (sim); only those set."""
        opts: dict = {}
        if self.backend == "torch" and self.threads:
            opts["threads"] = self.threads
        if self.backend == "torch":
            opts["compile"] = self.compile
        if self.backend == "xla" and self.xla_cache:
            opts["cache_path"] = self.xla_cache
        if self.backend == "sim":
            for key, value in (
                ("preset", self.sim_preset),
                ("batch_ms", self.sim_batch_ms),
                ("row_ms", self.sim_row_ms),
            ):
                if value is not None:
                    opts[key] = value
        return opts

    def replace(self, **changes: Any) -> WorkerConfig:
        """A copy with `changes` (checked again)."""
        return dataclasses.replace(self, **changes)

    def changed_defaults(self, defaults: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
        """{field: (value a command's `defaults` give it, the worker's own default)} for each field whose
        `defaults` entry differs from `WorkerConfig()`'s: what a bench should say it changed."""
        base = WorkerConfig()
        out = {}
        for name, value in defaults.items():
            ours = getattr(base, name)
            theirs = getattr(base.replace(**{name: value}), name)  # normalised as the config does
            if theirs != ours:
                out[name] = (theirs, ours)
        return out

    def to_argv(self) -> list[str]:
        """`ddm-fleet worker` options that reproduce this config (every option, defaults included)."""
        argv: list[str] = []
        for f in fields(self):
            opt = f.metadata["option"]
            value = opt.to_cli(getattr(self, f.name))
            if opt.cli and value is not None:
                argv += [_flag(f), str(value)]
        return argv

    # ------------------------------------------------------------------ command line

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser, defaults: Mapping[str, Any] | None = None) -> None:
        """Declare every serving option on `parser` (`--backend`, `--buckets`, `--dtype`, ...).
        `defaults`: {field name: value} a command uses instead of the worker's (e.g. a bench's buckets);
        the help shows the command's default."""
        d = {f.name: f.default for f in fields(WorkerConfig)}
        unknown = set(defaults or {}) - set(d)
        if unknown:
            raise ValueError(f"WorkerConfig has no option(s) {', '.join(sorted(unknown))}")
        d.update(defaults or {})
        group = parser.add_argument_group("worker serving options")
        for f in fields(WorkerConfig):
            opt = f.metadata["option"]
            if opt.cli:
                opt.add(group, f, d[f.name])

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> WorkerConfig:
        """The config of parsed `add_arguments` options (ValueError, saying what to fix, when out of range).
        A flag's `off` value (`--max-queue-rows 0`, `--metrics-port 0`) is None here."""
        values = {}
        for f in fields(cls):
            if hasattr(args, f.name):
                value, off = getattr(args, f.name), f.metadata["option"].off
                values[f.name] = None if off is not None and value == off else value
        return cls(**values)
