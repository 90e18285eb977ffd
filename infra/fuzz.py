"""`ddm-fleet fuzz`: throw hostile inputs at the decoders, a worker, the coordinator and the web socket.

Targets (inputs come from `schemas.fuzzing`):

    codec        msgpack bytes -> schemas.loads -> decode_tensor                 (pure, in-process)
    messages     byte 0 picks a message type or union, the rest -> schemas.unpack (pure, in-process)
    worker       raw and mutated StepRequests (and other messages) over NATS to a real ExpertWorker
    coordinator  raw and mutated bytes on jobs.submit, jobs.<id>.cancel, jobs.<id>.status, fleet.status
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

A cancel / job-status request whose subject token is not a job id (`ddm.v1.jobs.<65 chars>.cancel`,
`bad%token`, non-ASCII) must get an `error` reply with `bad_request` (counted as the clear error
`not_a_job_id`); any other answer, or none in time, is a crash. A status reply must be a
`job_status` for the job asked about.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

TARGETS = ("codec", "messages", "worker", "coordinator", "websocket")
PURE = ("codec", "messages")
NETWORK = ("worker", "coordinator", "websocket")
#: Inputs per target when --runs is not given.
DEFAULT_RUNS = {"codec": 20_000, "messages": 20_000, "worker": 2_000, "coordinator": 2_000, "websocket": 2_000}
MAX_SAMPLES = 8  # crash examples kept per target

log = logging.getLogger(__name__)


@dataclasses.dataclass
class FuzzResult:
    target: str
    engine: str
    runs: int
    tried: int = 0
    ok: int = 0
    clear: int = 0
    crashes: int = 0
    unanswered: int = 0
    wall_s: float = 0.0
    check: str = ""  # the after-run liveness check (network targets)
    codes: dict = dataclasses.field(default_factory=dict)  # clear: error code -> count
    oks: dict = dataclasses.field(default_factory=dict)  # ok: what was served -> count
    samples: list = dataclasses.field(default_factory=list)  # first crashes: {"input", "len", "error"}

    def crash(self, data: Any, error: str) -> None:
        self.crashes += 1
        if len(self.samples) < MAX_SAMPLES:
            raw = data if isinstance(data, (bytes, bytearray)) else str(data).encode("utf-8", "replace")
            self.samples.append({"input": bytes(raw[:512]).hex(), "len": len(raw), "error": error[:2000]})

    def count(self, kind: str, detail: str = "") -> None:
        if kind == "ok":
            self.ok += 1
            self.oks[detail or "ok"] = self.oks.get(detail or "ok", 0) + 1
        elif kind == "clear":
            self.clear += 1
            self.codes[detail] = self.codes.get(detail, 0) + 1
        elif kind == "unanswered":
            self.unanswered += 1
        else:
            raise ValueError(kind)

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["inputs_per_s"] = round(self.tried / self.wall_s, 1) if self.wall_s else 0.0
        return d


def _progress(total: int, desc: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=f"fuzz {desc}", unit="in", file=sys.stderr, disable=not enabled,
                dynamic_ncols=True, mininterval=0.5)


def atheris_available() -> tuple[bool, str]:
    try:
        import atheris  # noqa: F401
    except Exception as err:  # ImportError, or a broken native build
        return False, f"{type(err).__name__}: {err}"
    return True, ""


# ---------------------------------------------------------------- pure targets


def run_pure_random(target: str, runs: int, seed: int, progress: bool = False) -> FuzzResult:
    import traceback

    from schemas.fuzzing import PURE_TARGETS, pure_inputs

    one = PURE_TARGETS[target]
    gen = pure_inputs(target, random.Random(f"{target}:{seed}"))
    res = FuzzResult(target, "random", runs)
    start = time.perf_counter()
    with _progress(runs, target, progress) as bar:
        for _ in range(runs):
            data = gen()
            res.tried += 1
            try:
                res.count(*one(data))
            except Exception as err:
                res.crash(data, f"{type(err).__name__}: {err}\n{traceback.format_exc(limit=-4)}")
            bar.update(1)
    res.wall_s = time.perf_counter() - start
    return res


def run_pure_atheris(target: str, runs: int, seed: int, progress: bool = False, timeout_s: float = 3600) -> FuzzResult:
    """Run atheris in a child (libFuzzer exits the process when done) and read its counts."""
    res = FuzzResult(target, "atheris", runs)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f"ddm-fuzz-{target}-") as tmp:
        stats = Path(tmp) / "stats.json"
        artifacts = Path(tmp) / "artifacts"
        artifacts.mkdir()
        logfile = Path(tmp) / "libfuzzer.log"
        cmd = [sys.executable, "-m", "infra.fuzz", "atheris-child", target, str(runs), str(seed), str(stats),
               str(Path(tmp) / "corpus"), str(artifacts)]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                                             os.environ.get("PYTHONPATH", "")])}
        with open(logfile, "wb") as out, _progress(runs, f"{target} (atheris)", progress) as bar:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
            seen = 0
            while proc.poll() is None:
                if time.perf_counter() - start > timeout_s:
                    proc.kill()
                    proc.wait()
                    break
                time.sleep(0.2)
                now = _read_stats(stats).get("tried", seen)
                bar.update(now - seen)
                seen = now
            final = _read_stats(stats)
            bar.update(final.get("tried", seen) - seen)
        for key in ("tried", "ok", "clear", "crashes"):
            setattr(res, key, int(final.get(key, 0)))
        res.codes = final.get("codes", {})
        res.oks = final.get("oks", {})
        res.samples = final.get("samples", [])
        if proc.returncode != 0 or res.tried < runs:
            tail = logfile.read_bytes()[-3000:].decode("utf-8", "replace")
            found = sorted(p.name for p in artifacts.iterdir())
            crash_input = (artifacts / found[0]).read_bytes() if found else b""
            res.crash(crash_input, f"atheris child exited with {proc.returncode} after {res.tried} of {runs} inputs "
                                   f"(process death, hang or out of memory); libFuzzer log tail:\n{tail}")
    res.wall_s = time.perf_counter() - start
    return res


def _read_stats(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _atheris_child(target: str, runs: int, seed: int, stats_path: str, corpus_dir: str, artifacts: str) -> None:
    """Entry point of the atheris child. Never returns (libFuzzer exits the process)."""
    import traceback

    import atheris

    with atheris.instrument_imports(include=["schemas"]):
        from schemas import fuzzing

    one = fuzzing.PURE_TARGETS[target]
    corpus = Path(corpus_dir)
    corpus.mkdir(parents=True, exist_ok=True)
    for i, data in enumerate(fuzzing.corpus(target)):
        (corpus / f"seed-{i:03d}").write_bytes(data)
    res = FuzzResult(target, "atheris", runs)

    def write() -> None:
        tmp = Path(stats_path + ".tmp")
        tmp.write_text(json.dumps(res.as_dict()))
        os.replace(tmp, stats_path)

    def test_one_input(data: bytes) -> None:
        if res.tried >= runs:  # libFuzzer runs the whole seed corpus even when -runs is smaller
            return
        res.tried += 1
        try:
            res.count(*one(data))
        except Exception as err:
            res.crash(data, f"{type(err).__name__}: {err}\n{traceback.format_exc(limit=-4)}")
        if res.tried == runs or res.tried % 250 == 0:
            write()

    write()
    atheris.Setup([sys.argv[0], f"-runs={runs}", f"-seed={seed % (2**31 - 2) + 1}", "-max_len=16384",
                   "-timeout=30", "-rss_limit_mb=4096", f"-artifact_prefix={artifacts}/", "-print_final_stats=1",
                   str(corpus)], test_one_input)
    atheris.Fuzz()


# ---------------------------------------------------------------- the private fleet


class _ErrorLog(logging.Handler):
    """Collects ERROR records from every logger while a network target runs."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        text = f"{record.name}: {record.getMessage()}"
        if record.exc_info:
            import traceback

            text += "\n" + "".join(traceback.format_exception(*record.exc_info))[-1500:]
        self.records.append(text)


