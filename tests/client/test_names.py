"""Which client a connection is (client.jobs): the NATS user of the URL, or the inbox prefix it connected with."""

from __future__ import annotations

import nats
import pytest

from client.jobs import client_connect_options, client_from_url, client_of


async def test_the_client_name_comes_from_the_inbox_prefix_or_the_nats_user(nats_url):
    assert client_from_url("nats://alice:pw@127.0.0.1:4222") == "alice"
    assert client_from_url("127.0.0.1:4222,nats://bob:pw@h2:4222") == "bob"
    assert client_from_url("nats://127.0.0.1:4222") == client_from_url(None) == "anon"
    with pytest.raises(ValueError, match="cannot name a client"):
        client_from_url("nats://first.last:pw@127.0.0.1:4222")
    assert client_connect_options("alice") == {"inbox_prefix": "_INBOX_alice"}
    with pytest.raises(ValueError):
        client_connect_options("a.b")
    plain = await nats.connect(nats_url)
    mine = await nats.connect(nats_url, **client_connect_options("carol"))
    try:
        assert client_of(plain) == "anon" and client_of(mine) == "carol"
        assert mine.new_inbox().startswith("_INBOX_carol.")
    finally:
        await plain.close()
        await mine.close()
