"""A ddm-fleet client written from docs/PROTOCOL.md alone: nats-py, msgpack and numpy, no project imports.

It shows the three things a client does:

* `step(...)`: call one expert directly (a `step_request` on `ddm.v1.expert.<k>.velocity`);
* `generate(...)`: run a generation job (subscribe to the job's events subject FIRST, then
  submit on `ddm.v1.c.<client>.jobs.submit`, then read accepted / frame* / done|failed events);
* `cancel(...)`: cancel a job on `ddm.v1.c.<client>.jobs.<job_id>.cancel`.

Jobs live in the client's namespace `ddm.v1.c.<client>.`: on an authenticated bus `<client>` is
your NATS user, and you must connect with the reply inbox prefix `_INBOX_<client>` (the only inbox
your permissions allow); on an open bus any token of 1-64 [A-Za-z0-9_-] (default "anon").

    python docs/examples/raw_client.py --url nats://127.0.0.1:4222 step --expert 0
    python docs/examples/raw_client.py --url nats://127.0.0.1:4222 generate --digits 3 7 --steps 20
    python docs/examples/raw_client.py --url nats://client:PASSWORD@host:4222 generate --digits 1

Copy it into another project and it still runs; port it to another language line by line.
"""

from __future__ import annotations

import argparse
import asyncio
import secrets
import sys
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import msgpack
import nats
import numpy as np

PROTOCOL_VERSION = 1
PREFIX = f"ddm.v{PROTOCOL_VERSION}"
MAX_PAYLOAD_BYTES = 8 * 1024 * 1024
ALLOWED_DTYPES = {"<f2", "<f4", "<f8", "|i1", "<i2", "<i4", "<i8", "|u1", "<u2", "<u4", "<u8", "|b1"}


class ProtocolFailure(Exception):
    """The other side answered with an error (`code` is an error-code string, e.g. "bad_shape")."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


# ---------------------------------------------------------------- encoding


def encode_tensor(array: np.ndarray) -> dict[str, Any]:
    """ndarray -> {"dtype", "shape", "data"}: little-endian, C order, raw bytes."""
    a = np.asarray(array)
    a = a.astype(a.dtype.newbyteorder("<"))  # no-op on little-endian machines
    if a.dtype.str not in ALLOWED_DTYPES:
        raise ValueError(f"dtype {a.dtype.str} is not allowed on the wire")
    return {"dtype": a.dtype.str, "shape": list(a.shape), "data": a.tobytes(order="C")}


def decode_tensor(obj: dict[str, Any]) -> np.ndarray:
    """{"dtype", "shape", "data"} -> read-only ndarray (a view over the received bytes)."""
    dtype, shape, data = obj["dtype"], [int(d) for d in obj["shape"]], obj["data"]
    if dtype not in ALLOWED_DTYPES:
        raise ValueError(f"dtype {dtype!r} is not allowed on the wire")
    expected = int(np.prod(shape, dtype=object)) * np.dtype(dtype).itemsize
    if len(data) != expected:
        raise ValueError(f"tensor data has {len(data)} bytes, shape {shape} of {dtype} needs {expected}")
    return np.frombuffer(data, dtype=dtype).reshape(tuple(shape))


def encode(message: dict[str, Any]) -> bytes:
    """A message map -> msgpack bytes (str as str, bytes as bin; `v` added)."""
    data = msgpack.packb({"v": PROTOCOL_VERSION, **message}, use_bin_type=True)
    if len(data) > MAX_PAYLOAD_BYTES:
        raise ValueError(f"message of {len(data)} bytes is over the {MAX_PAYLOAD_BYTES}-byte limit")
    return data


def decode(data: bytes) -> dict[str, Any]:
    """msgpack bytes -> message map. Refuses ext types; checks `v`."""

    def no_ext(code: int, _data: bytes):
        raise ValueError(f"msgpack ext type {code} is not part of the protocol")

    msg = msgpack.unpackb(data, raw=False, ext_hook=no_ext, strict_map_key=True)
    if not isinstance(msg, dict) or msg.get("v") != PROTOCOL_VERSION:
        raise ValueError(f"not a v{PROTOCOL_VERSION} message: {str(msg)[:80]}")
    return msg


def raise_if_error(msg: dict[str, Any]) -> dict[str, Any]:
    if msg["kind"] == "error":
        raise ProtocolFailure(msg["code"], msg["message"])
    if msg["kind"] == "rejected":
        raise ProtocolFailure(msg["code"], msg["reason"])
    return msg


# ---------------------------------------------------------------- expert step


async def step(nc, expert: int, x_t: np.ndarray, t: np.ndarray, y: np.ndarray, *, timeout: float = 10.0) -> dict:
    """One velocity evaluation by expert `expert`.

    x_t: [B, C, H, W] float32; t: [B] float32 in [0, 1] (0 noise, 1 data); y: [B] int64.
    Returns the step_reply map with "velocity" decoded to a [B, C, H, W] array.
    """
    b = x_t.shape[0]
    request = {
        "kind": "step_request",
        "expert": expert,
        "x_t": encode_tensor(x_t.astype("<f4")),
        "t": encode_tensor(t.astype("<f4")),
        "y": encode_tensor(y.astype("<i8")),
        "row_ids": [f"row-{i}" for i in range(b)],
        "request_id": secrets.token_hex(6),
    }
    reply = await nc.request(f"{PREFIX}.expert.{expert}.velocity", encode(request), timeout=timeout)
    msg = raise_if_error(decode(reply.data))
    if msg["kind"] != "step_reply":
        raise ValueError(f"unexpected reply kind {msg['kind']!r}")
    msg["velocity"] = decode_tensor(msg["velocity"])
    return msg


# ---------------------------------------------------------------- generation jobs


async def generate(
    nc,
    digits: list[int],
    *,
    steps: int = 40,
    strategy: str = "top1",
    seed: int | None = None,
    on_event: Callable[[dict], None] | None = None,
    timeout: float = 120.0,
    client: str = "anon",
) -> dict:
    """Run one job; returns the "done" event with "images" decoded to [N, 1, 32, 32] float32 in [-1, 1].

    Order matters: choose the job id, subscribe to its events subject, flush (so the server
    has the subscription), and only then submit. Otherwise the first frames can be missed.
    """
    job_id = "raw-" + secrets.token_hex(8)
    jobs = f"{PREFIX}.c.{client}.jobs"  # this client's namespace: the job is ours alone
    events = await nc.subscribe(f"{jobs}.{job_id}.events")
    try:
        await nc.flush()
        request = {
            "kind": "job_request",
            "job_id": job_id,
            "digits": digits,
            "steps": steps,
            "strategy": strategy,
            "stream": True,
            "frame_every": 1,
        }
        if seed is not None:
            request["seed"] = seed
        reply = raise_if_error(decode((await nc.request(f"{jobs}.submit", encode(request), timeout=10)).data))
        assert reply["kind"] == "accepted" and reply["job_id"] == job_id, reply
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                await cancel(nc, job_id, client=client)
                raise TimeoutError(f"job {job_id} did not finish in {timeout} s")
            event = decode((await events.next_msg(timeout=left)).data)
            kind = event["kind"]
            if kind == "frame":
                event["x"] = decode_tensor(event["x"])  # [N, C, H, W] float16
                event["weights"] = decode_tensor(event["weights"])  # [N, K] float32
            elif kind == "done":
                event["images"] = decode_tensor(event["images"])
                event["usage"] = decode_tensor(event["usage"])
            if on_event is not None:
                on_event(event)
            if kind == "done":
                return event
            if kind == "failed":
                raise ProtocolFailure(event["code"], event["reason"])
            # "accepted" (a copy of the submit reply) and "frame": keep reading
    finally:
        await events.unsubscribe()


async def cancel(nc, job_id: str, *, client: str = "anon") -> bool:
    """Ask the coordinator to cancel `client`'s job `job_id`; its events then end with failed/cancelled.
    False for a job that is not (or no longer) queued or running, or that is another client's."""
    subject = f"{PREFIX}.c.{client}.jobs.{job_id}.cancel"
    reply = await nc.request(subject, encode({"kind": "cancel", "job_id": job_id}), timeout=5)
    return bool(decode(reply.data)["cancelled"])


