"""`ddm-fleet bench fleet`: argument checks, the in-process ceiling path, the per-level minimum duration,
the forward-only limit, and the report table."""

from __future__ import annotations

import argparse
import json

import pytest

from benchmarks import fleet as bench


def _args(**kw):
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    a = p.parse_args([])
    for k, v in kw.items():
        setattr(a, k, v)
    return a


def test_bad_arguments_are_refused(capsys):
    assert bench.run(_args(concurrency="1,x")) == 2
    assert "--concurrency" in capsys.readouterr().err
    assert bench.run(_args(steps=0)) == 2
    assert "--steps" in capsys.readouterr().err
    assert bench.run(_args(max_rows=0)) == 2
    assert "--max-rows" in capsys.readouterr().err
    assert bench.run(_args(job_timeout=0.0)) == 2
    assert "--job-timeout" in capsys.readouterr().err
    assert bench.run(_args(router="/nonexistent.safetensors")) == 2
    assert "--router /nonexistent.safetensors does not exist" in capsys.readouterr().err
    assert bench.run(_args(min_level_s=-1.0)) == 2
    assert "--min-level-s" in capsys.readouterr().err
    assert bench.run(_args(limit_batches="8,x")) == 2
    assert "--limit-batches" in capsys.readouterr().err


async def test_ceiling_path_measures_every_concurrency(tmp_path):
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        args = _args(
            concurrency="1,3",
            steps=2,
            widths="8,16,32",
            checkpoints=str(tmp_path / "none"),
            buckets="1,4",
            only="ceiling",
            jobs_per_client=2,
            min_level_s=0.0,
            limit_batches="1,4",
        )
        args.concurrency_list = [1, 3]
        res = await bench.bench_fleet(args)
    finally:
        torch.set_num_threads(threads)
    assert res["setup"]["models"].startswith("random UNets")
    rows = {r["concurrency"]: r for r in res["rows"]}
    assert rows[1]["ceiling"]["jobs"] == 2 and rows[3]["ceiling"]["jobs"] == 6
    assert rows[3]["ceiling"]["images"] == 6 and rows[3]["ceiling"]["images_per_s"] > 0
    assert rows[3]["ceiling"]["p99_s"] >= rows[3]["ceiling"]["p50_s"] > 0
    assert rows[3]["ceiling"]["submitted"] == 6 and rows[3]["ceiling"]["completed"] == 6
    assert rows[3]["ceiling"]["rejected"] == rows[3]["ceiling"]["lost"] == rows[3]["ceiling"]["failed"] == 0
    assert rows[1]["ceiling"]["jobs_per_client"] == [2, 2]  # --min-level-s 0: exactly --jobs-per-client
    table = bench.format_table(res).splitlines()
    assert "ceil img/s" in table[2] and [t.split()[0] for t in table[3:5]] == ["1", "3"]
    assert table[4].split("|")[2].split()[3] == "6"  # ceiling 3: jobs run
    assert table[5].startswith("forward-only limit ")
    assert table[6].startswith("the limit at each level's load") and "conc 3: batch 1.5, " in table[6]
    assert table[10].split("|")[1].split() == ["6", "6", "0", "0", "0"]  # ceiling 3: submitted .. LOST


def test_a_level_lasts_min_level_s_and_the_forward_limit_is_reported(tmp_path, capsys):
    # One client, jobs of a few ms: with --min-level-s 0.6 it runs far more than --jobs-per-client 2
    # jobs, and the level lasts the 0.6 s. The limit (tiny experts' forward alone) is at least the
    # in-process rate, give or take the noise of a shared machine.
    args = _args(
        concurrency="1,2",
        steps=2,
        widths="8,16,32",
        checkpoints=str(tmp_path / "none"),
        buckets="1,4",
        only="ceiling",
        jobs_per_client=2,
        min_level_s=0.6,
        limit_batches="1,4",
        threads=1,
        json=True,
        dtype="float32",  # these tiny random experts run slower under bfloat16 autocast than in float32
    )
    import torch

    threads = torch.get_num_threads()
    try:
        assert bench.run(args) == 0
    finally:
        torch.set_num_threads(threads)
    res = json.loads(capsys.readouterr().out)
    assert res["setup"]["min_level_s"] == 0.6
    for row in res["rows"]:
        x = row["ceiling"]
        assert x["wall_s"] >= 0.6, x
        assert x["submitted"] == x["completed"] > 2 * row["concurrency"], x
        lo, hi = x["jobs_per_client"]
        assert 2 < lo <= hi and lo * row["concurrency"] <= x["submitted"] <= hi * row["concurrency"]
    lim = res["limit"]
    assert lim["rows_per_image"] == 2 and lim["evals_per_step"] == 1 and lim["experts_per_row"] == 1
    assert lim["unit"] == "core" and lim["threads_per_forward"] == 1 and lim["batches"] == [1, 4]
    assert [e["best_batch"] in (1, 4) for e in lim["experts"]] == [True, True]
    assert lim["images_per_s"] == pytest.approx(lim["rows_per_s"] / 2, rel=0.01)
    for row in res["rows"]:
        assert row["ceiling_over_limit"] == pytest.approx(
            row["ceiling"]["images_per_s"] / lim["images_per_s"], rel=0.01
        )
        assert row["ceiling_over_limit"] < 1.5, (row, lim)  # the forward alone is the limit, within noise
        at = row["limit_at_load"]  # 1 or 2 rows over 2 experts: each expert read at its smallest timed batch
        assert at["batch"] == max(1.0, row["concurrency"] / 2)
        assert at["images_per_s"] <= lim["images_per_s"] * 1.001
        assert row["ceiling_over_limit_at_load"] == pytest.approx(
            row["ceiling"]["images_per_s"] / at["images_per_s"], rel=0.01
        )
    assert "fleet_over_limit" not in res["rows"][0]


