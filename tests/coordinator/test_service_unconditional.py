"""Unconditional generation through a real fleet (nats-server, tiny torch experts, coordinator): digit
-1 (label unknown) rows are routed by the router alone, deterministically for a seed; oracle refuses
them; a fleet whose experts have no null label refuses such a job at admission and keeps serving."""

from __future__ import annotations

import asyncio

import msgpack
import numpy as np
import pytest

from client.jobs import JobFailed, fleet_status, run_job
from coordinator.local_fleet import LabelRouter
from coordinator.rows import initial_noise
from coordinator.service import Coordinator
from schemas import UNCONDITIONAL, ErrorCode, FrameEvent, JobRejected, JobRequest, SubmitReply, subjects, unpack
from tests.coordinator.helpers import JITTER, TINY_WIDTHS, start_workers, stop_workers

C2E = [0] * 5 + [1] * 5
U = UNCONDITIONAL


@pytest.fixture(scope="module")
def null_experts(tmp_path_factory):
    """Two tiny jittered experts with a null label (as `train-expert --label-dropout > 0`)."""
    import torch

    from models.tiny import make_tiny_experts

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a shared small box: one intra-op thread keeps tiny forwards fast
    yield make_tiny_experts(
        tmp_path_factory.mktemp("null-experts"), 2, widths=TINY_WIDTHS, jitter=JITTER, groups=8, null_label=True
    )
    torch.set_num_threads(threads)


async def _submit_raw(nc, fields: dict):
    data = msgpack.packb({"v": 1, "kind": "job_request", **fields}, use_bin_type=True)
    msg = await nc.request(subjects.jobs_submit("anon"), data, timeout=10)
    return unpack(msg.data, SubmitReply)


def test_label_router_gives_unknown_labels_uniform_weights():
    w = LabelRouter(C2E, 2, confidence=0.9).weights(np.zeros((3, 1, 32, 32)), np.zeros(3), np.array([U, 2, 7]))
    np.testing.assert_allclose(w, [[0.5, 0.5], [0.9, 0.1], [0.1, 0.9]])
    w4 = LabelRouter([0, 1, 2, 3] * 2 + [0, 1], 4).weights(np.zeros((1, 1, 32, 32)), np.zeros(1), np.array([U]))
    np.testing.assert_allclose(w4, [[0.25] * 4])


async def test_unconditional_job_end_to_end_routed_by_the_router(nats_url, nc, null_experts, tiny_router):
    from models.router import Router

    router = Router.load(tiny_router)
    ws = await start_workers(nats_url, null_experts, buckets=(1, 4, 8), dtype="float32")
    try:
        async with Coordinator(router, num_experts=2, class_to_expert=C2E, nats_url=nats_url, step_timeout=10):
            digits = [U, U, 4, U]
            frames: list[FrameEvent] = []
            req = JobRequest(digits=digits, seed=21, steps=3, strategy="top1")
            first = await run_job(
                nc, req, lambda ev: frames.append(ev) if isinstance(ev, FrameEvent) else None, timeout=120
            )
            again = await run_job(nc, req, timeout=120)
            assert first.digits == digits and first.images.shape == (4, 1, 32, 32)
            np.testing.assert_array_equal(first.images, again.images)  # deterministic for a seed
            np.testing.assert_allclose(first.usage.sum(axis=1), 1.0)  # top1: one expert per step
            # the router saw y = -1: step 0's weights are its weights for (noise, t = 0, label unknown)
            x0 = np.stack([initial_noise(21, i, (1, 32, 32)) for i in range(4)])
            want = router.weights(x0, np.zeros(4, np.float32), np.array(digits, np.int64))
            step1 = next(f for f in frames if f.step == 1)
            np.testing.assert_allclose(np.asarray(step1.weights, np.float64), want, atol=2e-3)
            assert step1.experts == np.argmax(want, axis=1).tolist()  # top1: the router's own choice
            # the label reached the experts: the same noise with digit 0 ends elsewhere
            zero = await run_job(nc, JobRequest(digits=[0, U, 4, U], seed=21, steps=3), timeout=120)
            assert np.abs(zero.images[0] - first.images[0]).max() > 1e-4
            np.testing.assert_allclose(zero.images[1:], first.images[1:], atol=1e-4)  # other rows: as before

            full = await run_job(nc, JobRequest(digits=[U, U], seed=3, steps=2, strategy="full"), timeout=120)
            assert full.digits == [U, U] and (np.asarray(full.usage) > 0).all()  # every expert, router weighted
            topk = await run_job(nc, JobRequest(digits=[U], seed=3, steps=2, strategy="topk", top_k=2), timeout=120)
            assert topk.images.shape == (1, 1, 32, 32)

            rejected = await _submit_raw(nc, {"digits": [3, U], "strategy": "oracle"})
            assert isinstance(rejected, JobRejected) and rejected.code == ErrorCode.BAD_REQUEST
            assert "oracle" in rejected.reason and "label unknown" in rejected.reason
    finally:
        await stop_workers(ws)


