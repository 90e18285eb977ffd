"""`ddm-fleet fuzz`: throw hostile inputs at the decoders, a worker, the coordinator and the web socket.

Targets (inputs come from `fuzzing.inputs`):

    codec        msgpack bytes -> schemas.loads -> decode_tensor                 (pure, in-process)
    messages     byte 0 picks a message type or union, the rest -> schemas.unpack (pure, in-process)
    worker       raw and mutated StepRequests (and other messages) over NATS to a real ExpertWorker
    coordinator  raw and mutated bytes on c.<client>.jobs.submit, c.<client>.jobs.<id>.cancel|status, fleet.status
    websocket    random and mutated text / binary frames to the real web app's /ws

The network targets run a private fleet: a nats-server on a free port (max_payload 16 MiB, so
messages between our 8 MiB limit and the server's reach our code), two tiny random-init torch
experts (`ExpertWorker`), a `Coordinator` with a random-init router, and the aiohttp web app,
all in this process. Nothing touches a shared bus.

Every input ends as one of:
    ok       valid input, served (and the answer is honest: shapes, row ids, re-encoding)
    clear    refused with the documented error: a ProtocolError / ErrorReply / JobRejected with a
             code, NoResponders for an expert nobody serves, the NATS max-payload error, a
             websocket `error` message, or the 1009 close for a frame over the socket's limit
    crash    anything else: another exception type, a reply that does not decode, the wrong
             error code for what the schema says, an `internal` error, no reply in time, a
             socket closed on us, an ERROR logged by the server side, a dead process
A network target then checks that the fleet still serves: the worker's velocity for a valid
request equals the model's, a real job completes, the web page answers ping and a job. A failed
check counts as a crash. `unanswered` counts requests that get no reply by design; no target has
any at present (every request is answered, see below), so it stays 0.

Engines for the pure targets: `atheris` (coverage-guided libFuzzer, run in a child process,
since atheris.Fuzz() never returns; `pip install atheris`, part of the `test` extra) or `random`
(the structure-aware generator alone, in-process). `--engine auto` uses atheris when it imports.
The network targets always use the generator: their inputs must mostly be well-formed to get
past the first check, and coverage would be measured in the wrong place (the client).

A cancel / job-status request whose subject token is not a job id or client name
(`ddm.v1.c.fuzz.jobs.<65 chars>.cancel`, `bad%token`, non-ASCII) must get an `error` reply with
`bad_request` (counted as the clear error `not_a_job_id`); any other answer, or none in time, is a
crash. Requests in another client's namespace ("other") must be answered as for an unknown job. A status reply must be a
`job_status` for the job asked about.
"""

from __future__ import annotations

import asyncio
import logging
import tempfile
import time

from .engines import atheris_available, run_pure_atheris, run_pure_random
from .fleet import Fleet, _ErrorLog
from .result import FuzzResult, progress_bar

TARGETS = ("codec", "messages", "worker", "coordinator", "websocket")
PURE = ("codec", "messages")
NETWORK = ("worker", "coordinator", "websocket")
#: Inputs per target when --runs is not given.
DEFAULT_RUNS = {"codec": 20_000, "messages": 20_000, "worker": 2_000, "coordinator": 2_000, "websocket": 2_000}


def _network_fuzzer(target: str):
    from importlib import import_module

    return import_module(f"fuzzing.targets.{target}").fuzz


async def run_network(
    targets: list[str], runs: dict[str, int], seed: int, concurrency: int, timeout: float, progress: bool
) -> list[FuzzResult]:
    results = []
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)  # one line per socket otherwise
    with tempfile.TemporaryDirectory(prefix="ddm-fuzz-fleet-") as tmp:
        async with Fleet(tmp) as fleet:
            for target in targets:
                handler = _ErrorLog()
                root = logging.getLogger()
                root.addHandler(handler)
                start = time.perf_counter()
                try:
                    with progress_bar(runs[target], target, progress) as bar:
                        res = await _network_fuzzer(target)(fleet, runs[target], seed, concurrency, timeout, bar)
                    await asyncio.sleep(0.5)  # late errors of the last inputs
                finally:
                    root.removeHandler(handler)
                for text in handler.records:
                    res.crash(b"", f"logged: {text}")
                res.wall_s = time.perf_counter() - start
                results.append(res)
    return results


def run(
    targets: list[str],
    *,
    runs: int | None = None,
    seed: int = 0,
    engine: str = "auto",
    concurrency: int = 8,
    timeout: float = 10.0,
    progress: bool = False,
) -> list[FuzzResult]:
    """Fuzz `targets` (names from TARGETS, in that order). `runs` per target (None: DEFAULT_RUNS)."""
    unknown = [t for t in targets if t not in TARGETS]
    if unknown:
        raise ValueError(f"unknown fuzz target(s) {unknown}; choose from {', '.join(TARGETS)}")
    if engine not in ("auto", "atheris", "random"):
        raise ValueError(f"engine must be auto, atheris or random, got {engine!r}")
    if engine == "atheris":
        ok, why = atheris_available()
        if not ok:
            raise RuntimeError(f"--engine atheris, but atheris does not import: {why}")
    use_atheris = engine == "atheris" or (engine == "auto" and atheris_available()[0])
    per = {t: runs if runs is not None else DEFAULT_RUNS[t] for t in targets}
    if any(n < 1 for n in per.values()):
        raise ValueError("--runs must be at least 1")
    results = []
    for target in [t for t in TARGETS if t in targets and t in PURE]:
        fn = run_pure_atheris if use_atheris else run_pure_random
        results.append(fn(target, per[target], seed, progress))
    net = [t for t in TARGETS if t in targets and t in NETWORK]
    if net:
        results += asyncio.run(run_network(net, per, seed, concurrency, timeout, progress))
    return results


def format_table(results: list[FuzzResult]) -> str:
    head = (
        f"{'target':12s} {'engine':8s} {'tried':>8s} {'ok':>7s} {'clear':>8s} {'crashes':>7s} {'unansw.':>7s} "
        f"{'wall s':>8s} {'in/s':>8s}"
    )
    lines = [head, "-" * len(head)]
    for r in results:
        d = r.as_dict()
        lines.append(
            f"{r.target:12s} {r.engine:8s} {r.tried:8d} {r.ok:7d} {r.clear:8d} {r.crashes:7d} "
            f"{r.unanswered:7d} {r.wall_s:8.1f} {d['inputs_per_s']:8.1f}"
        )
    for r in results:
        top = sorted(r.codes.items(), key=lambda kv: -kv[1])[:8]
        if top:
            lines.append(f"{r.target}: clear errors by code: " + ", ".join(f"{k} {v}" for k, v in top))
        top = sorted(r.oks.items(), key=lambda kv: -kv[1])[:6]
        if top and r.target in NETWORK:
            lines.append(f"{r.target}: ok: " + ", ".join(f"{k} {v}" for k, v in top))
        if r.check:
            lines.append(f"{r.target}: after the run: {r.check}")
        for s in r.samples:
            lines.append(f"{r.target}: CRASH on {s['len']}-byte input {s['input'][:160]}...: {s['error']}")
    return "\n".join(lines)
