"""The private fleet the network targets run against, all in this process: a nats-server on a free
port (max_payload 16 MiB, so messages between our 8 MiB limit and the server's reach our code), two
tiny random-init torch experts, a coordinator with a random-init router, and the aiohttp web app.
Plus the driver that probes inputs with bounded concurrency.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .result import FuzzResult

log = logging.getLogger(__name__)


class _ErrorLog(logging.Handler):
    """Collects ERROR records from every logger while a network target runs."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        text = f"{record.name}: {record.getMessage()}"
        if record.exc_info:
            import traceback

            text += "\n" + "".join(traceback.format_exception(*record.exc_info))[-1500:]
        self.records.append(text)


class Fleet:
    """nats-server + 2 tiny experts + coordinator + web app, in this process."""

    NUM_EXPERTS = 2

    def __init__(self, workdir: str):
        self.workdir = Path(workdir)
        self.server = None
        self.workers: list = []
        self.coordinator = None
        self.web_runner = None
        self.web_url = ""
        self.nc = None

    @property
    def url(self) -> str:
        return self.server.url

    async def __aenter__(self) -> Fleet:
        try:
            await self._start()
        except BaseException:
            await self.__aexit__(None, None, None)
            raise
        return self

    async def _start(self) -> None:
        from bus.connect import connect
        from bus.nats_server import NatsServer, free_port
        from coordinator.service import Coordinator
        from models.router import Router
        from workers.service import ExpertWorker

        self.server = NatsServer(extra_config="max_payload: 16MB")
        await asyncio.to_thread(self.server.start)
        ckpts = await asyncio.to_thread(self._checkpoints)
        for k, ckpt in enumerate(ckpts):
            w = ExpertWorker(
                k, ckpt, "torch", nats_url=self.url, buckets=(1, 2, 4, 8), max_queue_rows=2048, worker_id=f"fuzz-e{k}"
            )
            await w.start()
            self.workers.append(w)
        from models.tiny import make_tiny_router

        router = Router.load(await asyncio.to_thread(make_tiny_router, self.workdir / "fuzz-router", self.NUM_EXPERTS))
        self.coordinator = Coordinator(
            router,
            num_experts=self.NUM_EXPERTS,
            class_to_expert=[0] * 5 + [1] * 5,
            nats_url=self.url,
            max_rows=32,
            max_queued_jobs=16,
            step_timeout=5.0,
            retries=1,
            name="fuzz-coordinator",
            submit_rate=None,  # the fuzzer sends as fast as the coordinator answers: parsing, not rate limits
            status_rate=None,
        )
        await self.coordinator.__aenter__()
        from aiohttp import web

        from web.app import WebConfig, create_app

        # the fuzzer probes parsing as fast as the socket answers: lift the per-socket message rate cap
        app = create_app(
            WebConfig(
                nats_url=self.url,
                fleet_interval=1.0,
                discovery_window=0.2,
                submit_timeout=5.0,
                max_messages_per_second=1e6,
            )
        )
        self.web_runner = web.AppRunner(app, handle_signals=False)
        await self.web_runner.setup()
        port = free_port()
        await web.TCPSite(self.web_runner, "127.0.0.1", port).start()
        self.web_url = f"http://127.0.0.1:{port}"
        self.nc = await connect(self.url, name="ddm-fuzz", reconnect=2, first_connect_attempts=3)

    def _checkpoints(self) -> list[str]:
        from models.tiny import make_tiny_experts

        paths = make_tiny_experts(self.workdir, self.NUM_EXPERTS, prefix="fuzz-expert", split_classes=False)
        return [str(p) for p in paths]

    async def __aexit__(self, *exc) -> None:
        if self.nc is not None:
            from bus.connect import drain_or_close

            await drain_or_close(self.nc)
        if self.web_runner is not None:
            await self.web_runner.cleanup()
        if self.coordinator is not None:
            try:
                await self.coordinator.__aexit__(None, None, None)
            except Exception as err:
                log.warning("stopping the coordinator: %s", err)
        for w in self.workers:
            await w.stop()
        if self.server is not None:
            await asyncio.to_thread(self.server.stop)


async def _drive(
    runs: int, concurrency: int, make: Callable[[int], Any], probe: Callable[[Any], Any], bar, res: FuzzResult
) -> None:
    """Generate `runs` inputs in order; probe them with at most `concurrency` in flight. A probe
    that raises (the connection to the server died, ...) counts as a crash of that input."""
    sem = asyncio.Semaphore(concurrency)
    tasks: set[asyncio.Task] = set()

    async def one(item) -> None:
        try:
            await probe(item)
        except Exception as err:
            res.crash(item[-1], f"probe failed: {type(err).__name__}: {err}")
        finally:
            sem.release()
            bar.update(1)

    for i in range(runs):
        item = make(i)
        await sem.acquire()
        task = asyncio.create_task(one(item))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    if tasks:
        await asyncio.gather(*list(tasks))


def _local(data: bytes, tp) -> tuple[Any, Any]:
    """What the schema itself says of `data`: (message, None) or (None, ErrorCode)."""
    from schemas import ProtocolError, unpack

    try:
        return unpack(data, tp), None
    except ProtocolError as err:
        return None, err.code
