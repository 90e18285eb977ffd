"""NATS traffic per image of a `bench fleet` level, from the private nats-server's monitoring endpoint.

nats-server's `/varz` counts, since it started, what its clients published to it (`in_msgs`, `in_bytes`)
and what it delivered to subscribers (`out_msgs`, `out_bytes`); bytes are the messages' payloads and
headers, not the protocol's framing. The bench reads it just before and just after each level, as it reads
the processes' CPU, and divides the differences by the images the level made: every expert step request and
reply, frame and done event, decode request and reply of the level, and whatever else the fleet said on the
bus meanwhile (discovery, heartbeats), per image. A message delivered to two subscribers counts once in and twice out.

`traffic` is a pure function of two readings, tested with hand-made ones; `read_varz` is the HTTP read.
"""

from __future__ import annotations

#: the /varz counters the bench keeps (cumulative since the server started)
FIELDS = ("in_msgs", "out_msgs", "in_bytes", "out_bytes")


def read_varz(port: int, host: str = "127.0.0.1", timeout: float = 10.0) -> dict[str, int] | None:
    """The server's cumulative FIELDS from http://host:port/varz; None when it cannot be read."""
    import json
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://{host}:{port}/varz", timeout=timeout) as r:
            varz = json.loads(r.read())
        return {f: int(varz[f]) for f in FIELDS}
    except (OSError, ValueError, KeyError, TypeError):
        return None


def traffic(before: dict | None, after: dict | None, images: int) -> dict | None:
    """A level's traffic from the readings at its start and end: the differences of FIELDS and, when the level
    made images, each per image (`<field>_per_image`). None when either reading is missing or a counter went
    down (the server restarted in between: the difference would mean nothing)."""
    if before is None or after is None:
        return None
    delta = {f: int(after[f]) - int(before[f]) for f in FIELDS}
    if any(v < 0 for v in delta.values()):
        return None
    out: dict = {**delta, "images": int(images)}
    if images > 0:
        for f in FIELDS:
            out[f"{f}_per_image"] = round(delta[f] / images, 1)
    return out


def _size(n: float) -> str:
    """Bytes as a short figure: 512 B, 20.5 kB, 1.23 MB (decimal units)."""
    if n >= 1e6:
        return f"{n / 1e6:.2f} MB"
    if n >= 1e3:
        return f"{n / 1e3:.1f} kB"
    return f"{n:.0f} B"


def format_traffic(concurrency: int, t: dict | None) -> str:
    """One report line of a level's traffic."""
    if t is None:
        return f"conc {concurrency}: nats-server /varz not read"
    if "in_msgs_per_image" not in t:
        return f"conc {concurrency}: no images ({t['in_msgs']} msgs in, {t['out_msgs']} out)"
    return (
        f"conc {concurrency}: {t['in_msgs_per_image']:.1f} msgs/img in, {t['out_msgs_per_image']:.1f} out; "
        f"{_size(t['in_bytes_per_image'])}/img in, {_size(t['out_bytes_per_image'])}/img out"
    )
