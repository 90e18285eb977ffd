"""Fuzz target `websocket`: random and mutated text / binary frames to the real web app's /ws."""

from __future__ import annotations

import asyncio
import json
import random
import time
from typing import Any

from ..fleet import Fleet
from ..result import FuzzResult


async def fuzz(fleet: Fleet, runs: int, seed: int, concurrency: int, timeout: float, bar) -> FuzzResult:
    import aiohttp

    from fuzzing.inputs import Mutator
    from web.protocol import MAX_CLIENT_MESSAGE_BYTES

    rng = random.Random(f"websocket:{seed}")
    seeds = [
        {"type": "generate", "digits": "3,7,7", "steps": 4},
        {"type": "generate", "digits": [1, 2], "steps": 3, "ref": 5},
        {
            "type": "generate",
            "count": 2,
            "steps": 3,
            "strategy": "topk",
            "top_k": 2,
            "solver": "heun",
            "seed": "11",
            "frame_every": 2,
            "ref": "r",
        },
        {"type": "cancel", "job_id": "web0011223344556677", "ref": 1},
        {"type": "ping", "ref": "x"},
    ]
    mut = Mutator(
        rng,
        seeds,
        extra_keys=(
            "type",
            "digits",
            "count",
            "steps",
            "strategy",
            "solver",
            "top_k",
            "seed",
            "frame_every",
            "ref",
            "job_id",
        ),
    )
    frames = [mut.websocket_frame(MAX_CLIENT_MESSAGE_BYTES) for _ in range(runs)]
    res = FuzzResult("websocket", "random", runs)
    lanes = max(1, min(concurrency, 4))

    async with aiohttp.ClientSession() as http:

        async def connect():
            ws = await http.ws_connect(fleet.web_url + "/ws", max_msg_size=0, heartbeat=None)
            hello = await ws.receive_json(timeout=timeout)
            if hello.get("type") != "hello":
                raise AssertionError(f"first message is not hello: {hello}")
            return ws

        async def lane(index: int, items: list[tuple[int, tuple[str, Any]]]) -> None:
            ws = await connect()
            try:
                for n, (kind, payload) in items:
                    res.tried += 1
                    try:
                        ws = await _ws_probe(
                            ws, connect, res, f"{index}-{n}", kind, payload, timeout, MAX_CLIENT_MESSAGE_BYTES
                        )
                    except Exception as err:  # e.g. the server no longer accepts sockets
                        res.crash(payload, f"probe failed: {type(err).__name__}: {err}")
                        await ws.close()
                        ws = await connect()
                    bar.update(1)
            finally:
                await ws.close()

        items = list(enumerate(frames))
        await asyncio.gather(*(lane(i, items[i::lanes]) for i in range(lanes)))

        # after the run: healthz, a fresh socket answers ping and runs a real job
        try:
            async with http.get(fleet.web_url + "/healthz") as resp:
                if resp.status != 200:
                    raise AssertionError(f"/healthz answered {resp.status}")
            ws = await connect()
            try:
                await ws.send_json({"type": "ping", "ref": "check"})
                await ws.send_json({"type": "generate", "digits": "3,8", "steps": 3, "ref": "check"})
                seen: list[str] = []
                deadline = time.monotonic() + 60
                while "done" not in seen:
                    msg = await ws.receive_json(timeout=max(0.1, deadline - time.monotonic()))
                    seen.append(msg["type"])
                    if msg["type"] in ("error", "failed", "rejected"):
                        raise AssertionError(f"the check job got {msg}")
                if "pong" not in seen or "accepted" not in seen:
                    raise AssertionError(f"messages seen: {seen}")
            finally:
                await ws.close()
            res.check = "web app: healthz, ping and a real job on a fresh socket"
        except Exception as err:
            res.check = f"FAILED: {type(err).__name__}: {err}"
            res.crash(b"", f"after the run the web app does not serve: {type(err).__name__}: {err}")
    return res


async def _ws_probe(ws, connect, res: FuzzResult, tag: str, kind: str, payload: Any, timeout: float, max_text: int):
    """Send one frame and a ping barrier; classify what comes back before the pong. Returns the
    socket to use next (a new one when the server closed this one)."""
    from aiohttp import WSMsgType

    barrier = f"fz-{tag}"
    oversize = kind == "text" and len(payload.encode("utf-8")) > max_text
    try:
        if kind == "binary":
            await ws.send_bytes(payload)
        else:
            await ws.send_str(payload)
        if not oversize:
            await ws.send_json({"type": "ping", "ref": barrier})
    except (ConnectionError, RuntimeError) as err:
        res.crash(payload, f"socket unusable before the pong: {type(err).__name__}: {err}")
        return await connect()
    errors: list[dict] = []
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        try:
            msg = await ws.receive(timeout=max(0.05, deadline - loop.time()))
        except TimeoutError:
            res.crash(payload, f"no pong within {timeout} s")
            await ws.close()
            return await connect()
        if msg.type in (WSMsgType.CLOSE, WSMsgType.CLOSING, WSMsgType.CLOSED, WSMsgType.ERROR):
            code = ws.close_code
            if oversize:  # documented: a frame over the limit closes the socket (1009; 1006 when the
                # server hangs up while the client is still writing the frame)
                res.count("clear", f"ws_close_{code}")
            else:
                res.crash(payload, f"server closed the socket: {msg.type.name} code {code} {msg.extra!r}")
            return await connect()
        if msg.type != WSMsgType.TEXT:
            res.crash(payload, f"server sent a {msg.type.name} frame")
            continue
        try:
            out = json.loads(msg.data)
        except ValueError:
            res.crash(payload, f"server sent non-JSON: {msg.data[:200]!r}")
            continue
        typ = out.get("type")
        if typ == "pong" and out.get("ref") == barrier:
            break
        if typ == "error":
            if out.get("code") == "internal" or not out.get("message"):
                res.crash(payload, f"error message: {out}")
                return ws
            errors.append(out)
        elif typ == "accepted":  # a fuzzed job got through: stop it
            await ws.send_json({"type": "cancel", "job_id": out["job_id"]})
        elif typ in ("rejected", "failed") and out.get("code") == "internal":
            res.crash(payload, f"{typ} with code internal: {out}")
            return ws
    if errors:
        res.count("clear", str(errors[0].get("code")))
    else:
        res.count("ok", "answered" if kind == "text" else "binary")
    return ws
