"""Hosts made of Linux network namespaces, for partition tests.

Each "host" is a network namespace with one interface (`eth0`, address 10.213.0.<n>/24) whose other
end is a port of a bridge in a "switch" namespace. The switch namespace, the bridge and every link
live only inside namespaces this harness made: nothing is added to the caller's network, and the
test subnet is private to this run (two runs use the same addresses in different namespaces, which
never meet).

    with Net(["n0", "n1", "cl"]) as net:
        net.ip("n0")                                  # "10.213.0.2"
        proc = net.popen("n0", ["nats-server", ...])  # a process inside host n0
        argv = net.argv("cl", ["python", ...])        # ["ip", "netns", "exec", <ns>, "python", ...]
        net.cut("n0")                                 # its switch port down: n0 reaches nobody
        net.heal("n0")
        net.partition(["n0", "cl"], ["n1"])           # two sides (a bridge each); the rest: cut
        net.heal_all()
        loop = net.loop("cl")                         # an asyncio loop in a thread inside host cl
        await loop.run(some_coroutine())              # runs there: its sockets are cl's
        net.call("n0", fn, *args)                     # a sync function in a thread inside n0

Names are `ddmnt-<pid>-<random>-<host>`, so parallel runs never collide. Everything is removed by
`close()` (also called by the context manager, a finalizer and atexit): the processes started in the
namespaces (killed), the namespaces (their links go with them). `sweep_stale()` (run by every new Net)
removes the namespaces of harness runs whose process is gone, with what still runs in them.

Needs root (CAP_SYS_ADMIN and CAP_NET_ADMIN) and `ip` from iproute2; without them Net()
raises NetnsUnavailable with the reason (tests that need hosts fail: they never skip).
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import ctypes
import logging
import os
import secrets
import shutil
import signal
import subprocess
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

log = logging.getLogger(__name__)

#: Every namespace this harness makes starts with this.
PREFIX = "ddmnt"
#: The private test subnet (inside the run's own namespaces only).
SUBNET = "10.213.0"
CLONE_NEWNET = 0x40000000
NETNS_DIR = "/run/netns"

_libc = ctypes.CDLL(None, use_errno=True)


class NetnsUnavailable(RuntimeError):
    """Network namespaces cannot be made here (not root, no iproute2, a kernel or container without
    them). The message says which and what to do."""


def _run(argv: Sequence[str], *, check: bool = True, timeout: float = 20.0) -> subprocess.CompletedProcess:
    res = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    if check and res.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({res.returncode}): {(res.stderr or res.stdout).strip()}")
    return res


def setns(name: str) -> None:
    """Move the calling thread into network namespace `name` (sockets it opens from now on are there)."""
    fd = os.open(os.path.join(NETNS_DIR, name), os.O_RDONLY)
    try:
        if _libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into network namespace {name}: {os.strerror(err)}")
    finally:
        os.close(fd)


def check_available() -> None:
    """Raise NetnsUnavailable unless this process can make a namespace with a veth pair and a bridge."""
    if shutil.which("ip") is None:
        raise NetnsUnavailable("`ip` (iproute2) is not installed: apt-get install iproute2")
    if os.geteuid() != 0:
        raise NetnsUnavailable(
            f"network namespaces need root (CAP_SYS_ADMIN, CAP_NET_ADMIN); running as uid {os.geteuid()}: "
            "run the partition tests as root (CI does), e.g. in a container with --privileged"
        )
    probe = f"{PREFIX}-{os.getpid()}-probe{secrets.token_hex(2)}"
    try:
        _run(["ip", "netns", "add", probe])
        _run(["ip", "-n", probe, "link", "add", "p0", "type", "veth", "peer", "name", "p1"])
        _run(["ip", "-n", probe, "link", "add", "br0", "type", "bridge"])
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as err:
        raise NetnsUnavailable(f"cannot make a network namespace with a veth pair and a bridge: {err}") from None
    finally:
        _run(["ip", "netns", "del", probe], check=False)


def _namespaces() -> list[str]:
    res = _run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in res.stdout.splitlines() if line.strip()]


def _pids_in(ns: str) -> list[int]:
    res = _run(["ip", "netns", "pids", ns], check=False)
    return [int(p) for p in res.stdout.split() if p.isdigit()]


def _kill_all_in(ns: str) -> None:
    """SIGKILL every process whose network namespace is `ns` (ours: only this harness starts any there)."""
    me = os.getpid()
    for pid in _pids_in(ns):
        if pid != me:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale() -> list[str]:
    """Remove the namespaces (and kill the processes in them) of harness runs whose process is gone
    (a crashed or killed test run); returns their names."""
    swept = []
    for ns in _namespaces():
        parts = ns.split("-")
        if len(parts) < 4 or parts[0] != PREFIX or not parts[1].isdigit():
            continue
        if _alive(int(parts[1])):
            continue
        _kill_all_in(ns)
        _run(["ip", "netns", "del", ns], check=False)
        swept.append(ns)
    if swept:
        log.warning("removed %d stale namespaces of dead harness runs: %s", len(swept), swept)
    return swept


class NsLoop:
    """An asyncio event loop in its own thread, inside one namespace: every socket it opens (a NATS
    connection and its reconnects) belongs to that host."""

    def __init__(self, ns: str):
        self.ns = ns
        self.loop = asyncio.new_event_loop()
        ready: concurrent.futures.Future = concurrent.futures.Future()

        def main() -> None:
            try:
                setns(ns)
            except BaseException as err:
                ready.set_exception(err)
                return
            asyncio.set_event_loop(self.loop)
            ready.set_result(None)
            self.loop.run_forever()

        self.thread = threading.Thread(target=main, name=f"netns-{ns}", daemon=True)
        self.thread.start()
        ready.result(10)

    def submit(self, coro) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    async def run(self, coro) -> Any:
        """Await `coro` run on this host's loop (from another loop)."""
        return await asyncio.wrap_future(self.submit(coro))

    def close(self, timeout: float = 10.0) -> None:
        if not self.loop.is_closed() and self.thread.is_alive():

            async def cancel_all() -> None:
                me = asyncio.current_task()
                tasks = [t for t in asyncio.all_tasks() if t is not me]
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

            try:
                self.submit(cancel_all()).result(timeout)
            except Exception as err:  # a task that will not end: the daemon thread dies with the process
                log.warning("netns loop %s: tasks did not end: %r", self.ns, err)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout)
        if not self.thread.is_alive() and not self.loop.is_closed():
            self.loop.close()


