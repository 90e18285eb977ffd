"""CoordinatorConfig: one declaration of `ddm-fleet coordinator`'s settings, checked once, read back
from the command line and handed to a child coordinator unchanged."""

from __future__ import annotations

import argparse

import pytest

from coordinator.config import DEFAULT_METRICS_PORT, GROUPS, CoordinatorConfig, TransportSettings
from coordinator.option import options_of


def _parse(argv, **kw):
    parser = argparse.ArgumentParser()
    CoordinatorConfig.add_arguments(parser, **kw)
    return parser.parse_args(argv)


@pytest.mark.parametrize(
    "change, flag",
    [
        (dict(max_rows=0), "--max-rows"),
        (dict(step_timeout=0.0), "--step-timeout-s"),
        (dict(wait_experts=-1.0), "--wait-experts-s"),
        (dict(request_rows=513), "--request-rows"),
        (dict(js_replicas=6), "--js-replicas"),
        (dict(name=""), "--name"),
        (dict(hedge="sometimes"), "--hedge"),
        (dict(cohorts=0), "--cohorts"),
        (dict(metrics_port=70000), "--metrics-port"),
        (dict(hedge_after_s=-1.0), "--hedge-after-s"),
    ],
)
def test_a_bad_setting_names_its_flag(change, flag):
    with pytest.raises(ValueError, match=flag):
        CoordinatorConfig(**change)


def test_command_line_values_map_to_the_config():
    cfg = CoordinatorConfig.from_args(
        _parse(
            ["--max-job-cost", "0", "--max-job-run-s", "0", "--no-speculate", "--metrics-port", "0", "--cohorts", "3"]
        )
    )
    assert cfg.max_job_cost is None and cfg.max_job_run_s is None and cfg.speculate is False
    assert cfg.metrics_port is None and cfg.cohorts == 3
    default = CoordinatorConfig.from_args(_parse([]))
    assert (default.metrics_port, default.metrics_optional) == (DEFAULT_METRICS_PORT, True)
    assert default.step_timeout == 10.0 and default.speculate is True


def test_the_old_on_off_spelling_still_works_with_a_warning(capsys):
    assert CoordinatorConfig.from_args(_parse(["--speculate", "off"])).speculate is False
    assert "--no-speculate" in capsys.readouterr().err


def test_seconds_are_spelled_with_s_and_the_old_spellings_still_work_with_a_warning(capsys):
    cfg = CoordinatorConfig.from_args(_parse(["--step-timeout-s", "2.5", "--wait-experts-s", "7"]))
    assert (cfg.step_timeout, cfg.wait_experts) == (2.5, 7.0)
    assert "deprecated" not in capsys.readouterr().err
    cfg = CoordinatorConfig.from_args(_parse(["--step-timeout", "3", "--wait-experts", "4"]))
    assert (cfg.step_timeout, cfg.wait_experts) == (3.0, 4.0)
    err = capsys.readouterr().err
    assert "--step-timeout is deprecated and will be removed; use --step-timeout-s" in err, err
    assert "--wait-experts is deprecated and will be removed; use --wait-experts-s" in err, err
    assert CoordinatorConfig(step_timeout=3.0).to_argv(only=["step_timeout"]) == ["--step-timeout-s", "3.0"]
    with pytest.raises(ValueError, match="--step-timeout-s must be"):
        CoordinatorConfig.from_args(_parse(["--step-timeout", "0"]))


def test_to_argv_round_trips_through_the_parser():
    cfg = CoordinatorConfig(
        max_rows=64, step_timeout=2.5, speculate=False, durable=True, max_job_cost=None, hedge_after_s=0.2, name="c-1"
    )
    again = CoordinatorConfig.from_args(_parse(cfg.to_argv()))
    assert again.replace(metrics_port=None, metrics_optional=False, nats=None) == cfg


def test_a_bench_declares_a_subset_with_its_own_defaults_and_says_so():
    only, defaults = ("step_timeout", "retries", "speculate"), {"step_timeout": 60.0, "retries": 2}
    args = _parse([], only=only, defaults=defaults)
    assert (args.step_timeout, args.retries, args.speculate) == (60.0, 2, True) and not hasattr(args, "max_rows")
    note = CoordinatorConfig.differing_defaults(defaults)
    assert note == "bench defaults differing from `ddm-fleet coordinator`: --step-timeout-s 60 (coordinator: 10)"
    with pytest.raises(ValueError, match="no coordinator flag"):
        _parse([], only=("step_timeout", "bogus"))


