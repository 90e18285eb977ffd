"""How an expert worker serves: its runtime, batch sizes, limits, metrics and bus retries, in one place.

`WorkerConfig` holds every serving option of a worker (not which expert, which checkpoint or which bus:
those name *what* is served and *where*) and checks its ranges in `__post_init__`, with errors that say
how to fix them. `WorkerConfig.add_arguments(parser, defaults=...)` declares the same options for every
command that starts a worker (`ddm-fleet worker`, `ddm-fleet bench worker`) and
`WorkerConfig.from_args(args)` reads them back, so a default is written once; a command that changes one
passes `defaults={...}` and can say so with `changed_defaults`. `workers.service.ExpertWorker` takes a
`WorkerConfig` (`config=`) or the same fields as keyword arguments.

Importing this module imports no torch, jax, nats or model code (building a command's parser stays cheap).
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from schemas.limits import MAX_STEP_ROWS

from .backends.base import DEFAULT_BATCH_QUANTUM, MAX_BATCH_QUANTUM
from .backends.torch_compile import COMPILE_CHOICES, check_compile
from .metrics_http import DEFAULT_METRICS_HOST

#: Model runtimes a worker can load (`workers.backends.get_backend`); sim: a simulated expert, no model.
BACKENDS = ("torch", "xla", "jax", "sim")
#: `workers.backends.sim_backend.PRESETS` names (listed here so building a parser imports no numpy).
SIM_PRESETS = ("h200-torch", "h200-jax", "instant")
DEFAULT_BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128)
MERGE_MODES = ("auto", "always")
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
class WorkerConfig:
    """Serving options of one expert worker. Units: rows are batch rows (images); seconds are `_s`.

    backend: model runtime (`BACKENDS`); device: torch cpu | cuda[:N], xla xla[:N], jax cpu | gpu[:N] |
    tpu[:N] (None: the backend's default); dtype: the expert's compute type, "auto" (bfloat16 where the
    device computes it natively, else float32: `models.precision`), "float32" or "bfloat16".
    buckets: batch sizes compiled and padded to; max_batch: most rows per forward pass (None: the largest
    bucket; buckets above the one that holds it are dropped: `plan`). merge: "auto" (merge queued requests into one
    pass where the warm forward times say it is cheaper) or "always".
    max_request_rows: larger requests are refused `too_large` (at most the protocol's MAX_STEP_ROWS);
    max_queue_rows: rows waiting before `overloaded` (None: no limit); max_inflight: requests held before
    `overloaded`. metrics_port / metrics_host: Prometheus text metrics (None: off).
    connect_attempts: tries for the first bus connection (reconnects after it are unlimited);
    reconnect_wait_s: seconds between tries.
    threads (torch: intra-op CPU threads), compile (torch: "auto" | "on" | "off",
    `workers.backends.torch_compile`), xla_cache (xla: compile cache directory), sim_preset /
    sim_batch_ms / sim_row_ms (sim: latency model): backend options, see `backend_options`.
    batch_quantum: > 1 makes the worker batch-invariant (every forward padded to a multiple of this many rows,
    checked at start: `workers.backends.base.BackendBase.make_batch_invariant`); 0: off."""

    backend: str = "torch"
    device: str | None = None
    dtype: str = "auto"
    buckets: tuple[int, ...] = DEFAULT_BUCKETS
    max_batch: int | None = None
    merge: str = "auto"
    max_request_rows: int = MAX_STEP_ROWS
    max_queue_rows: int | None = DEFAULT_MAX_QUEUE_ROWS
    max_inflight: int = DEFAULT_MAX_INFLIGHT
    metrics_port: int | None = None
    metrics_host: str = DEFAULT_METRICS_HOST
    connect_attempts: int = 10
    reconnect_wait_s: float = 1.0
    threads: int | None = None
    compile: str = "auto"
    xla_cache: str | None = None
    sim_preset: str | None = None
    sim_batch_ms: float | None = None
    sim_row_ms: float | None = None
    batch_quantum: int = 0

    def __post_init__(self) -> None:
        def fix(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        from models.precision import check_dtype

        fix("dtype", check_dtype(self.dtype))
        fix("buckets", parse_buckets(self.buckets))
        plan_buckets(self.buckets, self.max_batch)  # max_batch fits a bucket (the error says which to add)
        if self.merge not in MERGE_MODES:
            raise ValueError(f"merge must be one of {', '.join(MERGE_MODES)}, got {self.merge!r}")
        if not 1 <= self.max_request_rows:
            raise ValueError(f"max_request_rows must be positive, got {self.max_request_rows}")
        # more than the protocol allows is never sent: the limit is the protocol's
        fix("max_request_rows", min(int(self.max_request_rows), MAX_STEP_ROWS))
        if self.max_queue_rows is not None and self.max_queue_rows <= 0:
            raise ValueError(f"max_queue_rows must be positive or None (no limit), got {self.max_queue_rows}")
        if self.max_inflight < 1:
            raise ValueError(f"max_inflight must be >= 1, got {self.max_inflight}")
        if self.metrics_port == 0:
            fix("metrics_port", None)  # 0 means off, as on the command line
        if self.metrics_port is not None and not 1 <= self.metrics_port <= 65535:
            raise ValueError(
                f"metrics_port must be a TCP port 1-65535 (or None / 0: no metrics), got {self.metrics_port}"
            )
        if not self.metrics_host:
            raise ValueError("metrics_host must name an interface, e.g. 127.0.0.1 or 0.0.0.0")
        if self.connect_attempts < 1:
            raise ValueError(
                f"connect_attempts must be >= 1 (tries for the first bus connection), got {self.connect_attempts}"
            )
        if self.reconnect_wait_s < 0:
            raise ValueError(f"reconnect_wait_s must be >= 0 seconds, got {self.reconnect_wait_s}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1 (or None: torch's default), got {self.threads}")
        fix("compile", check_compile(self.compile))
        if not 0 <= self.batch_quantum <= MAX_BATCH_QUANTUM:
            raise ValueError(f"batch_quantum must be 0 (off) to {MAX_BATCH_QUANTUM} rows, got {self.batch_quantum}")
        sim = {"sim_preset": self.sim_preset, "sim_batch_ms": self.sim_batch_ms, "sim_row_ms": self.sim_row_ms}
        if self.backend != "sim" and any(v is not None for v in sim.values()):
            raise ValueError("--sim-preset / --sim-batch-ms / --sim-row-ms need --backend sim")
        if self.sim_preset is not None and self.sim_preset not in SIM_PRESETS:
            raise ValueError(f"sim_preset must be one of {', '.join(SIM_PRESETS)}, got {self.sim_preset!r}")
        for name in ("sim_batch_ms", "sim_row_ms"):
            if sim[name] is not None and sim[name] < 0:
                raise ValueError(f"{name} must be >= 0 milliseconds, got {sim[name]}")

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
        argv = [
            "--backend",
            self.backend,
            "--buckets",
            ",".join(map(str, self.buckets)),
            "--merge",
            self.merge,
            "--max-request-rows",
            str(self.max_request_rows),
            "--max-queue-rows",
            str(self.max_queue_rows or 0),
            "--max-inflight",
            str(self.max_inflight),
            "--connect-attempts",
            str(self.connect_attempts),
            "--metrics-host",
            self.metrics_host,
            "--dtype",
            self.dtype,
            "--compile",
            self.compile,
        ]
        for flag, value in (
            ("--device", self.device),
            ("--max-batch", self.max_batch),
            ("--metrics-port", self.metrics_port),
            ("--threads", self.threads),
            ("--xla-cache", self.xla_cache),
            ("--sim-preset", self.sim_preset),
            ("--sim-batch-ms", self.sim_batch_ms),
            ("--sim-row-ms", self.sim_row_ms),
            ("--batch-quantum", self.batch_quantum or None),
        ):
            if value is not None:
                argv += [flag, str(value)]
        return argv

    # ------------------------------------------------------------------ command line

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser, defaults: Mapping[str, Any] | None = None) -> None:
        """Declare every serving option on `parser` (`--backend`, `--buckets`, `--dtype`, ...).
        `defaults`: {field name: value} a command uses instead of the worker's (e.g. a bench's buckets);
        the help shows the command's default."""
        from bus.options import add_dtype_option

        d = {f.name: f.default for f in fields(WorkerConfig)}
        unknown = set(defaults or {}) - set(d)
        if unknown:
            raise ValueError(f"WorkerConfig has no option(s) {', '.join(sorted(unknown))}")
        d.update(defaults or {})
        buckets = d["buckets"] if isinstance(d["buckets"], str) else ",".join(map(str, d["buckets"]))

        g = parser.add_argument_group("worker serving options")
        g.add_argument(
            "--backend",
            choices=BACKENDS,
            default=d["backend"],
            help=f"model runtime (default: {d['backend']}). sim: a simulated expert, no model: it sleeps "
            "batch_ms + row_ms * padded rows per batch and returns a closed-form velocity toward a "
            "fixed per-class image; decoding, validation, batching and replies stay real (the "
            "checkpoint still gives shape, classes and expert id), so dozens of 'GPU' workers fit on "
            "one CPU box",
        )
        g.add_argument(
            "--sim-preset",
            choices=SIM_PRESETS,
            default=d["sim_preset"],
            help="sim backend latency: h200-torch (3.33 ms + 0.00575 ms/row, the default), h200-jax "
            "(2.20 ms + 0.0165 ms/row; both fitted to the H200 table in docs/DEPLOYMENT.md), "
            "instant (0 + 0)",
        )
        g.add_argument(
            "--sim-batch-ms",
            type=float,
            default=d["sim_batch_ms"],
            metavar="MS",
            help="sim backend: fixed milliseconds per batch (overrides the preset)",
        )
        g.add_argument(
            "--sim-row-ms",
            type=float,
            default=d["sim_row_ms"],
            metavar="MS",
            help="sim backend: milliseconds per padded row (overrides the preset)",
        )
        g.add_argument(
            "--device",
            default=d["device"],
            help="torch: cpu | cuda[:N] (default cpu); xla: xla[:N]; jax: cpu | gpu[:N] | tpu[:N]",
        )
        add_dtype_option(
            g,
            default=d["dtype"],
            help="the expert's compute type: auto = bfloat16 where the device computes it natively (CPU with "
            "AMX or AVX512-BF16, CUDA compute capability >= 8.0, XLA: TPU / Trainium), else float32; bfloat16 "
            "(torch / xla autocast, jax cast; inputs and outputs stay float32); float32 for images identical "
            "bit for bit across hosts. The worker advertises the dtype it computes in (default %(default)s)",
        )
        g.add_argument("--buckets", default=buckets, help=f"batch sizes compiled and padded to (default: {buckets})")
        g.add_argument(
            "--max-batch",
            type=int,
            default=d["max_batch"],
            metavar="N",
            help="most rows per forward pass (default: the largest bucket; must fit a bucket)",
        )
        g.add_argument(
            "--merge",
            choices=MERGE_MODES,
            default=d["merge"],
            help="merging queued requests into one forward pass: auto (default) merges where the warm "
            "forward times say one bigger pass is at least 10%% cheaper than two (a GPU/XLA device, "
            "whose cost is mostly fixed, merges; a CPU, whose cost grows with the rows, runs them "
            "one after another so each answer goes back sooner); always: fill every pass up to "
            "--max-batch",
        )
        g.add_argument(
            "--max-request-rows",
            type=int,
            default=d["max_request_rows"],
            metavar="N",
            help=f"refuse requests with more rows (too_large); default {d['max_request_rows']}, the "
            f"protocol limit is {MAX_STEP_ROWS}",
        )
        g.add_argument(
            "--max-queue-rows",
            type=int,
            default=d["max_queue_rows"],
            metavar="N",
            help=f"answer `overloaded` when this many rows already wait (default {d['max_queue_rows']}; 0: no limit)",
        )
        g.add_argument(
            "--max-inflight",
            type=int,
            default=d["max_inflight"],
            metavar="N",
            help=f"answer `overloaded` while this many requests are held (default {d['max_inflight']})",
        )
        g.add_argument(
            "--metrics-port",
            type=int,
            default=d["metrics_port"],
            metavar="P",
            help="also serve Prometheus text metrics on http://HOST:P/metrics (conventional port: "
            "9477; default and 0: off)",
        )
        g.add_argument(
            "--metrics-host",
            default=d["metrics_host"],
            metavar="HOST",
            help=f"interface the metrics bind (default {d['metrics_host']}, loopback only; 0.0.0.0 for "
            "a Prometheus on another machine)",
        )
        g.add_argument(
            "--connect-attempts",
            type=int,
            default=d["connect_attempts"],
            metavar="N",
            help="tries for the first connection to NATS (reconnects after that are unlimited; "
            f"default {d['connect_attempts']})",
        )
        g.add_argument(
            "--threads", type=int, default=d["threads"], metavar="N", help="torch backend: intra-op CPU threads"
        )
        g.add_argument(
            "--compile",
            choices=COMPILE_CHOICES,
            default=d["compile"],
            help="torch backend: torch.compile the expert with inductor's freezing (~1.3x the rows/s of the "
            "eager forward on an AMX CPU; 20-40 s of compiling at start-up, before the worker subscribes). "
            "auto: on for a CPU where a C++ compiler is found, off on CUDA; $DDM_FLEET_COMPILE=on|off sets "
            "what auto means on a host (default %(default)s)",
        )
        add_batch_invariant_option(
            g,
            default=d["batch_quantum"],
            help="compute every forward at a multiple of %(const)s rows, so that an image's velocities do not "
            "depend on the other jobs' rows batched beside it: a seeded job's images repeat bit for bit however "
            "busy the fleet, and match `ddm-fleet sample --batch-invariant`. Checked at start; costs the padding "
            "(a lone row costs what %(const)s do, a busy worker's batches nearly nothing)",
        )
        g.add_argument(
            "--xla-cache",
            default=d["xla_cache"],
            metavar="DIR",
            help="xla backend: persistent compile cache directory (or $XLA_PERSISTENT_CACHE_PATH)",
        )

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> WorkerConfig:
        """The config of parsed `add_arguments` options (ValueError, saying what to fix, when out of range).
        `--max-queue-rows 0` means no limit; `--metrics-port 0` means no metrics."""
        values = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
        if values.get("max_queue_rows") == 0:
            values["max_queue_rows"] = None
        return cls(**values)
