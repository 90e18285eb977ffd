"""`ddm-fleet web` as a real subprocess: help, a clear error without NATS, serving and stopping."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from bus.nats_server import free_port

CLI = [str(Path(sys.executable).parent / "ddm-fleet")]


def test_help_explains_the_options():
    out = subprocess.run([*CLI, "web", "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    for flag in ("--port", "--host", "--nats", "--fleet-interval"):
        assert flag in out.stdout
    assert "denoise" in out.stdout


def test_no_nats_is_a_clear_error_not_a_traceback():
    port = free_port()  # nothing listens there
    out = subprocess.run([*CLI, "web", "--port", str(free_port()), "--nats", f"nats://web:s3cret@127.0.0.1:{port}"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert "cannot connect to NATS" in out.stderr and "Traceback" not in out.stderr
    assert "nats://web:***@127.0.0.1" in out.stderr and "s3cret" not in out.stderr + out.stdout


def test_bad_arguments_exit_2(capsys):
    from infra.cli import main

    assert main(["web", "--port", "70000"]) == 2
    assert "--port must be 1-65535" in capsys.readouterr().err
    assert main(["web", "--nats", "http://x"]) == 2
    assert "must start with nats://" in capsys.readouterr().err


def test_serves_the_page_and_stops_on_sigint(nats_url):
    port = free_port()
    proc = subprocess.Popen([*CLI, "web", "--port", str(port), "--nats", nats_url],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as r:
                    assert r.read() == b"ok"
                break
            except OSError:
                assert proc.poll() is None, proc.communicate()
                assert time.monotonic() < deadline, "ddm-fleet web did not come up"
                time.sleep(0.2)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5) as r:
            assert b'id="generate"' in r.read()
    finally:
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    assert proc.returncode in (0, 130), err
    assert f"serving http://127.0.0.1:{port}/" in out
    assert "Traceback" not in err