class Fleet:
    """nats-server + 2 tiny experts + coordinator + web app, in this process."""

    NUM_EXPERTS = 2

    def __init__(self, workdir: str):
        self.workdir = Path(workdir)
        self.server = None
        self.workers: list = []
        self.coordinator = None
        self.web_runner = None
        self.web_url = ""
        self.nc = None

    @property
    def url(self) -> str:
        return self.server.url

    async def __aenter__(self) -> "Fleet":
        try:
            await self._start()
        except BaseException:
            await self.__aexit__(None, None, None)
            raise
        return self

    async def _start(self) -> None:
        import nats

        from coordinator.router import Router, RouterConfig, RouterNet
        from coordinator.service import Coordinator
        from infra.nats_server import NatsServer, free_port
        from workers.service import ExpertWorker

        self.server = NatsServer(extra_config="max_payload: 16MB")
        await asyncio.to_thread(self.server.start)
        ckpts = await asyncio.to_thread(self._checkpoints)
        for k, ckpt in enumerate(ckpts):
            w = ExpertWorker(k, ckpt, "torch", nats_url=self.url, buckets=(1, 2, 4, 8), max_queue_rows=2048,
                             worker_id=f"fuzz-e{k}")
            await w.start()
            self.workers.append(w)
        import torch

        torch.manual_seed(5)
        router = Router(RouterNet(cfg=RouterConfig(num_experts=self.NUM_EXPERTS, width=8, emb_dim=16)))
        self.coordinator = Coordinator(router, num_experts=self.NUM_EXPERTS, class_to_expert=[0] * 5 + [1] * 5,
                                       nats_url=self.url, max_rows=32, max_queued_jobs=16, step_timeout=5.0,
                                       retries=1, name="fuzz-coordinator")
        await self.coordinator.__aenter__()
        from aiohttp import web

        from web.app import WebConfig, create_app

        app = create_app(WebConfig(nats_url=self.url, fleet_interval=1.0, discovery_window=0.2, submit_timeout=5.0))
        self.web_runner = web.AppRunner(app, handle_signals=False)
        await self.web_runner.setup()
        port = free_port()
        await web.TCPSite(self.web_runner, "127.0.0.1", port).start()
        self.web_url = f"http://127.0.0.1:{port}"
        self.nc = await nats.connect(self.url, name="ddm-fuzz", max_reconnect_attempts=2)

    def _checkpoints(self) -> list[str]:
        import torch

        from workers.checkpoint import save_checkpoint, torch_state_to_numpy
        from workers.models.config import UNetConfig
        from workers.models.unet_torch import UNet

        cfg = UNetConfig(widths=(8, 16), time_dim=16, class_dim=16, groups=4)
        out = []
        for k in range(self.NUM_EXPERTS):
            torch.manual_seed(100 + k)
            state = torch_state_to_numpy(UNet(cfg).state_dict())
            out.append(str(save_checkpoint(self.workdir / f"fuzz-expert{k}", state, {"config": cfg, "expert_id": k})))
        return out

    async def __aexit__(self, *exc) -> None:
        if self.nc is not None and not self.nc.is_closed:
            try:
                await self.nc.drain()
            except Exception:
                await self.nc.close()
        if self.web_runner is not None:
            await self.web_runner.cleanup()
        if self.coordinator is not None:
            try:
                await self.coordinator.__aexit__(None, None, None)
            except Exception as err:
                log.warning("stopping the coordinator: %s", err)
        for w in self.workers:
            await w.stop()
        if self.server is not None:
            await asyncio.to_thread(self.server.stop)


