"""Fuzz target `worker`: raw and mutated StepRequests (and other messages) over NATS to a real ExpertWorker."""

from __future__ import annotations

import asyncio
import random

from ..fleet import Fleet, _drive, _local
from ..result import FuzzResult


async def fuzz(fleet: Fleet, runs: int, seed: int, concurrency: int, timeout: float, bar) -> FuzzResult:
    import nats.errors
    import numpy as np

    from fuzzing.inputs import Mutator, message_seeds, step_request_variant
    from schemas import ErrorCode, ErrorReply, ProtocolError, StepReply, StepRequest, StepResult, subjects, unpack

    rng = random.Random(f"worker:{seed}")
    seeds = message_seeds(image=(1, 32, 32), rows=(1, 2, 3))
    steps = [s for s in seeds if s["kind"] == "step_request"]
    mut = Mutator(rng, steps * 4 + seeds)
    res = FuzzResult("worker", "random", runs)
    unserved = 7
    # what the worker adds to the schema: model shape, row and label limits, deadline, queue, overflow
    allowed_for_valid = {
        ErrorCode.UNKNOWN_EXPERT,
        ErrorCode.BAD_SHAPE,
        ErrorCode.TOO_LARGE,
        ErrorCode.BAD_REQUEST,
        ErrorCode.DEADLINE_EXCEEDED,
        ErrorCode.OVERLOADED,
        ErrorCode.NON_FINITE,
    }

    def make(_i: int) -> tuple[int, bytes]:
        p = rng.random()
        expert = 0 if p < 0.9 else (1 if p < 0.95 else unserved)
        return expert, step_request_variant(rng) if rng.random() < 0.25 else mut.message_bytes()

    async def probe(item: tuple[int, bytes]) -> None:
        expert, data = item
        res.tried += 1
        local, local_code = _local(data, StepRequest)
        try:
            msg = await fleet.nc.request(subjects.expert_velocity(expert), data, timeout=timeout)
        except nats.errors.MaxPayloadError:
            return (
                res.count("clear", "nats_max_payload")
                if len(data) > fleet.nc.max_payload
                else res.crash(data, "MaxPayloadError under the server's max_payload")
            )
        except nats.errors.NoRespondersError:
            if expert == unserved:
                return res.count("clear", "no_responders")
            return res.crash(data, f"no responders on expert {expert}'s subject: the worker is gone")
        except nats.errors.TimeoutError:
            return res.crash(data, f"no reply in {timeout} s")
        try:
            reply = unpack(msg.data, StepResult)
        except ProtocolError as err:
            return res.crash(data, f"undecodable reply: {err.code.value}: {err.message}")
        if isinstance(reply, ErrorReply):
            if reply.code is ErrorCode.INTERNAL:
                return res.crash(data, f"internal error reply: {reply.message}")
            if local_code is not None and reply.code is not local_code:
                return res.crash(
                    data,
                    f"worker answered {reply.code.value} ({reply.message}) where the schema says {local_code.value}",
                )
            if local_code is None and reply.code not in allowed_for_valid:
                return res.crash(data, f"valid request answered {reply.code.value}: {reply.message}")
            return res.count("clear", reply.code.value)
        assert isinstance(reply, StepReply)
        if local is None:
            return res.crash(data, f"worker served a request the schema refuses ({local_code.value})")
        if reply.velocity.shape != local.x_t.shape or reply.row_ids != local.row_ids or reply.expert != expert:
            return res.crash(
                data,
                f"dishonest reply: velocity {list(reply.velocity.shape)} for x_t "
                f"{list(local.x_t.shape)}, row_ids {reply.row_ids[:4]} for {local.row_ids[:4]}",
            )
        return res.count("ok", "step_reply")

    await _drive(runs, concurrency, make, probe, bar, res)

    # after the run: a valid request gets the model's own velocity
    worker = fleet.workers[0]
    r = np.random.default_rng(seed)
    req = StepRequest(
        expert=0,
        x_t=r.standard_normal((3, 1, 32, 32)).astype(np.float32),
        t=r.uniform(0, 1, 3).astype(np.float32),
        y=r.integers(0, 10, 3),
        row_ids=["a", "b", "c"],
    )
    from schemas import pack

    try:
        msg = await fleet.nc.request(subjects.expert_velocity(0), pack(req), timeout=timeout)
        reply = unpack(msg.data, StepResult)
        want = await asyncio.to_thread(worker.backend.forward, np.array(req.x_t), np.array(req.t), np.array(req.y))
        if not isinstance(reply, StepReply) or not np.allclose(reply.velocity, want, atol=1e-5):
            raise AssertionError(f"wrong answer: {reply!r:.200}")
        res.check = "worker answers a valid request with the model's velocity"
    except Exception as err:
        res.check = f"FAILED: {type(err).__name__}: {err}"
        res.crash(b"", f"after the run the worker does not serve: {type(err).__name__}: {err}")
    return res
