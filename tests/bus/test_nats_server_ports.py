"""A nats-server whose chosen port another process took first (tests side by side): started again on fresh
ports when this object chose them and writes the config; a caller's config file keeps the caller's ports."""

from __future__ import annotations

import socket

import pytest

import bus.nats_server as ns
from bus.nats_server import NatsServer


@pytest.fixture
def squatter():
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    yield s.getsockname()[1]
    s.close()


@pytest.mark.bus
def test_a_taken_port_is_left_for_a_fresh_one(squatter, monkeypatch, tmp_path):
    real, handed = ns.free_port, []

    def first_one_taken(host="127.0.0.1"):
        handed.append(real(host))
        return squatter if len(handed) == 1 else handed[-1]

    monkeypatch.setattr(ns, "free_port", first_one_taken)
    srv = NatsServer(log_file=tmp_path / "nats.log")
    assert srv.port == squatter
    with srv:
        assert srv.port != squatter and srv.proc is not None and srv.proc.poll() is None
        with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as c:
            assert c.recv(4) == b"INFO"  # our nats-server answers there, not the squatter
    assert "address already in use" in (tmp_path / "nats.log").read_text().lower()


@pytest.mark.bus
def test_a_callers_config_file_is_not_restarted_elsewhere(tmp_path):
    cfg = tmp_path / "nats.conf"
    cfg.write_text("listen: 127.0.0.1:1\nno_such_setting {\n")  # refused at once
    srv = NatsServer(port=4999, config_file=cfg, log_file=tmp_path / "nats.log")
    with pytest.raises(RuntimeError, match="nats-server exited"):
        srv.start(timeout=5)
    assert srv.port == 4999 and srv.proc is None