async def _drive(runs: int, concurrency: int, make: Callable[[int], Any], probe: Callable[[Any], Any],
                 bar, res: FuzzResult) -> None:
    """Generate `runs` inputs in order; probe them with at most `concurrency` in flight. A probe
    that raises (the connection to the server died, ...) counts as a crash of that input."""
    sem = asyncio.Semaphore(concurrency)
    tasks: set[asyncio.Task] = set()

    async def one(item) -> None:
        try:
            await probe(item)
        except Exception as err:
            res.crash(item[-1], f"probe failed: {type(err).__name__}: {err}")
        finally:
            sem.release()
            bar.update(1)

    for i in range(runs):
        item = make(i)
        await sem.acquire()
        task = asyncio.create_task(one(item))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    if tasks:
        await asyncio.gather(*list(tasks))


def _local(data: bytes, tp) -> tuple[Any, Any]:
    """What the schema itself says of `data`: (message, None) or (None, ErrorCode)."""
    from schemas import ProtocolError, unpack

    try:
        return unpack(data, tp), None
    except ProtocolError as err:
        return None, err.code


# ---------------------------------------------------------------- worker


async def fuzz_worker(fleet: Fleet, runs: int, seed: int, concurrency: int, timeout: float, bar) -> FuzzResult:
    import nats.errors
    import numpy as np

    from schemas import ErrorCode, ErrorReply, ProtocolError, StepReply, StepRequest, StepResult, subjects, unpack
    from schemas.fuzzing import Mutator, message_seeds, step_request_variant

    rng = random.Random(f"worker:{seed}")
    seeds = message_seeds(image=(1, 32, 32), rows=(1, 2, 3))
    steps = [s for s in seeds if s["kind"] == "step_request"]
    mut = Mutator(rng, steps * 4 + seeds)
    res = FuzzResult("worker", "random", runs)
    unserved = 7
    # what the worker adds to the schema: model shape, row and label limits, deadline, queue, overflow
    allowed_for_valid = {ErrorCode.UNKNOWN_EXPERT, ErrorCode.BAD_SHAPE, ErrorCode.TOO_LARGE, ErrorCode.BAD_REQUEST,
                         ErrorCode.DEADLINE_EXCEEDED, ErrorCode.OVERLOADED, ErrorCode.NON_FINITE}

    def make(_i: int) -> tuple[int, bytes]:
        p = rng.random()
        expert = 0 if p < 0.9 else (1 if p < 0.95 else unserved)
        return expert, step_request_variant(rng) if rng.random() < 0.25 else mut.message_bytes()

    async def probe(item: tuple[int, bytes]) -> None:
        expert, data = item
        res.tried += 1
        local, local_code = _local(data, StepRequest)
        try:
            msg = await fleet.nc.request(subjects.expert_velocity(expert), data, timeout=timeout)
        except nats.errors.MaxPayloadError:
            return res.count("clear", "nats_max_payload") if len(data) > fleet.nc.max_payload else \
                res.crash(data, "MaxPayloadError under the server's max_payload")
        except nats.errors.NoRespondersError:
            if expert == unserved:
                return res.count("clear", "no_responders")
            return res.crash(data, f"no responders on expert {expert}'s subject: the worker is gone")
        except nats.errors.TimeoutError:
            return res.crash(data, f"no reply in {timeout} s")
        try:
            reply = unpack(msg.data, StepResult)
        except ProtocolError as err:
            return res.crash(data, f"undecodable reply: {err.code.value}: {err.message}")
        if isinstance(reply, ErrorReply):
            if reply.code is ErrorCode.INTERNAL:
                return res.crash(data, f"internal error reply: {reply.message}")
            if local_code is not None and reply.code is not local_code:
                return res.crash(data, f"worker answered {reply.code.value} ({reply.message}) where the schema "
                                       f"says {local_code.value}")
            if local_code is None and reply.code not in allowed_for_valid:
                return res.crash(data, f"valid request answered {reply.code.value}: {reply.message}")
            return res.count("clear", reply.code.value)
        assert isinstance(reply, StepReply)
        if local is None:
            return res.crash(data, f"worker served a request the schema refuses ({local_code.value})")
        if reply.velocity.shape != local.x_t.shape or reply.row_ids != local.row_ids or reply.expert != expert:
            return res.crash(data, f"dishonest reply: velocity {list(reply.velocity.shape)} for x_t "
                                   f"{list(local.x_t.shape)}, row_ids {reply.row_ids[:4]} for {local.row_ids[:4]}")
        return res.count("ok", "step_reply")

    await _drive(runs, concurrency, make, probe, bar, res)

    # after the run: a valid request gets the model's own velocity
    worker = fleet.workers[0]
    r = np.random.default_rng(seed)
    req = StepRequest(expert=0, x_t=r.standard_normal((3, 1, 32, 32)).astype(np.float32),
                      t=r.uniform(0, 1, 3).astype(np.float32), y=r.integers(0, 10, 3), row_ids=["a", "b", "c"])
    from schemas import pack

    try:
        msg = await fleet.nc.request(subjects.expert_velocity(0), pack(req), timeout=timeout)
        reply = unpack(msg.data, StepResult)
        want = await asyncio.to_thread(worker.backend.forward, np.array(req.x_t), np.array(req.t), np.array(req.y))
        if not isinstance(reply, StepReply) or not np.allclose(reply.velocity, want, atol=1e-5):
            raise AssertionError(f"wrong answer: {reply!r:.200}")
        res.check = "worker answers a valid request with the model's velocity"
    except Exception as err:
        res.check = f"FAILED: {type(err).__name__}: {err}"
        res.crash(b"", f"after the run the worker does not serve: {type(err).__name__}: {err}")
    return res