def _cleanup(namespaces: list[str], procs: list, loops: list) -> None:
    for lp in loops:
        lp.close()
    for p in procs:
        if p.poll() is None:
            p.kill()
    for ns in namespaces:
        _kill_all_in(ns)
    for p in procs:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            pass
    for ns in namespaces:
        _run(["ip", "netns", "del", ns], check=False)


class Net:
    """Hosts on one switch; see the module docstring."""

    def __init__(self, hosts: Sequence[str]):
        hosts = list(hosts)
        if not hosts or len(set(hosts)) != len(hosts) or len(hosts) > 200:
            raise ValueError(f"hosts must be 1-200 distinct names, got {hosts}")
        for h in hosts:
            if not h.isalnum() or len(h) > 12:
                raise ValueError(f"host name {h!r}: letters and digits only, at most 12")
        check_available()
        sweep_stale()
        self.run_id = f"{PREFIX}-{os.getpid()}-{secrets.token_hex(3)}"
        self.hosts = hosts
        self.switch = f"{self.run_id}-sw"
        self._procs: list[subprocess.Popen] = []
        self._loops: list[NsLoop] = []
        self._namespaces: list[str] = []
        self._bridges = ["br0"]
        self._call_pools: dict[str, concurrent.futures.ThreadPoolExecutor] = {}
        self._finalizer = weakref.finalize(self, _cleanup, self._namespaces, self._procs, self._loops)
        atexit.register(self._finalizer)
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------ names
    def ns(self, host: str) -> str:
        if host not in self.hosts:
            raise KeyError(f"unknown host {host!r}; this net has {self.hosts}")
        return f"{self.run_id}-{host}"

    def ip(self, host: str) -> str:
        self.ns(host)  # unknown host: KeyError
        return f"{SUBNET}.{self.hosts.index(host) + 2}"

    def port(self, host: str) -> str:
        """The host's port on the switch (an interface in the switch namespace)."""
        return f"p{self.hosts.index(host)}"

    # ------------------------------------------------------------ building
    def _add_ns(self, name: str) -> None:
        _run(["ip", "netns", "add", name])
        self._namespaces.append(name)
        _run(["ip", "-n", name, "link", "set", "lo", "up"])

    def _build(self) -> None:
        self._add_ns(self.switch)
        sw = ["ip", "-n", self.switch]
        _run(sw + ["link", "add", "br0", "type", "bridge", "stp_state", "0"])
        _run(sw + ["link", "set", "br0", "up"])
        for h in self.hosts:
            ns = self.ns(h)
            self._add_ns(ns)
            _run(
                ["ip", "link", "add", "eth0", "netns", ns, "type", "veth"]
                + ["peer", "name", self.port(h), "netns", self.switch]
            )
            _run(sw + ["link", "set", self.port(h), "master", "br0"])
            _run(sw + ["link", "set", self.port(h), "up"])
            _run(["ip", "-n", ns, "addr", "add", f"{self.ip(h)}/24", "dev", "eth0"])
            _run(["ip", "-n", ns, "link", "set", "eth0", "up"])

    # ------------------------------------------------------------ faults
    def cut(self, *hosts: str) -> None:
        """Pull each host's cable at the switch (`ip link set <port> down`): its packets go nowhere,
        and nothing reaches it; its open TCP connections are not told (they time out or resume)."""
        for h in hosts:
            _run(["ip", "-n", self.switch, "link", "set", self.port(h), "down"])

    def heal(self, *hosts: str) -> None:
        """Plug the cables back (`ip link set <port> up`)."""
        for h in hosts:
            _run(["ip", "-n", self.switch, "link", "set", self.port(h), "up"])

    def partition(self, *groups: Sequence[str]) -> None:
        """Split the switch: each group's ports move to a bridge of their own (`ip link set <port>
        master br<k>`), so hosts of one group reach each other only; a host in no group is cut. Ports
        stay up: open connections across groups see their packets vanish, as on a cut cable."""
        seen = [h for g in groups for h in g]
        if len(seen) != len(set(seen)) or not set(seen) <= set(self.hosts):
            raise ValueError(f"groups must hold distinct hosts of {self.hosts}, got {groups}")
        side = {h: i + 1 for i, g in enumerate(groups) for h in g}
        sw = ["ip", "-n", self.switch, "link"]
        for i in range(1, len(groups) + 1):
            if f"br{i}" not in self._bridges:
                _run(sw + ["add", f"br{i}", "type", "bridge", "stp_state", "0"])
                _run(sw + ["set", f"br{i}", "up"])
                self._bridges.append(f"br{i}")
        for h in self.hosts:
            if h in side:
                _run(sw + ["set", self.port(h), "master", f"br{side[h]}"])
            else:
                _run(sw + ["set", self.port(h), "down"])

    def heal_all(self) -> None:
        """Undo every partition and cut: every port on the one bridge, up."""
        for h in self.hosts:
            _run(["ip", "-n", self.switch, "link", "set", self.port(h), "master", "br0"])
        self.heal(*self.hosts)

    # ------------------------------------------------------------ running things inside
    def argv(self, host: str, argv: Sequence[str]) -> list[str]:
        """`argv` run inside host's namespace (for asyncio.create_subprocess_exec; see `track`)."""
        return ["ip", "netns", "exec", self.ns(host), *map(str, argv)]

    def popen(self, host: str, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        """Start `argv` inside `host`; killed by close() if still running."""
        proc = subprocess.Popen(self.argv(host, argv), **kwargs)
        self._procs.append(proc)
        return proc

    def track(self, proc) -> Any:
        """Kill `proc` (anything with poll / kill / wait) at close() (asyncio processes: close kills
        every process in the namespaces anyway)."""
        if hasattr(proc, "poll"):
            self._procs.append(proc)
        return proc

    def loop(self, host: str) -> NsLoop:
        """A new asyncio loop running in a thread inside `host` (stopped by close())."""
        lp = NsLoop(self.ns(host))
        self._loops.append(lp)
        return lp

    def call(self, host: str, fn: Callable, *args, timeout: float = 30.0, **kwargs) -> Any:
        """Run the sync `fn(*args, **kwargs)` in a thread inside `host`; returns its result."""
        pool = self._call_pools.get(host)
        if pool is None:
            ns = self.ns(host)
            pool = self._call_pools[host] = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix=f"netns-call-{host}", initializer=setns, initargs=(ns,)
            )
        return pool.submit(fn, *args, **kwargs).result(timeout)

    async def acall(self, host: str, fn: Callable, *args, timeout: float = 30.0, **kwargs) -> Any:
        """`call` from a coroutine (without blocking its loop)."""
        return await asyncio.to_thread(self.call, host, fn, *args, timeout=timeout, **kwargs)

    # ------------------------------------------------------------ teardown
    def close(self) -> None:
        """Kill what runs in the namespaces and delete them (idempotent)."""
        for pool in self._call_pools.values():
            pool.shutdown(wait=False, cancel_futures=True)
        self._call_pools.clear()
        self._finalizer()
        atexit.unregister(self._finalizer)

    def __enter__(self) -> Net:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
