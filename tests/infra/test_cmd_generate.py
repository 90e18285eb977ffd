"""`ddm-fleet generate` end to end (a real CLI subprocess against a real fleet) and its helpers."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from bus.connect import flushed
from coordinator.local_fleet import LabelRouter
from coordinator.service import Coordinator
from infra.cmd_generate import local_buckets, parse_digits
from tests.coordinator.helpers import make_tiny_experts, make_tiny_router


def _cli(*args, timeout=120):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, "-m", "infra.cli", "generate", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


def test_local_buckets_cover_the_job():
    assert local_buckets(1) == (1,)
    assert local_buckets(10) == (1, 2, 4, 8, 16)
    assert local_buckets(256) == (1, 2, 4, 8, 16, 32, 64)


def test_parse_digits():
    assert parse_digits("3,7, 7") == [3, 7, 7]
    for bad in ("", "3,x", "10", "-1"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_digits(bad)


def test_bad_arguments_fail_clearly(tmp_path, capsys):
    from infra.cli import main

    assert main(["generate", "--digits", "3", "--out", str(tmp_path / "x.jpg")]) == 2
    assert ".png or .npz" in capsys.readouterr().err
    assert main(["generate", "--digits", "3", "--steps", "5000", "--out", "x.png"]) == 2
    assert "bad request" in capsys.readouterr().err
    for argv, msg in (
        (["--digits", "3,12"], "0-9"),
        (["--digits", "3", "--count", "2"], "not allowed with"),
        (["--count", "0"], "positive"),
    ):
        with pytest.raises(SystemExit) as err:
            main(["generate", *argv])
        assert err.value.code == 2 and msg in capsys.readouterr().err


def test_no_fleet_is_a_clear_error(tmp_path, capsys):
    from bus.nats_server import free_port
    from infra.cli import main

    url = f"nats://127.0.0.1:{free_port()}"
    assert main(["generate", "--digits", "3", "--nats", url, "--out", str(tmp_path / "x.png"), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "cannot connect to NATS" in err and "--local" in err and "Traceback" not in err


@pytest.fixture(scope="module")
def experts(tmp_path_factory):
    return make_tiny_experts(tmp_path_factory.mktemp("gen-experts"))


@pytest.mark.procs
async def test_generate_against_a_running_fleet(nats_url, experts, tmp_path):
    import torch

    from workers.service import ExpertWorker

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    ws = []
    try:
        for k, p in enumerate(experts):
            ws.append(ExpertWorker(expert=k, checkpoint=p, nats_url=nats_url, buckets=(1, 4), dtype="float32"))
            await ws[-1].start()
        async with Coordinator(
            LabelRouter([0] * 5 + [1] * 5, 2), num_experts=2, class_to_expert=[0] * 5 + [1] * 5, nats_url=nats_url
        ):
            npz = tmp_path / "out.npz"
            r = await asyncio.to_thread(
                _cli,
                "--digits",
                "3,7,7",
                "--steps",
                "3",
                "--seed",
                "5",
                "--out",
                str(npz),
                "--json",
                "--nats",
                nats_url,
                "--no-progress",
            )
            assert r.returncode == 0, r.stderr
            summary = json.loads(r.stdout)
            assert summary["seed"] == 5 and [i["digit"] for i in summary["images"]] == [3, 7, 7]
            assert summary["images"][0]["usage"] == [1.0, 0.0] and summary["images"][1]["usage"] == [0.0, 1.0]
            data = np.load(npz)
            assert data["images"].shape == (3, 1, 32, 32) and data["labels"].tolist() == [3, 7, 7]
            assert np.abs(data["images"]).max() <= 1.0

            png = tmp_path / "out.png"
            r = await asyncio.to_thread(
                _cli,
                "--count",
                "4",
                "--steps",
                "2",
                "--solver",
                "heun",
                "--strategy",
                "oracle",
                "--seed",
                "5",
                "--out",
                str(png),
                "--nats",
                nats_url,
            )
            assert r.returncode == 0, r.stderr
            assert "wrote 4 images" in r.stdout
            from PIL import Image

            assert Image.open(png).size == (4 * 66 + 2, 66 + 2)  # one row of 4 digits of 64 px, 2 px gaps

            # `ddm-fleet status` sees this fleet: the coordinator, and each expert's worker that served the jobs
            env = dict(os.environ, OMP_NUM_THREADS="1")
            status = [sys.executable, "-m", "infra.cli", "status", "--nats", nats_url, "--rate-over", "0.3"]
            r = await asyncio.to_thread(subprocess.run, [*status, "--json"], capture_output=True, text=True, env=env)
            assert r.returncode == 0, r.stderr
            snap = json.loads(r.stdout)
            assert snap["coordinator"]["jobs_done"] >= 2 and snap["coordinator_stale"] is False
            workers = {e["expert"]: e["workers"] for e in snap["experts"]}
            assert sorted(workers) == [0, 1] and {w["id"] for w in workers[0]} == {ws[0].service_id}
            for ex in (0, 1):
                (w,) = workers[ex]
                assert w["backend"] == "torch" and w["dtype"] == "float32" and w["requests"] >= 1
                assert w["rows_per_s"] is not None and w["stale"] is False  # a rate from the two snapshots
            r = await asyncio.to_thread(subprocess.run, status, capture_output=True, text=True, env=env)
            assert r.returncode == 0 and "expert 0 · 1 worker" in r.stdout and "expert 1 · 1 worker" in r.stdout
            assert r.stdout.startswith("coordinator: active_jobs") and "jobs_done " in r.stdout, r.stdout
    finally:
        for w in ws:
            await w.stop()
        torch.set_num_threads(threads)


@pytest.mark.procs
def test_generate_local_runs_its_own_fleet(experts, tmp_path):
    import shutil

    d = tmp_path / "ck"
    d.mkdir()
    for k, p in enumerate(experts):
        shutil.copy(p, d / f"expert{k}.safetensors")
        shutil.copy(p.with_suffix(".json"), d / f"expert{k}.json")
    make_tiny_router(d / "router")
    shutil.copy("checkpoints/partition.json", d / "partition.json")
    out = tmp_path / "local.npz"
    r = _cli(
        "--local",
        "--checkpoints",
        str(d),
        "--digits",
        "1,8",
        "--steps",
        "2",
        "--seed",
        "3",
        "--out",
        str(out),
        "--json",
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    s = json.loads(r.stdout)
    assert [i["digit"] for i in s["images"]] == [1, 8]
    assert all(abs(sum(i["usage"]) - 1.0) < 1e-6 for i in s["images"])  # top1: one expert per step
    assert np.load(out)["images"].shape == (2, 1, 32, 32)


@pytest.mark.procs
def test_generate_local_without_checkpoints_says_what_is_missing(tmp_path):
    r = _cli("--local", "--checkpoints", str(tmp_path), "--digits", "1", "--out", str(tmp_path / "x.png"))
    assert r.returncode == 2 and "router.safetensors" in r.stderr and "checkpoints/README.md" in r.stderr


# ------------------------------------------------------------------ runs over the per-job limit


def _args(**kw) -> argparse.Namespace:
    from infra.cli import parse_args

    argv = ["generate", "--out", "x.npz"]
    for k, v in kw.items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
    return parse_args(argv)


def test_split_plan_and_seed_rule():
    from coordinator.rows import draw_digits
    from infra.cmd_generate import SEED_RANGE, job_seed, plan_requests, split_images
    from schemas.limits import MAX_JOB_IMAGES

    assert split_images(10, 4) == [range(0, 4), range(4, 8), range(8, 10)]
    assert split_images(1000, MAX_JOB_IMAGES)[-1] == range(768, 1000)
    assert job_seed(5, 2) == 7 and job_seed(SEED_RANGE - 1, 1) == 0
    reqs, seed = plan_requests(_args(count=10, seed=5, images_per_job=4))
    assert seed == 5 and [r.seed for r in reqs] == [5, 6, 7] and [r.n_images for r in reqs] == [4, 4, 2]
    assert [d for r in reqs for d in r.digits] == draw_digits(5, 10)
    assert draw_digits(5, 10)[:4] == draw_digits(5, 4)  # so the first job's classes are a lone 4-image job's
    one, seed = plan_requests(_args(count=10, seed=5))  # fits one job: sent as before, the coordinator draws
    assert seed == 5 and len(one) == 1 and one[0].count == 10 and one[0].seed == 5
    reqs, seed = plan_requests(_args(digits="1,2,3", images_per_job=2))  # no --seed: one is drawn for all jobs
    assert 0 <= seed < SEED_RANGE and [r.seed for r in reqs] == [seed, job_seed(seed, 1)]
    assert [r.digits for r in reqs] == [[1, 2], [3]]
    big, _ = plan_requests(_args(count=300, seed=1))
    assert [r.n_images for r in big] == [MAX_JOB_IMAGES, 300 - MAX_JOB_IMAGES]


def test_split_options_refuse_bad_values(capsys):
    from infra.cli import main
    from infra.cmd_generate import MAX_RUN_IMAGES

    for argv, msg in (
        (["--count", "5", "--images-per-job", "257"], "at most 256 images per job"),
        (["--count", "5", "--jobs-in-flight", "0"], "positive"),
        (["--count", "5", "--seed", "-1"], "[0, 2^63)"),
    ):
        with pytest.raises(SystemExit) as err:
            main(["generate", *argv])
        assert err.value.code == 2 and msg in capsys.readouterr().err
    assert main(["generate", "--count", str(MAX_RUN_IMAGES + 1), "--out", "x.npz"]) == 2
    assert f"at most {MAX_RUN_IMAGES}" in capsys.readouterr().err


@pytest.mark.procs
async def test_a_run_over_the_job_limit_is_split_with_seeds_independent_of_the_split_timing(
    nats_url, experts, tmp_path
):
    """10 images in jobs of 4: 3 jobs (4 + 4 + 2) with seeds S, S+1, S+2, written in order; the first 4
    equal a single 10-image job's, job 2 equals a lone job of its classes seeded S+1, and the same run
    with another --jobs-in-flight (or as --digits) gives the same images."""
    import torch

    from workers.service import ExpertWorker

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    ws = []
    try:
        for k, p in enumerate(experts):
            ws.append(ExpertWorker(expert=k, checkpoint=p, nats_url=nats_url, buckets=(1, 4), dtype="float32"))
            await ws[-1].start()
        async with Coordinator(
            LabelRouter([0] * 5 + [1] * 5, 2), num_experts=2, class_to_expert=[0] * 5 + [1] * 5, nats_url=nats_url
        ):

            async def gen(name, *argv):
                out = tmp_path / f"{name}.npz"
                r = await asyncio.to_thread(
                    _cli, *argv, "--steps", "2", "--out", str(out), "--json", "--nats", nats_url, "--no-progress"
                )
                assert r.returncode == 0, r.stderr
                data = np.load(out)
                return json.loads(r.stdout), data["images"], data["labels"].tolist()

            s, split, labels = await gen(
                "split", "--count", "10", "--seed", "5", "--images-per-job", "4", "--jobs-in-flight", "2"
            )
            assert [(j["seed"], j["first_image"], j["images"]) for j in s["jobs"]] == [(5, 0, 4), (6, 4, 4), (7, 8, 2)]
            assert s["seed"] == 5 and len({j["job_id"] for j in s["jobs"]}) == 3 and split.shape == (10, 1, 32, 32)
            assert [i["digit"] for i in s["images"]] == labels and [i["index"] for i in s["images"]] == list(range(10))

            w, whole, whole_labels = await gen("whole", "--count", "10", "--seed", "5")
            assert len(w["jobs"]) == 1 and whole_labels == labels
            np.testing.assert_allclose(split[:4], whole[:4], atol=2e-4)
            assert np.abs(split[4:] - whole[4:]).max() > 0.05  # other seeds: other noise

            _, job2, _ = await gen("job2", "--digits", ",".join(map(str, labels[4:8])), "--seed", "6")
            np.testing.assert_allclose(split[4:8], job2, atol=2e-4)

            _, again, again_labels = await gen(
                "again",
                "--digits",
                ",".join(map(str, labels)),
                "--seed",
                "5",
                "--images-per-job",
                "4",
                "--jobs-in-flight",
                "3",
            )
            assert again_labels == labels
            np.testing.assert_allclose(split, again, atol=2e-4)
    finally:
        for w_ in ws:
            await w_.stop()
        torch.set_num_threads(threads)


async def test_run_jobs_keeps_at_most_j_in_flight_and_one_bar_over_all_images(nats_url, nc, experts):
    import io

    from tqdm import tqdm

    from infra.cmd_generate import plan_requests, run_jobs
    from schemas import JobEvent, subjects, unpack
    from workers.service import ExpertWorker

    ws = []
    try:
        for k, p in enumerate(experts):
            ws.append(ExpertWorker(expert=k, checkpoint=p, nats_url=nats_url, buckets=(1, 4), dtype="float32"))
            await ws[-1].start()
        async with Coordinator(LabelRouter([0] * 5 + [1] * 5, 2), num_experts=2, nats_url=nats_url):
            live, most = set(), 0

            async def watch(msg):
                nonlocal most
                ev = unpack(msg.data, JobEvent)
                if ev.kind == "accepted":
                    live.add(ev.job_id)
                    most = max(most, len(live))
                elif ev.kind in ("done", "failed"):
                    live.discard(ev.job_id)

            sub = await nc.subscribe(subjects.ALL_JOB_EVENTS, cb=watch)
            await flushed(nc)
            requests, _ = plan_requests(_args(count=7, seed=3, steps=3, images_per_job=2))
            bar = tqdm(total=7, file=io.StringIO(), disable=False)
            dones, seeds = await run_jobs(nc, requests, in_flight=2, timeout=120, bar=bar)
            await nc.flush()
            await sub.unsubscribe()
        assert [len(d.digits) for d in dones] == [2, 2, 2, 1] and seeds == [3, 4, 5, 6]
        assert [d.digits for d in dones] == [r.digits for r in requests]
        assert most == 2 and not live
        assert bar.n == 7 and bar.total == 7
    finally:
        for w_ in ws:
            await w_.stop()


def test_a_latent_fleets_png_shows_its_decoded_images_not_scaled_by_the_latent_range(tmp_path):
    """The grid of a latent fleet's images maps the images' own range ([-1, 1]) to pixels: scaling by the
    latents' range (+-4.5) washed every colour out to grey."""
    from PIL import Image

    from infra.cmd_generate import RunResult, image_range, save_output
    from schemas.spec import ModelSpec, legacy_spec

    latent = ModelSpec.from_json(
        {**legacy_spec(in_channels=4, image_size=8).to_json(), "space": "latent", "decoder": "autoencoder@sha256:ab"}
    ).model_copy(update={"value_range": (-4.5, 4.5)})
    assert image_range(latent) == (-1.0, 1.0) and image_range(legacy_spec()) == (-1.0, 1.0)
    images = np.full((2, 3, 16, 16), -1.0, np.float32)
    images[:, 0] = 1.0  # pure red
    result = RunResult(images=images, labels=[1, 2], usage=np.ones((2, 1), np.float32), elapsed_s=0.1, seed=0)
    save_output(result, str(tmp_path / "g.png"), per_row=2, spec=latent)
    px = np.asarray(Image.open(tmp_path / "g.png").convert("RGB"))
    assert px[10, 10].tolist() == [255, 0, 0]