# ---------------------------------------------------------------- coordinator


async def fuzz_coordinator(fleet: Fleet, runs: int, seed: int, concurrency: int, timeout: float, bar) -> FuzzResult:
    import nats.errors

    from schemas import (
        CancelReply,
        CancelRequest,
        ErrorCode,
        ErrorReply,
        FleetStatus,
        JobAccepted,
        JobRejected,
        JobRequest,
        JobStatus,
        ProtocolError,
        SubmitReply,
        pack,
        subjects,
        unpack,
    )
    from schemas.fuzzing import Mutator, job_request_variant, message_seeds

    rng = random.Random(f"coordinator:{seed}")
    seeds = message_seeds()
    jobs = [s for s in seeds if s["kind"] in ("job_request", "cancel", "job_status")]
    mut = Mutator(rng, jobs * 4 + seeds)
    res = FuzzResult("coordinator", "random", runs)
    accepted: list[str] = []
    nc = fleet.nc
    allowed_for_valid = {ErrorCode.TOO_LARGE, ErrorCode.BAD_REQUEST, ErrorCode.OVERLOADED, ErrorCode.UNAVAILABLE}

    def job_token() -> str:
        p = rng.random()
        if p < 0.3 and accepted:
            return rng.choice(accepted)
        if p < 0.9:
            return rng.choice(["j1", "fuzz-job", "web0011223344556677", "x", "A_-9" * 16])
        return rng.choice(["x" * 65, "bad%token", "é", "a" * 200, "j1\u2028"])  # not a job id: a bad_request error

    def make(_i: int) -> tuple[str, str, bytes]:
        p = rng.random()
        if p < 0.6:
            return "submit", subjects.JOBS_SUBMIT, job_request_variant(rng) if rng.random() < 0.25 else \
                mut.message_bytes()
        token = job_token()
        body = b"" if rng.random() < 0.15 else mut.message_bytes()
        if p < 0.78:
            return "cancel", f"{subjects.PREFIX}.jobs.{token}.cancel", body
        if p < 0.93:
            return "job_status", f"{subjects.PREFIX}.jobs.{token}.status", body
        return "fleet_status", subjects.FLEET_STATUS, body

    async def probe(item: tuple[str, str, bytes]) -> None:
        what, subject, data = item
        res.tried += 1
        try:
            msg = await nc.request(subject, data, timeout=timeout)
        except nats.errors.MaxPayloadError:
            return res.count("clear", "nats_max_payload") if len(data) > nc.max_payload else \
                res.crash(data, "MaxPayloadError under the server's max_payload")
        except nats.errors.NoRespondersError:
            return res.crash(data, f"no responders on {subject}: the coordinator is gone")
        except nats.errors.TimeoutError:
            return res.crash(data, f"no reply on {subject} in {timeout} s")
        if what in ("cancel", "job_status") and subjects.parse_job_subject(subject) is None:
            try:  # not a job id: the documented answer is an error reply with bad_request
                err = unpack(msg.data, ErrorReply)
            except ProtocolError as e:
                return res.crash(data, f"{what} on {subject!r} (not a job id) answered with something other than "
                                       f"an error reply: {e.code.value}: {e.message}")
            if err.code is not ErrorCode.BAD_REQUEST or "job id" not in err.message:
                return res.crash(data, f"{what} on {subject!r} (not a job id) answered {err.code.value}: {err.message}")
            return res.count("clear", "not_a_job_id")
        try:
            if what == "submit":
                reply = unpack(msg.data, SubmitReply)
            elif what == "cancel":
                reply = unpack(msg.data, CancelReply)
            elif what == "job_status":
                reply = unpack(msg.data, JobStatus)
            else:
                reply = unpack(msg.data, FleetStatus)
        except ProtocolError as err:
            return res.crash(data, f"undecodable {what} reply: {err.code.value}: {err.message}")
        if what != "submit":
            if what == "job_status" and reply.job_id != subjects.parse_job_subject(subject):
                return res.crash(data, f"status request on {subject!r} answered for job {reply.job_id!r}")
            if what == "cancel" and not reply.cancelled:
                return res.count("clear", "cancel_refused")
            return res.count("ok", "cancelled" if what == "cancel" else what)
        local, local_code = _local(data, JobRequest)
        if isinstance(reply, JobAccepted):
            if local is None:
                return res.crash(data, f"coordinator accepted a job the schema refuses ({local_code.value})")
            accepted.append(reply.job_id)
            try:  # do not let accepted fuzz jobs pile up
                await nc.publish(subjects.job_cancel(reply.job_id), pack(CancelRequest(job_id=reply.job_id)))
            except Exception as err:
                log.warning("cancel publish failed: %s", err)
            return res.count("ok", "accepted")
        assert isinstance(reply, (JobRejected, ErrorReply))
        if reply.code is ErrorCode.INTERNAL:
            return res.crash(data, f"internal error: {getattr(reply, 'reason', None) or reply.message}")
        if local_code is not None and reply.code is not local_code:
            return res.crash(data, f"rejected with {reply.code.value} where the schema says {local_code.value}")
        if local_code is None and reply.code not in allowed_for_valid:
            return res.crash(data, f"valid job rejected with {reply.code.value}")
        return res.count("clear", reply.code.value)

    await _drive(runs, concurrency, make, probe, bar, res)

    # after the run: the engine is alive and a real job completes
    try:
        if fleet.coordinator._task is None or fleet.coordinator._task.done():
            raise AssertionError("the engine task has ended")
        done = await _real_job(nc, "fuzz-check-" + str(seed), timeout=60)
        msg = await nc.request(subjects.FLEET_STATUS, b"", timeout=timeout)
        unpack(msg.data, FleetStatus)
        res.check = f"a real job completes ({done}); fleet status answers"
    except Exception as err:
        res.check = f"FAILED: {type(err).__name__}: {err}"
        res.crash(b"", f"after the run the coordinator does not serve: {type(err).__name__}: {err}")
    return res


