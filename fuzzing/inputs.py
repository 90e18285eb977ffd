"""Hostile inputs for the wire decoders, and the pure (no network) fuzz targets.

Used by `ddm-fleet fuzz` (fuzzing/run.py drives these and the network targets) and by the tests.
Everything is deterministic given a `random.Random`, so a `--seed` reproduces a run.

Inputs come from four generators, mixed by `Mutator.message_bytes`:

* random bytes (short and long);
* byte-level mutations of valid encoded messages (bit flips, msgpack marker bytes, length
  fields set to interesting values, insertions, deletions, truncation, splicing);
* structure-aware mutations of valid messages (decoded to maps, a few fields replaced by values
  of other types or boundary values, tensor specs given wrong dtypes / negative, huge or
  overflowing dims / short or long data, keys of the wrong type, extension types, timestamps);
* hand-written hostile shapes: deep nesting (up to 100k levels), arrays, maps and bin/str with
  huge declared lengths, ext types, too many containers, oversize messages.

A *target* takes one input and returns `("ok" | "clear", detail)`: "ok" when the input was valid
and what came back is honest, "clear" when it was refused with the documented `ProtocolError`
(a code and a message). Anything else raises `Crash` (or any other exception, which the drivers
count as a crash too): an unexpected exception type, an array that disagrees with its shape or
bytes, a message that validates but cannot be sent back.
"""

from __future__ import annotations

import json
import math
import random
import struct
from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np

from schemas import messages as _messages
from schemas.errors import ErrorCode, ProtocolError
from schemas.limits import MAX_PAYLOAD_BYTES, MAX_WIRE_ARRAY_LEN, MAX_WIRE_CONTAINERS, MAX_WIRE_DEPTH, MAX_WIRE_MAP_LEN
from schemas.messages import (
    CancelReply,
    CancelRequest,
    DoneEvent,
    ErrorReply,
    FailedEvent,
    FleetStatus,
    FrameEvent,
    JobAccepted,
    JobEvent,
    JobRejected,
    JobRequest,
    JobStatus,
    Message,
    StepReply,
    StepRequest,
    StepResult,
    SubmitReply,
)
from schemas.tensor import ALLOWED_DTYPES, decode_tensor, encode_tensor
from schemas.wire import loads, pack, unpack


class Crash(AssertionError):
    """An input broke a promise of the decoder (not merely refused)."""


# ---------------------------------------------------------------- boundary values

INTERESTING_INTS = [
    0,
    1,
    -1,
    2,
    3,
    7,
    9,
    10,
    16,
    31,
    32,
    33,
    64,
    127,
    128,
    255,
    256,
    257,
    511,
    512,
    513,
    1000,
    1001,
    1024,
    1025,
    4095,
    4096,
    4097,
    3600,
    65535,
    65536,
    2**31 - 1,
    2**31,
    2**32 - 1,
    2**32,
    2**53 + 1,
    2**63 - 1,
    2**63,
    2**64 - 1,
    -(2**7),
    -(2**15),
    -(2**31),
    -(2**63),
    MAX_PAYLOAD_BYTES,
    MAX_PAYLOAD_BYTES + 1,
]
INTERESTING_FLOATS = [
    0.0,
    -0.0,
    0.5,
    1.0,
    1.0000001,
    -1.0,
    -1e-300,
    5e-324,
    1e308,
    -1e308,
    3600.0,
    3600.5,
    1.7e9,
    4.1e9,
    float("inf"),
    float("-inf"),
    float("nan"),
    2.0**63,
    -(2.0**63),
]
INTERESTING_STRS = [
    "",
    "a",
    "0",
    "1",
    "3,7,7",
    "x" * 64,
    "x" * 65,
    "x" * 129,
    "é",
    "\u2028",
    "\x00",
    "\r\n",
    "a\u0301",
    "step_request",
    "step_reply",
    "job_request",
    "error",
    "cancel",
    "frame",
    "done",
    "failed",
    "accepted",
    "rejected",
    "cancel_reply",
    "fleet_status",
    "<f4",
    ">f4",
    "<f2",
    "<f8",
    "|b1",
    "|O",
    "<c8",
    "<U4",
    "V8",
    "|u1",
    "<i8",
    "top1",
    "topk",
    "full",
    "oracle",
    "euler",
    "heun",
    "bad_request",
    "internal",
    "too_large",
    "ddm.v1.c.anon.jobs.submit",
    "_INBOX_web.x",
    "Nats-Service-Error: x",
    "😀" * 3,
    " ",
    "NaN",
    "-1",
]
#: msgpack marker bytes worth planting: nil, never-used (0xc1), bools, bin/ext/str/array/map headers, fixext.
MARKER_BYTES = [
    0x00,
    0x7F,
    0x80,
    0x8F,
    0x90,
    0x9F,
    0xA0,
    0xBF,
    0xC0,
    0xC1,
    0xC2,
    0xC3,
    0xC4,
    0xC5,
    0xC6,
    0xC7,
    0xC8,
    0xC9,
    0xCA,
    0xCB,
    0xCC,
    0xCF,
    0xD0,
    0xD3,
    0xD4,
    0xD6,
    0xD8,
    0xD9,
    0xDA,
    0xDB,
    0xDC,
    0xDD,
    0xDE,
    0xDF,
    0xE0,
    0xFF,
]
BAD_DTYPES = [">f4", ">i8", "|O", "<c8", "<U4", "V8", "<M8[s]", "f4", "float32", "", "<f16", "|S4", "<f4 "]

