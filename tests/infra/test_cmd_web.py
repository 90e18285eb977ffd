"""`ddm-fleet web` as a real subprocess: help, a clear error without NATS, serving and stopping."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from bus.nats_server import free_port

CLI = [str(Path(sys.executable).parent / "ddm-fleet")]


@pytest.mark.procs
def test_help_explains_the_options():
    out = subprocess.run([*CLI, "web", "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    for flag in (
        "--port",
        "--host",
        "--nats",
        "--fleet-interval",
        "--allow-origin",
        "--allow-host",
        "--token-file",
        "--insecure-no-token",
        "--max-sockets-per-client",
        "--max-messages-per-second",
    ):
        assert flag in out.stdout
    assert "denoise" in out.stdout


@pytest.mark.procs
def test_no_nats_is_a_clear_error_not_a_traceback():
    port = free_port()  # nothing listens there
    out = subprocess.run(
        [*CLI, "web", "--port", str(free_port()), "--nats", f"nats://web:s3cret@127.0.0.1:{port}"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1
    assert "cannot connect to NATS" in out.stderr and "Traceback" not in out.stderr
    # the URL it tried, without its credentials (bus.connect shows no user or password)
    assert f"nats://127.0.0.1:{port}" in out.stderr and "s3cret" not in out.stderr + out.stdout


def test_bad_arguments_exit_2(capsys):
    from infra.cli import main

    assert main(["web", "--port", "70000"]) == 2
    assert "--port must be 1-65535" in capsys.readouterr().err
    assert main(["web", "--nats", "http://x"]) == 2
    assert "must start with nats://" in capsys.readouterr().err


@pytest.mark.procs
def test_serves_the_page_and_stops_on_sigint(nats_url):
    port = free_port()
    proc = subprocess.Popen(
        [*CLI, "web", "--port", str(port), "--nats", nats_url],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
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


def test_beyond_loopback_needs_a_token_or_an_explicit_insecure_flag(capsys, tmp_path, monkeypatch):
    from infra.cli import main

    monkeypatch.delenv("DDM_WEB_TOKEN", raising=False)
    assert main(["web", "--host", "0.0.0.0"]) == 2
    err = capsys.readouterr().err
    assert "refusing to serve 0.0.0.0 (beyond loopback) without a token" in err and "--insecure-no-token" in err
    short = tmp_path / "short.token"
    short.write_text("abc\n")
    assert main(["web", "--host", "0.0.0.0", "--token-file", str(short)]) == 2
    assert "16-256 characters" in capsys.readouterr().err
    assert main(["web", "--token-file", str(tmp_path / "missing")]) == 2
    assert "cannot read --token-file" in capsys.readouterr().err
    monkeypatch.setenv("DDM_WEB_TOKEN", "bad token")
    assert main(["web", "--host", "10.0.0.1"]) == 2
    assert "16-256 characters" in capsys.readouterr().err
    monkeypatch.delenv("DDM_WEB_TOKEN")
    assert main(["web", "--allow-origin", "viewer.example.com"]) == 2
    assert "is not an origin" in capsys.readouterr().err
    assert main(["web", "--max-sockets-per-client", "0"]) == 2
    assert "max_sockets_per_client must be >= 1" in capsys.readouterr().err


@pytest.mark.procs
def test_token_file_protects_the_api_and_host_is_checked(nats_url, tmp_path):
    token = "cli-test-token-0123456789abcdef"
    path = tmp_path / "web.token"
    path.write_text(token + "\n")
    port = free_port()
    proc = subprocess.Popen(
        [*CLI, "web", "--port", str(port), "--nats", nats_url, "--token-file", str(path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )

    def get(path: str, headers: dict) -> tuple[int, str, dict]:
        req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=5) as r:
                return r.status, r.read().decode(), dict(r.headers)
        except urllib.error.HTTPError as err:
            return err.code, err.read().decode(), dict(err.headers)

    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                assert get("/healthz", {})[0] == 200
                break
            except OSError:
                assert proc.poll() is None, proc.communicate()
                assert time.monotonic() < deadline, "ddm-fleet web did not come up"
                time.sleep(0.2)
        assert get("/api/fleet", {})[0] == 401
        status, body, headers = get("/api/fleet", {"Authorization": f"Bearer {token}"})
        assert status == 200 and '"type": "fleet"' in body
        assert "frame-ancestors 'none'" in headers["Content-Security-Policy"] and headers["X-Frame-Options"] == "DENY"
        status, body, _ = get("/api/fleet", {"Authorization": f"Bearer {token}", "Host": "evil.example"})
        assert status == 421 and "evil.example" in body
    finally:
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    assert f"open http://127.0.0.1:{port}/#token=<token>" in out and token not in out + err
    assert "refused GET /api/fleet" in err and "evil.example" in err
