"""The network-namespace harness itself (tests.netns.harness): hosts reach each other over the test
switch, a cut / partition stops traffic and a heal brings it back, every namespace and process is
gone after close, stale namespaces of a dead run are swept, and a process that cannot make
namespaces gets a clear NetnsUnavailable."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from tests.netns.harness import PREFIX, Net, _namespaces, sweep_stale

pytestmark = pytest.mark.procs

LISTENER = (
    "import socket\n"
    "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
    "s.bind(('0.0.0.0', 9999)); s.listen(64); print('up', flush=True)\n"
    "while True:\n"
    "    c, _ = s.accept(); c.sendall(b'hi'); c.close()\n"
)


def reach(ip: str) -> bool:
    try:
        with socket.create_connection((ip, 9999), timeout=1.0) as c:
            return c.recv(2) == b"hi"
    except OSError:
        return False


def reaches(net, host: str, ip: str, within: float = 10.0) -> bool:
    """Whether `host` reaches `ip`, trying for up to `within` s: a link just set up or moved between
    bridges may take a moment to forward (a negative check is one try: nothing should get through)."""
    deadline = time.monotonic() + within
    while True:
        if net.call(host, reach, ip):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)


def mine() -> set[str]:
    return {ns for ns in _namespaces() if ns.startswith(f"{PREFIX}-{os.getpid()}-")}


def test_cut_heal_partition_and_cleanup():
    before = mine()
    with Net(["a", "b", "c"]) as net:
        assert mine() - before == {net.ns(h) for h in ("a", "b", "c")} | {net.switch}
        srv = net.popen("b", [sys.executable, "-c", LISTENER], stdout=subprocess.PIPE)
        assert srv.stdout.readline() == b"up\n"
        assert reaches(net, "a", net.ip("b")) and reaches(net, "c", net.ip("b"))
        # nothing of the test network in the caller's namespace (no address, no route, no link)
        assert "10.213." not in subprocess.run(["ip", "-4", "addr"], capture_output=True, text=True).stdout
        assert "10.213." not in subprocess.run(["ip", "-4", "route"], capture_output=True, text=True).stdout
        net.cut("b")
        assert not net.call("a", reach, net.ip("b"))
        net.heal("b")
        assert reaches(net, "a", net.ip("b"))
        net.partition(["a"], ["b", "c"])
        assert not net.call("a", reach, net.ip("b")) and reaches(net, "c", net.ip("b"))
        net.partition(["a", "b"])  # c in no group: cut
        assert reaches(net, "a", net.ip("b")) and not net.call("c", reach, net.ip("b"))
        net.heal_all()
        assert reaches(net, "a", net.ip("b")) and reaches(net, "c", net.ip("b"))
    assert srv.wait(10) is not None  # killed with its host
    assert mine() == before


def test_a_crashed_runs_namespaces_are_swept_with_their_processes():
    # a child makes a net, starts a process in it and dies without cleaning up (SIGKILL)
    code = (
        "import os, signal, subprocess, sys\n"
        "from tests.netns.harness import Net\n"
        "net = Net(['x'])\n"
        "p = net.popen('x', ['sleep', '300'], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
        "print(net.run_id, p.pid, flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=os.getcwd())
    run_id, pid = child.stdout.split()
    left = [ns for ns in _namespaces() if ns.startswith(run_id)]
    assert len(left) == 2, (left, child.stderr)  # host x and the switch
    swept = sweep_stale()
    assert set(left) <= set(swept)
    assert not [ns for ns in _namespaces() if ns.startswith(run_id)]
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{pid}") or "Z" in open(f"/proc/{pid}/stat").read().split()[2]


def test_without_the_rights_net_says_why_and_makes_nothing(monkeypatch):
    import tests.netns.harness as harness

    before = mine()
    monkeypatch.setattr(harness.os, "geteuid", lambda: 1000)
    with pytest.raises(harness.NetnsUnavailable, match="network namespaces need root"):
        Net(["a"])
    monkeypatch.undo()
    monkeypatch.setattr(harness.shutil, "which", lambda tool: None)
    with pytest.raises(harness.NetnsUnavailable, match=r"`ip` \(iproute2\) is not installed"):
        Net(["a"])
    assert mine() == before