async def _real_job(nc, job_id: str, timeout: float) -> str:
    from schemas import DoneEvent, FailedEvent, JobAccepted, JobEvent, JobRequest, SubmitReply, pack, subjects, unpack

    events: asyncio.Queue = asyncio.Queue()
    sub = await nc.subscribe(subjects.job_events(job_id), cb=events.put)
    try:
        msg = await nc.request(subjects.JOBS_SUBMIT, pack(JobRequest(job_id=job_id, digits=[1, 6], steps=3)),
                               timeout=10)
        reply = unpack(msg.data, SubmitReply)
        if not isinstance(reply, JobAccepted):
            raise AssertionError(f"the job was not accepted: {reply!r:.300}")
        deadline = time.monotonic() + timeout
        while True:
            ev = unpack((await asyncio.wait_for(events.get(), max(0.1, deadline - time.monotonic()))).data, JobEvent)
            if isinstance(ev, DoneEvent):
                if ev.images.shape != (2, 1, 32, 32):
                    raise AssertionError(f"done with images {list(ev.images.shape)}")
                return f"2 images in {ev.elapsed_s:.2f} s"
            if isinstance(ev, FailedEvent):
                raise AssertionError(f"the job failed: {ev.code.value}: {ev.reason}")
    finally:
        await sub.unsubscribe()