#: Which types `unpack` is fuzzed against in the `messages` target (the first input byte picks one):
#: every message type (by name, so a new one is fuzzed without editing this file), then the unions.
MESSAGE_TYPES: list[type[Message]] = sorted(
    (
        obj
        for obj in vars(_messages).values()
        if isinstance(obj, type) and issubclass(obj, Message) and obj is not Message and "kind" in obj.model_fields
    ),  # not the bases (Message, _Labelled)
    key=lambda cls: cls.__name__,
)
MESSAGE_TARGETS: list[Any] = [*MESSAGE_TYPES, StepResult, SubmitReply, JobEvent, _messages.DecodeResult]


def _wire(msg: Message) -> dict:
    return msgpack.unpackb(pack(msg), raw=False)


def message_seeds(image: tuple[int, int, int] = (1, 4, 4), rows: tuple[int, ...] = (1, 2, 3)) -> list[dict]:
    """Valid wire maps of every message type (tensors of `image` per row)."""
    rng = np.random.default_rng(7)
    out: list[Message] = []
    for b in rows:
        out.append(
            StepRequest(
                expert=0,
                x_t=rng.standard_normal((b, *image)).astype(np.float32),
                t=rng.uniform(0, 1, b).astype(np.float32),
                y=rng.integers(0, 10, b),
                row_ids=[f"r{i}" for i in range(b)],
                request_id=f"q{b}",
                deadline=None,
            )
        )
    out += [
        StepReply(
            expert=1,
            velocity=rng.standard_normal((2, *image)).astype(np.float32),
            row_ids=["a", "b"],
            backend="torch",
            device="cpu",
            worker_id="w1",
            compute_ms=1.5,
            batch_rows=2,
        ),
        ErrorReply(code=ErrorCode.BAD_SHAPE, message="x_t rows must be [1, 32, 32]", request_id="q1"),
        JobRequest(digits=[3, 7, 7], steps=4),
        JobRequest(
            job_id="fuzz-job",
            count=2,
            steps=3,
            solver="heun",
            strategy="topk",
            top_k=2,
            seed=11,
            frame_every=2,
            deadline_s=30.0,
            stream=False,
        ),
        JobAccepted(
            job_id="j1", events_subject="ddm.v1.c.anon.jobs.j1.events", digits=[1, 2], seed=5, queue_position=1
        ),
        JobRejected(code=ErrorCode.OVERLOADED, reason="queue full"),
        FrameEvent(
            job_id="j1",
            step=1,
            steps=4,
            t=0.25,
            x=rng.standard_normal((2, *image)).astype(np.float16),
            experts=[0, -1],
            weights=np.array([[0.9, 0.1], [0.5, 0.5]], np.float32),
            notes=["row 1: x"],
        ),
        DoneEvent(
            job_id="j1",
            images=rng.uniform(-1, 1, (2, *image)).astype(np.float32),
            digits=[1, 2],
            usage=np.array([[1.0, 0.0], [0.5, 0.5]], np.float32),
            steps=4,
            strategy="top1",
            elapsed_s=0.5,
        ),
        FailedEvent(job_id="j1", code=ErrorCode.UNAVAILABLE, reason="no expert"),
        CancelRequest(job_id="j1"),
        CancelReply(job_id="j1", cancelled=False, reason="no such job"),
        FleetStatus(coordinator="c", active_jobs=1, num_experts=2, rows_per_s=10.5, unavailable_experts=[1]),
        JobStatus(job_id="j1", state="running", step=2, steps=4, coordinator="c"),
        JobStatus(job_id="fuzz-job", state="queued", steps=40, queue_position=3),
        JobStatus(job_id="j1", state="unknown", coordinator="c2"),
        _messages.DecodeRequest(decoder="ab" * 32, latents=rng.standard_normal((2, 4, 2, 2)).astype(np.float32)),
        _messages.DecodeReply(decoder="ab" * 32, images=rng.uniform(-1, 1, (2, *image)).astype(np.float32)),
    ]
    return [_wire(m) for m in out]


def tensor_seeds() -> list[dict]:
    """Valid tensor maps: every allowed dtype, ranks 0-4, a few empty ones."""
    rng = np.random.default_rng(3)
    out = []
    for i, dt in enumerate(sorted(ALLOWED_DTYPES)):
        shape = [(), (3,), (2, 3), (1, 1, 2, 2), (0, 4), (2, 0, 1)][i % 6]
        a = rng.integers(0, 2, shape) if dt == "|b1" else rng.standard_normal(shape) * 10
        out.append(encode_tensor(np.asarray(a).astype(np.dtype(dt))))
    return out