def test_limit_counts_rows_per_image_for_the_run_s_solver_and_strategy(tmp_path):
    # heun: 2 evaluations per step; full: every expert per row. 3 steps x 2 x 2 experts = 12 rows per image.
    args = _args(
        steps=3, solver="heun", strategy="full", widths="8,16,32", checkpoints=str(tmp_path / "none"), limit_batches="2"
    )
    models = bench._models(args, str(tmp_path))
    lim = bench._forward_limit(args, models)
    assert (lim["evals_per_step"], lim["experts_per_row"], lim["rows_per_image"]) == (2, 2, 12)
    assert lim["images_per_s"] == pytest.approx(lim["rows_per_s"] / 12, rel=0.01)
    assert bench._forward_limit(_args(limit_batches="none"), models) is None


def test_the_limit_at_a_level_s_load_reads_each_expert_at_the_batch_the_load_allows():
    """64 rows over 2 experts: calls of at most 32 rows, so each expert's rate is read at batch 32 (log-linear
    between the timed 8 and 128), never above its best; one row per expert reads the smallest timed batch."""
    lim = {
        "units": 2,
        "rows_per_image": 40,
        "experts": [
            {"rows_per_s": 400.0, "rows_per_s_by_batch": {"8": 100.0, "32": 200.0, "128": 400.0}},
            {"rows_per_s": 300.0, "rows_per_s_by_batch": {"8": 100.0, "128": 300.0}},
        ],
    }
    at = bench.limit_at_load(lim, 64, 2)
    assert at["batch"] == 32
    # expert 0 at 32: 200 (timed); expert 1 at 32: halfway from 8 to 128 in log2 -> 200; 2 cores
    assert at["rows_per_s"] == pytest.approx(2 * 200.0) and at["images_per_s"] == pytest.approx(400.0 / 40)
    assert bench.limit_at_load(lim, 2, 2)["rows_per_s"] == pytest.approx(2 * 100.0)  # below 8: clamped to 8
    big = bench.limit_at_load(lim, 10_000, 2)  # above the largest timed batch: the experts' best
    assert big["rows_per_s"] == pytest.approx(2 / ((1 / 400 + 1 / 300) / 2), abs=0.1)


def test_auto_cohorts_are_what_up_starts_on_this_host_and_a_number_is_kept():
    import argparse
    import os

    from benchmarks.fleet import bench_cohorts
    from infra.cmd_up import shared_cpu_cohorts

    def args(**kw):
        return argparse.Namespace(**{"cohorts": "auto", "workers_per_expert": 1, "device": "cpu", **kw})

    assert bench_cohorts(args(cohorts=2), 2) == 2 and bench_cohorts(args(cohorts=1), 64) == 1
    up = shared_cpu_cohorts("", 1, 2, accelerator=False)  # what `up` starts here with 2 CPU experts
    assert bench_cohorts(args(), 2) == (int(up[1]) if up else "auto")
    assert bench_cohorts(args(device="cuda"), 2) == "auto"  # the workers on a device: the coordinator's auto
    assert bench_cohorts(args(workers_per_expert=2), 2) == "auto"
    assert bench_cohorts(args(), (os.cpu_count() or 1)) == 1  # as many experts as cores: one cohort


