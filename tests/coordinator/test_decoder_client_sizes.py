"""The decoder client gathers the decode calls of one loop turn into requests whose replies fit one message:
by rows (`max_rows`) and, once the decoders' image shape is known, by the bytes of their float32 images
(a 3x256x256 image is 786 KB: 10 per 8 MiB reply). Whole calls are never split. The network call is replaced
by a recorder (a pure unit of the grouping)."""

from __future__ import annotations

import asyncio

import numpy as np

from coordinator.decoder_client import DecoderClient


def _client(image_shape, max_rows=256):
    client = DecoderClient(None, "0" * 64, max_rows=max_rows)
    client.image_shape = image_shape
    sent: list[int] = []

    async def request(z):  # what a decoder would answer: one image per latent row
        sent.append(len(z))
        return np.zeros((len(z), *(image_shape or (3, 32, 32))), np.float32)

    client._request = request
    return client, sent


async def test_large_images_go_in_requests_whose_replies_fit_one_message():
    client, sent = _client((3, 256, 256))
    assert client.rows_per_request() == 10
    calls = [np.zeros((n, 4, 32, 32), np.float32) for n in (4, 4, 4, 6, 2)]
    images = await asyncio.gather(*(client.decode(z) for z in calls))
    assert [len(i) for i in images] == [4, 4, 4, 6, 2]  # each call gets its own rows back
    assert sent == [8, 10, 2] and all(4 * n * 3 * 256 * 256 < 8 * 2**20 for n in sent)


async def test_small_images_and_an_unknown_shape_gather_up_to_max_rows():
    client, sent = _client((3, 32, 32), max_rows=16)
    await asyncio.gather(*(client.decode(np.zeros((6, 4, 16, 16), np.float32)) for _ in range(4)))
    assert sent == [12, 12]  # whole calls only: 6 + 6, then 6 + 6
    unknown, sent = _client(None, max_rows=256)
    assert unknown.rows_per_request() == 256
    await asyncio.gather(*(unknown.decode(np.zeros((100, 4, 16, 16), np.float32)) for _ in range(3)))
    assert sent == [200, 100]
