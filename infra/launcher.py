"""A small process supervisor (what `ddm-fleet up` runs the local fleet with).

    sup = Supervisor([[nats_spec], [worker0, worker1, coordinator, web]], log_dir="out/up")
    code = asyncio.run(sup.run())        # start, watch, stop on SIGINT/SIGTERM -> exit code

* Children start stage by stage: every child of a stage is spawned, then the supervisor waits until
  each answers its readiness probe (an async callable) before the next stage starts.
* Each child writes stdout+stderr to `<log_dir>/<name>.log` (appended across restarts).
* A child that exits on its own is reported (exit code, last lines of its log) and restarted with
  exponential backoff. After `max_crashes` exits within `crash_window` seconds the supervisor gives
  up on it: a critical child (the bus, the coordinator, the web server) then stops the whole fleet
  (exit 1); a non-critical one (a worker) is left down and the rest keeps running.
* SIGINT / SIGTERM: children get SIGTERM one at a time in reverse start order (neighbours sharing a
  `stop_group`, e.g. all workers, together), SIGKILL after `stop_timeout` seconds; run() returns 0.
  A second signal SIGKILLs every child at once.
* Children run in their own session (a terminal's Ctrl-C reaches only the supervisor, which stops
  them in order) and, on Linux, get SIGTERM if the supervisor itself dies (PR_SET_PDEATHSIG).

No heavy imports: probes bring their own clients.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

Probe = Callable[["Child"], Awaitable[bool]]

#: Log lines shown for a child killed because it did not stop (enough for the stacks it wrote).
KILLED_LOG_LINES = 80


@dataclass
class ChildSpec:
    """One supervised process. `role`, `backend` and `where` only feed the status table."""

    name: str
    argv: list[str]
    role: str
    backend: str = "-"
    where: str = "-"
    probe: Probe | None = None  # True once ready; None = ready when spawned
    critical: bool = True
    env: dict[str, str] | None = None
    stop_group: str | None = None  # neighbours in start order with the same group are stopped together

    def __post_init__(self) -> None:
        if not self.name or any(c in self.name for c in "/\\ "):
            raise ValueError(f"child name {self.name!r} must be non-empty without spaces or slashes")
        if not self.argv:
            raise ValueError(f"child {self.name}: empty command")


@dataclass
class RestartPolicy:
    """Backoff before restart k (1-based) is min(backoff_max, backoff * 2**(k-1)), k counting
    crashes inside the window; `max_crashes` crashes inside `crash_window` s means give up."""

    backoff: float = 1.0
    backoff_max: float = 15.0
    max_crashes: int = 4
    crash_window: float = 60.0

    def __post_init__(self) -> None:
        if self.backoff < 0 or self.backoff_max < self.backoff or self.max_crashes < 1 or self.crash_window <= 0:
            raise ValueError("need 0 <= backoff <= backoff_max, max_crashes >= 1, crash_window > 0")

    def delay(self, recent_crashes: int) -> float:
        return min(self.backoff_max, self.backoff * 2 ** max(recent_crashes - 1, 0))


class StartupError(RuntimeError):
    """A child exited or did not become ready while the fleet was starting."""


@dataclass
class Child:
    spec: ChildSpec
    log_path: Path
    proc: asyncio.subprocess.Process | None = None
    log_offset: int = 0  # size of the log when the current process started
    started_at: float = 0.0
    restarts: int = 0
    crashes: deque = field(default_factory=deque)
    gave_up: bool = False
    ready: bool = False

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    def log_since_start(self) -> str:
        """What the current process has written so far."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self.log_offset)
                return f.read().decode("utf-8", "replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = 15) -> list[str]:
        return self.log_since_start().splitlines()[-lines:]


def _child_preexec() -> None:  # runs in the child between fork and exec
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        except OSError:
            pass


class Supervisor:
    def __init__(
        self,
        stages: Sequence[Sequence[ChildSpec]],
        log_dir: str | os.PathLike,
        *,
        ready_timeout: float = 300.0,
        stop_timeout: float = 10.0,
        policy: RestartPolicy | None = None,
        probe_interval: float = 0.25,
        progress_every: float = 30.0,
        out: Callable[[str], None] | None = None,
        on_ready: Callable[[Supervisor], None] | None = None,
        on_stopping: Callable[[], Awaitable[None]] | None = None,
    ):
        specs = [s for stage in stages for s in stage]
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"child names must be unique: {names}")
        if ready_timeout <= 0 or stop_timeout <= 0:
            raise ValueError("ready_timeout and stop_timeout must be > 0")
        self.stages = [list(stage) for stage in stages if stage]
        self.log_dir = Path(log_dir)
        self.ready_timeout = ready_timeout
        self.stop_timeout = stop_timeout
        self.policy = policy or RestartPolicy()
        self.probe_interval = probe_interval
        self.progress_every = progress_every
        self.out = out or (lambda line: print(line, flush=True))
        self.on_ready = on_ready
        self.on_stopping = on_stopping  # awaited once before the first child is stopped
        self.children: list[Child] = []  # in start order
        self._stop = asyncio.Event()
        self._stopping = False
        self._watchers: list[asyncio.Task] = []
        self._failure: str | None = None  # why the fleet stops on its own (exit 1)

    # ------------------------------------------------------------------ public

    async def run(self, *, handle_signals: bool = True) -> int:
        """Start every stage, supervise until a signal (or a fatal failure), stop. Returns the exit
        code: 0 after a requested stop, 1 if startup failed or a critical child was given up on."""
        loop = asyncio.get_running_loop()
        sigs = (signal.SIGINT, signal.SIGTERM) if handle_signals else ()
        for sig in sigs:
            loop.add_signal_handler(sig, self._on_signal, sig)
        try:
            try:
                await self._start_all()
            except StartupError as err:
                self._failure = str(err)
                self.out(f"startup failed: {err}")
            else:
                if self.on_ready is not None and not self._stop.is_set():
                    self.on_ready(self)
                await self._stop.wait()
            await self.stop()
        finally:
            for sig in sigs:
                loop.remove_signal_handler(sig)
        if self._failure:
            self.out(f"fleet stopped after a failure: {self._failure.splitlines()[0].rstrip(':')}")
            return 1
        self.out("fleet stopped: every process exited")
        return 0

    def request_stop(self) -> None:
        self._stop.set()

    async def stop(self) -> None:
        """Stop children in reverse start order: SIGTERM, then SIGKILL after stop_timeout."""
        if not self._stopping and self.on_stopping is not None:
            try:
                await self.on_stopping()
            except Exception as err:
                self.out(f"on_stopping hook failed: {type(err).__name__}: {err}")
        self._stopping = True
        self._stop.set()
        groups: list[list[Child]] = []
        for child in reversed(self.children):
            if groups and child.spec.stop_group and groups[-1][0].spec.stop_group == child.spec.stop_group:
                groups[-1].append(child)
            else:
                groups.append([child])
        for group in groups:
            await asyncio.gather(*(self._terminate(c) for c in group))
        for task in self._watchers:
            task.cancel()
        await asyncio.gather(*self._watchers, return_exceptions=True)
        self._watchers.clear()

    def table(self) -> list[str]:
        """The status table: process, pid, role, backend, URL/subject."""
        rows = [("PROCESS", "PID", "ROLE", "BACKEND", "URL / SUBJECT")]
        for c in self.children:
            pid = str(c.pid) if c.running else ("gave up" if c.gave_up else "down")
            rows.append((c.name, pid, c.spec.role, c.spec.backend, c.spec.where))
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        return ["  ".join(r[i].ljust(widths[i]) for i in range(4)) + "  " + r[4] for r in rows]

    # ------------------------------------------------------------------ internals

    def _on_signal(self, sig: int) -> None:
        if self._stop.is_set():  # a second Ctrl-C: no more waiting
            self.out(f"{signal.Signals(sig).name} again: killing every child now")
            for child in self.children:
                if child.running:
                    _signal_group(child.pid, signal.SIGKILL)
            return
        self.out(
            f"{signal.Signals(sig).name}: stopping the fleet (reverse order; SIGKILL after {self.stop_timeout:g} s)"
        )
        self._stop.set()

    async def _start_all(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for stage in self.stages:
            batch = []
            for spec in stage:
                child = Child(spec, self.log_dir / f"{spec.name}.log")
                child.log_path.write_bytes(b"")  # a fresh log per `up`
                self.children.append(child)
                await self._spawn(child)
                batch.append(child)
            waits = [asyncio.create_task(self._wait_ready(c)) for c in batch]
            stop = asyncio.create_task(self._stop.wait())
            try:
                pending = set(waits)
                while pending:
                    done, pending = await asyncio.wait(pending | {stop}, return_when=asyncio.FIRST_COMPLETED)
                    if stop in done:
                        return
                    pending.discard(stop)
                    for t in done:
                        t.result()  # raises StartupError
            finally:
                for t in waits + [stop]:
                    t.cancel()
                await asyncio.gather(*waits, stop, return_exceptions=True)
            for c in batch:  # watch for crashes only once started
                self._watchers.append(asyncio.create_task(self._watch(c), name=f"watch-{c.name}"))

    async def _spawn(self, child: Child) -> None:
        child.ready = False
        with open(child.log_path, "ab") as log:
            child.log_offset = log.tell()
            stamp = time.strftime("%Y-%m-%d %H:%M:%S")
            log.write(f"=== {stamp} ddm-fleet up: starting {child.name}: {' '.join(child.spec.argv)}\n".encode())
            log.flush()
            child.log_offset = log.tell()
            env = {**os.environ, "PYTHONUNBUFFERED": "1", **(child.spec.env or {})}
            try:
                child.proc = await asyncio.create_subprocess_exec(
                    *child.spec.argv,
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=log,
                    stderr=asyncio.subprocess.STDOUT,
                    env=env,
                    start_new_session=True,
                    preexec_fn=_child_preexec,
                )
            except OSError as err:
                raise StartupError(f"cannot start {child.name} ({child.spec.argv[0]}): {err}") from None
        child.started_at = time.monotonic()

    async def _wait_ready(self, child: Child) -> None:
        """Poll the probe until True. StartupError if the child exits or the timeout passes."""
        start = time.monotonic()
        deadline = start + self.ready_timeout
        next_note = start + self.progress_every
        while True:
            if time.monotonic() > next_note:  # say what a slow start (jax warm-up) is doing
                last = (child.log_tail(1) or ["(no output yet)"])[0].strip()
                self.out(
                    f"still waiting for {child.name} (pid {child.pid}, {time.monotonic() - start:.0f} s): {last[:160]}"
                )
                next_note += self.progress_every
            if child.proc.returncode is not None:
                raise StartupError(self._exit_report(child, "before it was ready"))
            ok = True
            if child.spec.probe is not None:
                try:
                    ok = await child.spec.probe(child)
                except Exception:
                    ok = False
            if ok and child.proc.returncode is None:
                child.ready = True
                return
            if time.monotonic() > deadline:
                raise StartupError(
                    f"{child.name} (pid {child.pid}) was not ready after {self.ready_timeout:g} s; "
                    + _log_and_tail(child, empty=" (no output yet)")
                )
            try:
                await asyncio.wait_for(child.proc.wait(), self.probe_interval)
            except TimeoutError:
                pass

    def _exit_report(self, child: Child, when: str) -> str:
        rc = child.proc.returncode
        how = f"killed by {signal.Signals(-rc).name}" if rc < 0 and -rc in signal.valid_signals() else f"exit code {rc}"
        return f"{child.name} (pid {child.pid}) exited {when}: {how}; " + _log_and_tail(child)

    async def _watch(self, child: Child) -> None:
        """Restart `child` whenever it exits on its own, until stop or give-up."""
        while True:
            await child.proc.wait()
            if self._stopping:
                return
            now = time.monotonic()
            child.crashes.append(now)
            while child.crashes and now - child.crashes[0] > self.policy.crash_window:
                child.crashes.popleft()
            self.out("CRASH " + self._exit_report(child, f"after {now - child.started_at:.1f} s"))
            if len(child.crashes) >= self.policy.max_crashes:
                child.gave_up = True
                msg = (
                    f"giving up on {child.name}: {len(child.crashes)} crashes within "
                    f"{self.policy.crash_window:g} s; see {child.log_path}"
                )
                self.out(msg)
                if child.spec.critical:
                    self._failure = msg
                    self._stop.set()
                else:
                    self.out(f"the rest of the fleet keeps running without {child.name}")
                return
            delay = self.policy.delay(len(child.crashes))
            self.out(
                f"restarting {child.name} in {delay:g} s (crash {len(child.crashes)} of "
                f"{self.policy.max_crashes} allowed within {self.policy.crash_window:g} s)"
            )
            try:
                await asyncio.wait_for(self._stop.wait(), delay)
                return  # stop requested during the backoff
            except TimeoutError:
                pass
            child.restarts += 1
            try:
                await self._spawn(child)
                await self._wait_ready(child)
            except StartupError as err:
                if self._stopping:
                    return
                self.out(f"restart of {child.name} failed: {err}")
                if child.running:  # not ready in time: count it as a crash
                    await self._terminate(child)
                continue
            self.out(f"restarted {child.name}: pid {child.pid} ready (restart {child.restarts})")

    async def _terminate(self, child: Child) -> None:
        if not child.running:
            return
        pid = child.pid
        _signal_group(pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(child.proc.wait(), self.stop_timeout)
            self.out(f"stopped {child.name} (pid {pid}): exit code {child.proc.returncode}")
        except TimeoutError:
            _signal_group(pid, signal.SIGKILL)
            await child.proc.wait()
            self.out(  # with what it hung on, if it said (bus.exit_watch)
                f"killed {child.name} (pid {pid}): no exit {self.stop_timeout:g} s after SIGTERM; "
                + _log_and_tail(child, KILLED_LOG_LINES)
            )


def _signal_group(pid: int, sig: int) -> None:
    """Signal the child's process group (it leads its own session), else the child alone."""
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _log_and_tail(child: Child, lines: int = 15, empty: str = " (empty)") -> str:
    """ "log <path>:" and the last `lines` lines of what the child's current process wrote, indented
    (`empty` after the path when it wrote nothing)."""
    tail = child.log_tail(lines)
    return f"log {child.log_path}" + (":\n" + _indent(tail) if tail else empty)


def _indent(lines: Sequence[str]) -> str:
    return "\n".join("    | " + line for line in lines)