def test_table_shows_ratio():
    res = {
        "setup": {
            "models": "m",
            "experts": 2,
            "steps": 4,
            "solver": "euler",
            "strategy": "top1",
            "images_per_job": 1,
            "jobs_per_client": 1,
            "stream": True,
            "bf16": False,
            "cpus": 2,
        },
        "rows": [
            {
                "concurrency": 8,
                "fleet": {"images_per_s": 5.0, "p50_s": 1.0, "p99_s": 2.0},
                "ceiling": {"images_per_s": 10.0, "p50_s": 0.5, "p99_s": 1.0},
                "ratio": 0.5,
            }
        ],
    }
    res["limit"] = {
        "images_per_s": 20.0,
        "rows_per_s": 800.0,
        "rows_per_image": 40,
        "evals_per_step": 1,
        "experts_per_row": 1,
        "threads_per_forward": 1,
        "units": 2,
        "unit": "core",
        "batches": [8, 32],
        "experts": [{"best_batch": 32, "rows_per_s": 400.0, "rows_per_s_by_batch": {"8": 300.0, "32": 400.0}}],
    }
    res["rows"][0]["fleet_over_limit"] = 0.25
    res["rows"][0]["ceiling_over_limit"] = 0.5
    lines = bench.format_table(res).splitlines()
    assert lines[1].split("|")[-1].split() == ["fleet/ceil", "fleet/lim", "ceil/lim"]
    assert lines[2].split() == [
        "8",
        "|",
        "5.0",
        "1.000",
        "2.000",
        "-",
        "|",
        "10.0",
        "0.500",
        "1.000",
        "-",
        "|",
        "0.50",
        "0.25",
        "0.50",
    ]
    assert lines[3].startswith("forward-only limit 20.0 img/s = 800 rows/s / 40 rows per image")
    assert "expert0 400 rows/s at batch 32" in lines[3] and "one thread per core x 2 cores" in lines[3]


