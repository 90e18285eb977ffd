"""The decoder service as guarded as the expert workers (issue 44), on a real nats-server with a real tiny
autoencoder: replies (discovery too) go only to `_INBOX` subjects, dropped requests are counted and logged
at a bounded rate; every request gets a reply, latents that decode to NaN / Inf included (`non_finite`,
not a 60 s wait); requests over `max_request_rows` are refused `too_large`."""

from __future__ import annotations

import asyncio
import json
import logging

import numpy as np
import pytest

from schemas import DecodeReply, DecodeRequest, DecodeResult, ErrorCode, ErrorReply, pack, unpack
from tests.waiting import wait_until
from workers.decoder_service import SERVICE_NAME, DecoderWorker


@pytest.fixture(scope="module")
def codec(tmp_path_factory):
    """A real random-init autoencoder (3x16x16 images <-> 4x8x8 latents), loaded."""
    from models.autoencoder_torch import LatentCodec
    from models.tiny import make_tiny_autoencoder

    return LatentCodec.load(make_tiny_autoencoder(tmp_path_factory.mktemp("ae") / "autoencoder", seed=3))


def _request(codec, z) -> bytes:
    return pack(DecodeRequest(decoder=codec.content_hash, latents=z, request_id="q1"))


def _latents(n: int = 2) -> np.ndarray:
    return np.random.default_rng(0).standard_normal((n, 4, 8, 8)).astype(np.float32)


async def test_reply_subject_outside_inbox_is_dropped_discovery_too(nats_url, nc, codec, caplog):
    """A decode request or a $SRV request whose reply subject is another client's events subject is
    never answered there; each is counted (STATS `dropped`), one log line for the lot; inboxes still work."""
    victim = "ddm.v1.jobs.victim-job.events"
    got: list = []

    async def on_victim(msg):
        got.append(msg)

    sub = await nc.subscribe(victim, cb=on_victim)
    caplog.set_level(logging.WARNING, logger="workers.decoder_service")
    async with DecoderWorker(codec=codec, nats_url=nats_url) as dec:
        await nc.publish(dec.subject, _request(codec, _latents()), reply=victim)
        await nc.publish(dec.subject, _request(codec, _latents()), reply="_INBOXevil.x")
        for verb in ("PING", "INFO", "STATS"):
            await nc.publish(f"$SRV.{verb}.{SERVICE_NAME}.{dec.service_id}", b"", reply=victim)
        await nc.flush()
        await wait_until(lambda: dec.dropped_requests == 5, timeout=10)
        reply = unpack((await nc.request(dec.subject, _request(codec, _latents()), timeout=20)).data, DecodeResult)
        assert isinstance(reply, DecodeReply)
        stats = json.loads((await nc.request(f"$SRV.STATS.{SERVICE_NAME}.{dec.service_id}", b"", timeout=5)).data)
        await asyncio.sleep(0.2)
    await sub.unsubscribe()
    assert got == []
    assert stats["endpoints"][0]["data"]["dropped"] == 5 and dec.requests == 1
    lines = [r for r in caplog.records if "dropped a decode request" in r.getMessage()]
    assert len(lines) == 1 and victim in lines[0].getMessage(), [r.getMessage() for r in caplog.records]


async def test_latents_that_decode_to_nan_get_an_error_reply_at_once(nats_url, nc, codec):
    """Finite latents of 1e30 (float32) or 1e300 (float64, Inf in float32) are answered `non_finite` at
    once, not left unanswered; the decoder keeps serving."""
    async with DecoderWorker(codec=codec, nats_url=nats_url) as dec:
        for z in (np.full((2, 4, 8, 8), 1e30, np.float32), np.full((1, 4, 8, 8), 1e300, np.float64)):
            reply = unpack((await nc.request(dec.subject, _request(codec, z), timeout=5)).data, DecodeResult)
            assert isinstance(reply, ErrorReply) and reply.code == ErrorCode.NON_FINITE, reply
            assert reply.request_id == "q1"
        good = unpack((await nc.request(dec.subject, _request(codec, _latents()), timeout=20)).data, DecodeResult)
        assert isinstance(good, DecodeReply) and np.isfinite(good.images).all()
        assert dec.errors == 2 and dec.requests == 1


class _BadCodec:
    """The real codec's shapes and hash; `decode` returns what `make` gives (a broken decoder)."""

    def __init__(self, codec, make):
        self.latent_shape, self.image_shape = codec.latent_shape, codec.image_shape
        self.content_hash, self.latent_shape_error = codec.content_hash, codec.latent_shape_error
        self.codec, self.make, self.broken = codec, make, False

    def decode(self, z):
        return self.make(self.codec.decode(z)) if self.broken else self.codec.decode(z)


@pytest.mark.parametrize(
    ("make", "code"),
    [
        (lambda images: np.full_like(images, np.nan), ErrorCode.INTERNAL),  # NaN from sane latents: our fault
        (lambda images: images[0], ErrorCode.INTERNAL),  # a reply that fails its own validation: a bug
    ],
    ids=["nan-images", "3d-images"],
)
async def test_a_broken_decode_result_is_answered_not_raised(nats_url, nc, codec, make, code):
    bad = _BadCodec(codec, make)
    async with DecoderWorker(codec=bad, nats_url=nats_url) as dec:
        bad.broken = True
        reply = unpack((await nc.request(dec.subject, _request(codec, _latents()), timeout=5)).data, DecodeResult)
        assert isinstance(reply, ErrorReply) and reply.code == code, reply
        bad.broken = False
        good = unpack((await nc.request(dec.subject, _request(codec, _latents()), timeout=20)).data, DecodeResult)
        assert isinstance(good, DecodeReply)


async def test_requests_over_max_request_rows_are_refused_too_large(nats_url, nc, codec):
    for wrong in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="max_request_rows"):
            DecoderWorker(codec=codec, max_request_rows=wrong)
    assert DecoderWorker(codec=codec, max_request_rows=10**6).max_request_rows == 512  # the protocol's limit
    async with DecoderWorker(codec=codec, nats_url=nats_url, max_request_rows=2) as dec:
        assert dec.metadata()["max_request_rows"] == "2"
        reply = unpack((await nc.request(dec.subject, _request(codec, _latents(3)), timeout=5)).data, DecodeResult)
        assert isinstance(reply, ErrorReply) and reply.code == ErrorCode.TOO_LARGE, reply
        assert "3 latent rows exceed this decoder's limit of 2" in reply.message
        good = unpack((await nc.request(dec.subject, _request(codec, _latents(2)), timeout=20)).data, DecodeResult)
        assert isinstance(good, DecodeReply) and good.images.shape[0] == 2
        assert dec.rows == 2
