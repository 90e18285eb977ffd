"""A latent fleet end to end: real nats-server, tiny latent experts (random init, spec says latent),
a real tiny autoencoder served by `DecoderWorker` / `ddm-fleet decoder`, and a real Coordinator.

A job's `done` images are decode(latents) as the autoencoder computes them in-process; previews ride
on the frames the job chose; a fleet with no decoder fails its jobs with `decoder_unavailable` (not a
hang); a decoder killed with kill -9 while a second one runs loses no job."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from bus.connect import flushed
from client.jobs import JobFailed, run_job
from coordinator.local_fleet import LabelRouter
from coordinator.service import Coordinator
from schemas import DoneEvent, ErrorCode, FrameEvent, JobRequest, subjects
from tests.coordinator.helpers import start_workers, stop_workers

C2E = [0] * 5 + [1] * 5


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """(autoencoder path, its LatentCodec, the latent spec, [expert paths]): 3x16x16 images <-> 4x8x8 latents."""
    import torch

    from models.autoencoder_torch import LatentCodec
    from models.tiny import make_tiny_latent_fleet

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    made = make_tiny_latent_fleet(tmp_path_factory.mktemp("latent-fleet"), autoencoder_seed=3)
    yield made.autoencoder, LatentCodec.load(made.autoencoder), made.spec, made.experts
    torch.set_num_threads(threads)


async def test_done_images_are_the_decoded_latents_and_previews_ride_on_chosen_frames(nats_url, nc, fleet):
    from workers.decoder_service import DecoderWorker

    ae, codec, spec, paths = fleet
    ws = await start_workers(nats_url, paths)
    try:
        async with DecoderWorker(ae, nats_url=nats_url) as dec:
            assert dec.subject == subjects.decoder_decode(codec.content_hash)
            async with Coordinator(
                LabelRouter(C2E, 2), num_experts=2, class_to_expert=C2E, nats_url=nats_url, spec=spec, step_timeout=10
            ):
                frames: list[FrameEvent] = []
                req = JobRequest(digits=[1, 7, 3], steps=3, seed=4, preview_every=2, return_latents=True)
                done, plain = await asyncio.wait_for(
                    asyncio.gather(
                        run_job(nc, req, lambda ev: frames.append(ev) if ev.kind == "frame" else None),
                        run_job(nc, JobRequest(digits=[2], steps=2, seed=5)),
                    ),
                    120,
                )
                # a v1 client's done (no return_latents) has no latents key on the wire
                raw = []

                async def keep(msg):
                    raw.append(msg.data)

                sub = await nc.subscribe(subjects.job_events("anon", "v1job"), cb=keep)
                await flushed(nc)
                await run_job(nc, JobRequest(job_id="v1job", digits=[4], steps=1, seed=6, stream=False))
                await nc.flush()
                await sub.unsubscribe()
        assert dec.requests >= 1 and dec.rows >= 3 + 1 + 1
    finally:
        await stop_workers(ws)
    assert isinstance(done, DoneEvent)
    assert done.latents.shape == (3, 4, 8, 8) and done.images.shape == (3, 3, 16, 16)
    assert np.abs(done.latents).max() > 1.0 or np.abs(done.latents).min() < 1.0  # real latents, not pixels
    np.testing.assert_allclose(done.images, codec.decode(np.array(done.latents)), atol=1e-5)
    assert done.images.min() >= -1.0 and done.images.max() <= 1.0
    assert plain.latents is None and plain.images.shape == (1, 3, 16, 16)
    # previews: step 2 (a multiple of preview_every) and the last step 3; not step 1
    by_step = {f.step: f for f in frames}
    assert sorted(by_step) == [1, 2, 3]
    assert by_step[1].preview is None and by_step[1].x.shape == (3, 4, 8, 8)
    for s in (2, 3):
        want = codec.decode(np.asarray(by_step[s].x, np.float32))
        np.testing.assert_allclose(np.asarray(by_step[s].preview, np.float32), want, atol=2e-3)
    done_raw = [m for m in raw if _kind(m) == "done"]
    assert done_raw and b"latents" not in done_raw[0] and b"images" in done_raw[0]


def _kind(data: bytes) -> str:
    import msgpack

    return msgpack.unpackb(data, raw=False).get("kind")


async def test_no_decoder_fails_the_job_with_decoder_unavailable_not_a_hang(nats_url, nc, fleet):
    ae, codec, spec, paths = fleet
    ws = await start_workers(nats_url, paths)
    try:
        async with Coordinator(
            LabelRouter(C2E, 2),
            num_experts=2,
            class_to_expert=C2E,
            nats_url=nats_url,
            spec=spec,
            step_timeout=2,
            retries=1,
        ) as coord:
            start = time.monotonic()
            with pytest.raises(JobFailed) as info:
                await asyncio.wait_for(run_job(nc, JobRequest(digits=[1, 8], steps=2, seed=1)), 60)
            took = time.monotonic() - start
            # a failed decode pauses previews: the next job's frames go out at once, without them, with a note
            frames: list[FrameEvent] = []
            with pytest.raises(JobFailed):
                await run_job(
                    nc,
                    JobRequest(digits=[2], steps=3, seed=2, preview_every=1),
                    lambda ev: frames.append(ev) if ev.kind == "frame" else None,
                )
            status = coord.status()
    finally:
        await stop_workers(ws)
    assert info.value.code == ErrorCode.DECODER_UNAVAILABLE
    assert "no decoder serves" in info.value.reason and codec.content_hash in info.value.reason
    assert took < 30
    assert status.jobs_failed == 2 and status.jobs_done == 0
    assert [f.step for f in frames] == [1, 2, 3] and all(f.preview is None for f in frames)
    assert all(any(n.startswith("no preview: ") for n in f.notes) for f in frames)


async def test_stopping_with_a_hung_decoder_ends_the_job_within_the_bound(nats_url, nc, fleet):
    """A decoder that took the request and never answers (what a frozen decoder process looks like on the
    bus: a subscriber that keeps what it gets): stopping the coordinator does not wait out the decode's
    bound (here 30 s, the step timeout), and the client hears `unavailable` rather than nothing."""
    ae, codec, spec, paths = fleet
    asked = asyncio.Event()

    async def keep(msg):
        asked.set()

    hung = await nc.subscribe(
        subjects.decoder_decode(codec.content_hash), queue=subjects.decoder_queue_group(codec.content_hash), cb=keep
    )
    await nc.flush()
    ws = await start_workers(nats_url, paths)
    try:
        coord = Coordinator(
            LabelRouter(C2E, 2),
            num_experts=2,
            class_to_expert=C2E,
            nats_url=nats_url,
            spec=spec,
            step_timeout=30,
            retries=0,
        )
        coord.decode_stop_wait_s = 1.0
        await coord.__aenter__()
        job = asyncio.ensure_future(run_job(nc, JobRequest(digits=[3], steps=2, seed=7), timeout=120))
        try:
            await asyncio.wait_for(asked.wait(), 60)  # the job's done is in the decode stage
        finally:
            start = time.monotonic()
            await coord.__aexit__(None, None, None)
            took = time.monotonic() - start
        with pytest.raises(JobFailed) as info:
            await asyncio.wait_for(job, 10)
        status = coord.status()
    finally:
        await hung.unsubscribe()
        await stop_workers(ws)
    assert took < 10, took  # before: the decode's 30 s + 5
    assert info.value.code == ErrorCode.UNAVAILABLE and "decoded" in info.value.reason
    assert status.jobs_done == 0 and status.jobs_failed == 1


DECODER_CMD = [sys.executable, "-m", "infra.cli", "decoder", "--threads", "1", "--checkpoint"]


@pytest.mark.procs
@pytest.mark.slow
async def test_killing_one_of_two_decoder_processes_loses_no_job(nats_url, nc, fleet):
    ae, codec, spec, paths = fleet
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.getcwd())
    procs = [
        subprocess.Popen([*DECODER_CMD, str(ae), "--nats", nats_url], stdout=subprocess.PIPE, env=env, cwd=os.getcwd())
        for _ in range(2)
    ]
    ws = await start_workers(nats_url, paths)
    try:
        for p in procs:
            line = await asyncio.wait_for(asyncio.to_thread(p.stdout.readline), 120)
            assert line.startswith(b"ready: decoder on " + subjects.decoder_decode(codec.content_hash).encode())
        async with Coordinator(
            LabelRouter(C2E, 2),
            num_experts=2,
            class_to_expert=C2E,
            nats_url=nats_url,
            spec=spec,
            step_timeout=2.0,
            retries=3,
        ) as coord:
            previews = 0
            killed_at: list[float] = []
            victim = procs[0]

            seen: list[float] = []

            def on(ev):
                nonlocal previews
                seen.append(time.monotonic())
                if ev.kind == "frame" and ev.preview is not None:
                    previews += 1
                    if previews == 6 and not killed_at:
                        victim.send_signal(signal.SIGKILL)
                        killed_at.append(time.monotonic())

            jobs = [JobRequest(digits=[i % 10, (i + 3) % 10], steps=8, seed=i, preview_every=1) for i in range(8)]
            start = time.monotonic()
            results = await asyncio.wait_for(asyncio.gather(*(run_job(nc, j, on) for j in jobs)), 240)
            took = time.monotonic() - start
            retried = coord.decoder.failures
    finally:
        await stop_workers(ws)
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
            p.wait(timeout=30)
    assert killed_at, "the decoder was never killed: too few previews"
    assert victim.returncode == -signal.SIGKILL
    assert all(isinstance(r, DoneEvent) for r in results) and len(results) == 8
    for r in results:  # each decoded by the survivor (or the victim before it died): the same decoder
        assert r.images.shape == (2, 3, 16, 16)
    after = sorted(t for t in seen if t >= killed_at[0])
    pause = max((b - a for a, b in zip([killed_at[0], *after], after)), default=0.0)
    print(
        f"\n8 latent jobs, one of two decoders killed (kill -9) mid-run: 0 lost, {took:.1f} s in all, "
        f"longest gap between events after the kill {pause:.2f} s, {retried} decode tries failed (retried)"
    )


async def test_decoder_answers_bad_requests_with_codes_and_keeps_serving(nats_url, nc, fleet):
    from schemas import DecodeReply, DecodeRequest, DecodeResult, pack, unpack
    from workers.decoder_service import DecoderWorker

    ae, codec, spec, paths = fleet
    async with DecoderWorker(ae, nats_url=nats_url) as dec:
        h = codec.content_hash

        async def ask(body: bytes):
            return unpack((await nc.request(dec.subject, body, timeout=20)).data, DecodeResult)

        bad = {
            b"\xc1 not msgpack": ErrorCode.BAD_REQUEST,
            pack(DecodeRequest(decoder="0" * 64, latents=np.zeros((1, 4, 8, 8), np.float32))): ErrorCode.BAD_REQUEST,
            pack(DecodeRequest(decoder=h, latents=np.zeros((2, 4, 4, 4), np.float32))): ErrorCode.BAD_SHAPE,
            pack(DecodeRequest(decoder=h, latents=np.zeros((1, 4, 8, 8), np.float32), deadline=1.0)): (
                ErrorCode.DEADLINE_EXCEEDED
            ),
        }
        for body, code in bad.items():
            reply = await ask(body)
            assert reply.kind == "error" and reply.code == code, (code, reply)
        import msgpack

        from schemas.tensor import encode_tensor

        nan = {"v": 1, "kind": "decode_request", "decoder": h, "latents": encode_tensor(np.full((1, 4, 8, 8), np.nan))}
        assert (await ask(msgpack.packb(nan, use_bin_type=True))).code == ErrorCode.NON_FINITE
        z = np.random.default_rng(0).standard_normal((3, 4, 8, 8)).astype(np.float32)
        good = await ask(pack(DecodeRequest(decoder=h, latents=z)))
        assert isinstance(good, DecodeReply) and good.decoder == h and good.worker_id == dec.worker_id
        np.testing.assert_allclose(good.images, codec.decode(z), atol=1e-6)
        assert dec.errors == 5 and dec.requests == 1
        # the coordinator's client: calls of one loop turn go in one request, split back in order
        from coordinator.decoder_client import DecoderClient

        client = DecoderClient(nc, h, timeout=20, retries=0)
        parts = [z[:1], z[1:3], z[:2]]
        got = await asyncio.gather(*(client.decode(p) for p in parts))
        assert dec.requests == 2 and client.requests == 1
        for p, images in zip(parts, got):  # decoded 5 rows at once: conv sums round by batch size (~1e-6)
            np.testing.assert_allclose(images, codec.decode(p), atol=1e-5)


class _SlowCodec:
    """The real codec, taking `delay` seconds more per decode (a loaded decoder)."""

    def __init__(self, codec, delay: float):
        self.codec, self.delay = codec, delay
        self.latent_shape, self.image_shape = codec.latent_shape, codec.image_shape
        self.content_hash = codec.content_hash
        self.latent_shape_error = codec.latent_shape_error

    def decode(self, z):
        time.sleep(self.delay)
        return self.codec.decode(z)


async def test_a_job_being_decoded_is_running_not_unknown(nats_url, nc, fleet):
    """Between its last step and its decoded `done`, a job's status is `running` at its last step (a
    client must not take it for lost)."""
    from workers.decoder_service import DecoderWorker

    ae, codec, spec, paths = fleet
    ws = await start_workers(nats_url, paths)
    try:
        async with DecoderWorker(codec=_SlowCodec(codec, 2.0), nats_url=nats_url):
            async with Coordinator(
                LabelRouter(C2E, 2), num_experts=2, class_to_expert=C2E, nats_url=nats_url, spec=spec, step_timeout=10
            ) as coord:
                last = asyncio.Event()
                req = JobRequest(job_id="slowdec", digits=[2], steps=2, seed=3)
                job = asyncio.ensure_future(
                    run_job(nc, req, lambda ev: last.set() if ev.kind == "frame" and ev.step == ev.steps else None)
                )
                await asyncio.wait_for(last.wait(), 60)
                during = await coord.job_status("slowdec")
                done = await asyncio.wait_for(job, 60)
                after = await coord.job_status("slowdec")
    finally:
        await stop_workers(ws)
    assert during.state == "running" and during.step == during.steps == 2
    assert after.state == "done" and isinstance(done, DoneEvent)
    assert done.images.shape == (1, 3, 16, 16)


async def test_a_latent_fleet_reports_its_decoded_images_beside_its_latents(nats_url, nc, fleet):
    """The spec a latent fleet reports (`{"spec": true, "image_spec": true}`) names the latents (`sample_shape`,
    `value_range`: the experts') and, beside them, the images a client gets (`image_shape`, `image_value_range`:
    the decoder's); its decoder advertises both image fields as strings. With no decoder running, the image
    fields are left out (nothing could draw them) while the rest of the spec is there."""
    import json

    from bus.gather import gather_replies
    from client.jobs import fleet_status
    from workers.decoder_service import DecoderWorker

    ae, codec, spec, paths = fleet
    ws = await start_workers(nats_url, paths)
    kw = dict(num_experts=2, class_to_expert=C2E, nats_url=nats_url, spec=spec, step_timeout=10)
    try:
        async with Coordinator(LabelRouter(C2E, 2), **kw):
            without = await fleet_status(nc, spec=True, image_spec=True)
        async with DecoderWorker(ae, nats_url=nats_url):
            infos = [json.loads(r) for r in await gather_replies(nc, "$SRV.INFO.ddm-decoder", window=0.5)]
            async with Coordinator(LabelRouter(C2E, 2), **kw):
                status = await fleet_status(nc, spec=True, image_spec=True)
                plain = await fleet_status(nc, spec=True)
                done = await asyncio.wait_for(run_job(nc, JobRequest(digits=[3], steps=2, seed=9)), 60)
    finally:
        await stop_workers(ws)
    assert [i["metadata"]["image_shape"] for i in infos] == ["3,16,16"]
    assert [i["metadata"]["image_value_range"] for i in infos] == ["-1,1"]
    assert without.spec.space == "latent" and without.spec.sample_shape == (4, 8, 8)
    assert without.spec.image_shape is None and without.spec.image_value_range is None
    got = status.spec
    assert got.space == "latent" and got.sample_shape == (4, 8, 8) and got.value_range == (-4.0, 4.0)
    assert got.image_shape == tuple(codec.image_shape) == (3, 16, 16) and got.image_value_range == (-1.0, 1.0)
    assert plain.spec.image_shape is None and plain.spec.image_value_range is None
    # the images a job returns are what the spec says
    assert done.images.shape[1:] == got.image_shape
    lo, hi = got.image_value_range
    assert lo <= float(done.images.min()) and float(done.images.max()) <= hi


def test_decoder_metadata_names_the_images_or_is_another_autoencoders():
    from coordinator.decoder_client import images_of_metadata

    h = "b" * 64
    both = {"decoder": h, "image_shape": "3,16,16", "image_value_range": "-1,1"}
    assert images_of_metadata(both, h) == ((3, 16, 16), (-1.0, 1.0))
    assert images_of_metadata({"decoder": h, "image_shape": "3,16,16"}, h) == ((3, 16, 16), (-1.0, 1.0))
    assert images_of_metadata({**both, "decoder": "c" * 64}, h) is None
    assert images_of_metadata({**both, "image_shape": "3,16"}, h) is None
    assert images_of_metadata({**both, "image_value_range": "1,-1"}, h) is None
    assert images_of_metadata(None, h) is None


def test_decoder_command_refuses_a_missing_checkpoint(tmp_path, capsys):
    from infra.cli import main

    assert main(["decoder", "--checkpoint", str(tmp_path / "nope.safetensors")]) == 2
    err = capsys.readouterr().err
    assert "nope.safetensors" in err and "not found" in err
