"""`benchmarks.cpu_account`: the fleet's CPU per image against its experts' own forward, from hand-made samples."""

from __future__ import annotations

import pytest

from benchmarks.cpu_account import account, at_batch, format_account, role_of, worker_rows


def test_roles_of_the_bench_processes():
    assert [role_of(n) for n in ("coordinator", "worker0", "worker1.2", "nats-server", "decoder")] == [
        "coordinator",
        "workers",
        "workers",
        "nats-server",
        "decoder",
    ]
    assert role_of("bench (clients)") == "clients"


def test_per_row_cost_is_log_linear_between_timed_batches_and_clamped_outside():
    table = {"1": 0.004, "4": 0.002, "16": 0.001}
    assert at_batch(table, 1) == pytest.approx(0.004)
    assert at_batch(table, 2) == pytest.approx(0.003)  # halfway from 1 to 4 in log2
    assert at_batch(table, 8) == pytest.approx(0.0015)
    assert at_batch(table, 0.5) == pytest.approx(0.004) and at_batch(table, 64) == pytest.approx(0.001)
    assert at_batch({}, 4) is None


def test_worker_rows_add_up_each_experts_workers_and_padding_counts_in_the_batch():
    deltas = [
        {"rows": 60.0, "padded_rows": 4.0, "batches": 8.0, "forward_s": 1.0},
        {"rows": 40.0, "padded_rows": 0.0, "batches": 4.0},
        {"rows": 30.0, "padded_rows": 0.0, "batches": 10.0},
    ]
    rows = worker_rows(deltas, [0, 0, 1])
    assert rows == {
        0: {"rows": 100, "padded_rows": 4, "batches": 12, "mean_batch": round(104 / 12, 2)},
        1: {"rows": 30, "padded_rows": 0, "batches": 10, "mean_batch": 3.0},
    }
    assert worker_rows([deltas[0], None], [0, 1]) is None  # a worker not scraped: no figure, not a wrong one


def _limit():
    return {"experts": [{"cpu_s_per_row_by_batch": {"1": 0.004, "4": 0.002}}, {"cpu_s_per_row_by_batch": {"4": 0.001}}]}


def test_account_splits_the_fleet_by_role_and_reads_the_forward_at_the_levels_batch():
    cpu = {"coordinator": 0.5, "worker0": 1.2, "worker1": 0.6, "nats-server": 0.2, "bench (clients)": 0.9}
    rows = {
        0: {"rows": 400, "padded_rows": 0, "batches": 100, "mean_batch": 4.0},
        1: {"rows": 200, "padded_rows": 0, "batches": 50, "mean_batch": 4.0},
    }
    acc = account(cpu, images=20, steps=10, rows=rows, limit=_limit())
    fleet_s = 0.5 + 1.2 + 0.6 + 0.2  # the clients apart
    forward_s = 400 * 0.002 + 200 * 0.001
    assert acc["fleet_ms_per_image"] == pytest.approx(1000 * fleet_s / 20)
    assert acc["by_role_ms_per_image"] == {
        "coordinator": 25.0,
        "workers": 90.0,
        "nats-server": 10.0,
        "clients": 45.0,
    }
    assert acc["forward_ms_per_image"] == pytest.approx(1000 * forward_s / 20)
    assert acc["overhead_factor"] == pytest.approx(fleet_s / forward_s, rel=1e-3)
    assert acc["overhead_ms_per_image_step"] == pytest.approx(1000 * (fleet_s - forward_s) / 200, rel=1e-3)
    assert acc["mean_batch"] == {"0": 4.0, "1": 4.0}
    line = format_account(64, acc)
    assert line.startswith("conc 64: fleet 125.00 ms/img (coordinator 25.00, workers 90.00, nats-server 10.00)")
    assert "overhead x2.50" in line and "clients 45.00 ms/img apart" in line


