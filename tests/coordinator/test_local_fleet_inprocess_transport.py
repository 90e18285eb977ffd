"""InProcessTransport (the in-process path `bench fleet` measures as its ceiling): fixed-shape
backends get their rows padded to a warmed bucket and split at the largest, as a worker's batcher
does; others get exactly their rows. The backends here are fakes recording the shapes they see."""

import numpy as np
import pytest

from coordinator.errors import ExpertUnavailable
from coordinator.local_fleet import InProcessTransport


class FakeBackend:
    def __init__(self, pads: bool):
        self.pads_to_buckets = pads
        self.seen: list[int] = []

    def forward(self, x, t, y):
        self.seen.append(len(x))
        return x * 2.0 + t[:, None, None, None] + y[:, None, None, None]  # row-wise, so slicing shows


def _rows(n: int):
    rng = np.random.default_rng(n)
    return (
        rng.standard_normal((n, 1, 4, 4)).astype(np.float32),
        rng.uniform(0, 1, n).astype(np.float32),
        rng.integers(0, 10, n),
    )


@pytest.mark.parametrize("n, shapes", [(3, [4]), (4, [4]), (1, [1]), (11, [8, 4])])
async def test_a_fixed_shape_backend_sees_buckets_and_each_row_gets_its_own_answer(n, shapes):
    be = FakeBackend(pads=True)
    tr = InProcessTransport([be], buckets=(1, 2, 4, 8))
    x, t, y = _rows(n)
    v = await tr.velocity(0, x, t, y, [f"r{i}" for i in range(n)])
    assert be.seen == shapes
    np.testing.assert_allclose(v, x * 2.0 + t[:, None, None, None] + y[:, None, None, None], rtol=1e-6)


async def test_a_backend_without_fixed_shapes_or_without_buckets_gets_exactly_its_rows():
    free, unwarmed = FakeBackend(pads=False), FakeBackend(pads=True)
    x, t, y = _rows(3)
    assert (await InProcessTransport([free], buckets=(1, 2, 4)).velocity(0, x, t, y, ["a", "b", "c"])).shape[0] == 3
    assert (await InProcessTransport([unwarmed]).velocity(0, x, t, y, ["a", "b", "c"])).shape[0] == 3
    assert free.seen == [3] and unwarmed.seen == [3]


async def test_an_expert_not_loaded_is_unavailable():
    with pytest.raises(ExpertUnavailable):
        await InProcessTransport([FakeBackend(pads=True)], buckets=(1,)).velocity(1, *_rows(1), ["a"])
