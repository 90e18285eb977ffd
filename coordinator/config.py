"""Every setting of `ddm-fleet coordinator`, in one dataclass, checked once.

    config = CoordinatorConfig(max_rows=512, step_timeout=5.0)       # in-process (tests, local fleets)
    CoordinatorConfig.add_arguments(parser)                          # `ddm-fleet coordinator`'s flags
    config = CoordinatorConfig.from_args(args)                       # ValueError naming the flag to fix

A bench that starts coordinators declares the flags it passes through with
`add_arguments(parser, only=(...), defaults={...})`, reads them back with `from_args`, hands them to its
child with `to_argv(only=...)` and tells its reader which defaults it changed with `differing_defaults`.

Units: rows are images denoised at once; seconds are wall-clock seconds (float); `max_job_cost` is
row-evaluations (images x steps x evaluations per step x experts per row).

On the command line `--max-job-cost 0` / `--max-job-run-s 0` mean "no limit" (None here) and
`--metrics-port` means: absent, port 9478 best effort (`metrics_optional`); 0, no /metrics (None
here); P, port P, which must be free. Here `metrics_port=0` asks for any free port (tests).
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from schemas.limits import MAX_GUIDANCE_SCALE
from schemas.messages import MAX_COORDINATOR_NAME_LEN

#: The most rows one expert request may carry (schemas.MAX_STEP_ROWS; repeated so that building the
#: parser imports no numpy).
MAX_REQUEST_ROWS = 512
#: `--metrics-port`'s default: served best effort (a taken port is a warning).
DEFAULT_METRICS_PORT = 9478
#: Solver steps between two snapshot writes of a durable job (see docs/COORDINATOR.md for the cost).
DEFAULT_CHECKPOINT_EVERY = 10
#: Rows one client (every session of it together) runs at once by default: the largest job
#: (schemas.MAX_JOB_IMAGES), a quarter of the default --max-rows.
DEFAULT_CLIENT_ROWS = 256
#: Submits per second one client may send (bursts of 2 s worth); more are rejected `rate_limited`.
DEFAULT_SUBMIT_RATE = 50.0
#: Job status requests per second one client may send (bursts of 2 s worth); more get `rate_limited`.
DEFAULT_STATUS_RATE = 50.0
#: Seconds a durable job's ownership lease lives without renewal (renewed every third of it).
DEFAULT_LEASE_S = 6.0

WIRE_DTYPES = ("float32", "float16", "bfloat16")
HEDGE_MODES = ("auto", "off")
DISPATCH_MODES = ("direct", "queue")


@dataclass
class CoordinatorConfig:
    """The coordinator's settings (see `ddm-fleet coordinator --help` for what each does)."""

    # identity and files (the command's; `Coordinator` takes the router itself)
    name: str = "coordinator"
    nats: str | None = None  # server URL or comma-separated cluster nodes (None: give nc)
    router: str = "checkpoints/router.safetensors"
    partition: str = "checkpoints/partition.json"
    wait_experts: float = 0.0  # seconds to wait for every expert's workers before serving
    # the guidance scale of jobs that set none (None: the router JSON's, models.fleet_guidance; 1 = off)
    default_guidance: float | None = None
    # admission and fair sharing (coordinator.scheduler.SchedulerConfig)
    max_rows: int = 1024
    max_queued_jobs: int = 256
    max_client_rows: int | None = DEFAULT_CLIENT_ROWS  # None: max_rows
    max_client_queued_jobs: int | None = None  # None: a quarter of max_queued_jobs (64 of the default 256)
    max_session_rows: int | None = None  # None: max_client_rows
    max_session_queued_jobs: int | None = None  # None: max_client_queued_jobs
    max_job_cost: int | None = 256_000  # None: no limit
    max_job_run_s: float | None = 600.0  # None: no limit
    # requests per second per client (token buckets of 2 s worth; None: no limit)
    submit_rate: float | None = DEFAULT_SUBMIT_RATE
    status_rate: float | None = DEFAULT_STATUS_RATE
    image_shape: tuple[int, int, int] = (1, 32, 32)
    # expert requests (coordinator.transport.NatsTransport)
    step_timeout: float = 10.0
    retries: int = 2
    bad_reply_retries: int = 4
    request_rows: int = MAX_REQUEST_ROWS
    wire_dtype: str = "float32"
    hedge: str = "auto"
    hedge_after_s: float | None = None  # None: the measured p99
    dispatch: str = "direct"
    # the engine (coordinator.engine)
    cohorts: int | str = "auto"
    route_every: int = 1
    speculate: bool = True
    run_ahead: int = 8  # engine.DEFAULT_RUN_AHEAD
    run_ahead_rows: int = 4  # engine.DEFAULT_RUN_AHEAD_ROWS
    # finished jobs kept for status requests
    keep_finished: int = 256
    keep_finished_mb: float = 64.0
    keep_finished_s: float = 600.0
    # GET /metrics (None: not served; 0: any free port)
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    metrics_optional: bool = False
    # durable jobs (coordinator.durable)
    durable: bool = False
    checkpoint_every: int = DEFAULT_CHECKPOINT_EVERY
    lease_s: float = DEFAULT_LEASE_S
    js_replicas: int = 1

    def __post_init__(self) -> None:
        from .engine import check_cohorts

        if not isinstance(self.name, str) or not 1 <= len(self.name) <= MAX_COORDINATOR_NAME_LEN:
            raise ValueError(
                f"--name must be 1-{MAX_COORDINATOR_NAME_LEN} characters, got {self.name!r:.80}: "
                "give each coordinator on a bus a short name of its own"
            )
        self.image_shape = tuple(int(d) for d in self.image_shape)
        if self.request_rows is None:
            self.request_rows = MAX_REQUEST_ROWS
        for flag, value, low in (
            ("--max-rows", self.max_rows, 1),
            ("--max-queued-jobs", self.max_queued_jobs, 1),
            ("--max-client-rows", self.max_client_rows, 1),
            ("--max-client-queued-jobs", self.max_client_queued_jobs, 1),
            ("--max-session-rows", self.max_session_rows, 1),
            ("--max-session-queued-jobs", self.max_session_queued_jobs, 1),
            ("--max-job-cost", self.max_job_cost, 1),
            ("--retries", self.retries, 0),
            ("--bad-reply-retries", self.bad_reply_retries, 0),
            ("--request-rows", self.request_rows, 1),
            ("--route-every", self.route_every, 1),
            ("--run-ahead", self.run_ahead, 0),
            ("--run-ahead-rows", self.run_ahead_rows, 0),
            ("--checkpoint-every", self.checkpoint_every, 1),
            ("--js-replicas", self.js_replicas, 1),
            ("keep_finished", self.keep_finished, 0),
        ):
            if value is None and flag in (
                "--max-client-rows",
                "--max-client-queued-jobs",
                "--max-job-cost",
                "--max-session-rows",
                "--max-session-queued-jobs",
            ):
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{flag} must be an integer >= {low}, got {value!r}")
        if self.request_rows > MAX_REQUEST_ROWS:
            raise ValueError(
                f"--request-rows must be <= {MAX_REQUEST_ROWS} (the protocol's most rows per expert "
                f"request, schemas.MAX_STEP_ROWS), got {self.request_rows}"
            )
        if self.js_replicas > 5:
            raise ValueError(
                f"--js-replicas must be 1-5 (copies of each KV bucket; 3 for the shipped 3-node "
                f"cluster), got {self.js_replicas}"
            )
        for flag, value in (
            ("--step-timeout", self.step_timeout),
            ("--lease-s", self.lease_s),
            ("--max-job-run-s", self.max_job_run_s),
            ("--submit-rate", self.submit_rate),
            ("--status-rate", self.status_rate),
            ("--hedge-after-s", self.hedge_after_s),
            ("keep_finished_mb", self.keep_finished_mb),
            ("keep_finished_s", self.keep_finished_s),
        ):
            if value is None and flag in ("--max-job-run-s", "--hedge-after-s", "--submit-rate", "--status-rate"):
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(
                    (
                        f"{flag} must be a number of requests per second > 0 (0 on the command line: no limit)"
                        if flag in ("--submit-rate", "--status-rate")
                        else f"{flag} must be a number of seconds > 0"
                    )
                    + f", got {value!r}"
                    + (" (0 on the command line: no limit)" if flag == "--max-job-run-s" else "")
                )
        if self.default_guidance is not None and (
            isinstance(self.default_guidance, bool)
            or not isinstance(self.default_guidance, (int, float))
            or not 0.0 <= self.default_guidance <= MAX_GUIDANCE_SCALE
        ):
            raise ValueError(
                f"--default-guidance must be a number in [0, {MAX_GUIDANCE_SCALE:g}] (1 = off), "
                f"got {self.default_guidance!r}"
            )
        if not isinstance(self.wait_experts, (int, float)) or self.wait_experts < 0:
            raise ValueError(f"--wait-experts must be >= 0 seconds (0: don't wait), got {self.wait_experts!r}")
        for flag, value, choices in (
            ("--wire-dtype", self.wire_dtype, WIRE_DTYPES),
            ("--hedge", self.hedge, HEDGE_MODES),
            ("--dispatch", self.dispatch, DISPATCH_MODES),
        ):
            if value not in choices:
                raise ValueError(f"{flag} must be one of {', '.join(choices)}, got {value!r}")
        if self.metrics_port is not None and (
            isinstance(self.metrics_port, bool)
            or not isinstance(self.metrics_port, int)
            or not 0 <= self.metrics_port <= 65535
        ):
            raise ValueError(
                f"--metrics-port must be a TCP port (0-65535; 0 on the command line: no /metrics), "
                f"got {self.metrics_port!r}"
            )
        if not isinstance(self.speculate, bool):
            raise ValueError(f"speculate must be True or False (--speculate / --no-speculate), got {self.speculate!r}")
        try:
            self.cohorts = check_cohorts(self.cohorts)
        except (ValueError, TypeError) as err:
            raise ValueError(f"--cohorts: {err}") from None

    # ------------------------------------------------------------ derived
    def scheduler_config(self, num_experts: int, class_to_expert=None, spec=None):
        """The `SchedulerConfig` of these limits for a fleet of `num_experts` experts; `spec` (the
        fleet's `schemas.spec.ModelSpec`) gives the sample shape, class count and value range (a pixel
        fleet's images are clipped to it), else `image_shape`, 10 classes and [-1, 1]."""
        from .scheduler import SchedulerConfig

        shape = tuple(spec.sample_shape) if spec is not None else self.image_shape
        classes = {"num_classes": max(spec.num_classes, 1)} if spec is not None else {}
        return SchedulerConfig(
            num_experts=num_experts,
            max_rows=self.max_rows,
            max_queued_jobs=self.max_queued_jobs,
            image_shape=shape,
            class_to_expert=class_to_expert,
            **classes,
            max_client_rows=self.max_client_rows,
            max_client_queued_jobs=self.client_queued_jobs,
            max_session_rows=self.max_session_rows,
            max_session_queued_jobs=self.max_session_queued_jobs,
            max_job_cost=self.max_job_cost,
            max_job_run_s=self.max_job_run_s,
            latent=spec is not None and spec.space == "latent",
            **({"value_range": tuple(float(v) for v in spec.value_range)} if spec is not None else {}),
        )

    @property
    def client_queued_jobs(self) -> int:
        """Jobs one client may keep waiting: --max-client-queued-jobs, by default a quarter of
        --max-queued-jobs (at least 1), so that one client never fills the queue."""
        if self.max_client_queued_jobs is not None:
            return self.max_client_queued_jobs
        return max(1, self.max_queued_jobs // 4)

    def replace(self, **changes: Any) -> CoordinatorConfig:
        """A copy with `changes` (checked again)."""
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------ the command line
    @classmethod
    def add_arguments(
        cls, parser: argparse.ArgumentParser, defaults: dict[str, Any] | None = None, only: Iterable[str] | None = None
    ) -> None:
        """Add the flags of the fields in `only` (default: every command-line field) to `parser`.
        `defaults` (field name -> value, in this class's terms) replaces this class's defaults: a bench
        that changes one says so with `differing_defaults`."""
        names = list(only) if only is not None else [o.field for o in _OPTIONS]
        unknown = set(names) - _BY_FIELD.keys() | set(defaults or {}) - _BY_FIELD.keys()
        if unknown:
            raise ValueError(f"no coordinator flag for {sorted(unknown)}; known: {sorted(_BY_FIELD)}")
        base = cls()
        for name in names:
            opt = _BY_FIELD[name]
            if name in (defaults or {}):
                opt.add(parser, opt.to_cli(defaults[name]))
            else:
                opt.add(parser, opt.cli_default(base))

    @classmethod
    def from_args(cls, args: argparse.Namespace, **overrides: Any) -> CoordinatorConfig:
        """The config of parsed `args` (fields without a flag in `args` keep their defaults), with
        `overrides`. Raises ValueError naming the flag to fix."""
        values: dict[str, Any] = {}
        for opt in _OPTIONS:
            if hasattr(args, opt.dest):
                values.update(opt.from_cli(getattr(args, opt.dest)))
        values.update(overrides)
        return cls(**values)

    def to_argv(self, only: Iterable[str] | None = None) -> list[str]:
        """`ddm-fleet coordinator` flags that give a child process these settings (only the fields in
        `only`, default every command-line field; flags at their default are left out)."""
        base = CoordinatorConfig()
        argv: list[str] = []
        for name in list(only) if only is not None else [o.field for o in _OPTIONS]:
            opt = _BY_FIELD[name]
            mine, theirs = opt.to_cli(getattr(self, name), self), opt.cli_default(base)
            if mine != theirs:
                argv += opt.argv(mine)
        return argv

    @classmethod
    def differing_defaults(cls, defaults: dict[str, Any]) -> str:
        """One line for a bench's output: the defaults it changed against `ddm-fleet coordinator`'s,
        e.g. "bench defaults differing from `ddm-fleet coordinator`: --step-timeout 60 (coordinator: 10)";
        "" when none differ."""
        base = cls()
        parts = []
        for name, value in defaults.items():
            opt = _BY_FIELD[name]
            mine, theirs = opt.to_cli(value), opt.cli_default(base)
            if mine != theirs:
                parts.append(f"{opt.flag} {_shown(mine)} (coordinator: {_shown(theirs)})")
        return "bench defaults differing from `ddm-fleet coordinator`: " + ", ".join(parts) if parts else ""


def _shown(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return "none" if value is None else f"{value:g}" if isinstance(value, float) else str(value)


@dataclass
class _Option:
    """One command-line flag of a config field: how it is declared, and read back."""

    field: str
    help: str
    type: Any = None
    metavar: str | None = None
    choices: tuple | None = None
    kind: str = "value"  # "value" | "switch" | "flag" (store_true) | "nats"
    zero_is_none: bool = False  # the flag's 0 is the field's None ("no limit")
    flag: str = ""

    def __post_init__(self) -> None:
        self.flag = self.flag or "--" + self.field.replace("_", "-")

    @property
    def dest(self) -> str:
        return self.field

    def cli_default(self, base: CoordinatorConfig) -> Any:
        """The flag's default on `ddm-fleet coordinator`: the field's, in the flag's terms (for
        --metrics-port: absent, i.e. port 9478 best effort)."""
        return None if self.field == "metrics_port" else self.to_cli(getattr(base, self.field))

    def to_cli(self, value: Any, config: CoordinatorConfig | None = None) -> Any:
        if self.field == "metrics_port":  # None (off) -> 0; 9478 best effort -> None (the flag's default)
            optional = config.metrics_optional if config is not None else True
            return 0 if value is None else None if (value == DEFAULT_METRICS_PORT and optional) else value
        if self.zero_is_none and value is None:
            return 0
        return value

    def from_cli(self, value: Any) -> dict[str, Any]:
        if self.field == "metrics_port":
            if value is None:
                return {"metrics_port": DEFAULT_METRICS_PORT, "metrics_optional": True}
            return {"metrics_port": value or None, "metrics_optional": False}
        if self.zero_is_none and value == 0:
            return {self.field: None}
        return {self.field: value}

    def argv(self, value: Any) -> list[str]:
        if self.kind == "switch":
            return [self.flag if value else "--no-" + self.flag[2:]]
        if self.kind == "flag":
            return [self.flag] if value else []
        return [self.flag, str(value)]

    def add(self, parser: argparse.ArgumentParser, default: Any) -> None:
        from bus.options import add_nats_option, add_switch

        if self.kind == "nats":
            add_nats_option(parser) if default is None else add_nats_option(parser, default=default)
        elif self.kind == "switch":
            add_switch(parser, self.flag[2:], default=bool(default), help=self.help, dest=self.field)
        elif self.kind == "flag":
            parser.add_argument(self.flag, action="store_true", default=bool(default), dest=self.field, help=self.help)
        else:
            kwargs: dict[str, Any] = dict(default=default, dest=self.field, help=self.help)
            if self.type is not None:
                kwargs["type"] = self.type
            if self.choices:
                kwargs["choices"] = self.choices
            elif self.metavar:
                kwargs["metavar"] = self.metavar
            parser.add_argument(self.flag, **kwargs)


def _cohorts(text: str) -> int | str:
    from .engine import parse_cohorts

    return parse_cohorts(text)


_cohorts.__name__ = "cohorts"  # argparse names the type in its error: "invalid cohorts value"

_OPTIONS: tuple[_Option, ...] = (
    _Option("router", metavar="PATH", help="router checkpoint (.safetensors with its .json; default %(default)s)"),
    _Option(
        "partition",
        metavar="PATH",
        help="partition manifest: number of experts and the class owners for --strategy oracle (default %(default)s)",
    ),
    _Option("nats", kind="nats", help=""),
    _Option(
        "name",
        metavar="NAME",
        help="this coordinator's name in its replies (1-128 characters, default %(default)s): give each "
        "coordinator on a bus its own, and keep it across restarts",
    ),
    _Option(
        "max_rows",
        type=int,
        metavar="N",
        help="most images denoised at once, over all jobs (default %(default)s); a job waits in the queue "
        "until its rows fit",
    ),
    _Option(
        "max_queued_jobs",
        type=int,
        metavar="N",
        help="most jobs waiting for rows; more are rejected with `overloaded` (default %(default)s)",
    ),
    _Option(
        "max_client_rows",
        type=int,
        metavar="N",
        zero_is_none=True,
        help="most images one client (the <client> of its subjects, every session of it together) runs at "
        "once (default %(default)s, at most --max-rows; 0: --max-rows); its further jobs wait, a larger job "
        "is rejected with `too_large`. Below --max-rows it keeps rows free for others",
    ),
    _Option(
        "max_client_queued_jobs",
        type=int,
        metavar="N",
        help="most jobs one client (every session of it together) may have waiting; more are rejected with "
        "`overloaded` (default: a quarter of --max-queued-jobs, 64 with its default; at most --max-queued-jobs)",
    ),
    _Option(
        "max_session_rows",
        type=int,
        metavar="N",
        zero_is_none=True,
        help="most images one session of a client (a job's `session` tag) runs at once (default: --max-client-rows)",
    ),
    _Option(
        "max_session_queued_jobs",
        type=int,
        metavar="N",
        zero_is_none=True,
        help="most jobs one session of a client may have waiting (default: --max-client-queued-jobs)",
    ),
    _Option(
        "max_job_cost",
        type=int,
        metavar="N",
        zero_is_none=True,
        help="most row-evaluations per job: images x steps x evaluations per step (heun 2) x experts per row "
        "(top1/oracle 1, topk k, full all); more is rejected with `too_large` (default %(default)s: 256 "
        "images x 1000 euler top1 steps; 0: no limit)",
    ),
    _Option(
        "max_job_run_s",
        type=float,
        metavar="S",
        zero_is_none=True,
        help="most seconds a job may run once started; longer fails with `deadline_exceeded` (default "
        "%(default)s; 0: no limit)",
    ),
    _Option(
        "submit_rate",
        type=float,
        metavar="N",
        zero_is_none=True,
        help="most job submits per second from one client (bursts of 2 s worth); more are rejected with "
        "`rate_limited` (default %(default)s; 0: no limit)",
    ),
    _Option(
        "status_rate",
        type=float,
        metavar="N",
        zero_is_none=True,
        help="most job status requests per second from one client (bursts of 2 s worth); more are answered "
        "`rate_limited` (default %(default)s; 0: no limit). Each job's result is published again at most "
        "every 2 s, however often its status is asked",
    ),
    _Option(
        "step_timeout",
        type=float,
        metavar="S",
        help="seconds to wait for an expert's reply before retrying (default %(default)s)",
    ),
    _Option(
        "retries",
        type=int,
        metavar="N",
        help="extra tries of a timed-out expert request; the queue group hands each try to a worker "
        "(default %(default)s)",
    ),
    _Option(
        "bad_reply_retries",
        type=int,
        metavar="N",
        help="extra tries of an expert request after unusable replies (NaN/Inf, wrong shape or dtype), each "
        "to a worker the queue group picks (default %(default)s)",
    ),
    _Option(
        "request_rows",
        type=int,
        metavar="N",
        help=f"most rows in one expert request (at most {MAX_REQUEST_ROWS}, default %(default)s); a smaller "
        "value splits an expert's batch into concurrent requests that the queue group spreads over several "
        "workers of that expert (one worker re-batches them)",
    ),
    _Option(
        "cohorts",
        type=_cohorts,
        metavar="N|auto",
        help="batches of rows out at once: the active jobs are dealt into N cohorts, so one cohort is routed "
        "and stepped while the experts work on another (no lock-step); 1 is the lock-step tick. Default "
        "auto: 2, or 3 once an expert has 4 known workers and 4 from 8 (more workers per expert need more "
        "requests queued; docs/CAPACITY.md). A job's images do not depend on it",
    ),
    _Option(
        "route_every",
        type=int,
        metavar="N",
        help="ask the router every N evaluations of a job and reuse its weights in between (default "
        "%(default)s: every evaluation). N > 1 cuts the coordinator's router cost N-fold; it can change "
        "images (see docs/CAPACITY.md for the measured effect)",
    ),
    _Option(
        "speculate",
        kind="switch",
        help="send each row's likely expert requests while the router runs (what its job's last routing "
        "chose; a job's first evaluation waits), then ask for the rows the router sent elsewhere. Hides "
        "the router's time behind the experts' at no cost to the images; a guess the router overrules "
        "costs its expert that work (ddm_coordinator_rows_guessed_unused_total)",
    ),
    _Option(
        "run_ahead",
        type=int,
        metavar="A",
        help="while the coordinator runs at most --run-ahead-rows rows (a job or two alone), let each expert "
        "request compute up to A more "
        "Euler steps on its worker, streamed back as they are computed (default %(default)s; 0: off). "
        "A lone job then pays the round trip through NATS once per A steps instead of every step; a "
        "streamed velocity is used only where the routing chose that expert and the rows are exactly "
        'where the worker stepped them, so images do not change (docs/CAPACITY.md "Running ahead"). '
        "Workers of older releases refuse it, and are asked plainly",
    ),
    _Option(
        "run_ahead_rows",
        type=int,
        metavar="N",
        help="most rows the coordinator may be running (all its jobs' images) for its expert requests to run "
        "ahead (default %(default)s): at load, batching already shares the round trip among many rows",
    ),
    _Option(
        "wire_dtype",
        choices=WIRE_DTYPES,
        help="precision of x_t and of the velocity on the coordinator<->worker wire (default %(default)s). "
        "float16 / bfloat16 halve the bytes; the velocity is widened to float32 and checked for NaN/Inf "
        "here. Every worker must be of this release or later (older ones answer `bad_request`). An x_t or "
        "velocity that overflows float16 is sent again in float32",
    ),
    _Option(
        "hedge",
        choices=HEDGE_MODES,
        help="hedged requests (default %(default)s): a try of an expert with no reply after 1.5 x the p99 of "
        "its recent call times (at least 0.05 s; 1 s until 20 calls are known) is sent once more, so that "
        "another worker of its queue group can answer; the first usable reply wins. Only for experts whose "
        "recent replies came from 2+ workers, and at most ~10%% of requests. A killed worker then costs "
        "its jobs ~that delay, not --step-timeout",
    ),
    _Option(
        "hedge_after_s",
        type=float,
        metavar="S",
        help="with --hedge auto: hedge after a fixed S seconds instead of the measured p99",
    ),
    _Option(
        "dispatch",
        choices=DISPATCH_MODES,
        help="how expert requests reach workers (default %(default)s). direct: join the shortest queue: each "
        "request goes to the worker of its expert with the fewest requests outstanding from this "
        "coordinator, on that worker's own subject (workers are learned from their replies; the queue "
        "group when none is known, when every known worker has 2 outstanding, and for every 8th request, "
        "to find new workers). queue: every request to the expert's queue group, which picks a worker at "
        "random (the behaviour before direct subjects)",
    ),
    _Option(
        "metrics_port",
        type=int,
        metavar="P",
        help=f"serve Prometheus text metrics on http://HOST:P/metrics (default {DEFAULT_METRICS_PORT}, skipped "
        "with a warning when taken; 0 disables)",
    ),
    _Option(
        "metrics_host",
        metavar="HOST",
        help="interface the metrics bind (default %(default)s, loopback only; 0.0.0.0 for a Prometheus on "
        "another machine)",
    ),
    _Option(
        "durable",
        kind="flag",
        help="durable jobs (off by default): keep each running job's snapshot in the NATS JetStream KV bucket "
        "ddm_jobs (on admission and every --checkpoint-every steps), so that this coordinator's restart "
        "(same --name, at once) or another coordinator (once this one's lease of --lease-s has expired) "
        "resumes it mid-trajectory with bit-identical images; SIGTERM then hands the jobs over instead of "
        "failing them. Needs a server with JetStream (exit 2 without); see docs/COORDINATOR.md",
    ),
    _Option(
        "checkpoint_every",
        type=int,
        metavar="N",
        help="with --durable: solver steps between two snapshot writes of a job (default %(default)s); a crash "
        "repeats at most N steps of each job",
    ),
    _Option(
        "lease_s",
        type=float,
        metavar="S",
        help="with --durable: seconds a job's ownership lease lives unrenewed (default %(default)s); another "
        "coordinator takes a dead one's jobs within about 1.3 x S",
    ),
    _Option(
        "js_replicas",
        type=int,
        metavar="N",
        help="with --durable: copies of each KV bucket on the servers of a JetStream cluster (default "
        "%(default)s; 1-5). Use 3 with the shipped 3-node cluster.conf, so that jobs survive the loss of a "
        "NATS node; a single server takes only 1. Fixed by the coordinator that creates the buckets",
    ),
    _Option(
        "default_guidance",
        type=float,
        metavar="S",
        help="classifier-free guidance scale of the jobs that set no guidance_scale (1 = off; default: the "
        'router JSON\'s "guidance": {"default_scale": S}, the scale the fleet\'s judges chose, else 1). A '
        "job's own guidance_scale, 1 included, always wins",
    ),
    _Option(
        "wait_experts",
        type=float,
        metavar="S",
        help="before serving, wait up to S seconds for every expert to have a worker (default: don't)",
    ),
)
_BY_FIELD = {o.field: o for o in _OPTIONS}