@pytest.mark.slow  # ~10 s: a real fleet (nats-server, coordinator and worker processes) for 1.5 s
@pytest.mark.bus
@pytest.mark.procs
async def test_fleet_level_lasts_min_level_s_and_stays_under_the_forward_limit(tmp_path):
    args = _args(
        concurrency="1",
        steps=2,
        widths="8,16,32",
        checkpoints=str(tmp_path / "none"),
        buckets="1,4",
        only="fleet",
        jobs_per_client=1,
        min_level_s=1.5,
        limit_batches="1,4",
        threads=1,
        job_timeout=60.0,
        dtype="float32",  # these tiny random experts run slower under bfloat16 autocast than in float32
        run_ahead=0,  # one expert request per step: the split below (running ahead's: test_step_profile.py)
    )
    res = await bench.bench_fleet(args)
    x = res["rows"][0]["fleet"]
    assert res["setup"]["run_ahead"] == 0
    assert x["wall_s"] >= 1.5 and x["submitted"] == x["completed"] > 1 and x["jobs_per_client"] == [x["submitted"]] * 2
    lim = res["limit"]
    # one client of 2-step jobs through NATS is far from the tiny experts' forward alone (noise allowed)
    assert lim["images_per_s"] >= 0.7 * x["images_per_s"], (lim, x)
    # the report rounds the ratio to 3 decimals: a small ratio (0.033) is 1% off its unrounded value
    ratio = x["images_per_s"] / lim["images_per_s"]
    assert res["rows"][0]["fleet_over_limit"] == pytest.approx(ratio, rel=0.01, abs=5e-4)
    assert json.loads(json.dumps(res))["limit"]["rows_per_image"] == 2
    table = bench.format_table(res).splitlines()
    assert table[3].split("|")[1].split()[3] == str(x["submitted"])  # the jobs run
    assert table[3].split("|")[3].split()[1] == f"{res['rows'][0]['fleet_over_limit']:.2f}"
    assert table[4].startswith("forward-only limit ")
    # where the ticks' time went, from the processes' own clocks: one tick per step of the one client's jobs
    split = x["split_ms"]
    assert split["ticks"] == x["completed"] * 2, split
    assert split["forward"] > 0 and split["worker"] >= 0 and split["worker_requests_per_tick"] >= 1, split
    assert split["coordinator"] + split["expert_call"] == pytest.approx(split["tick"], abs=0.01)
    assert split["wire"] + split["worker"] + split["forward"] == pytest.approx(split["expert_call"], abs=0.01)
    assert split["client_step"] == pytest.approx(1000 * x["wall_s"] / (x["jobs"] * 2), rel=0.01)
    assert any("where a tick's time goes at c = 1" in line for line in table)
    # CPU per image: the fleet's processes against the tiny experts' own forward at the batch the level ran
    acc = x["cpu_account"]
    assert acc["images"] == x["images"] > 0 and set(acc["by_role_ms_per_image"]) >= {"coordinator", "workers"}
    rows = x["worker_rows"][0]["rows"] + x["worker_rows"][1]["rows"]
    # top1: a row per step, and at most one more where speculation guessed the expert wrong
    assert 2 * x["images"] <= rows <= 4 * x["images"]
    assert 1.0 <= float(acc["mean_batch"]["0"]) <= 4.0 and all(
        lim["experts"][k]["cpu_s_per_row_by_batch"] for k in (0, 1)
    )
    # one client of 2-step jobs: the coordinator, NATS and the workers' wire work are well above the forwards
    assert acc["overhead_factor"] > 1.0 and acc["fleet_ms_per_image"] > acc["forward_ms_per_image"] > 0
    assert any(line.strip().startswith("conc 1: fleet ") and "overhead x" in line for line in table)
    # the cores the level kept busy (every process's CPU over the level), and what its CPU per image would give
    # with all of them busy: what the level made scaled from its busy cores to all of them
    cpu = x["cpu"]
    assert acc["cores_busy"] == pytest.approx(sum(cpu["seconds"].values()) / cpu["wall_s"], rel=0.01), (acc, cpu)
    scaled = res["rows"][0]["fleet_over_limit"] * lim["units"] / acc["cores_busy"] * x["wall_s"] / cpu["wall_s"]
    assert acc["full_cores_over_limit"] == pytest.approx(scaled, rel=0.05), (acc, x["wall_s"], cpu)
    assert acc["workers_alone_over_limit"] > acc["full_cores_over_limit"], acc
    assert any("cores busy" in line and "every core busy at this CPU per image" in line for line in table)
    assert "decoder_share" not in acc and "decoder share" not in "\n".join(table)  # a pixel fleet: no decoder
    # NATS per image, from nats-server's /varz around the level: one job at a time, so every step of an image
    # is at least its own expert request (published by the coordinator) and reply (by a worker), each
    # delivered once; the request carries x_t and the reply the velocity, 1x32x32 float32 each (--wire-dtype)
    nats = x["nats"]
    assert nats["images"] == x["images"] and nats["in_msgs_per_image"] == pytest.approx(
        nats["in_msgs"] / x["images"], abs=0.05
    ), nats
    assert nats["in_msgs_per_image"] >= 2 * 2 and nats["out_msgs_per_image"] >= 2 * 2, nats
    assert nats["in_bytes_per_image"] >= 2 * 2 * 32 * 32 * 4 and nats["out_bytes_per_image"] >= 2 * 2 * 32 * 32 * 4
    assert nats["in_bytes_per_image"] < 100 * 2 * 2 * 32 * 32 * 4, nats  # per image, not the server's total
    assert "nats" not in res["rows"][0].get("ceiling", {})
    at = table.index(next(line for line in table if line.startswith("NATS per image")))
    assert table[at + 1].startswith(f"  conc 1: {nats['in_msgs_per_image']:.1f} msgs/img in, "), table[at + 1]


@pytest.mark.slow  # ~15 s: a real latent fleet (nats-server, coordinator, workers and a decoder process)
@pytest.mark.bus
@pytest.mark.procs
async def test_a_latent_fleet_is_benched_with_its_decoder_on_both_paths(tmp_path):
    """Checkpoints whose spec says latent: the fleet path runs a decoder process (without one its jobs fail
    decoder_unavailable) and the ceiling decodes in-process; a missing autoencoder is refused by name."""
    import shutil

    from models.tiny import make_tiny_latent_fleet

    d = tmp_path / "latent"  # 3x16x16 images <-> 4x8x8 latents, two experts and a router
    make_tiny_latent_fleet(d, router=True, scale_factor=1.0, shift_factor=0.0, latent_range=3.0)
    shutil.copy("checkpoints/partition.json", d / "partition.json")
    args = _args(
        concurrency="2",
        steps=2,
        checkpoints=str(d),
        buckets="1,4",
        jobs_per_client=25,  # 50 images: enough of the decoder's CPU to read in clock ticks (10 ms)
        min_level_s=0.0,
        limit_batches="none",
        threads=1,
        job_timeout=60.0,
        dtype="float32",
    )
    res = await bench.bench_fleet(args)
    assert "latent: a decoder of" in res["setup"]["models"]
    for path in ("fleet", "ceiling"):
        x = res["rows"][0][path]
        assert x["completed"] == x["submitted"] == 50 and x["lost"] == 0, (path, x)
    fleet = res["rows"][0]["fleet"]
    assert "decoder" in fleet["cpu"]["seconds"]  # its own process, counted with the others
    assert 0 < fleet["cpu_account"]["decoder_share"] < 1, fleet["cpu_account"]
    # each image's latents go to the decoder and come back decoded: 4x8x8 latents, 3x16x16 images (float32)
    nats = fleet["nats"]
    assert (
        nats["in_msgs_per_image"] >= 2 * 2 + 2 and nats["in_bytes_per_image"] >= 2 * 2 * 4 * 8 * 8 * 4 + 3 * 16 * 16 * 4
    )

    (d / "autoencoder.safetensors").unlink()
    with pytest.raises(ValueError, match="their autoencoder is needed as"):
        bench._models(args, str(tmp_path))


