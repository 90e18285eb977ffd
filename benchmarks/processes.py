"""The processes a fleet bench starts, and their memory.

`Child` runs one `ddm-fleet` subprocess and reads its stdout and stderr all the time (a full pipe
would block it mid-run), keeping the last lines for error messages, counting WARNING+ log lines,
and noticing the `ready ...` line the worker and coordinator print. `infra/launcher.py` supervises
long-lived fleets (log files, restarts); this is the bench's short-lived, pipe-reading kind.
`proc_memory` / `reset_peak` read and reset a process's RSS and peak RSS from /proc (Linux);
`cpu_seconds` reads the CPU time it has used; `box_cpu` / `idle_share` how much of the machine stayed idle.
`run_bench` is the command body of the benches that start such processes (`bench fleet`, `bench scale`).
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from typing import Any


def run_bench(
    name: str,
    args,
    check_args: Callable[[Any], None],
    bench: Callable[[Any], Awaitable[dict]],
    format_table: Callable[[dict], str],
) -> int:
    """Check `args` (ValueError: exit 2), run `bench(args)` with SIGTERM unwinding like Ctrl-C (so its
    child processes and nats-server are stopped; exit 130), print the results as a table or `--json`.
    A ValueError, OSError, RuntimeError or TimeoutError from the bench is one line on stderr, exit 1."""
    import asyncio
    import json
    import sys

    try:
        check_args(args)
    except ValueError as err:
        print(f"ddm-fleet bench {name}: {err}", file=sys.stderr)
        return 2

    async def main():
        import signal

        task = asyncio.current_task()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
        return await bench(args)

    try:
        results = asyncio.run(main())
    except (asyncio.CancelledError, KeyboardInterrupt):
        print(f"ddm-fleet bench {name}: stopped", file=sys.stderr)
        return 130
    except (ValueError, OSError, RuntimeError, TimeoutError) as err:
        print(f"ddm-fleet bench {name}: {type(err).__name__}: {err}", file=sys.stderr)
        return 1
    print(json.dumps(results, indent=2) if args.json else format_table(results))
    return 0


def proc_memory(pid: int) -> dict | None:
    """{"rss": bytes, "peak": bytes} of a live process from /proc/<pid>/status (VmRSS, VmHWM); None if gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            text = f.read()
    except OSError:
        return None
    out = {}
    for line in text.splitlines():
        key, _, val = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out["rss" if key == "VmRSS" else "peak"] = int(val.split()[0]) * 1024
    return out if len(out) == 2 else None


def _stat_fields(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name (field 3, the state, first); None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()
    except OSError:
        return None


def cpu_seconds(pid: int) -> float | None:
    """utime + stime of a live process in seconds, from /proc/<pid>/stat; None if gone."""
    fields = _stat_fields(pid)
    return None if fields is None else (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def page_faults(pid: int) -> int | None:
    """Minor page faults of a live process so far, from /proc/<pid>/stat; None if gone."""
    fields = _stat_fields(pid)
    try:
        return None if fields is None else int(fields[7])
    except (IndexError, ValueError):
        return None


def box_cpu() -> tuple[int, int] | None:
    """(idle, total) clock ticks of the whole machine since boot from /proc/stat's first line (idle
    counts idle + iowait; steal and guest are left out of both); None where there is no /proc/stat.
    Two readings give the share of the CPUs that stayed idle between them (`idle_share`)."""
    try:
        with open("/proc/stat") as f:
            first = f.readline().split()
    except OSError:
        return None
    if not first or first[0] != "cpu" or len(first) < 6:
        return None
    ticks = [int(v) for v in first[1:8]]  # user nice system idle iowait irq softirq
    return ticks[3] + ticks[4], sum(ticks)


def idle_share(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float | None:
    """The share of the machine's CPUs (0 - 1) that were idle between two `box_cpu` readings."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1])


def reset_peak(pid: int) -> bool:
    """Reset the process's VmHWM to its current RSS (Linux >= 4.0, own processes). False if refused."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class Child:
    """A `ddm-fleet` subprocess whose stdout and stderr are read all the time (a full pipe would
    block it mid-run); the last lines are kept for error messages."""

    def __init__(self, name: str, proc):
        import asyncio
        from collections import deque

        self.name = name
        self.proc = proc
        self.tail: deque[str] = deque(maxlen=40)
        self.warnings = 0  # log lines at WARNING or above
        self.last_warning = ""
        self.ready = asyncio.Event()
        self._readers = [
            asyncio.create_task(self._read(proc.stdout, True)),
            asyncio.create_task(self._read(proc.stderr, False)),
        ]

    @classmethod
    async def start(cls, name: str, cmd: list[str], env: dict | None = None) -> Child:
        import asyncio

        proc = await asyncio.create_subprocess_exec(
            *cmd, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env
        )
        return cls(name, proc)

    async def _read(self, stream, is_stdout: bool) -> None:
        partial = b""
        while True:
            chunk = await stream.read(65536)
            if not chunk:
                if partial:
                    self.tail.append(partial.decode(errors="replace"))
                return
            lines = (partial + chunk).split(b"\n")
            partial = lines.pop()[-4096:]
            for line in lines:
                text = line.decode(errors="replace").rstrip()
                self.tail.append(text[:2000])
                if any(f" {lvl} " in text for lvl in ("WARNING", "ERROR", "CRITICAL")):
                    self.warnings += 1
                    self.last_warning = text[:300]
                if is_stdout and text.startswith("ready"):
                    self.ready.set()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.returncode is None

    def last_lines(self) -> str:
        return "\n".join(self.tail)

    async def wait_ready(self, timeout: float) -> None:
        import asyncio

        ready = asyncio.create_task(self.ready.wait())
        exited = asyncio.create_task(self.proc.wait())
        try:
            await asyncio.wait({ready, exited}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            ready.cancel()
            exited.cancel()
        if self.ready.is_set():
            return
        if self.proc.returncode is not None:
            await asyncio.wait(self._readers, timeout=5)
            raise RuntimeError(f"{self.name} exited with {self.proc.returncode} before ready:\n{self.last_lines()}")
        raise RuntimeError(f"{self.name} not ready after {timeout:g} s:\n{self.last_lines()}")

    async def stop(self, timeout: float = 30.0) -> None:
        import asyncio

        if self.proc.returncode is None:
            try:
                self.proc.terminate()
            except ProcessLookupError:
                pass
            try:
                await asyncio.wait_for(self.proc.wait(), timeout)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()
        await asyncio.wait(self._readers, timeout=5)
        for r in self._readers:
            r.cancel()


def cli_argv(*argv) -> list[str]:
    import sys

    return [sys.executable, "-m", "infra.cli", *[str(a) for a in argv]]
