"""Batch-invariant experts (`BackendBase.make_batch_invariant`, `ddm-fleet worker --batch-invariant`): a row's
velocity bit for bit the same whatever rows share its forward pass, checked on the real torch backend; the
switch's own check refuses a host whose kernels do not keep the promise."""

from __future__ import annotations

import json

import numpy as np
import pytest

from workers.backends import BackendError, get_backend
from workers.backends.base import BackendBase


def _rows(n: int, seed: int):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 1, 32, 32)).astype(np.float32)
    return x, rng.random(n).astype(np.float32), rng.integers(0, 10, n).astype(np.int64)


#: (first row, rows): slices of a 48-row batch computed on their own
SLICES = [(0, 1), (5, 3), (7, 13), (2, 17), (11, 21), (0, 33), (9, 39)]


def _slices_differ(be, x, t, y) -> list[tuple[int, int]]:
    full = be.forward(x, t, y)
    alone = {(i, n): be.forward(x[i : i + n], t[i : i + n], y[i : i + n]) for i, n in SLICES}
    return [(i, n) for (i, n), v in alone.items() if not np.array_equal(v, full[i : i + n])]


def test_a_batch_invariant_backend_gives_each_row_the_same_bits_whatever_its_batch(tiny_expert_checkpoint):
    """The tiny UNet on torch's CPU kernels, float32: plainly some rows move in their last bits with the
    batch (oneDNN's blocking follows it); batch-invariant, none does, at any slice of a busy batch."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the worker's own setting in the suite's fleets; the check passes at 2 as well
    try:
        be = get_backend("torch", dtype="float32")
        be.load(tiny_expert_checkpoint)
        x, t, y = _rows(48, 3)
        plain = _slices_differ(be, x, t, y)
        assert plain, "this host's kernels gave every slice the same bits unpadded: nothing here shows the mode"
        be.make_batch_invariant(16)
        assert be.batch_quantum == 16 and be.describe()["batch_quantum"] == "16"
        assert _slices_differ(be, x, t, y) == []
        assert be.forward(x[:0], t[:0], y[:0]).shape == (0, 1, 32, 32)
        be.make_batch_invariant(0)  # off again: exactly the rows, as before
        assert be.batch_quantum == 0 and "batch_quantum" not in be.describe()
        assert _slices_differ(be, x, t, y) == plain
    finally:
        torch.set_num_threads(threads)


class _BatchSensitive(BackendBase):
    """A pure unit: a model whose rows move with the batch size, as a kernel whose blocking follows it."""

    name = "batch-sensitive"

    def __init__(self, period: int):
        super().__init__(dtype="float32")
        self.period = period  # rows come out the same only among batches whose size is a multiple of this

    def load(self, checkpoint_path=None) -> None:
        from models.config import UNetConfig

        self.config = UNetConfig(widths=(8, 16, 32), groups=8)

    def _forward(self, x, t, y):
        return x * np.float32(1 + 1e-6 * (len(x) % self.period))


def test_the_switch_refuses_a_host_whose_rows_still_depend_on_the_batch():
    be = _BatchSensitive(period=7)
    be.load()
    with pytest.raises(BackendError, match="a row's velocity changes with its batch even at multiples of 16 rows"):
        be.make_batch_invariant(16)
    assert be.batch_quantum == 0  # left as it was
    ok = _BatchSensitive(period=16)  # a kernel that only moves off multiples of 16: the quantum fixes it
    ok.load()
    ok.make_batch_invariant(16)
    x, t, y = _rows(20, 1)
    np.testing.assert_array_equal(ok.forward(x[:3], t[:3], y[:3]), ok.forward(x, t, y)[:3])
    with pytest.raises(BackendError, match="0 \\(off\\) to 256 rows"):
        ok.make_batch_invariant(1000)


async def test_a_batch_invariant_worker_advertises_its_quantum_and_counts_the_rows_it_computes(
    nats_url, tiny_expert_checkpoint
):
    from bus.connect import connect
    from schemas import StepReply, StepRequest, pack, subjects, unpack
    from workers.service import ExpertWorker

    async with ExpertWorker(0, tiny_expert_checkpoint, dtype="float32", nats_url=nats_url, batch_quantum=16) as w:
        nc = await connect(nats_url, name="test")
        try:
            info = await nc.request("$SRV.INFO.ddm-expert", b"", timeout=5)
            assert json.loads(info.data)["metadata"]["batch_quantum"] == "16"
            x, t, y = _rows(3, 2)
            req = StepRequest(expert=0, x_t=x, t=t, y=y, row_ids=["a", "b", "c"], request_id="r")
            reply = unpack((await nc.request(subjects.expert_velocity(0), pack(req), timeout=10)).data, StepReply)
            assert reply.velocity.shape == (3, 1, 32, 32)
            assert w.metrics.padded_rows == 13  # 3 rows asked, 16 computed
        finally:
            await nc.close()
