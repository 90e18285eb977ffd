"""`ddm-fleet up` and its supervisor (infra/launcher.py), with real processes.

The fleet test starts `ddm-fleet up` as a subprocess on free ports with tiny random-init expert
checkpoints and the shipped router + partition: it waits for the page (HTTP 200), runs a job over
the fleet's NATS URL, kills -9 a worker and checks the supervisor reports and restarts it (a later
job is served by that expert again), then SIGINT stops everything with exit code 0 and no child left.
"""

from __future__ import annotations

import asyncio
import json
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from bus.nats_server import free_port
from infra import cli
from infra.launcher import ChildSpec, RestartPolicy, Supervisor
from tests.coordinator.helpers import make_tiny_experts
from tests.waiting import wait_until

REPO = Path(__file__).resolve().parents[2]
SHIPPED = REPO / "checkpoints"


@pytest.fixture(scope="module")
def tiny_fleet_dir(tmp_path_factory) -> Path:
    """Tiny expert0/1 checkpoints + the shipped router and partition, in one directory. The tiny experts have
    no null label, so the router JSON goes without the shipped fleet's default guidance (they could not
    serve it: every job would be refused)."""
    d = tmp_path_factory.mktemp("up-checkpoints")
    make_tiny_experts(d, 2)
    for name in ("router.safetensors", "partition.json"):
        shutil.copy(SHIPPED / name, d / name)
    meta = json.loads((SHIPPED / "router.json").read_text())
    meta.pop("guidance", None)
    (d / "router.json").write_text(json.dumps(meta))
    return d


# ------------------------------------------------------------------ clear errors, before anything starts