# ---------------------------------------------------------------- websocket


async def fuzz_websocket(fleet: Fleet, runs: int, seed: int, concurrency: int, timeout: float, bar) -> FuzzResult:
    import aiohttp

    from schemas.fuzzing import Mutator
    from web.protocol import MAX_CLIENT_MESSAGE_BYTES

    rng = random.Random(f"websocket:{seed}")
    seeds = [
        {"type": "generate", "digits": "3,7,7", "steps": 4},
        {"type": "generate", "digits": [1, 2], "steps": 3, "ref": 5},
        {"type": "generate", "count": 2, "steps": 3, "strategy": "topk", "top_k": 2, "solver": "heun", "seed": "11",
         "frame_every": 2, "ref": "r"},
        {"type": "cancel", "job_id": "web0011223344556677", "ref": 1},
        {"type": "ping", "ref": "x"},
    ]
    mut = Mutator(rng, seeds, extra_keys=("type", "digits", "count", "steps", "strategy", "solver", "top_k", "seed",
                                          "frame_every", "ref", "job_id"))
    frames = [mut.websocket_frame(MAX_CLIENT_MESSAGE_BYTES) for _ in range(runs)]
    res = FuzzResult("websocket", "random", runs)
    lanes = max(1, min(concurrency, 4))

    async with aiohttp.ClientSession() as http:
        async def connect():
            ws = await http.ws_connect(fleet.web_url + "/ws", max_msg_size=0, heartbeat=None)
            hello = await ws.receive_json(timeout=timeout)
            if hello.get("type") != "hello":
                raise AssertionError(f"first message is not hello: {hello}")
            return ws

        async def lane(index: int, items: list[tuple[int, tuple[str, Any]]]) -> None:
            ws = await connect()
            try:
                for n, (kind, payload) in items:
                    res.tried += 1
                    try:
                        ws = await _ws_probe(ws, connect, res, f"{index}-{n}", kind, payload, timeout,
                                             MAX_CLIENT_MESSAGE_BYTES)
                    except Exception as err:  # e.g. the server no longer accepts sockets
                        res.crash(payload, f"probe failed: {type(err).__name__}: {err}")
                        await ws.close()
                        ws = await connect()
                    bar.update(1)
            finally:
                await ws.close()

        items = list(enumerate(frames))
        await asyncio.gather(*(lane(i, items[i::lanes]) for i in range(lanes)))

        # after the run: healthz, a fresh socket answers ping and runs a real job
        try:
            async with http.get(fleet.web_url + "/healthz") as resp:
                if resp.status != 200:
                    raise AssertionError(f"/healthz answered {resp.status}")
            ws = await connect()
            try:
                await ws.send_json({"type": "ping", "ref": "check"})
                await ws.send_json({"type": "generate", "digits": "3,8", "steps": 3, "ref": "check"})
                seen: list[str] = []
                deadline = time.monotonic() + 60
                while "done" not in seen:
                    msg = await ws.receive_json(timeout=max(0.1, deadline - time.monotonic()))
                    seen.append(msg["type"])
                    if msg["type"] in ("error", "failed", "rejected"):
                        raise AssertionError(f"the check job got {msg}")
                if "pong" not in seen or "accepted" not in seen:
                    raise AssertionError(f"messages seen: {seen}")
            finally:
                await ws.close()
            res.check = "web app: healthz, ping and a real job on a fresh socket"
        except Exception as err:
            res.check = f"FAILED: {type(err).__name__}: {err}"
            res.crash(b"", f"after the run the web app does not serve: {type(err).__name__}: {err}")
    return res