async def test_guidance_goes_into_every_job_the_setup_and_the_limit_counts_two_rows_per_image(tmp_path):
    """--guidance 3 on the random UNets (which then get a null label): every job asks for it, the ceiling's
    guided jobs complete, the setup and the table say it, and the forward-only limit counts each image as two
    forward rows per evaluation (its label's and the null label's): half the images/s of the same rows/s."""
    import torch

    args = _args(
        concurrency="2",
        steps=2,
        widths="8,16,32",
        checkpoints=str(tmp_path / "none"),
        buckets="1,4",
        only="ceiling",
        jobs_per_client=1,
        min_level_s=0.0,
        limit_batches="2",
        threads=1,
        dtype="float32",
        guidance=3.0,
    )
    args.concurrency_list = [2]
    assert [make(0).guidance_scale for make in bench._requests(args, 2, "t")] == [3.0, 3.0]
    # off, said on the wire: a fleet whose default guides would otherwise double the rows the bench counts
    assert bench._requests(_args(), 1, "t")[0](0).model_dump().get("guidance_scale") == 1.0
    threads = torch.get_num_threads()
    try:
        res = await bench.bench_fleet(args)
    finally:
        torch.set_num_threads(threads)
    assert res["setup"]["guidance"] == 3.0 and "with a null label" in res["setup"]["models"]
    x = res["rows"][0]["ceiling"]
    assert x["submitted"] == x["completed"] == 2 and x["failed"] == x["lost"] == 0, x
    lim = res["limit"]
    assert (lim["rows_per_eval"], lim["experts_per_row"], lim["rows_per_image"]) == (2, 1, 4)  # 2 steps x 2 rows
    assert lim["images_per_s"] == pytest.approx(lim["rows_per_s"] / 4, rel=0.01)
    # 2 clients x 1 image x 2 forward rows over 2 experts: calls of 2 rows
    assert res["rows"][0]["limit_at_load"]["batch"] == 2
    table = bench.format_table(res)
    assert "top1, guidance 3, 1 image(s)/job" in table
    assert "x 2 forward rows per evaluation (guided: the label's and the null label's)" in table
    # unguided, the same models: one row per evaluation, and nothing about guidance in the setup line
    plain = bench._forward_limit(_args(steps=2, limit_batches="2", dtype="float32"), bench._models(args, str(tmp_path)))
    assert (plain["rows_per_eval"], plain["rows_per_image"]) == (1, 2)


def test_guidance_on_experts_without_a_null_label_is_refused_up_front(tmp_path, capsys):
    import numpy as np

    from dataset.partition import partition_by_classes, save_manifest
    from models.tiny import make_tiny_experts, make_tiny_router

    ck = tmp_path / "ck"
    make_tiny_experts(ck, 2, widths=(8, 16, 32))
    make_tiny_router(ck / "router", 2)
    save_manifest(partition_by_classes(np.arange(10), [list(range(5)), list(range(5, 10))]), ck / "partition.json")
    with pytest.raises(ValueError, match=r"--guidance 2.5 needs experts with a null label, and .*expert0.* has none"):
        bench._models(_args(checkpoints=str(ck), guidance=2.5), str(tmp_path))
    assert bench._models(_args(checkpoints=str(ck)), str(tmp_path))["k"] == 2  # unguided: as before
    # the flag itself takes what a job's guidance_scale takes
    for bad in ("21", "-1", "nan", "x"):
        with pytest.raises(SystemExit):
            p = argparse.ArgumentParser()
            bench.add_arguments(p)
            p.parse_args(["--guidance", bad])
        assert "--guidance" in capsys.readouterr().err
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    assert p.parse_args(["--guidance", "4.5"]).guidance == 4.5 and p.parse_args([]).guidance == 1.0