async def test_a_fleet_without_null_labels_refuses_unconditional_jobs_and_keeps_serving(nats_url, nc, tiny_experts):
    # experts trained without label dropout: no null label
    ws = await start_workers(nats_url, tiny_experts, buckets=(1, 4, 8), dtype="float32")
    try:
        async with Coordinator(
            LabelRouter(C2E, 2), num_experts=2, class_to_expert=C2E, nats_url=nats_url, step_timeout=10
        ):
            before = (await fleet_status(nc)).jobs_rejected
            normal = asyncio.create_task(run_job(nc, JobRequest(digits=[3, 8], seed=5, steps=3), timeout=120))
            for _ in range(2):  # the second answer comes from what the first probe learned
                with pytest.raises(JobFailed) as err:
                    await run_job(nc, JobRequest(digits=[U, 3], seed=5, steps=3), timeout=60)
                assert err.value.code == ErrorCode.BAD_REQUEST
                assert "null label" in err.value.reason and "--label-dropout" in err.value.reason
                assert "experts 0, 1" in err.value.reason and "1 of 2 digits are -1" in err.value.reason
            done = await normal  # the conditional job beside them is served as usual
            assert done.digits == [3, 8] and not done.notes
            after = await run_job(nc, JobRequest(digits=[1], seed=6, steps=2), timeout=120)
            assert after.images.shape == (1, 1, 32, 32)
            assert (await fleet_status(nc)).jobs_rejected == before + 2
    finally:
        await stop_workers(ws)


async def test_an_expert_that_does_not_answer_the_probe_is_asked_again_only_after_a_while(nats_url, nc, null_experts):
    """Submits are handled one at a time: a silent expert (no worker) must not make every unconditional
    submit wait for its own probe. The unknown answer is kept NULL_LABEL_UNKNOWN_TTL_S, and the job is
    not refused for it (expert 1 serves its rows, as an expert with no responders is treated)."""
    from coordinator import service

    # expert 0 only: expert 1 never answers
    ws = await start_workers(nats_url, null_experts[:1], buckets=(1, 4, 8), dtype="float32")
    try:
        async with Coordinator(
            LabelRouter(C2E, 2), num_experts=2, class_to_expert=C2E, nats_url=nats_url, step_timeout=10
        ) as coord:
            asked = []
            probe = coord.null_labels.probe

            async def counting(k):
                asked.append(k)
                return await probe(k)

            coord.null_labels.probe = counting
            for seed in (1, 2, 3):
                done = await run_job(nc, JobRequest(digits=[U], seed=seed, steps=2), timeout=60)
                assert done.images.shape == (1, 1, 32, 32)
            assert sorted(asked) == [0, 1]  # one probe each, not one per submit
            assert coord.null_labels.known[0][0] is True and coord.null_labels.known[1][0] is None
            assert service.NULL_LABEL_UNKNOWN_TTL_S < service.NULL_LABEL_TTL_S
    finally:
        await stop_workers(ws)