async def _ws_probe(ws, connect, res: FuzzResult, tag: str, kind: str, payload: Any, timeout: float,
                    max_text: int):
    """Send one frame and a ping barrier; classify what comes back before the pong. Returns the
    socket to use next (a new one when the server closed this one)."""
    from aiohttp import WSMsgType

    barrier = f"fz-{tag}"
    oversize = kind == "text" and len(payload.encode("utf-8")) > max_text
    try:
        if kind == "binary":
            await ws.send_bytes(payload)
        else:
            await ws.send_str(payload)
        if not oversize:
            await ws.send_json({"type": "ping", "ref": barrier})
    except (ConnectionError, RuntimeError) as err:
        res.crash(payload, f"socket unusable before the pong: {type(err).__name__}: {err}")
        return await connect()
    errors: list[dict] = []
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        try:
            msg = await ws.receive(timeout=max(0.05, deadline - loop.time()))
        except asyncio.TimeoutError:
            res.crash(payload, f"no pong within {timeout} s")
            await ws.close()
            return await connect()
        if msg.type in (WSMsgType.CLOSE, WSMsgType.CLOSING, WSMsgType.CLOSED, WSMsgType.ERROR):
            code = ws.close_code
            if oversize:  # documented: a frame over the limit closes the socket (1009; 1006 when the
                # server hangs up while the client is still writing the frame)
                res.count("clear", f"ws_close_{code}")
            else:
                res.crash(payload, f"server closed the socket: {msg.type.name} code {code} {msg.extra!r}")
            return await connect()
        if msg.type != WSMsgType.TEXT:
            res.crash(payload, f"server sent a {msg.type.name} frame")
            continue
        try:
            out = json.loads(msg.data)
        except ValueError:
            res.crash(payload, f"server sent non-JSON: {msg.data[:200]!r}")
            continue
        typ = out.get("type")
        if typ == "pong" and out.get("ref") == barrier:
            break
        if typ == "error":
            if out.get("code") == "internal" or not out.get("message"):
                res.crash(payload, f"error message: {out}")
                return ws
            errors.append(out)
        elif typ == "accepted":  # a fuzzed job got through: stop it
            await ws.send_json({"type": "cancel", "job_id": out["job_id"]})
        elif typ in ("rejected", "failed") and out.get("code") == "internal":
            res.crash(payload, f"{typ} with code internal: {out}")
            return ws
    if errors:
        res.count("clear", str(errors[0].get("code")))
    else:
        res.count("ok", "answered" if kind == "text" else "binary")
    return ws