def test_missing_checkpoints_named(tmp_path, capsys):
    shutil.copy(SHIPPED / "partition.json", tmp_path / "partition.json")
    code = cli.main(["up", "--checkpoints", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2
    for missing in ("router.safetensors", "expert0.safetensors", "expert1.safetensors", "expert1.json"):
        assert missing in err
    assert "checkpoints/README.md" in err and "--checkpoints" in err


def test_port_in_use(tiny_fleet_dir, capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        busy = s.getsockname()[1]
        code = cli.main(
            [
                "up",
                "--checkpoints",
                str(tiny_fleet_dir),
                "--port",
                str(busy),
                "--nats-port",
                str(free_port()),
                "--nats-monitor-port",
                "0",
            ]
        )
    err = capsys.readouterr().err
    assert code == 2
    assert f"web port 127.0.0.1:{busy} is in use" in err and "--port" in err


def test_nats_server_missing(tiny_fleet_dir, capsys, monkeypatch):
    import bus.nats_server

    def missing():
        raise FileNotFoundError("nats-server not found: install the project (`make install`)")

    monkeypatch.setattr(bus.nats_server, "find_nats_server", missing)
    code = cli.main(["up", "--checkpoints", str(tiny_fleet_dir), "--nats-port", str(free_port())])
    assert code == 2
    assert "nats-server not found" in capsys.readouterr().err


# ------------------------------------------------------------------ the supervisor with plain processes


def _py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


# The children's own `time.sleep` calls below are kept: they are each child's lifetime (a crash
# 0.2-0.3 s after starting, so it counts as a crash after ready, not a failed start; or a
# long-running process for 60 s), not a wait of the test's.


@pytest.mark.procs
async def test_supervisor_restarts_then_gives_up_on_critical(tmp_path):
    lines: list[str] = []
    crashy = ChildSpec(
        "crashy", _py("import sys, time; print('boom', flush=True); time.sleep(0.3); sys.exit(3)"), role="test"
    )
    sup = Supervisor(
        [[crashy]],
        tmp_path,
        out=lines.append,
        policy=RestartPolicy(backoff=0.05, backoff_max=0.1, max_crashes=3, crash_window=30),
    )
    code = await asyncio.wait_for(sup.run(handle_signals=False), 30)
    text = "\n".join(lines)
    assert code == 1
    assert text.count("CRASH crashy") == 3 and "exit code 3" in text and "| boom" in text
    assert text.count("restarted crashy") == 2
    assert "giving up on crashy: 3 crashes within 30 s" in text
    assert (tmp_path / "crashy.log").read_text().splitlines().count("boom") == 3  # appended across restarts


@pytest.mark.procs
async def test_supervisor_gives_up_on_noncritical_keeps_rest(tmp_path):
    lines: list[str] = []
    keeper = ChildSpec("keeper", _py("import time; time.sleep(60)"), role="test")
    flaky = ChildSpec("flaky", _py("import time; time.sleep(0.2); raise SystemExit(4)"), role="test", critical=False)
    sup = Supervisor(
        [[keeper], [flaky]],
        tmp_path,
        out=lines.append,
        policy=RestartPolicy(backoff=0.05, backoff_max=0.05, max_crashes=2, crash_window=30),
    )
    task = asyncio.create_task(sup.run(handle_signals=False))
    await wait_until(
        lambda: any("keeps running without flaky" in line for line in lines),
        timeout=20,
        what="'the rest of the fleet keeps running without flaky'",
    )
    assert sup.children[0].running
    sup.request_stop()
    assert await asyncio.wait_for(task, 20) == 0
    assert "gave up" in "\n".join(sup.table())


@pytest.mark.procs
async def test_supervisor_stops_in_reverse_order_and_kills_stubborn(tmp_path):
    lines: list[str] = []
    ignore_term = (
        "import signal, time; signal.signal(signal.SIGTERM, lambda *a: print('stuck on the way out', flush=True)); "
        "print('up', flush=True); time.sleep(60)"
    )
    specs = [
        ChildSpec("first", _py("import time; time.sleep(60)"), role="test"),
        ChildSpec("second", _py("import time; time.sleep(60)"), role="test"),
        ChildSpec(
            "stubborn", _py(ignore_term), role="test", probe=lambda c: _async_true_if("up" in c.log_since_start())
        ),
    ]
    sup = Supervisor([specs[:1], specs[1:]], tmp_path, out=lines.append, stop_timeout=0.5)
    task = asyncio.create_task(sup.run(handle_signals=False))
    await wait_until(
        lambda: len(sup.children) == 3 and all(c.ready for c in sup.children),
        timeout=20,
        what="all three children ready",
    )
    pids = [c.pid for c in sup.children]
    sup.request_stop()
    assert await asyncio.wait_for(task, 20) == 0
    stops = [line.split()[1] for line in lines if line.startswith(("stopped ", "killed "))]
    assert stops == ["stubborn", "second", "first"]
    killed = [line for line in lines if line.startswith("killed stubborn")]
    assert len(killed) == 1 and "no exit 0.5 s after SIGTERM" in killed[0]
    assert "| stuck on the way out" in killed[0]  # its log's tail: what it said while it hung
    for pid in pids:
        assert not _alive(pid)


@pytest.mark.procs
async def test_supervisor_stop_during_startup(tmp_path):
    """A stop while a child is still warming up (its probe says not ready) stops it and exits 0."""
    lines: list[str] = []
    slow = ChildSpec("slow", _py("import time; time.sleep(60)"), role="test", probe=lambda c: _async_true_if(False))
    sup = Supervisor([[slow]], tmp_path, out=lines.append, ready_timeout=60)
    task = asyncio.create_task(sup.run(handle_signals=False))
    await wait_until(lambda: sup.children and sup.children[0].running, timeout=20, what="the slow child started")
    pid = sup.children[0].pid
    sup.request_stop()
    assert await asyncio.wait_for(task, 20) == 0
    assert f"stopped slow (pid {pid})" in "\n".join(lines) and not _alive(pid)


@pytest.mark.procs
async def test_supervisor_second_signal_kills_at_once(tmp_path):
    lines: list[str] = []
    ignore_term = (
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(60)"
    )
    stubborn = ChildSpec(
        "stubborn", _py(ignore_term), role="test", probe=lambda c: _async_true_if("up" in c.log_since_start())
    )
    sup = Supervisor([[stubborn]], tmp_path, out=lines.append, stop_timeout=60)
    task = asyncio.create_task(sup.run())  # real handlers for SIGINT/SIGTERM in this process
    await wait_until(lambda: sup.children and sup.children[0].ready, timeout=20, what="the stubborn child ready")
    os.kill(os.getpid(), signal.SIGTERM)
    await wait_until(
        lambda: any(line.startswith("SIGTERM: stopping the fleet") for line in lines),
        timeout=10,
        what="the supervisor to act on the first SIGTERM",
    )
    await asyncio.sleep(1.0)  # kept: a window in which the stubborn child must survive its SIGTERM (stop_timeout 60 s)
    assert not task.done() and sup.children[0].running  # waiting out the stop timeout
    os.kill(os.getpid(), signal.SIGTERM)
    assert await asyncio.wait_for(task, 10) == 0
    assert "SIGTERM again: killing every child now" in lines


async def _async_true_if(value: bool) -> bool:
    return value


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


# ------------------------------------------------------------------ the real fleet


class Lines:
    """Collects a process's stdout lines in a thread; wait_for(regex) returns the match."""

    def __init__(self, stream):
        self.lines: list[str] = []
        self._q: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, args=(stream,), daemon=True).start()

    def _pump(self, stream) -> None:
        for line in stream:
            self._q.put(line.rstrip("\n"))
        self._q.put(None)

    def wait_for(self, pattern: str, timeout: float) -> re.Match:
        rx = re.compile(pattern)
        for line in self.lines:
            if m := rx.search(line):
                return m
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._q.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(
                    f"no line matching {pattern!r} in {timeout:g} s:\n" + "\n".join(self.lines)
                ) from None
            if line is None:
                raise AssertionError(f"output ended without {pattern!r}:\n" + "\n".join(self.lines))
            self.lines.append(line)
            if m := rx.search(line):
                return m


async def _job(url: str, digits: list[int]):
    import nats

    from client.jobs import run_job
    from schemas import JobRequest

    nc = await nats.connect(url, name="test-up")
    try:
        return await run_job(nc, JobRequest(digits=digits, steps=4, strategy="oracle", seed=1), timeout=60)
    finally:
        await nc.drain()


@pytest.mark.slow  # ~6 s: the whole fleet under ddm-fleet up
@pytest.mark.timeout(600)  # ~40 s on a quiet 2-core box; generous for a loaded one
@pytest.mark.procs
async def test_up_serves_restarts_and_stops(tiny_fleet_dir, tmp_path):
    import numpy as np

    nats_port, web_port = free_port(), free_port()
    url = f"nats://127.0.0.1:{nats_port}"
    cmd = [
        sys.executable,
        "-m",
        "infra.cli",
        "up",
        "--checkpoints",
        str(tiny_fleet_dir),
        "--nats-port",
        str(nats_port),
        "--nats-monitor-port",
        "0",
        "--port",
        str(web_port),
        "--buckets",
        "1,2",
        "--log-dir",
        str(tmp_path / "logs"),
        "--backend-1",
        "torch",
        "--worker-args",
        "--threads 1",
        "--stop-timeout",
        "60",
        "--js-store",
        str(tmp_path / "nats-js"),
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO)
    out = Lines(proc.stdout)
    pids: dict[str, int] = {}
    try:
        await asyncio.to_thread(out.wait_for, r"fleet ready: open http://127\.0\.0\.1:%d/" % web_port, 300)
        for name in ("nats-server", "worker-e0-0", "worker-e1-0", "coordinator", "web"):
            pids[name] = int((await asyncio.to_thread(out.wait_for, rf"^{name}\s+(\d+)\s", 1)).group(1))
        assert re.search(
            r"^worker-e1-0\s+\d+\s+expert 1\s+torch\s+ddm\.v1\.expert\.1\.velocity", "\n".join(out.lines), re.M
        )
        assert (tmp_path / "logs" / "coordinator.log").exists()
        # durable by default: JetStream on the bus (its store where asked), a --durable coordinator
        assert "durable jobs: on" in (tmp_path / "logs" / "coordinator.log").read_text()
        assert (tmp_path / "nats-js" / "jetstream").is_dir()

        with urllib.request.urlopen(f"http://127.0.0.1:{web_port}/", timeout=10) as resp:
            assert resp.status == 200
            assert b"<html" in resp.read().lower()

        done = await _job(url, [1, 8])
        assert done.images.shape == (2, 1, 32, 32) and np.isfinite(done.images).all()
        np.testing.assert_allclose(done.usage, [[1, 0], [0, 1]])

        os.kill(pids["worker-e0-0"], signal.SIGKILL)
        await asyncio.to_thread(
            out.wait_for, r"CRASH worker-e0-0 \(pid %d\) .*killed by SIGKILL" % pids["worker-e0-0"], 10
        )
        new_pid = int((await asyncio.to_thread(out.wait_for, r"restarted worker-e0-0: pid (\d+) ready", 240)).group(1))
        assert new_pid != pids["worker-e0-0"] and _alive(new_pid)
        pids["worker-e0-0 (restarted)"] = new_pid

        done = await _job(url, [1, 3])  # expert 0 only: served by the restarted worker, not a fallback
        np.testing.assert_allclose(done.usage, [[1, 0], [1, 0]])

        proc.send_signal(signal.SIGINT)
        assert await asyncio.to_thread(proc.wait, 240) == 0
        await asyncio.to_thread(out.wait_for, "fleet stopped: every process exited", 5)
        text = "\n".join(out.lines)
        order = [m.group(1) for m in re.finditer(r"^stopped (\S+) \(pid \d+\): exit code 0", text, re.M)]
        assert order[:2] == ["web", "coordinator"] and order[4:] == ["nats-server"], text  # reverse start order
        assert sorted(order[2:4]) == ["worker-e0-0", "worker-e1-0"], text  # workers together
        left = [name for name, pid in pids.items() if _alive(pid)]
        assert not left, f"still running after SIGINT: {left}"
    finally:
        if proc.poll() is None:
            proc.kill()  # children get SIGTERM through PR_SET_PDEATHSIG
            proc.wait()
        for pid in pids.values():
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_backends_default_and_override(tiny_fleet_dir):
    """Expert 0 on torch and expert 1 on jax by default (the reference demo's two frameworks);
    --backend-K overrides; --workers N gives N processes per expert; children run this interpreter."""
    from infra.cmd_up import Probes, build_stages, check_checkpoints

    def stages(*argv):
        args = cli.build_parser().parse_args(["up", "--checkpoints", str(tiny_fleet_dir), *argv])
        return build_stages(args, check_checkpoints(args.checkpoints), "/bin/nats-server", Probes("nats://x:1"))

    bus, rest = stages()
    assert bus[0].argv[:3] == ["/bin/nats-server", "-c", str(REPO / "infra" / "nats" / "local.conf")]
    # durable jobs by default: JetStream with its store under out/, and a --durable coordinator
    assert bus[0].argv[-3:] == ["-js", "-sd", str(Path("out/nats-js").resolve())]
    assert "--durable" in next(c for c in rest if c.name == "coordinator").argv
    plain_bus, plain_rest = stages("--no-durable")
    assert "-js" not in plain_bus[0].argv and "--durable" not in plain_rest[-2].argv
    assert stages("--js-store", "/tmp/elsewhere")[0][0].argv[-1] == "/tmp/elsewhere"
    assert [(c.name, c.backend) for c in rest] == [
        ("worker-e0-0", "torch"),
        ("worker-e1-0", "jax"),
        ("coordinator", "-"),
        ("web", "-"),
    ]
    assert all(c.argv[:3] == [sys.executable, "-m", "infra.cli"] for c in rest)
    _, rest = stages("--backend-0", "jax", "--backend-1", "torch", "--workers", "2", "--no-web", "--buckets", "1,4")
    assert [(c.name, c.backend) for c in rest] == [
        ("worker-e0-0", "jax"),
        ("worker-e0-1", "jax"),
        ("worker-e1-0", "torch"),
        ("worker-e1-1", "torch"),
        ("coordinator", "-"),
    ]
    assert "--buckets" in rest[0].argv and rest[0].argv[rest[0].argv.index("--buckets") + 1] == "1,4"
    assert not rest[0].critical and rest[-1].critical


def test_a_fleet_sharing_a_few_cpu_cores_runs_one_cohort_unless_told_otherwise(tiny_fleet_dir):
    """On a host without accelerators whose cores the fleet's processes fill (at most worker processes + 2),
    with one worker per expert, `up` starts the coordinator with --cohorts 1 (measured: docs/CAPACITY.md);
    with an accelerator, more cores, several workers per expert, or the user's own --cohorts it does not."""
    from infra.cmd_up import Probes, build_stages, check_checkpoints, shared_cpu_cohorts

    assert shared_cpu_cohorts("", 1, 2, cpu_count=2, accelerator=False) == ["--cohorts", "1"]
    assert shared_cpu_cohorts("", 1, 2, cpu_count=4, accelerator=False) == ["--cohorts", "1"]
    assert shared_cpu_cohorts("", 1, 2, cpu_count=5, accelerator=False) == []  # cores to spare: overlap pays
    assert shared_cpu_cohorts("", 1, 2, cpu_count=2, accelerator=True) == []  # workers may be on a GPU
    assert shared_cpu_cohorts("", 2, 4, cpu_count=2, accelerator=False) == []  # cohorts feed several workers
    assert shared_cpu_cohorts("--cohorts 3", 1, 2, cpu_count=2, accelerator=False) == []

    def coordinator_argv(*argv):
        args = cli.build_parser().parse_args(["up", "--checkpoints", str(tiny_fleet_dir), *argv])
        stages = build_stages(args, check_checkpoints(args.checkpoints), "/bin/nats-server", Probes("nats://x:1"))
        return next(c for c in stages[1] if c.name == "coordinator").argv

    want = shared_cpu_cohorts("", 1, 2)  # this host's answer, whatever it is
    argv = coordinator_argv()
    assert (argv[argv.index("--cohorts") :][:2] if "--cohorts" in argv else []) == want
    argv = coordinator_argv("--coordinator-args=--cohorts 2")
    assert argv.count("--cohorts") == 1 and argv[argv.index("--cohorts") + 1] == "2"


# ------------------------------------------------------------------ --nats: $NATS_URL and comma-separated lists


async def test_worker_connects_through_a_server_list(tiny_expert_checkpoint, nats_url, nc):
    """A comma-separated --nats (a dead node, then the live one) reaches the live node."""
    from workers.service import ExpertWorker

    dead = f"127.0.0.1:{free_port()}"  # no scheme: nats_servers() adds nats://
    worker = ExpertWorker(
        0, tiny_expert_checkpoint, "torch", nats_url=f"{dead},{nats_url}", buckets=(1,), connect_attempts=3
    )
    await worker.start()
    try:
        assert worker.nc.connected_url.port == int(nats_url.rsplit(":", 1)[1])
        reply = await nc.request(f"$SRV.PING.ddm-expert.{worker.service_id}", b"", timeout=2)
        assert worker.service_id.encode() in reply.data
    finally:
        await worker.stop()


@pytest.mark.procs
def test_commands_default_to_nats_url_env():
    env = {**os.environ, "NATS_URL": "nats://from-env:4999"}
    env.pop("DDM_NATS_URL", None)
    for command in ("worker", "coordinator", "web"):
        out = subprocess.run(
            [sys.executable, "-c", f"from infra import cli; cli.main(['{command}', '--help'])"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout
        assert "comma-separated list" in out, (command, out)
    code = "from infra import cli; p = cli.build_parser(); print(p.parse_args({argv}).nats)"
    for command in ("worker --expert 0 --checkpoint x", "coordinator", "web"):
        argv = repr(command.split())
        got = subprocess.run(
            [sys.executable, "-c", code.format(argv=argv)], env=env, capture_output=True, text=True, timeout=60
        ).stdout.strip()
        assert got == "nats://from-env:4999", (command, got)
    for command in ("worker --expert 0 --checkpoint x", "coordinator", "web", "generate --count 1"):
        argv = repr(command.split())
        env = {**os.environ, "NATS_URL": "nats://from-env:4999", "DDM_NATS_URL": "nats://ddm-env:4998"}
        got = subprocess.run(
            [sys.executable, "-c", code.format(argv=argv)], env=env, capture_output=True, text=True, timeout=60
        )
        assert got.stdout.strip() == "nats://from-env:4999" and "deprecated" not in got.stderr, (command, got)
        env.pop("NATS_URL")  # the old variable: still read, with one warning per process
        got = subprocess.run(
            [sys.executable, "-c", code.format(argv=argv)], env=env, capture_output=True, text=True, timeout=60
        )
        assert got.stdout.strip() == "nats://ddm-env:4998", (command, got.stderr)
        assert got.stderr.count("DDM_NATS_URL is deprecated") == 1 and "set NATS_URL" in got.stderr, got.stderr
        env.pop("DDM_NATS_URL")
        got = subprocess.run(
            [sys.executable, "-c", code.format(argv=argv)], env=env, capture_output=True, text=True, timeout=60
        )
        assert got.stdout.strip() == "nats://127.0.0.1:4222", (command, got.stderr)


# ------------------------------------------------------------------ --worker-args "--bf16" (a value starting with "-")


def test_child_args_take_values_that_start_with_a_dash(tiny_fleet_dir):
    """`up --worker-args "--bf16"`, as the option's own help types it, reaches every worker's command
    line (argparse alone refuses it: "expected one argument"); the `=` form still works, and each
    child's argv parses as that command with the extra options applied."""
    import argparse
    import contextlib

    from infra.cmd_up import Probes, add_arguments, build_stages, check_checkpoints

    up = argparse.ArgumentParser()
    add_arguments(up)
    help_text = next(a.help for a in up._actions if a.dest == "worker_args")
    example = re.search(r'e\.g\. "([^"]+)"', help_text).group(1)  # "--dtype float32 --threads 1"
    parser = cli.build_parser()
    for worker_args in ("--bf16", example):
        for form in (["--worker-args", worker_args], [f"--worker-args={worker_args}"]):
            args = cli.parse_args(
                [
                    "up",
                    "--checkpoints",
                    str(tiny_fleet_dir),
                    *form,
                    "--coordinator-args",
                    "--max-rows 256",
                    "--web-args",
                    "--fleet-interval 1",
                ]
            )
            assert args.worker_args == worker_args and args.coordinator_args == "--max-rows 256"
            _, rest = build_stages(args, check_checkpoints(args.checkpoints), "/bin/nats-server", Probes("nats://x:1"))
            workers = [c for c in rest if c.name.startswith("worker-")]
            assert workers and all(c.argv[-len(worker_args.split()) :] == worker_args.split() for c in workers)
            child = cli.parse_args(workers[0].argv[3:])  # drop `python -m infra.cli`
            want = "bfloat16" if worker_args == "--bf16" else "float32"  # --bf16: deprecated --dtype bfloat16
            assert child.command == "worker" and child.dtype == want
            coord = next(c for c in rest if c.name == "coordinator")
            assert cli.parse_args(coord.argv[3:]).max_rows == 256
            web = next(c for c in rest if c.name == "web")
            assert cli.parse_args(web.argv[3:]).fleet_interval == 1.0
    with pytest.raises(SystemExit):  # the plain parser still refuses it: the join in cli.parse_args is what helps
        with open(os.devnull, "w") as null, contextlib.redirect_stderr(null):
            parser.parse_args(["up", "--worker-args", "--bf16"])


def test_latent_fleet_starts_a_decoder_of_its_autoencoder(tiny_fleet_dir, tmp_path):
    """A router whose spec says space latent makes `up` start one `ddm-fleet decoder` of
    <DIR>/autoencoder.safetensors; a missing or different autoencoder is refused before anything starts."""
    import json

    import torch

    from infra.cmd_up import Probes, UpError, build_stages, check_checkpoints
    from models.autoencoder import AutoencoderConfig, decoder_name, make_spec, save_autoencoder
    from models.autoencoder_torch import Autoencoder
    from models.checkpoint import torch_state_to_numpy
    from schemas import subjects

    d = tmp_path / "latent"
    shutil.copytree(tiny_fleet_dir, d)

    def autoencoder(path, seed):
        cfg = AutoencoderConfig(in_channels=3, image_size=8, latent_channels=4, widths=(8, 16))
        torch.manual_seed(seed)
        meta = {"config": cfg.to_dict(), "spec": make_spec(cfg, scale_factor=1.0, shift_factor=0.0, latent_range=3.0)}
        save_autoencoder(path, torch_state_to_numpy(Autoencoder(cfg).state_dict()), meta)
        return json.loads(path.with_suffix(".json").read_text())["content_hash"]

    digest = autoencoder(tmp_path / "ae", 1)
    rj = d / "router.json"
    meta = json.loads(rj.read_text())
    from models.spec import spec_of

    spec = {**spec_of(meta).to_json(), "space": "latent", "decoder": decoder_name(digest)}
    rj.write_text(json.dumps({**meta, "spec": spec}))
    with pytest.raises(UpError, match="autoencoder.safetensors"):
        check_checkpoints(d)
    autoencoder(d / "autoencoder", 2)  # another autoencoder than the spec names
    with pytest.raises(UpError, match="spec names"):
        check_checkpoints(d)
    for suffix in (".safetensors", ".json"):
        shutil.copy((tmp_path / "ae").with_suffix(suffix), (d / "autoencoder").with_suffix(suffix))
    args = cli.build_parser().parse_args(["up", "--checkpoints", str(d), "--no-web"])
    _, rest = build_stages(args, check_checkpoints(d), "/bin/nats-server", Probes("nats://x:1"))
    dec = next(c for c in rest if c.name == "decoder-0")
    assert dec.argv[3:6] == ["decoder", "--checkpoint", str((d / "autoencoder.safetensors").resolve())]
    assert dec.where == subjects.decoder_decode(digest) and not dec.critical
    # a pixel fleet has none
    _, rest = build_stages(args, check_checkpoints(tiny_fleet_dir), "/bin/nats-server", Probes("nats://x:1"))
    assert not any(c.name.startswith("decoder") for c in rest)
