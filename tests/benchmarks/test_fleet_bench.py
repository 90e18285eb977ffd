"""`ddm-fleet bench fleet`: argument checks, the in-process ceiling path, and the report table."""

from __future__ import annotations

import argparse

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
    table = bench.format_table(res).splitlines()
    assert "ceil img/s" in table[2] and [t.split()[0] for t in table[3:5]] == ["1", "3"]
    assert table[8].split("|")[1].split() == ["6", "6", "0", "0", "0"]  # ceiling 3: submitted .. LOST


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
    assert bench.format_table(res).splitlines()[-1].split() == [
        "8",
        "|",
        "5.0",
        "1.000",
        "2.000",
        "|",
        "10.0",
        "0.500",
        "1.000",
        "|",
        "0.50",
    ]