# ---------------------------------------------------------------- orchestration


NETWORK_FUZZERS = {"worker": fuzz_worker, "coordinator": fuzz_coordinator, "websocket": fuzz_websocket}


async def run_network(targets: list[str], runs: dict[str, int], seed: int, concurrency: int, timeout: float,
                      progress: bool) -> list[FuzzResult]:
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
                    with _progress(runs[target], target, progress) as bar:
                        res = await NETWORK_FUZZERS[target](fleet, runs[target], seed, concurrency, timeout, bar)
                    await asyncio.sleep(0.5)  # late errors of the last inputs
                finally:
                    root.removeHandler(handler)
                for text in handler.records:
                    res.crash(b"", f"logged: {text}")
                res.wall_s = time.perf_counter() - start
                results.append(res)
    return results


def run(targets: list[str], *, runs: int | None = None, seed: int = 0, engine: str = "auto",
        concurrency: int = 8, timeout: float = 10.0, progress: bool = False) -> list[FuzzResult]:
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
    head = f"{'target':12s} {'engine':8s} {'tried':>8s} {'ok':>7s} {'clear':>8s} {'crashes':>7s} {'unansw.':>7s} " \
           f"{'wall s':>8s} {'in/s':>8s}"
    lines = [head, "-" * len(head)]
    for r in results:
        d = r.as_dict()
        lines.append(f"{r.target:12s} {r.engine:8s} {r.tried:8d} {r.ok:7d} {r.clear:8d} {r.crashes:7d} "
                     f"{r.unanswered:7d} {r.wall_s:8.1f} {d['inputs_per_s']:8.1f}")
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


if __name__ == "__main__":  # the atheris child: python -m infra.fuzz atheris-child TARGET RUNS SEED STATS CORPUS ARTIFACTS
    if len(sys.argv) == 8 and sys.argv[1] == "atheris-child":
        _atheris_child(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], sys.argv[6], sys.argv[7])
    sys.exit("usage: python -m infra.fuzz atheris-child TARGET RUNS SEED STATS CORPUS ARTIFACTS")
