"""benchmarks.step_profile: reading the processes' clocks from /metrics text and splitting a tick's time."""

import pytest

from benchmarks import step_profile as sp

COORDINATOR_TEXT = """# HELP ddm_coordinator_ticks_total Ticks.
# TYPE ddm_coordinator_ticks_total counter
ddm_coordinator_ticks_total 100.0
ddm_coordinator_tick_seconds_total 1.2
ddm_coordinator_router_seconds_total 0.3
ddm_coordinator_expert_request_seconds_sum{expert="0"} 0.6
ddm_coordinator_expert_request_seconds_sum{expert="1"} 0.4
ddm_coordinator_expert_request_seconds_count{expert="0"} 60.0
ddm_coordinator_expert_request_seconds_count{expert="1"} 40.0
ddm_coordinator_expert_request_seconds_bucket{expert="0",le="0.1"} 60.0
ddm_coordinator_rows_stepped_total 100.0
"""


def test_parse_samples_sums_label_sets_and_ignores_other_series():
    got = sp.parse_samples(COORDINATOR_TEXT, sp.COORDINATOR_SERIES)
    assert got == {"ticks": 100.0, "tick_s": 1.2, "router_s": 0.3, "call_s": 1.0, "calls": 100.0, "ahead_rows": 0.0}
    assert sp.parse_samples("garbage line\nddm_worker_latency_seconds_sum nan?\n", sp.WORKER_SERIES)["latency_s"] == 0


def test_fleet_split_names_each_part_per_tick():
    before = {"ticks": 0.0, "tick_s": 0.0, "router_s": 0.0, "call_s": 0.0, "calls": 0.0}
    after = sp.parse_samples(COORDINATOR_TEXT, sp.COORDINATOR_SERIES)
    w0 = {"latency_s": 0.5, "requests": 60.0, "forward_s": 0.4, "forwards": 60.0}
    w1 = {"latency_s": 0.3, "requests": 40.0, "forward_s": 0.2, "forwards": 40.0}
    workers = sp.summed([w0, w1])
    split = sp.fleet_split(sp.delta(before, after), workers, client_step_s=0.013)
    assert split["ticks"] == 100
    assert split["tick"] == pytest.approx(12.0) and split["expert_call"] == pytest.approx(10.0)
    assert split["coordinator"] == pytest.approx(2.0) and split["router"] == pytest.approx(3.0)
    assert split["forward"] == pytest.approx(6.0) and split["worker"] == pytest.approx(2.0)
    assert split["wire"] == pytest.approx(2.0)  # 10 ms call - 8 ms receive-to-reply
    assert split["client_step"] == pytest.approx(13.0) and split["outside_ticks"] == pytest.approx(1.0)
    # a worker that could not be scraped: no worker parts rather than wrong ones
    partial = sp.fleet_split(sp.delta(before, after), sp.summed([w0, None]), None)
    assert "forward" not in partial and "wire" not in partial and "client_step" not in partial
    assert sp.fleet_split(None, workers, None) is None
    # running ahead: 80 of the 100 ticks took a streamed velocity; the workers' 100 forwards hold all the
    # steps, their receive-to-reply only the 20 requests' first ones: no wire / worker split then
    ahead = dict(sp.delta(before, after), ahead_rows=80.0)
    split = sp.fleet_split(ahead, workers, None)
    assert split["run_ahead_rows"] == pytest.approx(0.8) and split["forward"] == pytest.approx(6.0)
    assert "wire" not in split and "worker" not in split
    lines = sp.format_split(1, split, None)
    assert any("rows answered by running ahead" in line and "0.80" in line for line in lines)
    assert sp.fleet_split(dict(before), workers, None) is None  # no ticks in the level


def test_format_split_puts_fleet_beside_in_process():
    fleet = {"ticks": 10, "tick": 12.0, "coordinator": 2.0, "expert_call": 10.0, "forward": 6.0}
    ceiling = sp.inprocess_split(10, 0.1, 0.02, 0.09, 0.011)
    lines = sp.format_split(1, fleet, ceiling)
    assert "ticks fleet / in-process: 10 / 10" in lines[0]
    row = next(line for line in lines if "expert call" in line)
    assert row.split()[-2:] == ["10.00", "9.00"]
    fwd = next(line for line in lines if line.strip().startswith("forward"))
    assert fwd.split()[-2:] == ["6.00", "-"]
    assert sp.format_split(1, None, None) == []


def test_parallel_calls_are_summed_and_the_coordinator_share_is_not_derived():
    coord = {"ticks": 10.0, "tick_s": 0.8, "router_s": 0.1, "call_s": 1.2, "calls": 20.0}
    workers = {"latency_s": 1.0, "requests": 20.0, "forward_s": 0.7, "forwards": 20.0}
    split = sp.fleet_split(coord, workers, None)
    assert split["calls_per_tick"] == 2 and split["expert_call"] == pytest.approx(120.0)
    assert "coordinator" not in split and split["forward"] == pytest.approx(70.0)
    assert "in parallel" in sp.format_split(64, split, None)[0]
    assert "coordinator" not in sp.inprocess_split(10, 0.8, 0.1, 1.2, None)
