"""A host that sees the coordinator's null-label probes cannot forge a latent job's decoded images.

The attack (an outside probe of a live fleet): a plain subscription on an expert's subject, which
any worker host may hold, receives the coordinator's null-label probes and so their reply subjects.
Were they nats-py request inboxes (`_INBOX.<mux>.<NUID>`: a fixed prefix and a counter with a fixed
step), two of them would predict the next ones, among them the reply subject of the next decode
request; a forged `DecodeReply` there (the right autoencoder hash, one image per row) would become
a client's final images (nats-py appends 4 random hex digits to the counter: 65,536 guesses per
subject, a second of publishing). Real nats-server, the real NullLabelProbes and DecoderClient; a
decoder that answers after 2 s (as under load) holds the window open while the attacker sprays.
"""

from __future__ import annotations

import asyncio
import secrets

import numpy as np
import pytest

from bus.connect import flushed
from coordinator.decoder_client import DecoderClient, DecoderUnavailable
from coordinator.null_labels import NullLabelProbes
from schemas import DecodeReply, DecodeRequest, StepReply, StepRequest, pack, subjects, unpack
from tests.web.test_inbox_forgery import _DIGITS

pytestmark = [pytest.mark.bus, pytest.mark.timeout(90)]

HASH = "ab" * 32
IMAGE_SHAPE = (3, 8, 8)
LATENT_SHAPE = (4, 2, 2)


def predict_next(observed: list[str]) -> list[str]:
    """Every reply subject the next request may use, if the observed ones (in order) are nats-py request
    inboxes: `_INBOX.<mux>.<token>`, the token a NUID (12 fixed characters, then a base-62 counter of 10
    with a fixed step) and up to 4 random hex digits (at most 65,536 subjects to spray); [] otherwise."""
    heads, seqs, tails = set(), [], set()
    for subject in observed:
        head, _, tok = subject.rpartition(".")
        nuid, tail = tok[:22], tok[22:]
        if len(nuid) != 22 or any(c not in _DIGITS for c in nuid.encode()) or len(tail) > 4:
            return []
        heads.add((head, nuid[:12]))
        tails.add(len(tail))
        n = 0
        for c in nuid[12:].encode():
            n = n * 62 + _DIGITS.index(c)
        seqs.append(n)
    steps = {b - a for a, b in zip(seqs, seqs[1:])}
    if len(heads) != 1 or len(tails) != 1 or len(steps) != 1 or not 0 < next(iter(steps)) < 62**4:
        return []
    (head, prefix), width = heads.pop(), tails.pop()
    n, digits = seqs[-1] + steps.pop(), bytearray()
    for _ in range(10):
        n, r = divmod(n, 62)
        digits.append(_DIGITS[r])
    nuid = prefix + bytes(reversed(digits)).decode()
    return [f"{head}.{nuid}{k:0{width}x}" if width else f"{head}.{nuid}" for k in range(16**width)]


async def _worker(nc, expert: int):
    """An expert worker that serves every label (queue group), echoing the rows."""

    async def on_msg(msg):
        req = unpack(msg.data, StepRequest)
        await msg.respond(
            pack(StepReply(expert=req.expert, velocity=np.zeros_like(req.x_t), row_ids=req.row_ids, worker_id="w"))
        )

    return await nc.subscribe(subjects.expert_velocity(expert), queue=subjects.expert_queue_group(expert), cb=on_msg)


async def _decoder(nc, delay: float = 2.0):
    """A decoder of HASH whose images are 0.25 everywhere, answering after `delay`."""

    async def on_msg(msg):
        req = unpack(msg.data, DecodeRequest)
        await asyncio.sleep(delay)
        images = np.full((len(req.latents), *IMAGE_SHAPE), 0.25, np.float32)
        await msg.respond(pack(DecodeReply(decoder=HASH, images=images, worker_id="dec")))

    subject = subjects.decoder_decode(HASH)
    return await nc.subscribe(subject, queue=f"{subject}.q", cb=on_msg)


