"""Every live key of a JetStream key-value bucket, listed exactly.

nats-py's `KeyValue.keys()` ends its listing at the first message whose `num_pending` reads 0, or
at once when the consumer it pushes from reports nothing pending while deliveries are still in
flight; either way it can return part of the bucket (nats-io/nats.py#842 and #995). A durable
coordinator that lists part of the checkpoints on a restart leaves the rest of its jobs orphaned
until the next scan, and its status answers say "unknown" meanwhile.

`live_keys` lists with a pull consumer instead: the server counts the last message of every key
when the consumer is created (nothing is delivered before a pull asks), and the listing pulls
that many messages, skipping delete and purge markers. Every key that holds a value when the
listing starts and is not written while it runs is listed, once; a key written meanwhile (another
coordinator's job) may or may not be.
"""

from __future__ import annotations

import uuid

#: Messages asked for per pull.
BATCH = 256
#: Seconds one pull waits for its messages; reached only when messages counted at creation expired
#: (the bucket's TTL) before they were pulled.
FETCH_TIMEOUT_S = 2.0

_DELETE_OPS = {"DEL", "PURGE"}
_DELETE_MARKERS = {"MaxAge", "Purge", "Remove"}  # nats-server 2.11+ markers (Nats-Marker-Reason)


def _is_delete(headers: dict | None) -> bool:
    if not headers:
        return False
    return headers.get("KV-Operation") in _DELETE_OPS or headers.get("Nats-Marker-Reason") in _DELETE_MARKERS


async def live_keys(js, bucket: str, *, batch: int = BATCH, fetch_timeout: float = FETCH_TIMEOUT_S) -> list[str]:
    """The keys of `bucket` that hold a value (not deleted or purged), each once, in stream order.

    `js` is a nats-py JetStreamContext. Bus errors (nats.errors.Error, OSError) propagate, and so does a
    pull that gets nothing while messages wait (nats.errors.TimeoutError: e.g. a user not allowed to
    publish `$JS.API.CONSUMER.MSG.NEXT.KV_<bucket>.*`); the consumer made for the listing is deleted
    (or expires 30 s later if the delete fails)."""
    import nats.errors
    from nats.js import api

    stream, prefix = f"KV_{bucket}", f"$KV.{bucket}."
    name = f"keys_{uuid.uuid4().hex[:16]}"
    config = api.ConsumerConfig(
        name=name,
        deliver_policy=api.DeliverPolicy.LAST_PER_SUBJECT,
        ack_policy=api.AckPolicy.NONE,
        filter_subject=f"{prefix}>",
        headers_only=True,
        mem_storage=True,
        num_replicas=1,
        inactive_threshold=30.0,
    )
    info = await js.add_consumer(stream, config=config)
    try:
        wanted = int(info.num_pending or 0)
        if wanted == 0:
            return []
        sub = await js.pull_subscribe_bind(consumer=name, stream=stream)
        try:
            keys: dict[str, None] = {}  # a key rewritten during the listing can come twice
            seen = 0
            while seen < wanted:
                try:
                    msgs = await sub.fetch(min(batch, wanted - seen), timeout=fetch_timeout)
                except nats.errors.TimeoutError:
                    if (await sub.consumer_info()).num_pending:
                        raise  # messages wait but none came: a pull not allowed (permissions), a bus fault
                    break  # the rest expired (bucket TTL) after the count
                for msg in msgs:
                    seen += 1
                    if not _is_delete(msg.headers):
                        keys[msg.subject[len(prefix) :]] = None
            return list(keys)
        finally:
            await sub.unsubscribe()
    finally:
        try:
            await js.delete_consumer(stream, name)
        except (nats.errors.Error, OSError):
            pass  # it expires after inactive_threshold
