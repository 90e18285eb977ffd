"""`benchmarks.nats_traffic`: a level's NATS messages and bytes per image, from hand-made /varz readings."""

from __future__ import annotations

from benchmarks.nats_traffic import format_traffic, read_varz, traffic


def _varz(in_msgs, out_msgs, in_bytes, out_bytes, **extra):
    return {"in_msgs": in_msgs, "out_msgs": out_msgs, "in_bytes": in_bytes, "out_bytes": out_bytes, **extra}


def test_the_differences_over_the_level_are_divided_by_its_images():
    before = _varz(1000, 1200, 5_000_000, 6_000_000, version="2.15.1")  # the warm-up and earlier levels
    after = _varz(1000 + 4 * 81, 1200 + 4 * 86, 5_000_000 + 4 * 1_230_000, 6_000_000 + 4 * 1_310_000)
    t = traffic(before, after, images=4)
    assert t == {
        "in_msgs": 324,
        "out_msgs": 344,
        "in_bytes": 4_920_000,
        "out_bytes": 5_240_000,
        "images": 4,
        "in_msgs_per_image": 81.0,
        "out_msgs_per_image": 86.0,
        "in_bytes_per_image": 1_230_000.0,
        "out_bytes_per_image": 1_310_000.0,
    }
    assert format_traffic(8, t) == "conc 8: 81.0 msgs/img in, 86.0 out; 1.23 MB/img in, 1.31 MB/img out"
    assert traffic(before, after, images=3)["in_msgs_per_image"] == 108.0
    small = traffic(_varz(0, 0, 0, 0), _varz(7, 9, 61_500, 512), images=2)
    assert format_traffic(1, small) == "conc 1: 3.5 msgs/img in, 4.5 out; 30.8 kB/img in, 256 B/img out"


def test_no_images_no_reading_or_a_restarted_server_give_no_per_image_figure():
    t = traffic(_varz(10, 10, 100, 100), _varz(13, 15, 400, 900), images=0)
    assert t == {"in_msgs": 3, "out_msgs": 5, "in_bytes": 300, "out_bytes": 800, "images": 0}
    assert format_traffic(4, t) == "conc 4: no images (3 msgs in, 5 out)"
    assert traffic(None, _varz(1, 1, 1, 1), 5) is None and traffic(_varz(1, 1, 1, 1), None, 5) is None
    assert traffic(_varz(500, 500, 9000, 9000), _varz(20, 25, 300, 400), 5) is None  # counters went back: restarted
    assert format_traffic(2, None) == "conc 2: nats-server /varz not read"


def test_reading_varz_from_nothing_listening_is_none():
    from bus.nats_server import free_port

    assert read_varz(free_port(), timeout=2) is None


async def test_a_real_server_counts_what_a_client_published_and_what_it_delivered(nats_server, nc):
    """One subscriber, two 1000-byte messages: 2 in and 2 out, and at least their 2000 bytes each way."""
    import asyncio

    before = await asyncio.to_thread(read_varz, nats_server.http_port)
    got = []

    async def cb(msg):
        got.append(msg)

    sub = await nc.subscribe("bench.traffic.test", cb=cb)
    for _ in range(2):
        await nc.publish("bench.traffic.test", b"x" * 1000)
    await nc.flush()
    for _ in range(100):
        if len(got) == 2:
            break
        await asyncio.sleep(0.01)
    await sub.unsubscribe()
    t = traffic(before, await asyncio.to_thread(read_varz, nats_server.http_port), images=2)
    # at least: the session's server may carry other tests' traffic at the same time
    assert t["in_msgs"] >= 2 and t["out_msgs"] >= 2 and t["in_bytes"] >= 2000 and t["out_bytes"] >= 2000, t
    assert t["in_bytes_per_image"] >= 1000