def test_client_quotas_are_on_by_default_and_scale_with_the_queue():
    """A client never gets every row or every queue slot with the shipped settings, and the queue
    quota follows --max-queued-jobs (a quarter of it) unless given."""
    base = CoordinatorConfig().scheduler_config(2)
    assert (base.client_rows, base.max_rows, base.client_queued_jobs, base.max_queued_jobs) == (256, 1024, 64, 256)
    small = CoordinatorConfig(max_queued_jobs=16).scheduler_config(2)
    assert small.client_queued_jobs == 4
    assert CoordinatorConfig(max_queued_jobs=16, max_client_queued_jobs=16).scheduler_config(2).client_queued_jobs == 16
    assert CoordinatorConfig(max_queued_jobs=1).scheduler_config(2).client_queued_jobs == 1
    assert (CoordinatorConfig().submit_rate, CoordinatorConfig().status_rate) == (50.0, 50.0)


def test_each_setting_reads_by_its_name_and_by_its_group():
    cfg = CoordinatorConfig(max_rows=8, step_timeout=2.0, transport=TransportSettings(retries=5))
    assert (cfg.max_rows, cfg.limits.max_rows) == (8, 8)
    assert (cfg.step_timeout, cfg.retries) == (2.0, 5) and cfg.transport == TransportSettings(
        step_timeout=2.0, retries=5
    )
    assert cfg.replace(retries=1).transport.retries == 1 and cfg.transport.retries == 5
    with pytest.raises(TypeError, match="bogus"):
        CoordinatorConfig(bogus=1)


def test_every_bounded_flag_is_checked_and_named_by_its_one_declaration():
    """The range check comes from the same declaration as the flag: a value below each declared bound
    is refused, naming that flag."""
    for group in GROUPS.values():
        for name, opt in options_of(group).items():
            if opt.number in (int, float) and opt.low is not None:
                with pytest.raises(ValueError, match=f"^{opt.label} must be"):
                    group(**{name: opt.low - 1})


def test_the_choice_lists_are_one_list_each():
    """The hedge and dispatch modes the config offers are the ones the hedging and dispatch policies serve:
    one tuple each (coordinator/choices.py), re-exported by the policies, not copies that could drift."""
    from coordinator import choices, dispatch, hedging

    assert hedging.HEDGE_MODES is choices.HEDGE_MODES and dispatch.DISPATCH_MODES is choices.DISPATCH_MODES


def test_the_transport_and_the_engine_take_their_settings_whole():
    """`NatsTransport.from_settings` / `Engine.from_settings` read every field of their group (the coordinator
    hands `settings.transport` and `settings.engine` whole): none left at its default."""
    from coordinator.engine import Engine
    from coordinator.local_fleet import LabelRouter
    from coordinator.scheduler import Scheduler, SchedulerConfig
    from coordinator.transport import NatsTransport

    cfg = CoordinatorConfig(
        step_timeout=3.5,
        retries=1,
        bad_reply_retries=2,
        wire_dtype="float16",
        hedge="off",
        hedge_after_s=0.2,
        dispatch="queue",
        request_rows=64,
        cohorts=3,
        route_every=2,
        speculate=False,
        run_ahead=4,
        run_ahead_rows=32,
    )
    t = NatsTransport.from_settings(None, cfg.transport)
    assert (t.step_timeout, t.retries, t.bad_reply_retries, t.wire_dtype, t.max_rows) == (3.5, 1, 2, "float16", 64)
    assert t.dispatch == "queue" and t.dispatcher is None and t.hedging.mode == "off"
    e = Engine.from_settings(Scheduler(SchedulerConfig(num_experts=2)), LabelRouter([0] * 10, 2), t, None, cfg.engine)
    x = e.executor
    assert e.cohorts == 3 and (x.route_every, x.speculate, x.run_ahead, x.run_ahead_rows) == (2, False, 4, 32)
