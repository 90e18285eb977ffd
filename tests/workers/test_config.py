"""workers.config.WorkerConfig: range checks that say how to fix, one declaration of the worker's options
for `ddm-fleet worker` and `bench worker`, and ExpertWorker built from it."""

from __future__ import annotations

import argparse

import pytest

from workers.config import DEFAULT_BUCKETS, WorkerConfig


def _parse(argv, defaults=None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    WorkerConfig.add_arguments(p, defaults=defaults)
    return p.parse_args(argv)


@pytest.mark.parametrize(
    "kwargs, hint",
    [
        (dict(backend="tensorflow"), "torch, xla, jax, sim"),
        (dict(buckets="1,x"), "comma-separated positive integers"),
        (dict(buckets=(1, 2), max_batch=4), "add a bucket >= 4"),
        (dict(merge="sometimes"), "auto, always"),
        (dict(max_request_rows=0), "positive"),
        (dict(max_queue_rows=0), "positive or None"),
        (dict(max_inflight=0), ">= 1"),
        (dict(metrics_port=70000), "1-65535"),
        (dict(connect_attempts=0), "tries for the first bus connection"),
        (dict(reconnect_wait_s=-1), ">= 0"),
        (dict(threads=0), ">= 1"),
        (dict(sim_preset="instant"), "need --backend sim"),
        (dict(backend="sim", sim_row_ms=-0.5), ">= 0 milliseconds"),
        (dict(direct_scope="a.b"), "one subject token"),
        (dict(batch_quantum=-1), "0 \\(off\\) to 256 rows"),
    ],
)
def test_out_of_range_options_say_how_to_fix(kwargs, hint):
    with pytest.raises(ValueError, match=hint):
        WorkerConfig(**kwargs)


def test_normalised_values():
    c = WorkerConfig(buckets="8,1,4,4", max_request_rows=10_000, metrics_port=0)
    assert c.buckets == (1, 4, 8) and c.max_request_rows == 512 and c.metrics_port is None
    assert c.plan() == ((1, 4, 8), 8)
    assert WorkerConfig(buckets=(1, 2, 4, 8), max_batch=3).plan() == ((1, 2, 4), 3)
    assert WorkerConfig().buckets == DEFAULT_BUCKETS


def test_backend_options_only_for_their_backend():
    assert WorkerConfig(threads=2, xla_cache="/c").backend_options() == {"threads": 2, "compile": "auto"}
    assert WorkerConfig(backend="xla", threads=2, xla_cache="/c").backend_options() == {"cache_path": "/c"}
    assert WorkerConfig(backend="sim", sim_preset="instant", sim_row_ms=0.5).backend_options() == {
        "preset": "instant",
        "row_ms": 0.5,
    }


def test_arguments_round_trip_and_defaults():
    assert WorkerConfig.from_args(_parse([])) == WorkerConfig()
    c = WorkerConfig.from_args(
        _parse(
            [
                "--backend",
                "sim",
                "--sim-preset",
                "h200-jax",
                "--buckets",
                "1,2,4",
                "--max-batch",
                "3",
                "--dtype",
                "bfloat16",
                "--max-queue-rows",
                "0",
                "--merge",
                "always",
            ]
        )
    )
    assert (c.backend, c.sim_preset, c.buckets, c.max_batch, c.dtype, c.max_queue_rows, c.merge) == (
        "sim",
        "h200-jax",
        (1, 2, 4),
        3,
        "bfloat16",
        None,
        "always",
    )
    # to_argv gives a worker the same config
    assert WorkerConfig.from_args(_parse(c.to_argv())) == c
    invariant = WorkerConfig.from_args(_parse(["--batch-invariant"]))
    assert invariant.batch_quantum == 16 and WorkerConfig.from_args(_parse(invariant.to_argv())) == invariant
    assert WorkerConfig.from_args(_parse(["--batch-quantum", "32"])).batch_quantum == 32
    assert WorkerConfig.from_args(_parse(WorkerConfig().to_argv())) == WorkerConfig()


def test_dtype_option_and_its_deprecated_bf16_spellings(capsys):
    assert _parse([]).dtype == "auto" == WorkerConfig().dtype
    assert _parse(["--dtype", "float32"]).dtype == "float32"
    assert capsys.readouterr().err == ""
    assert _parse(["--bf16"]).dtype == "bfloat16"  # deprecated alias of --dtype bfloat16, with a warning
    assert "--bf16 is deprecated and will be removed; use --dtype bfloat16" in capsys.readouterr().err
    assert _parse(["--bf16", "--no-bf16"]).dtype == "float32"
    assert _parse(["--dtype", "bfloat16", "--dtype", "float32"]).dtype == "float32"  # the last one wins
    with pytest.raises(SystemExit):
        _parse(["--dtype", "float16"])
    assert "invalid choice: 'float16'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="unknown dtype 'half'"):
        WorkerConfig(dtype="half")
    assert WorkerConfig(dtype="BF16").dtype == "bfloat16"
    assert WorkerConfig.from_args(_parse(WorkerConfig(dtype="float32").to_argv())).dtype == "float32"


def test_a_command_can_change_a_default_and_say_so():
    defaults = {"buckets": "1,8,64", "max_queue_rows": 1 << 20, "merge": "auto"}
    c = WorkerConfig.from_args(_parse([], defaults=defaults))
    assert c.buckets == (1, 8, 64) and c.max_queue_rows == 1 << 20
    changed = c.changed_defaults(defaults)
    assert changed == {"buckets": ((1, 8, 64), DEFAULT_BUCKETS), "max_queue_rows": (1 << 20, 4096)}
    with pytest.raises(ValueError, match="no option"):
        WorkerConfig.add_arguments(argparse.ArgumentParser(), defaults={"bucket": "1"})


def test_worker_and_bench_declare_the_same_options():
    from benchmarks import worker as bench
    from infra import cmd_worker

    def dests(add):
        p = argparse.ArgumentParser()
        add(p)
        return {a.dest for a in p._actions}

    config_fields = {f for f in WorkerConfig.__dataclass_fields__} - {"reconnect_wait_s"}
    assert config_fields <= dests(cmd_worker.add_arguments)
    assert config_fields <= dests(bench.add_arguments)


def test_bench_says_which_worker_defaults_it_changed():
    from benchmarks.worker import BENCH_WORKER_DEFAULTS, _defaults_in_use, format_table

    p = argparse.ArgumentParser()
    WorkerConfig.add_arguments(p, defaults=BENCH_WORKER_DEFAULTS)
    kept = _defaults_in_use(WorkerConfig.from_args(p.parse_args([])))
    assert kept["--buckets"] == {"bench": "1,8,64", "worker": "1,2,4,8,16,32,64,128"}
    assert "--max-queue-rows" in kept and "--max-inflight" in kept
    overridden = _defaults_in_use(WorkerConfig.from_args(p.parse_args(["--buckets", "1,4"])))
    assert "--buckets" not in overridden  # the user chose: nothing to announce
    setup = {
        "backend": "torch",
        "device": "cpu",
        "precision": "float32",
        "checkpoint": "x",
        "worker_defaults_changed": kept,
    }
    assert "--buckets 1,8,64 (ddm-fleet worker: 1,2,4,8,16,32,64,128)" in format_table({"setup": setup, "rows": []})


def test_expert_worker_takes_a_config_and_keyword_overrides(tiny_expert_checkpoint):
    from workers.service import ExpertWorker

    cfg = WorkerConfig(buckets=(1, 2, 4), max_queue_rows=64, merge="always", connect_attempts=3)
    w = ExpertWorker(0, tiny_expert_checkpoint, config=cfg)
    assert (w.buckets, w.max_batch, w.max_queue_rows, w.merge, w.connect_attempts) == ((1, 2, 4), 4, 64, "always", 3)
    w = ExpertWorker(0, tiny_expert_checkpoint, config=cfg, max_batch=2, reconnect_wait=0.25)
    assert (w.buckets, w.max_batch, w.reconnect_wait, w.config.max_queue_rows) == ((1, 2), 2, 0.25, 64)
    sim = ExpertWorker(0, tiny_expert_checkpoint, config=WorkerConfig(backend="sim", sim_preset="instant"))
    assert sim._backend_name == "sim" and sim.backend_options == {"preset": "instant"}
    with pytest.raises(TypeError, match="bucket"):
        ExpertWorker(0, tiny_expert_checkpoint, bucket=(1,))


def test_every_flag_round_trips_through_to_argv():
    """Each option's one declaration gives both its flag and its `to_argv` spelling: a config with every
    field away from its default comes back equal (reconnect_wait_s has no flag)."""
    c = WorkerConfig(
        backend="sim",
        sim_preset="instant",
        sim_batch_ms=0.25,
        sim_row_ms=0.5,
        device="cpu",
        dtype="bfloat16",
        buckets=(1, 4),
        max_batch=3,
        merge="always",
        inline_forward_ms=5.0,
        max_request_rows=100,
        max_queue_rows=None,
        max_inflight=7,
        metrics_port=9999,
        metrics_host="0.0.0.0",
        connect_attempts=2,
        threads=3,
        compile="off",
        batch_quantum=32,
        xla_cache="/c",
        direct_scope="leaf-expert-0",
    )
    assert {f for f in WorkerConfig.__dataclass_fields__ if getattr(c, f) == getattr(WorkerConfig(), f)} == {
        "reconnect_wait_s"
    }
    assert WorkerConfig.from_args(_parse(c.to_argv())) == c