# ---------------------------------------------------------------- the mutator


class Mutator:
    """Deterministic hostile-input generator over a list of valid seed objects."""

    def __init__(self, rng: random.Random, seeds: list[Any], *, extra_keys: tuple[str, ...] = ()):
        if not seeds:
            raise ValueError("the mutator needs at least one valid seed")
        self.rng = rng
        self.seeds = seeds
        keys = {k for s in seeds if isinstance(s, dict) for k in s}
        self.keys = sorted(keys | {"v", "kind", "dtype", "shape", "data", "other"} | set(extra_keys))

    # ------------------------------------------------------------ values

    def scalar(self) -> Any:
        r = self.rng
        pick = r.randrange(9)
        if pick == 0:
            return None
        if pick == 1:
            return r.random() < 0.5
        if pick == 2:
            return r.choice(INTERESTING_INTS)
        if pick == 3:
            return r.randint(-(2**63), 2**64 - 1) if r.random() < 0.3 else r.randint(-3, 300)
        if pick == 4:
            return r.choice(INTERESTING_FLOATS) if r.random() < 0.7 else r.uniform(-2, 2)
        if pick == 5:
            return r.choice(INTERESTING_STRS)
        if pick == 6:
            return "".join(
                chr(r.choice([r.randint(32, 126), r.randint(0, 0xD7FF), r.randint(0xE000, 0x10FFFF)]))
                for _ in range(r.randint(0, 12))
            )
        if pick == 7:
            return r.randbytes(r.choice([0, 1, 3, 4, 8, 16, 64]))
        return (
            msgpack.ExtType(r.randint(0, 127), r.randbytes(r.randint(0, 8)))
            if r.random() < 0.7
            else msgpack.Timestamp(r.randint(0, 2**32 - 1), r.randint(0, 999_999_999))
        )

    def value(self, depth: int = 0) -> Any:
        r = self.rng
        if depth >= 3 or r.random() < 0.6:
            return self.scalar()
        if r.random() < 0.5:
            return [self.value(depth + 1) for _ in range(r.choice([0, 1, 2, 3, 8]))]
        return {self.key(): self.value(depth + 1) for _ in range(r.choice([0, 1, 2, 3]))}

    def key(self) -> Any:
        r = self.rng
        p = r.random()
        if p < 0.75:
            return r.choice(self.keys)
        if p < 0.85:
            return r.choice(INTERESTING_STRS)
        # keys of the wrong type: strict_map_key must refuse them
        return r.choice([0, 1, -1, 2**40, b"v", b"kind", None, True, 1.5])

    # ------------------------------------------------------------ structure-aware mutation

    def _containers(self, obj: Any, out: list, depth: int = 0) -> list:
        if isinstance(obj, (dict, list)) and depth < 8:
            out.append(obj)
            for v in obj.values() if isinstance(obj, dict) else obj:
                self._containers(v, out, depth + 1)
        return out

    def mutate_tensor(self, spec: dict) -> None:
        r = self.rng
        op = r.randrange(10)
        data = spec.get("data") if isinstance(spec.get("data"), (bytes, bytearray)) else b""
        if op == 0:
            spec["dtype"] = r.choice(sorted(ALLOWED_DTYPES) + BAD_DTYPES + [self.scalar()])
        elif op == 1:  # any shape at all
            spec["shape"] = [r.choice(INTERESTING_INTS) for _ in range(r.choice([0, 1, 2, 4, 5, 8, 9, 12]))]
        elif op == 2:  # a huge declared shape with tiny data (zeros too: [0, 2**23, 2**23, ...])
            n = r.randint(1, 8)
            spec["shape"] = [r.choice([0, 1, 2**23, 2**23 + 1, 2**31, 2**63 - 1, 2**64 - 1]) for _ in range(n)]
        elif op == 3:  # negative / non-int dims
            spec["shape"] = [r.choice([-1, -(2**63), 1.0, True, None, "1", [1], 2]) for _ in range(r.randint(1, 4))]
        elif op == 4:  # data one byte short, long, empty, or not bin at all
            spec["data"] = r.choice(
                [data[:-1], data + b"\x00", b"", data * 2, data.decode("latin-1"), list(data[:8]), None]
            )
        elif op == 5:  # a shape that fits the bytes but a different rank
            dt = spec.get("dtype") if isinstance(spec.get("dtype"), str) and spec["dtype"] in ALLOWED_DTYPES else "<f4"
            n = len(data) // np.dtype(dt).itemsize
            dims = [1] * r.randint(0, 3) + [n] + [1] * r.randint(0, 3)
            r.shuffle(dims)
            spec["shape"] = dims
        elif op == 6:  # NaN / Inf / out-of-range payloads in float data
            dt = spec.get("dtype")
            if dt in ("<f2", "<f4", "<f8") and len(data) >= np.dtype(dt).itemsize:
                a = np.frombuffer(bytes(data[: len(data) - len(data) % np.dtype(dt).itemsize]), dtype=dt).copy()
                with np.errstate(over="ignore"):
                    a[r.randrange(a.size)] = r.choice([np.nan, np.inf, -np.inf, 2.0, -1e30])
                spec["data"] = a.tobytes()
            elif data:
                spec["data"] = bytes([r.randrange(256)]) + bytes(data[1:])
        elif op == 7:
            spec.pop(r.choice(["dtype", "shape", "data"]), None)
        elif op == 8:
            spec[self.key()] = self.value(1)
        else:  # change dtype keeping the bytes: sizes now disagree, or reinterpret
            spec["dtype"] = r.choice(sorted(ALLOWED_DTYPES))

    def mutate_object(self, obj: Any) -> Any:
        """A deep copy of `obj` with 1-4 random structural edits."""
        r = self.rng
        obj = _copy(obj)
        for _ in range(r.choice([1, 1, 1, 2, 2, 3, 4])):
            nodes = self._containers(obj, [])
            if not nodes or r.random() < 0.03:
                obj = self.value() if r.random() < 0.5 else [obj]
                continue
            node = r.choice(nodes)
            if isinstance(node, dict) and {"dtype", "shape", "data"} <= set(node) and r.random() < 0.6:
                self.mutate_tensor(node)
            elif isinstance(node, dict):
                op = r.randrange(6)
                keys = list(node)
                if op <= 1 and keys:
                    node[r.choice(keys)] = self.value() if op == 0 else self.scalar()
                elif op == 2 and keys:
                    node.pop(r.choice(keys))
                elif op == 3:
                    node[self.key()] = self.value()
                elif op == 4 and keys:  # re-key an entry (to a wrong-type key sometimes)
                    k = r.choice(keys)
                    node[self.key()] = node.pop(k)
                else:
                    node["kind"] = r.choice(INTERESTING_STRS) if r.random() < 0.8 else self.scalar()
                    if r.random() < 0.3:
                        node["v"] = r.choice([0, 1, 2, -1, 2**64 - 1, 1.0, True, "1", None])
            else:
                op = r.randrange(4)
                if op == 0 and node:
                    node[r.randrange(len(node))] = self.value()
                elif op == 1:
                    node.append(self.value())
                elif op == 2 and node:
                    node.pop(r.randrange(len(node)))
                else:
                    node.extend([self.scalar()] * r.choice([1, 10, 600]))
        return obj

    # ------------------------------------------------------------ bytes

    def mutate_bytes(self, data: bytes) -> bytes:
        r = self.rng
        b = bytearray(data)
        for _ in range(r.choice([1, 1, 2, 3, 5, 8])):
            if not b:
                b += r.randbytes(r.randint(1, 4))
                continue
            # headers sit at both ends of a message whose middle is tensor data
            n = len(b)
            pos = r.choice([r.randrange(n), r.randrange(min(n, 200)), max(0, n - 1 - r.randrange(min(n, 300)))])
            op = r.randrange(8)
            if op == 0:
                b[pos] ^= 1 << r.randrange(8)
            elif op == 1:
                b[pos] = r.choice(MARKER_BYTES)
            elif op == 2:
                b[pos] = r.randrange(256)
            elif op == 3:  # a length field set to something interesting
                width = r.choice([1, 2, 4])
                value = r.choice([0, 1, 2 ** (8 * width) - 1, 2 ** (8 * width - 1), r.randrange(2 ** (8 * width))])
                b[pos : pos + width] = value.to_bytes(width, "big")
            elif op == 4:
                b[pos:pos] = r.randbytes(r.randint(1, 8))
            elif op == 5:
                del b[pos : pos + r.randint(1, 16)]
            elif op == 6:
                chunk = b[pos : pos + r.randint(1, 32)]
                b[pos:pos] = chunk * r.randint(1, 4)
            else:
                del b[pos:]
        return bytes(b)

    def hostile(self) -> bytes:
        """One of the hand-written hostile shapes (deep nesting, huge declared lengths, ...)."""
        r = self.rng
        seed = self.seed_object()
        op = r.randrange(10)
        if op == 0:  # deep nesting, bare or as a field of a message
            depth = r.choice([MAX_WIRE_DEPTH - 1, MAX_WIRE_DEPTH, MAX_WIRE_DEPTH + 1, 5000, 100_000])
            level = r.choice([b"\x91", b"\x81\xa1k", b"\x92\xc0"])
            nest = level * depth + b"\xc0"
            if not isinstance(seed, dict) or r.random() < 0.3:
                return nest
            key = r.choice(list(seed) or ["v"])
            rest = {k: v for k, v in seed.items() if k != key}
            head = msgpack.packb(rest, use_bin_type=True)
            return _grow_map(head, 1) + _packb(key) + nest
        if op == 1:  # declared lengths far beyond the bytes that follow
            return (
                r.choice([b"\xdd", b"\xdf", b"\xc6", b"\xdb", b"\xc9"])
                + r.choice([b"\xff\xff\xff\xff", b"\x7f\xff\xff\xff", b"\x00\x10\x00\x00"])
                + r.randbytes(r.randint(0, 8))
            )
        if op == 2:  # arrays / maps around the limits
            n = r.choice([MAX_WIRE_ARRAY_LEN, MAX_WIRE_ARRAY_LEN + 1, 20_000])
            inner = r.choice([b"\xc0", b"\x90", b"\x01"])
            arr = b"\xdd" + struct.pack(">I", n) + inner * n
            if isinstance(seed, dict) and r.random() < 0.7:
                key = r.choice(list(seed) + ["row_ids", "digits"])
                rest = {k: v for k, v in seed.items() if k != key}
                return _grow_map(msgpack.packb(rest, use_bin_type=True), 1) + _packb(key) + arr
            return arr
        if op == 3:
            n = r.choice([MAX_WIRE_MAP_LEN, MAX_WIRE_MAP_LEN + 1, 1000])
            return msgpack.packb({**{f"k{i}": i for i in range(n)}, "v": 1, "kind": "x"}, use_bin_type=True)
        if op == 4:  # many small containers: [[[], [], ...], ...]
            per = r.choice([64, 2048])
            outer = MAX_WIRE_CONTAINERS // per + r.choice([0, 1, 4])
            inner = b"\xdc" + struct.pack(">H", per) + b"\x90" * per
            return b"\xdc" + struct.pack(">H", outer) + inner * outer
        if op == 5:  # ext types / timestamps where a value goes
            obj = _copy(seed) if isinstance(seed, dict) else {"v": 1}
            obj[r.choice(list(obj))] = r.choice(
                [msgpack.ExtType(r.randint(0, 127), b"\x00" * r.randint(0, 4)), msgpack.Timestamp(1, 2)]
            )
            if r.random() < 0.3:  # negative (reserved) ext codes, as raw fixext bytes
                return _grow_map(_packb({"v": 1}), 1) + b"\xa4kind" + bytes([0xD4, r.randint(0x80, 0xFF), 0])
            return _packb(obj) if r.random() < 0.8 else _packb(msgpack.Timestamp(5, 0))
        if op == 6:  # trailing bytes after a valid message, or two messages back to back
            data = _packb(seed)
            return data + r.choice([b"\x00", data, r.randbytes(3)])
        if op == 7:  # non-utf8 str, bin where str goes, str where bin goes
            obj = _copy(seed) if isinstance(seed, dict) else {"v": 1}
            data = _packb(obj)
            i = data.find(b"\xa4kind")
            return data[:i] + b"\xa4\xff\xfe\xfd\xfc" + data[i + 5 :] if i >= 0 else b"\xa2\xc3\x28"
        if op == 8 and r.random() < 0.2:  # oversize: just over our limit (through NATS in the network targets)
            return (
                b"\x83\xa1v\x01\xa4kind\xa5error\xa4data\xc6"
                + struct.pack(">I", MAX_PAYLOAD_BYTES)
                + b"\x00" * MAX_PAYLOAD_BYTES
            )
        if op == 8:
            return b"\xc0" * r.randint(1, 4)
        return r.randbytes(r.randint(0, 4096))

    def seed_object(self) -> Any:
        return self.rng.choice(self.seeds)

    def message_bytes(self) -> bytes:
        """One hostile input: random, byte-mutated, structure-mutated or hand-written."""
        r = self.rng
        p = r.random()
        if p < 0.08:
            return r.randbytes(r.choice([0, 1, 2, 5, 16, 64, 300]))
        if p < 0.12:
            return _packb(self.seed_object())  # valid inputs too: the "ok" path must hold up
        if p < 0.45:
            base = _packb(self.seed_object())
            if r.random() < 0.1:  # splice two seeds
                other = _packb(self.seed_object())
                base = base[: r.randrange(len(base) + 1)] + other[r.randrange(len(other) + 1) :]
            return self.mutate_bytes(base)
        if p < 0.93:
            obj = self.mutate_object(self.seed_object())
            data = _packb(obj)
            return self.mutate_bytes(data) if r.random() < 0.1 else data
        return self.hostile()

    # ------------------------------------------------------------ websocket text

    def json_value(self, depth: int = 0) -> Any:
        r = self.rng
        if depth >= 3 or r.random() < 0.6:
            v = self.scalar()
            if isinstance(v, (bytes, msgpack.ExtType, msgpack.Timestamp)):
                return r.choice(["", "1,2", [1, 2], {}, 10**30])
            return v
        if r.random() < 0.5:
            return [self.json_value(depth + 1) for _ in range(r.choice([0, 1, 2, 5]))]
        return {str(self.key()): self.json_value(depth + 1) for _ in range(r.choice([0, 1, 2]))}

    def websocket_frame(self, max_text: int) -> tuple[str, Any]:
        """("text", str) or ("binary", bytes): a hostile frame for the web viewer's socket."""
        r = self.rng
        p = r.random()
        if p < 0.04:
            return "binary", r.randbytes(r.randint(0, 64))
        if p < 0.55:  # structure-aware: a valid client message with a few fields changed
            obj = _copy(self.seed_object())
            for _ in range(r.choice([1, 1, 2, 3])):
                if not isinstance(obj, dict) or r.random() < 0.04:
                    obj = self.json_value()
                    continue
                op = r.randrange(4)
                if op == 0 and obj:
                    obj[r.choice(list(obj))] = self.json_value()
                elif op == 1 and obj:
                    obj.pop(r.choice(list(obj)))
                elif op == 2:
                    obj[str(self.key())] = self.json_value()
                else:
                    obj["type"] = r.choice(["generate", "cancel", "ping", "GENERATE", "", None, 1, ["ping"]])
            return "text", json.dumps(obj)
        if p < 0.8:  # text-level edits of a valid message
            text = list(json.dumps(self.seed_object()))
            for _ in range(r.choice([1, 2, 4])):
                i = r.randrange(len(text) + 1)
                op = r.randrange(3)
                if op == 0 and i < len(text):
                    del text[i]
                elif op == 1:
                    text.insert(i, r.choice(list('{}[]",:0123456789-.eE ntfa\\') + ["NaN", "Infinity", "\\ud800"]))
                elif i < len(text):
                    text[i] = chr(r.randint(32, 0x2FFF))
            return "text", "".join(text)
        # hand-written
        op = r.randrange(9)
        if op == 0:
            return "text", r.choice(["[", "{", "[{"]) * r.choice([100, 990, 1000, 100_000]) + "]" * r.randint(0, 5)
        if op == 1:  # deep nesting inside a field
            d = r.choice([500, 900, 980, 990, 1000])
            return "text", '{"type": "generate", "%s": %s1%s}' % (
                r.choice(["digits", "count", "seed", "type", "ref"]),
                "[" * d,
                "]" * d,
            )
        if op == 2:  # integer literals past Python's 4300-digit str->int limit
            return "text", '{"type": "%s", "%s": %s}' % (
                r.choice(["ping", "generate"]),
                r.choice(["ref", "count", "seed", "steps"]),
                "9" * r.choice([20, 4300, 4301, 50_000]),
            )
        if op == 3:
            return "text", '{"type": "generate", "count": %s, "steps": %s}' % (
                r.choice(["NaN", "Infinity", "-Infinity", "1e999", "-0", "2.0"]),
                r.choice(["3", "1e3", "NaN"]),
            )
        if op == 4 and r.random() < 0.3:  # over the server's frame limit: the socket is closed (1009)
            return "text", '{"type": "generate", "digits": "' + "1," * (max_text // 2) + '1"}'
        if op == 5:
            return "text", json.dumps({"type": "generate", "digits": [r.randint(0, 9)] * r.choice([257, 5000, 60_000])})
        if op == 6:
            return "text", json.dumps(
                {"type": "cancel", "job_id": r.choice(["", "x" * 10_000, "web" + "0" * 16, "\u2028", "../../etc"])}
            )
        if op == 7:
            return "text", "".join(chr(r.randint(1, 0xD7FF)) for _ in range(r.randint(0, 200)))
        return "text", r.choice(["", " ", "null", "true", "1", '"ping"', "{}", "[]", '{"type": "ping", "ref": 1.5}'])


def step_request_variant(rng: random.Random, image: tuple[int, int, int] = (1, 32, 32)) -> bytes:
    """A StepRequest that is well-formed msgpack with mostly plausible, often boundary, values:
    row counts around the limits, other image sizes, every float dtype, labels out of range,
    deadlines past / future / NaN / inf, odd row ids. Reaches the worker's own checks and model."""
    b = rng.choice([1, 1, 2, 3, 4, 7, 8, 9, 16, 17, 64, 513])
    shape = image if rng.random() < 0.8 else rng.choice([(1, 28, 28), (3, 32, 32), (1, 32, 31), (1, 1, 1), (0, 32, 32)])
    np_rng = np.random.default_rng(rng.randrange(2**32))
    x = np_rng.standard_normal((b, *shape)).astype(rng.choice(["<f4", "<f4", "<f2", "<f8"]))
    if rng.random() < 0.1:
        x.flat[rng.randrange(x.size or 1) if x.size else 0 :][:1] = rng.choice([np.nan, np.inf, 6e4])
    t = np_rng.uniform(0, 1, b)
    if rng.random() < 0.3:
        t[rng.randrange(b)] = rng.choice([0.0, 1.0, -0.0, 1.0000001, -1e-9, np.nan])
    y = np_rng.integers(0, 10, b)
    if rng.random() < 0.2:
        y[rng.randrange(b)] = rng.choice([-1, 10, 255, 2**31 - 1])
    msg: dict[str, Any] = {
        "v": 1,
        "kind": "step_request",
        "expert": rng.choice([0, 0, 0, 0, 1, 2, 2**63 - 1]),
        "x_t": encode_tensor(x),
        "t": encode_tensor(t.astype(rng.choice(["<f4", "<f8", "<f2"]))),
        "y": encode_tensor(y.astype(rng.choice(["<i8", "<i4", "|u1", "<u8", "|i1"]))),
    }
    if rng.random() < 0.5:
        msg["row_ids"] = [rng.choice(["r", "é" * 3, "x" * 128, "\u2028", str(i)]) + str(i) for i in range(b)]
    if rng.random() < 0.5:
        msg["deadline"] = rng.choice([None, 0.0, -1.0, 1e10, 4.1e9, float("nan"), float("inf"), float("-inf"), 1])
    if rng.random() < 0.3:
        msg["request_id"] = rng.choice(["q", "x" * 128, "\r\nNats-Service-Error: forged", "é"])
    return _packb(msg)


def job_request_variant(rng: random.Random) -> bytes:
    """A JobRequest with plausible, often boundary, values (reaches the coordinator's admission)."""
    msg: dict[str, Any] = {"v": 1, "kind": "job_request"}
    if rng.random() < 0.5:
        msg["digits"] = [
            rng.choice([0, 1, 5, 9, 9, 10, -1]) if rng.random() < 0.1 else rng.randrange(10)
            for _ in range(rng.choice([1, 2, 3, 32, 33, 256, 257]))
        ]
    else:
        msg["count"] = rng.choice([1, 2, 4, 31, 32, 33, 256, 257, 0])
    for key, values in (
        ("steps", [1, 2, 3, 1000, 1001, 0]),
        ("solver", ["euler", "heun", "rk4"]),
        ("strategy", ["top1", "topk", "full", "oracle", "best"]),
        ("top_k", [1, 2, 3, 64, 65]),
        ("seed", [0, 1, 2**63 - 1, 2**63]),
        ("stream", [True, False]),
        ("frame_every", [1, 2, 1000, 1001]),
        ("deadline_s", [0.001, 1.0, 3600.0, 3600.5, 0.0]),
        ("job_id", ["fuzz-dup", "j" + str(rng.randrange(10**6)), "x" * 64, "x" * 65, "a b"]),
    ):
        if rng.random() < 0.35:
            msg[key] = rng.choice(values)
    return _packb(msg)


def _copy(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _copy(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_copy(v) for v in obj]
    return obj


def _packb(obj: Any) -> bytes:
    """msgpack without our checks (non-str keys, ext types, anything goes); unpackable values become nil."""
    try:
        return msgpack.packb(obj, use_bin_type=True, strict_types=False)
    except (TypeError, ValueError, OverflowError, UnicodeEncodeError):
        return msgpack.packb(None)


def _grow_map(packed_map: bytes, extra: int) -> bytes:
    """A packed fixmap / map16 header with `extra` more entries (the caller appends them)."""
    first = packed_map[0]
    if 0x80 <= first <= 0x8F and (first & 0x0F) + extra <= 15:
        return bytes([first + extra]) + packed_map[1:]
    if 0x80 <= first <= 0x8F:
        return b"\xde" + struct.pack(">H", (first & 0x0F) + extra) + packed_map[1:]
    if first == 0xDE:
        (n,) = struct.unpack(">H", packed_map[1:3])
        return b"\xde" + struct.pack(">H", n + extra) + packed_map[3:]
    return packed_map


# ---------------------------------------------------------------- pure targets


def _check_array(a: np.ndarray, spec: Any, what: str) -> None:
    """An accepted array agrees with its own shape and with the bytes on the wire."""
    if not isinstance(a, np.ndarray):
        raise Crash(f"{what}: decoded to {type(a).__name__}, not an ndarray")
    if a.flags.writeable:
        raise Crash(f"{what}: decoded array is writable")
    if a.size != math.prod(a.shape) or a.dtype.str not in ALLOWED_DTYPES:
        raise Crash(f"{what}: dishonest array {a.dtype.str} {a.shape} size {a.size}")
    if isinstance(spec, dict):
        if list(a.shape) != list(spec.get("shape", [])) or a.dtype.str != spec.get("dtype"):
            raise Crash(
                f"{what}: array {a.dtype.str} {list(a.shape)} but the wire said {spec.get('dtype')} {spec.get('shape')}"
            )
        data = spec.get("data")
        if a.nbytes != len(data) or a.tobytes() != bytes(data):
            raise Crash(f"{what}: array bytes differ from the wire bytes")


def codec_one(data: bytes) -> tuple[str, str]:
    """Target `codec`: msgpack bytes -> `loads` -> `decode_tensor` (and with finite=True)."""
    try:
        obj = loads(data)
        arr = decode_tensor(obj)
    except ProtocolError as err:
        return "clear", _clear(err)
    _check_array(arr, obj, "tensor")
    try:
        again = decode_tensor(obj, finite=True)
    except ProtocolError as err:
        if err.code is not ErrorCode.NON_FINITE or np.isfinite(arr).all():
            raise Crash(
                f"finite=True refused an array finite=False took, with {err.code.value}: {err.message}"
            ) from err
        return "ok", "non-finite refused"
    if arr.dtype.kind == "f" and not np.isfinite(again).all():
        raise Crash("finite=True returned NaN/Inf")
    return "ok", arr.dtype.str


def message_target(data: bytes) -> tuple[Any, bytes]:
    """The type the first byte picks, and the rest of the input."""
    if not data:
        return MESSAGE_TARGETS[0], b""
    return MESSAGE_TARGETS[data[0] % len(MESSAGE_TARGETS)], data[1:]


def _name(tp: Any) -> str:
    unions = {id(StepResult): "StepResult", id(SubmitReply): "SubmitReply", id(JobEvent): "JobEvent"}
    return unions.get(id(tp)) or getattr(tp, "__name__", None) or repr(tp)[:40]


def messages_one(data: bytes) -> tuple[str, str]:
    """Target `messages`: byte 0 picks a message type (or union), the rest goes to `unpack`.
    An accepted message must pack again and unpack to the same fields."""
    tp, body = message_target(data)
    try:
        msg = unpack(body, tp)
    except ProtocolError as err:
        return "clear", _clear(err)
    if not isinstance(msg, Message):
        raise Crash(f"unpack({_name(tp)}) returned {type(msg).__name__}")
    wire = msgpack.unpackb(body, raw=False)
    for name in type(msg).model_fields:
        value = getattr(msg, name)
        if isinstance(value, np.ndarray):
            _check_array(value, wire.get(name), f"{type(msg).__name__}.{name}")
    try:
        again = unpack(pack(msg), type(msg))
    except ProtocolError as err:
        if err.code is ErrorCode.TOO_LARGE:  # valid at the limit, a few bytes longer re-encoded
            return "ok", f"{type(msg).__name__} (too large to re-send)"
        raise Crash(
            f"{type(msg).__name__} validated but does not survive pack/unpack: {err.code.value}: {err.message}"
        ) from None
    for name in type(msg).model_fields:
        a, b = getattr(msg, name), getattr(again, name)
        same = (
            (a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes())
            if isinstance(a, np.ndarray)
            else (a == b or (a != a and b != b))
        )
        if not same:
            raise Crash(f"{type(msg).__name__}.{name} changed through pack/unpack: {a!r:.60} -> {b!r:.60}")
    return "ok", type(msg).__name__


def _clear(err: ProtocolError) -> str:
    if not isinstance(err.code, ErrorCode) or not err.message:
        raise Crash(f"ProtocolError without a code or message: {err!r}")
    return err.code.value


PURE_TARGETS: dict[str, Callable[[bytes], tuple[str, str]]] = {"codec": codec_one, "messages": messages_one}


def pure_inputs(target: str, rng: random.Random) -> Callable[[], bytes]:
    """A generator of hostile inputs for a pure target (the random engine)."""
    if target == "codec":
        mut = Mutator(rng, tensor_seeds())
        return mut.message_bytes
    if target == "messages":
        mut = Mutator(rng, message_seeds())

        def gen() -> bytes:
            body = mut.message_bytes()
            # mostly aim the payload at the type it was made from, sometimes at any type
            i = rng.randrange(len(MESSAGE_TARGETS)) if rng.random() < 0.3 else _target_index_for(body, rng)
            return bytes([i]) + body

        return gen
    raise ValueError(f"no pure target {target!r}; choose from {', '.join(PURE_TARGETS)}")


_KIND_TO_INDEX = {t.model_fields["kind"].default: i for i, t in enumerate(MESSAGE_TARGETS) if isinstance(t, type)}


def _target_index_for(body: bytes, rng: random.Random) -> int:
    """Index of the message type whose `kind` the body names (a union sometimes), else random."""
    for kind, i in _KIND_TO_INDEX.items():
        if b"\xa4kind" + _packb(kind) in body:
            if rng.random() < 0.2:  # the union that contains it, when there is one
                unions = [j for j, t in enumerate(MESSAGE_TARGETS) if not isinstance(t, type)]
                return rng.choice(unions)
            return i
    return rng.randrange(len(MESSAGE_TARGETS))


def corpus(target: str) -> list[bytes]:
    """Valid inputs that seed atheris's corpus for a pure target."""
    if target == "codec":
        return [_packb(t) for t in tensor_seeds()]
    if target == "messages":
        out = []
        for seed in message_seeds():
            body = _packb(seed)
            out.append(bytes([_KIND_TO_INDEX[seed["kind"]]]) + body)
        return out
    raise ValueError(f"no pure target {target!r}")