async def test_probe_reply_subjects_predict_nothing_and_sprayed_decode_replies_miss(nats_url, nc):
    import nats

    spy = await nats.connect(nats_url, name="attacker")
    seen: list[str] = []

    async def record(msg):
        seen.append(msg.reply)

    spy_sub = await spy.subscribe(subjects.expert_velocity(0), cb=record)
    await flushed(spy)
    subs = [await _worker(nc, 0), await _decoder(nc)]
    await nc.flush()
    sprayed = 0
    try:
        probes = NullLabelProbes(nc, 1, (1, 4, 4), step_timeout=2.0)
        for _ in range(3):
            assert await probes.probe(0) == (True, "")
        await spy.flush()
        assert len(seen) == 3 and len(set(seen)) == 3
        predicted = predict_next(seen)
        # what the attacker sprays: the subjects predicted (none, unless they are a NUID sequence) and
        # guesses under the prefix it saw
        targets = predicted + [f"{s.rpartition('.')[0]}.{secrets.token_hex(16)}" for s in seen]
        forged = pack(DecodeReply(decoder=HASH, images=np.full((2, 1, 2, 2), 7.0, np.float32)))
        client = DecoderClient(nc, HASH, timeout=10.0, retries=0)
        task = asyncio.ensure_future(client.decode(np.zeros((2, *LATENT_SHAPE), np.float32)))
        await asyncio.sleep(0.1)  # the request is out
        for target in targets:
            await spy.publish(target, forged)
            sprayed += 1
        await spy.flush()
        images = await asyncio.wait_for(task, 15)
        assert sprayed > 0
        np.testing.assert_array_equal(images, np.full((2, *IMAGE_SHAPE), 0.25, np.float32))
        assert client.bad_replies == 0 and probes.bad_replies == 0
        assert predicted == [], f"the probes' reply subjects are a NUID sequence: {seen}"
    finally:
        await spy_sub.unsubscribe()
        await spy.close()
        for s in subs:
            await s.unsubscribe()


async def test_a_decode_reply_of_another_shape_or_range_is_a_bad_reply_not_images(nats_url, nc):
    """Replies that pass the hash and row count but not the images' shape or value range count as bad
    replies (ddm_coordinator_bad_replies_total{request="decode"}) and fail the try; the job is not handed
    them."""
    answers = [
        np.full((2, *IMAGE_SHAPE), 0.5, np.float32),  # good: learns the shape
        np.full((2, 1, 2, 2), 0.5, np.float32),  # another shape
        np.full((2, *IMAGE_SHAPE), 7.0, np.float32),  # outside [-1, 1]
    ]

    async def on_msg(msg):
        images = answers.pop(0)
        await msg.respond(pack(DecodeReply(decoder=HASH, images=images, worker_id="odd")))

    subject = subjects.decoder_decode(HASH)
    sub = await nc.subscribe(subject, queue=f"{subject}.q", cb=on_msg)
    try:
        client = DecoderClient(nc, HASH, timeout=2.0, retries=0)
        z = np.zeros((2, *LATENT_SHAPE), np.float32)
        assert (await client.decode(z)).shape == (2, *IMAGE_SHAPE)
        with pytest.raises(DecoderUnavailable, match=r"shape \[1, 2, 2\], but this fleet's are \[3, 8, 8\]"):
            await client.decode(z)
        with pytest.raises(DecoderUnavailable, match=r"outside the range \[-1, 1\]"):
            await client.decode(z)
        assert client.bad_replies == 2
    finally:
        await sub.unsubscribe()


async def test_a_probe_reply_for_other_rows_counts_as_bad_and_tells_nothing(nc):
    """A step reply that is not this probe's (other row ids, another expert, another shape) is no
    answer: the expert's null label stays unknown and the reply is counted."""
    replies = iter(
        [
            dict(expert=0, rows=["someone-else"], shape=(1, 1, 4, 4)),
            dict(expert=1, rows=None, shape=(1, 1, 4, 4)),
            dict(expert=0, rows=None, shape=(1, 1, 8, 8)),
            dict(expert=0, rows=None, shape=(1, 1, 4, 4)),  # a good one
        ]
    )

    async def on_msg(msg):
        req = unpack(msg.data, StepRequest)
        r = next(replies)
        rows = r["rows"] or req.row_ids
        v = np.zeros(r["shape"], np.float32)
        await msg.respond(pack(StepReply(expert=r["expert"], velocity=v, row_ids=rows, worker_id="w")))

    sub = await nc.subscribe(subjects.expert_velocity(0), queue=subjects.expert_queue_group(0), cb=on_msg)
    try:
        probes = NullLabelProbes(nc, 1, (1, 4, 4), step_timeout=2.0)
        assert [await probes.probe(0) for _ in range(3)] == [None, None, None]
        assert probes.bad_replies == 3
        assert await probes.probe(0) == (True, "")
    finally:
        await sub.unsubscribe()