def test_account_without_a_timed_forward_or_images_says_less_not_something_wrong():
    cpu = {"coordinator": 0.5, "worker0": None}
    rows = {0: {"rows": 400, "padded_rows": 0, "batches": 100, "mean_batch": 4.0}}
    acc = account(cpu, images=10, steps=4, rows=rows, limit=None)
    assert acc["processes_unread"] == ["worker0"] and "overhead_factor" not in acc
    assert "forward" not in format_account(1, acc)
    assert account(cpu, images=10, steps=4, rows=None, limit=_limit()).get("overhead_factor") is None
    assert account(cpu, images=0, steps=4, rows=rows, limit=_limit()) == {"images": 0}
    assert format_account(8, {"images": 0}) == "conc 8: no images"


def test_a_latent_fleets_decoder_share_is_its_fraction_of_the_fleets_cpu_and_a_pixel_fleet_has_none():
    cpu = {"coordinator": 0.5, "worker0": 1.0, "nats-server": 0.1, "decoder": 0.4, "bench (clients)": 3.0}
    acc = account(cpu, images=10, steps=4, rows=None, limit=None)
    assert acc["decoder_share"] == pytest.approx(0.4 / 2.0)  # the clients are not the fleet's
    assert acc["by_role_ms_per_image"]["decoder"] == 40.0
    line = format_account(2, acc)
    assert line.startswith(
        "conc 2: fleet 200.00 ms/img (coordinator 50.00, workers 100.00, nats-server 10.00, "
        "decoder 40.00), decoder share 20.0%"
    )
    pixel = account({"coordinator": 0.5, "worker0": 1.0}, images=10, steps=4, rows=None, limit=None)
    assert "decoder_share" not in pixel and "decoder share" not in format_account(2, pixel)
    idle = account({"coordinator": 0.0, "decoder": 0.0}, images=10, steps=4, rows=None, limit=None)
    assert "decoder_share" not in idle  # no fleet CPU read at all (ticks too coarse): no share, not 0/0


def test_reach_at_full_cores_is_the_limits_fraction_this_cpu_per_image_allows_with_every_core_busy():
    cpu = {"coordinator": 2.0, "worker0": 6.0, "worker1": 6.0, "nats-server": 0.5, "bench (clients)": 1.5}
    limit = {**_limit(), "unit": "core", "units": 2, "images_per_s": 40.0}
    acc = account(cpu, images=100, steps=40, rows=None, limit=limit, wall_s=10.0)
    assert acc["cores_busy"] == pytest.approx(16.0 / 10.0)  # the clients' CPU too: they share the cores
    # 16 CPU s for 100 images: 2 cores fully busy make 12.5 img/s, 0.3125 of the limit's 40
    assert acc["full_cores_over_limit"] == pytest.approx(2 * 100 / 16.0 / 40.0, abs=1e-3)
    assert acc["workers_alone_over_limit"] == pytest.approx(2 * 100 / 12.0 / 40.0, abs=1e-3)
    line = format_account(64, acc)
    assert "1.60 cores busy" in line and "every core busy at this CPU per image: 0.31 of the limit" in line
    assert "(0.42 with only the workers on the cores)" in line
    # a limit timed on a device says nothing of the host's cores; a process not read makes no figure
    device = account(cpu, images=100, steps=40, rows=None, limit={**limit, "unit": "device"}, wall_s=10.0)
    assert "full_cores_over_limit" not in device and device["cores_busy"] == pytest.approx(1.6)
    latent = account({**cpu, "decoder": 3.0}, images=100, steps=40, rows=None, limit=limit, wall_s=10.0)
    assert latent["workers_alone_over_limit"] == pytest.approx(2 * 100 / 15.0 / 40.0, abs=1e-3)  # its images need it
    assert "(0.33 with only the workers and the decoder on the cores)" in format_account(64, latent)
    unread = account({**cpu, "worker1": None}, images=100, steps=40, rows=None, limit=limit, wall_s=10.0)
    assert "full_cores_over_limit" not in unread and "cores_busy" not in unread
    assert "cores_busy" not in account(cpu, images=100, steps=40, rows=None, limit=None)