# ---------------------------------------------------------------- command line


async def _main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="ddm-fleet raw protocol client (nats-py + msgpack only)")
    parser.add_argument("--url", default="nats://127.0.0.1:4222", help="NATS server URL")
    parser.add_argument("--client", default=None, help="client name (default: the user in --url, else anon)")
    sub = parser.add_subparsers(dest="command", required=True)
    p_step = sub.add_parser("step", help="one velocity evaluation by one expert")
    p_step.add_argument("--expert", type=int, default=0)
    p_step.add_argument("--batch", type=int, default=4)
    p_gen = sub.add_parser("generate", help="generate digits through the coordinator")
    p_gen.add_argument("--digits", type=int, nargs="+", default=[3, 7])
    p_gen.add_argument("--steps", type=int, default=40)
    args = parser.parse_args(argv)

    client = args.client or urlsplit(args.url).username or "anon"
    nc = await nats.connect(args.url, name="raw-client", inbox_prefix=f"_INBOX_{client}")
    try:
        if args.command == "step":
            rng = np.random.default_rng(0)
            x = rng.standard_normal((args.batch, 1, 32, 32)).astype(np.float32)
            reply = await step(nc, args.expert, x, np.zeros(args.batch, np.float32), np.arange(args.batch) % 10)
            v = reply["velocity"]
            print(
                f"expert {reply['expert']} ({reply['backend'] or '?'} on {reply['device'] or '?'}): "
                f"velocity {list(v.shape)} {v.dtype}, mean |v| = {float(np.abs(v).mean()):.4f}"
            )
        else:
            done = await generate(
                nc,
                args.digits,
                steps=args.steps,
                client=client,
                on_event=lambda e: print(
                    f"  {e['kind']}" + (f" step {e['step']}/{e['steps']}" if e["kind"] == "frame" else "")
                ),
            )
            print(f"done: images {list(done['images'].shape)} for digits {done['digits']} in {done['elapsed_s']:.2f} s")
    except ProtocolFailure as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    finally:
        await nc.drain()
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(_main()))
