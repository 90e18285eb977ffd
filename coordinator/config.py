"""Every setting of `ddm-fleet coordinator`, each declared once, in groups, checked once.

    config = CoordinatorConfig(max_rows=512, step_timeout=5.0)       # in-process (tests, local fleets)
    config.max_rows, config.transport.step_timeout                   # a setting, flat or by its group
    CoordinatorConfig.add_arguments(parser)                          # `ddm-fleet coordinator`'s flags
    config = CoordinatorConfig.from_args(args)                       # ValueError naming the flag to fix

Each setting is one field of one group (`FleetSettings`, `AdmissionLimits`, `TransportSettings`,
`EngineSettings`, `FinishedJobs`, `MetricsSettings`, `DurableSettings`), declared with
`coordinator.option.option`: its default, help, bounds or choices and, from its name, its flag (unless
`flag=` spells it otherwise: seconds end in `-s`, so `step_timeout` is `--step-timeout-s` and
`wait_experts` `--wait-experts-s`; their old spellings `--step-timeout` and `--wait-experts` still work,
with a warning). That one declaration makes the flag, the range check and its error message
("--max-rows must be an integer >= 1, got 0") and the flag's words in `to_argv`. `CoordinatorConfig`
holds one of each group and reads every setting by its own name too (`config.max_rows`), so callers
need not know the groups.

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

from .choices import DISPATCH_MODES, HEDGE_MODES, WIRE_DTYPES
from .option import Option, Settings, option, options_of

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

_SECONDS = dict(number=float, low=0.0, above=True, unit="seconds")
_RATE = dict(number=float, low=0.0, above=True, unit="requests per second", none="no limit", zero_is_none=True)


def _cohorts(text: str) -> int | str:
    from .engine import parse_cohorts

    return parse_cohorts(text)


_cohorts.__name__ = "cohorts"  # argparse names the type in its error: "invalid cohorts value"


def _checked_cohorts(value: int | str) -> int | str:
    from .engine import check_cohorts

    return check_cohorts(value)


def _shape(value) -> tuple[int, ...]:
    return tuple(int(d) for d in value)


def _request_rows(value: int | None) -> int:
    return MAX_REQUEST_ROWS if value is None else value


@dataclass
class FleetSettings(Settings):
    """What this coordinator serves, where, and under which name (the command's files; `Coordinator`
    takes the router itself)."""

    router: str = option(
        "checkpoints/router.safetensors",
        "router checkpoint (.safetensors with its .json; default %(default)s)",
        metavar="PATH",
    )
    partition: str = option(
        "checkpoints/partition.json",
        "partition manifest: number of experts and the class owners for --strategy oracle (default %(default)s)",
        metavar="PATH",
    )
    # server URL or comma-separated cluster nodes (None: give nc)
    nats: str | None = option(None, kind="nats", none="the caller's connection")
    name: str = option(
        "coordinator",
        "this coordinator's name in its replies (1-128 characters, default %(default)s): give each "
        "coordinator on a bus its own, and keep it across restarts",
        metavar="NAME",
        low=1,
        high=MAX_COORDINATOR_NAME_LEN,
        why="give each coordinator on a bus a short name of its own",
    )
    # the guidance scale of jobs that set none (None: the router JSON's, models.fleet_guidance; 1 = off)
    default_guidance: float | None = option(
        None,
        "classifier-free guidance scale of the jobs that set no guidance_scale (1 = off; default: the "
        'router JSON\'s "guidance": {"default_scale": S}, the scale the fleet\'s judges chose, else 1). A '
        "job's own guidance_scale, 1 included, always wins",
        metavar="S",
        number=float,
        low=0.0,
        high=MAX_GUIDANCE_SCALE,
        why="1 = off",
        none="the fleet's",
    )
    wait_experts: float = option(
        0.0,
        "before serving, wait up to S seconds for every expert to have a worker (default: don't)",
        flag="--wait-experts-s",
        deprecated=("--wait-experts",),
        metavar="S",
        number=float,
        low=0.0,
        unit="seconds",
        why="0: don't wait",
    )
    # the sample shape of a fleet without a model spec
    image_shape: tuple[int, int, int] = option((1, 32, 32), kind="none", convert=_shape)


@dataclass
class AdmissionLimits(Settings):
    """Admission and fair sharing (coordinator.scheduler.SchedulerConfig) and the intake's request rates."""

    max_rows: int = option(
        1024,
        "most images denoised at once, over all jobs (default %(default)s); a job waits in the queue "
        "until its rows fit",
        metavar="N",
        number=int,
        low=1,
    )
    max_queued_jobs: int = option(
        256,
        "most jobs waiting for rows; more are rejected with `overloaded` (default %(default)s)",
        metavar="N",
        number=int,
        low=1,
    )
    max_client_rows: int | None = option(
        DEFAULT_CLIENT_ROWS,
        "most images one client (the <client> of its subjects, every session of it together) runs at "
        "once (default %(default)s, at most --max-rows; 0: --max-rows); its further jobs wait, a larger job "
        "is rejected with `too_large`. Below --max-rows it keeps rows free for others",
        metavar="N",
        number=int,
        low=1,
        none="--max-rows",
        zero_is_none=True,
    )
    max_client_queued_jobs: int | None = option(
        None,
        "most jobs one client (every session of it together) may have waiting; more are rejected with "
        "`overloaded` (default: a quarter of --max-queued-jobs, 64 with its default; at most --max-queued-jobs)",
        metavar="N",
        number=int,
        low=1,
        none="a quarter of --max-queued-jobs",
    )
    max_session_rows: int | None = option(
        None,
        "most images one session of a client (a job's `session` tag) runs at once (default: --max-client-rows)",
        metavar="N",
        number=int,
        low=1,
        none="--max-client-rows",
        zero_is_none=True,
    )
    max_session_queued_jobs: int | None = option(
        None,
        "most jobs one session of a client may have waiting (default: --max-client-queued-jobs)",
        metavar="N",
        number=int,
        low=1,
        none="--max-client-queued-jobs",
        zero_is_none=True,
    )
    max_job_cost: int | None = option(
        256_000,
        "most row-evaluations per job: images x steps x evaluations per step (heun 2) x experts per row "
        "(top1/oracle 1, topk k, full all); more is rejected with `too_large` (default %(default)s: 256 "
        "images x 1000 euler top1 steps; 0: no limit)",
        metavar="N",
        number=int,
        low=1,
        none="no limit",
        zero_is_none=True,
    )
    max_job_run_s: float | None = option(
        600.0,
        "most seconds a job may run once started; longer fails with `deadline_exceeded` (default "
        "%(default)s; 0: no limit)",
        metavar="S",
        **_SECONDS,
        none="no limit",
        zero_is_none=True,
    )
    # requests per second per client (token buckets of 2 s worth; None: no limit)
    submit_rate: float | None = option(
        DEFAULT_SUBMIT_RATE,
        "most job submits per second from one client (bursts of 2 s worth); more are rejected with "
        "`rate_limited` (default %(default)s; 0: no limit)",
        metavar="N",
        **_RATE,
    )
    status_rate: float | None = option(
        DEFAULT_STATUS_RATE,
        "most job status requests per second from one client (bursts of 2 s worth); more are answered "
        "`rate_limited` (default %(default)s; 0: no limit). Each job's result is published again at most "
        "every 2 s, however often its status is asked",
        metavar="N",
        **_RATE,
    )

    @property
    def client_queued_jobs(self) -> int:
        """Jobs one client may keep waiting: --max-client-queued-jobs, by default a quarter of
        --max-queued-jobs (at least 1), so that one client never fills the queue."""
        if self.max_client_queued_jobs is not None:
            return self.max_client_queued_jobs
        return max(1, self.max_queued_jobs // 4)


@dataclass
class TransportSettings(Settings):
    """Expert requests (coordinator.transport.NatsTransport)."""

    step_timeout: float = option(
        10.0,
        "seconds to wait for an expert's reply before retrying (default %(default)s)",
        flag="--step-timeout-s",
        deprecated=("--step-timeout",),
        metavar="S",
        **_SECONDS,
    )
    retries: int = option(
        2,
        "extra tries of a timed-out expert request; the queue group hands each try to a worker (default %(default)s)",
        metavar="N",
        number=int,
        low=0,
    )
    bad_reply_retries: int = option(
        4,
        "extra tries of an expert request after unusable replies (NaN/Inf, wrong shape or dtype), each "
        "to a worker the queue group picks (default %(default)s)",
        metavar="N",
        number=int,
        low=0,
    )
    request_rows: int = option(
        MAX_REQUEST_ROWS,
        f"most rows in one expert request (at most {MAX_REQUEST_ROWS}, default %(default)s); a smaller "
        "value splits an expert's batch into concurrent requests that the queue group spreads over several "
        "workers of that expert (one worker re-batches them)",
        metavar="N",
        number=int,
        low=1,
        high=MAX_REQUEST_ROWS,
        why="the protocol's most rows per expert request, schemas.MAX_STEP_ROWS",
        convert=_request_rows,
    )
    wire_dtype: str = option(
        "float32",
        "precision of x_t and of the velocity on the coordinator<->worker wire (default %(default)s). "
        "float16 / bfloat16 halve the bytes; the velocity is widened to float32 and checked for NaN/Inf "
        "here. Every worker must be of this release or later (older ones answer `bad_request`). An x_t or "
        "velocity that overflows float16 is sent again in float32",
        choices=WIRE_DTYPES,
    )
    hedge: str = option(
        "auto",
        "hedged requests (default %(default)s): a try of an expert with no reply after 1.5 x the p99 of "
        "its recent call times (at least 0.05 s; 1 s until 20 calls are known) is sent once more, so that "
        "another worker of its queue group can answer; the first usable reply wins. Only for experts whose "
        "recent replies came from 2+ workers, and at most ~10%% of requests. A killed worker then costs "
        "its jobs ~that delay, not --step-timeout-s",
        choices=HEDGE_MODES,
    )
    hedge_after_s: float | None = option(
        None,
        "with --hedge auto: hedge after a fixed S seconds instead of the measured p99",
        metavar="S",
        **_SECONDS,
        none="the measured p99",
    )
    dispatch: str = option(
        "direct",
        "how expert requests reach workers (default %(default)s). direct: join the shortest queue: each "
        "request goes to the worker of its expert with the fewest requests outstanding from this "
        "coordinator, on that worker's own subject (workers are learned from their replies; the queue "
        "group when none is known, when every known worker has 2 outstanding, and for every 8th request, "
        "to find new workers). queue: every request to the expert's queue group, which picks a worker at "
        "random (the behaviour before direct subjects)",
        choices=DISPATCH_MODES,
    )


@dataclass
class EngineSettings(Settings):
    """The engine loop (coordinator.engine)."""

    cohorts: int | str = option(
        "auto",
        "batches of rows out at once: the active jobs are dealt into N cohorts, so one cohort is routed "
        "and stepped while the experts work on another (no lock-step); 1 is the lock-step tick. Default "
        "auto: 2, or 3 once an expert has 4 known workers and 4 from 8 (more workers per expert need more "
        "requests queued; docs/CAPACITY.md). A job's images do not depend on it",
        metavar="N|auto",
        parse=_cohorts,
        convert=_checked_cohorts,
    )
    route_every: int = option(
        1,
        "ask the router every N evaluations of a job and reuse its weights in between (default "
        "%(default)s: every evaluation). N > 1 cuts the coordinator's router cost N-fold; it can change "
        "images (see docs/CAPACITY.md for the measured effect)",
        metavar="N",
        number=int,
        low=1,
    )
    speculate: bool = option(
        True,
        "send each row's likely expert requests while the router runs (what its job's last routing "
        "chose; a job's first evaluation waits), then ask for the rows the router sent elsewhere. Hides "
        "the router's time behind the experts' at no cost to the images; a guess the router overrules "
        "costs its expert that work (ddm_coordinator_rows_guessed_unused_total)",
        kind="switch",
    )
    run_ahead: int = option(
        8,  # engine.DEFAULT_RUN_AHEAD
        "while the coordinator runs at most --run-ahead-rows rows (a job or two alone), let each expert "
        "request compute up to A more "
        "Euler steps on its worker, streamed back as they are computed (default %(default)s; 0: off). "
        "A lone job then pays the round trip through NATS once per A steps instead of every step; a "
        "streamed velocity is used only where the routing chose that expert and the rows are exactly "
        'where the worker stepped them, so images do not change (docs/CAPACITY.md "Running ahead"). '
        "Workers of older releases refuse it, and are asked plainly",
        metavar="A",
        number=int,
        low=0,
    )
    early_update: bool = option(
        True,
        "step each job as soon as the experts its rows need have answered (its solver update and its frame "
        "go out while the batch's slower experts still compute), instead of every job at the tick's end. "
        "The next requests still leave together, so requests keep their size. A job's images do not "
        "depend on it",
        kind="switch",
    )
    run_ahead_rows: int = option(
        4,  # engine.DEFAULT_RUN_AHEAD_ROWS
        "most rows the coordinator may be running (all its jobs' images) for its expert requests to run "
        "ahead (default %(default)s): at load, batching already shares the round trip among many rows",
        metavar="N",
        number=int,
        low=0,
    )


@dataclass
class FinishedJobs(Settings):
    """Finished jobs kept for status requests (coordinator.ledger); no flags."""

    keep_finished: int = option(256, kind="none", number=int, low=0)
    keep_finished_mb: float = option(64.0, kind="none", number=float, low=0.0, above=True, unit="MiB")
    keep_finished_s: float = option(600.0, kind="none", **_SECONDS)


class _MetricsPort(Option):
    """--metrics-port: absent, port 9478 best effort; 0, no /metrics (None); P, port P, which must be free."""

    def cli_default(self, base: Any) -> Any:
        return None

    def to_cli(self, value: Any, config: Any = None) -> Any:
        optional = config.metrics_optional if config is not None else True
        return 0 if value is None else None if (value == DEFAULT_METRICS_PORT and optional) else value

    def from_cli(self, value: Any) -> dict[str, Any]:
        if value is None:
            return {"metrics_port": DEFAULT_METRICS_PORT, "metrics_optional": True}
        return {"metrics_port": value or None, "metrics_optional": False}


@dataclass
class MetricsSettings(Settings):
    """GET /metrics (coordinator.metrics_endpoint)."""

    # None: not served; 0: any free port
    metrics_port: int | None = option(
        None,
        f"serve Prometheus text metrics on http://HOST:P/metrics (default {DEFAULT_METRICS_PORT}, skipped "
        "with a warning when taken; 0 disables)",
        cls=_MetricsPort,
        metavar="P",
        number=int,
        low=0,
        high=65535,
        why="a TCP port; 0 on the command line: no /metrics",
        none="not served",
    )
    metrics_host: str = option(
        "127.0.0.1",
        "interface the metrics bind (default %(default)s, loopback only; 0.0.0.0 for a Prometheus on another machine)",
        metavar="HOST",
    )
    # a taken port is a warning, not an error (set by --metrics-port's absence)
    metrics_optional: bool = option(False, kind="none", number=bool)


@dataclass
class DurableSettings(Settings):
    """Durable jobs (coordinator.durable_store)."""

    durable: bool = option(
        False,
        "durable jobs (off by default): keep each running job's snapshot in the NATS JetStream KV bucket "
        "ddm_jobs (on admission and every --checkpoint-every steps), so that this coordinator's restart "
        "(same --name, at once) or another coordinator (once this one's lease of --lease-s has expired) "
        "resumes it mid-trajectory with bit-identical images; SIGTERM then hands the jobs over instead of "
        "failing them. Needs a server with JetStream (exit 2 without); see docs/COORDINATOR.md",
        kind="flag",
    )
    checkpoint_every: int = option(
        DEFAULT_CHECKPOINT_EVERY,
        "with --durable: solver steps between two snapshot writes of a job (default %(default)s); a crash "
        "repeats at most N steps of each job",
        metavar="N",
        number=int,
        low=1,
    )
    lease_s: float = option(
        DEFAULT_LEASE_S,
        "with --durable: seconds a job's ownership lease lives unrenewed (default %(default)s); another "
        "coordinator takes a dead one's jobs within about 1.3 x S",
        metavar="S",
        **_SECONDS,
    )
    js_replicas: int = option(
        1,
        "with --durable: copies of each KV bucket on the servers of a JetStream cluster (default "
        "%(default)s; 1-5). Use 3 with the shipped 3-node cluster.conf, so that jobs survive the loss of a "
        "NATS node; a single server takes only 1. Fixed by the coordinator that creates the buckets",
        metavar="N",
        number=int,
        low=1,
        high=5,
        why="copies of each KV bucket; 3 for the shipped 3-node cluster",
    )


#: The groups of `CoordinatorConfig`, by attribute, in the order of the command's flags.
GROUPS: dict[str, type[Settings]] = {
    "fleet": FleetSettings,
    "limits": AdmissionLimits,
    "transport": TransportSettings,
    "engine": EngineSettings,
    "metrics": MetricsSettings,
    "durability": DurableSettings,
    "finished": FinishedJobs,
}
#: Every setting's group.
_GROUP_OF = {name: group for group, cls in GROUPS.items() for name in options_of(cls)}
#: The settings with a flag, by field name, in the order of `ddm-fleet coordinator --help`.
_BY_FIELD = {name: opt for cls in GROUPS.values() for name, opt in options_of(cls).items() if opt.flag}


@dataclass(init=False)
class CoordinatorConfig:
    """The coordinator's settings, one group each (see `ddm-fleet coordinator --help` for what each does).

    Built from settings by name (`CoordinatorConfig(max_rows=8, step_timeout=5.0)`) and/or whole groups
    (`transport=TransportSettings(...)`); every setting also reads by its own name (`config.max_rows`)."""

    fleet: FleetSettings
    limits: AdmissionLimits
    transport: TransportSettings
    engine: EngineSettings
    metrics: MetricsSettings
    durability: DurableSettings
    finished: FinishedJobs

    def __init__(self, **settings: Any) -> None:
        unknown = settings.keys() - _GROUP_OF.keys() - GROUPS.keys()
        if unknown:
            raise TypeError(f"CoordinatorConfig got unexpected settings {sorted(unknown)}")
        for group, cls in GROUPS.items():
            mine = {name: settings[name] for name in options_of(cls) if name in settings}
            given = settings.get(group)
            setattr(self, group, dataclasses.replace(given, **mine) if given is not None else cls(**mine))

    # ------------------------------------------------------------ derived
    def scheduler_config(self, num_experts: int, class_to_expert=None, spec=None):
        """The `SchedulerConfig` of these limits for a fleet of `num_experts` experts; `spec` (the
        fleet's `schemas.spec.ModelSpec`) gives the sample shape, class count and value range (a pixel
        fleet's images are clipped to it), else `image_shape`, 10 classes and [-1, 1]."""
        from .scheduler import SchedulerConfig

        limits = self.limits
        shape = tuple(spec.sample_shape) if spec is not None else self.image_shape
        classes = {"num_classes": max(spec.num_classes, 1)} if spec is not None else {}
        return SchedulerConfig(
            num_experts=num_experts,
            max_rows=limits.max_rows,
            max_queued_jobs=limits.max_queued_jobs,
            image_shape=shape,
            class_to_expert=class_to_expert,
            **classes,
            max_client_rows=limits.max_client_rows,
            max_client_queued_jobs=limits.client_queued_jobs,
            max_session_rows=limits.max_session_rows,
            max_session_queued_jobs=limits.max_session_queued_jobs,
            max_job_cost=limits.max_job_cost,
            max_job_run_s=limits.max_job_run_s,
            latent=spec is not None and spec.space == "latent",
            **({"value_range": tuple(float(v) for v in spec.value_range)} if spec is not None else {}),
        )

    @property
    def client_queued_jobs(self) -> int:
        return self.limits.client_queued_jobs

    def replace(self, **changes: Any) -> CoordinatorConfig:
        """A copy with `changes` (settings by name, or whole groups; checked again)."""
        return CoordinatorConfig(**{**{group: getattr(self, group) for group in GROUPS}, **changes})

    # ------------------------------------------------------------ the command line
    @classmethod
    def add_arguments(
        cls, parser: argparse.ArgumentParser, defaults: dict[str, Any] | None = None, only: Iterable[str] | None = None
    ) -> None:
        """Add the flags of the fields in `only` (default: every command-line field) to `parser`.
        `defaults` (field name -> value, in this class's terms) replaces this class's defaults: a bench
        that changes one says so with `differing_defaults`."""
        names = list(only) if only is not None else list(_BY_FIELD)
        unknown = set(names) - _BY_FIELD.keys() | set(defaults or {}) - _BY_FIELD.keys()
        if unknown:
            raise ValueError(f"no coordinator flag for {sorted(unknown)}; known: {sorted(_BY_FIELD)}")
        base = cls()
        for name in names:
            opt = _BY_FIELD[name]
            opt.add(parser, opt.to_cli(defaults[name]) if name in (defaults or {}) else opt.cli_default(base))

    @classmethod
    def from_args(cls, args: argparse.Namespace, **overrides: Any) -> CoordinatorConfig:
        """The config of parsed `args` (fields without a flag in `args` keep their defaults), with
        `overrides`. Raises ValueError naming the flag to fix."""
        values: dict[str, Any] = {}
        for name, opt in _BY_FIELD.items():
            if hasattr(args, name):
                values.update(opt.from_cli(getattr(args, name)))
        values.update(overrides)
        return cls(**values)

    def to_argv(self, only: Iterable[str] | None = None) -> list[str]:
        """`ddm-fleet coordinator` flags that give a child process these settings (only the fields in
        `only`, default every command-line field; flags at their default are left out)."""
        base = CoordinatorConfig()
        argv: list[str] = []
        for name in list(only) if only is not None else list(_BY_FIELD):
            opt = _BY_FIELD[name]
            mine, theirs = opt.to_cli(getattr(self, name), self), opt.cli_default(base)
            if mine != theirs:
                argv += opt.argv(mine)
        return argv

    @classmethod
    def differing_defaults(cls, defaults: dict[str, Any]) -> str:
        """One line for a bench's output: the defaults it changed against `ddm-fleet coordinator`'s,
        e.g. "bench defaults differing from `ddm-fleet coordinator`: --step-timeout-s 60 (coordinator: 10)";
        "" when none differ."""
        base = cls()
        parts = []
        for name, value in defaults.items():
            opt = _BY_FIELD[name]
            mine, theirs = opt.to_cli(value), opt.cli_default(base)
            if mine != theirs:
                parts.append(f"{opt.flag} {_shown(mine)} (coordinator: {_shown(theirs)})")
        return "bench defaults differing from `ddm-fleet coordinator`: " + ", ".join(parts) if parts else ""


def _reads_setting(group: str, name: str) -> property:
    return property(lambda self: getattr(getattr(self, group), name), doc=f"`{group}.{name}`")


for _name, _group in _GROUP_OF.items():  # config.max_rows reads config.limits.max_rows
    setattr(CoordinatorConfig, _name, _reads_setting(_group, _name))
del _name, _group


def _shown(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return "none" if value is None else f"{value:g}" if isinstance(value, float) else str(value)
