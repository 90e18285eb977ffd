"""bus.kv_keys.live_keys against a real JetStream server: every live key, no deleted one, also
while other clients write; nothing left behind."""

from __future__ import annotations

import asyncio

import pytest

from bus.kv_keys import live_keys
from bus.nats_server import NatsServer


@pytest.fixture(scope="module")
def js_url(tmp_path_factory):
    store = tmp_path_factory.mktemp("kv-keys-js")
    with NatsServer(extra_config=f'jetstream {{ store_dir: "{store}" }}') as srv:
        yield srv.url


async def _bucket(js_url, name, **cfg):
    import nats

    nc = await nats.connect(js_url, name=f"pytest-{name}")
    js = nc.jetstream()
    kv = await js.create_key_value(bucket=name, history=1, **cfg)
    return nc, js, kv


async def test_empty_bucket_lists_nothing_and_leaves_no_consumer(js_url):
    nc, js, kv = await _bucket(js_url, "empty")
    try:
        assert await live_keys(js, "empty") == []
        await kv.put("a", b"1")
        await kv.delete("a")
        assert await live_keys(js, "empty") == []  # only a delete marker
        assert (await js.stream_info("KV_empty")).state.consumer_count == 0
    finally:
        await nc.close()


async def test_lists_exactly_the_live_keys_skipping_deleted_and_purged(js_url):
    nc, js, kv = await _bucket(js_url, "mixed")
    try:
        for i in range(300):  # more than one pull (BATCH 256)
            await kv.put(f"job-{i:03d}", b"x" * (i % 7 + 1))
        for i in range(0, 300, 5):
            await kv.delete(f"job-{i:03d}")
        for i in range(1, 300, 7):
            await kv.purge(f"job-{i:03d}")
        for i in range(2, 300, 3):  # rewritten: the key's last message is a later one
            await kv.put(f"job-{i:03d}", b"again")
        live = {f"job-{i:03d}" for i in range(300) if (i % 5 and (i - 1) % 7) or i % 3 == 2}
        got = await live_keys(js, "mixed")
        assert len(got) == len(set(got)) and set(got) == live
        assert (await js.stream_info("KV_mixed")).state.consumer_count == 0
    finally:
        await nc.close()


async def test_keys_live_before_a_listing_are_all_listed_while_another_client_writes(js_url):
    """Keys that hold a value when a listing starts and are not written while it runs are always
    in it, each once, whatever other clients write to other keys meanwhile."""
    nc, js, kv = await _bucket(js_url, "busy")
    nc2, _, kv2 = await _bucket(js_url, "busy")
    stable = {f"stable-{i}" for i in range(40)}
    for key in sorted(stable):
        await kv.put(key, b"cp")
    stop = asyncio.Event()
    deleted = [0]  # churn-0 .. churn-(deleted - 1) are gone for good

    async def writer():
        n = 0
        while not stop.is_set():
            await kv2.put(f"hot-{n % 5}", b"cp-%d" % n)  # rewritten again and again
            await kv2.put(f"churn-{n}", b"new")
            if n >= 3:
                await kv2.delete(f"churn-{n - 3}")
                deleted[0] = n - 2
            n += 1

    task = asyncio.create_task(writer())
    try:
        for _ in range(30):
            gone = deleted[0]
            got = await live_keys(js, "busy")
            assert stable <= set(got), sorted(stable - set(got))
            assert len(got) == len(set(got))
            assert not [k for k in got if k.startswith("churn-") and int(k[6:]) < gone]
    finally:
        stop.set()
        await task
        await nc.close()
        await nc2.close()


async def test_a_user_not_allowed_to_pull_gets_an_error_not_an_empty_list(tmp_path):
    """Without publish rights on $JS.API.CONSUMER.MSG.NEXT the pull is dropped by the server: the
    listing must fail loudly (a coordinator would otherwise see no checkpoints to resume)."""
    import nats
    import nats.errors

    conf = f"""
jetstream {{ store_dir: "{tmp_path / "js"}" }}
authorization {{
  users: [
    {{ user: admin, password: pw }},
    {{ user: lister, password: pw,
       permissions: {{ publish: {{ allow: ["$JS.API.>"], deny: ["$JS.API.CONSUMER.MSG.NEXT.>"] }},
                       subscribe: {{ allow: ["_INBOX.>"] }} }} }}
  ]
}}
"""
    with NatsServer(extra_config=conf) as srv:
        admin = await nats.connect(srv.url.replace("nats://", "nats://admin:pw@"))
        lister = await nats.connect(srv.url.replace("nats://", "nats://lister:pw@"), error_cb=_quiet)
        try:
            kv = await admin.jetstream().create_key_value(bucket="perm", history=1)
            await kv.put("job-1", b"cp")
            assert await live_keys(admin.jetstream(), "perm") == ["job-1"]
            with pytest.raises(nats.errors.TimeoutError):
                await live_keys(lister.jetstream(), "perm", fetch_timeout=0.5)
        finally:
            await lister.close()
            await admin.close()


async def _quiet(err) -> None:
    pass  # the permissions violation, expected
