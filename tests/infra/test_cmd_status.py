"""`ddm-fleet status`: the table from hand-made snapshots (pure), and the exit codes against a real bus with
no fleet and with none at all. The command against a real fleet: tests/infra/test_cmd_generate.py."""

from __future__ import annotations

from infra.cmd_status import format_status


def _worker(wid: str, **kw) -> dict:
    row = {
        "id": wid,
        "name": "ddm-expert",
        "version": "0.1.0",
        "backend": "torch",
        "device": "cpu",
        "dtype": "float32",
        "compiled": False,
        "host": "host-a",
        "requests": 12,
        "errors": 0,
        "rows_per_s": 310.5,
        "rate_unit": "rows/s",
        "latency_ms": 4.25,
        "stale": False,
    }
    return {**row, **kw}


def test_the_table_lists_the_coordinator_each_experts_workers_and_other_services():
    snap = {
        "type": "fleet",
        "experts": [
            {"expert": 0, "workers": [_worker("W" * 14 + "aaaa0001"), _worker("W" * 14 + "bbbb0002", compiled=True)]},
            {
                "expert": 1,
                "workers": [
                    _worker("W" * 14 + "cccc0003", backend="jax", device="cuda:0", dtype="bfloat16", host="gpu-1"),
                    _worker("W" * 14 + "dddd0004", stale=True, rows_per_s=None, latency_ms=None),
                ],
            },
        ],
        "services": [
            {
                "name": "ddm-decoder",
                "id": "S" * 14 + "eeee0005",
                "host": "host-b",
                "decoder": "0123456789abcdef",
                "image_shape": "3,256,256",
            },
        ],
        "coordinator": {
            "coordinator": "coord-1",
            "active_jobs": 2,
            "queued_jobs": 0,
            "rows_per_s": 120.5,
            "unavailable_experts": [1],
        },
        "coordinator_stale": False,
        "time": 0.0,
    }
    text = format_status(snap)
    lines = text.splitlines()
    assert lines[0] == "coordinator coord-1: active_jobs 2 · queued_jobs 0 · rows_per_s 120.5"
    assert lines[1] == "  unavailable_experts [1]"
    assert "expert 0 · 2 workers" in lines and "expert 1 · 2 workers" in lines
    row = next(line for line in lines if "aaaa0001" in line)
    assert row.split() == ["aaaa0001", "host-a", "torch", "·", "cpu", "float32", "310.5", "4.2", "12", "0"]
    assert "float32, compiled" in next(line for line in lines if "bbbb0002" in line)
    assert "jax · cuda:0" in text and "bfloat16" in text and "gpu-1" in text
    late = next(line for line in lines if "dddd0004" in line)
    assert "(late)" in late and late.count("…") == 2  # no rate, no latency for a worker that missed the round
    assert "other services" in lines and "decoder 0123456789ab… -> 3,256,256" in text
    # every worker table is aligned: its header and rows start their columns at the same places
    header = next(line for line in lines if line.strip().startswith("worker"))
    assert row.index("host-a") == header.index("host")


def test_a_missing_or_stale_coordinator_and_no_workers_are_said():
    base = {"type": "fleet", "experts": [], "services": [], "time": 0.0}
    text = format_status({**base, "coordinator": None, "coordinator_stale": False})
    assert text.splitlines() == ["coordinator: not answering", "no expert workers discovered"]
    stale = format_status({**base, "coordinator": {"active_jobs": 1}, "coordinator_stale": True})
    assert stale.startswith("coordinator (no answer this time: its last status): active_jobs 1")
    req = _worker("x" * 8, rate_unit="req/s", rows_per_s=3.0)
    line = format_status({**base, "experts": [{"expert": 3, "workers": [req]}], "coordinator": None})
    assert "3.0 req" in line and "expert 3 · 1 worker\n" in line


def test_exit_codes_no_coordinator_on_a_real_bus_and_no_bus(nats_url, capsys):
    from bus.nats_server import free_port
    from infra.cli import main

    assert main(["status", "--nats", nats_url, "--window", "0.2", "--rate-over", "0"]) == 3
    out = capsys.readouterr().out
    assert "coordinator: not answering" in out and "no expert workers discovered" in out
    assert main(["status", "--nats", f"nats://127.0.0.1:{free_port()}", "--rate-over", "0"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("ddm-fleet status: ") and "Traceback" not in err
    assert main(["status", "--nats", "nats://bad user:pw@127.0.0.1:1"]) == 2
    assert "ddm-fleet status: " in capsys.readouterr().err


def test_what_services_send_cannot_drive_the_operators_terminal():
    # a hostile service's metadata and a status string carry terminal escape sequences (clear screen, retitle)
    evil = _worker("\x1b[2J" + "x" * 8, host="h\x1b]0;pwned\x07", backend="torch\r\nFAKE LINE", device="c" * 300)
    snap = {
        "type": "fleet",
        "experts": [{"expert": 0, "workers": [evil]}],
        "services": [{"name": "svc\x9b31m", "id": "i" * 8, "host": "h", "decoder": "\x1bd", "image_shape": "3"}],
        "coordinator": {"coordinator": "c\x1b[1m", "note": "\x1b[31mred"},
        "coordinator_stale": False,
        "time": 0.0,
    }
    text = format_status(snap)
    assert not any(ch in text for ch in "\x1b\x07\x9b\r"), repr(text)
    assert "FAKE LINE" in text and "\nFAKE LINE" not in text  # kept visible, on its own row's line
    assert "c" * 65 not in text and "c" * 64 + "…" in text  # a long value is cut
