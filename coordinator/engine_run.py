"""A serving coordinator's engine loop, run as a task, and the periodic worker discovery beside it:
started once the coordinator serves, waited on by `serve_until`, wound down when it stops.

    run = EngineRun(engine, transport, watch_workers=True, check_s=WORKER_CHECK_S)
    await run.serve_until(stop)      # EngineDied when the loop dies first
    await run.stop_watch(); ...; await run.end()
"""

from __future__ import annotations

import asyncio
import logging

from bus.cancel import cancel_and_wait

log = logging.getLogger(__name__)

#: Seconds between two discoveries of the expert workers, whose specs are checked against the fleet's.
WORKER_CHECK_S = 5.0
#: Seconds a stopping coordinator lets its last tick finish before cancelling it (its jobs have failed
#: with `unavailable`, or been handed over, already).
STOP_GRACE_S = 3.0


class EngineDied(RuntimeError):
    """The coordinator's engine loop died; every job failed with `internal` and submits are refused."""


class EngineRun:
    """`engine.run()` as a task; with `watch_workers`, every `check_s` seconds a discovery of the expert
    workers (`transport.refresh_workers`): workers that join later are checked against the fleet's spec
    as they are discovered (coordinator/fleet_spec.py: the transport logs each odd one by name, stops
    addressing it and refuses its replies), and what each expert's workers can run ahead is learned
    (coordinator/run_ahead.py)."""

    def __init__(self, engine, transport, *, watch_workers: bool, check_s: float = WORKER_CHECK_S):
        self.engine, self.transport, self.check_s = engine, transport, check_s
        self.task = asyncio.create_task(engine.run(), name="coordinator-engine")
        self.task.add_done_callback(self._ended)
        self._watching = watch_workers  # False once stopping: the watch loop ends
        self.watch = (
            asyncio.create_task(self._watch_workers(), name="coordinator-worker-specs") if watch_workers else None
        )

    def _ended(self, task: asyncio.Task) -> None:
        """Done-callback of the engine task: a loop that died has already failed every job with
        `internal` and refuses submits (`unavailable`); say so loudly here."""
        if not task.cancelled() and task.exception() is not None:
            log.critical(
                "coordinator engine died (%s): every job failed, submits are refused; "
                "the process should exit and be restarted",
                self.engine.dead,
            )

    async def serve_until(self, stop: asyncio.Event) -> None:
        """Wait until `stop` is set. Raises EngineDied if the engine loop dies first (its jobs have
        failed with `internal`): the caller should exit non-zero so a supervisor restarts it."""
        stopper = asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait({stopper, self.task}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopper.cancel()
        if self.task.done() and not stop.is_set():
            raise EngineDied(self.engine.dead or "coordinator engine stopped")

    async def _watch_workers(self) -> None:
        # The loop also ends on `_watching` going False: a cancel can be lost inside nats-py (a cancelled
        # next_msg reads as ConnectionClosedError on a closed connection; 3.11's wait_for may swallow one),
        # and a task that outlives a lost cancel would hang asyncio.run's shutdown.
        while self._watching:
            try:
                await self.transport.refresh_workers()
            except Exception as err:  # never let discovery take the coordinator down
                log.warning("worker discovery failed: %r", err)
            if self._watching:
                await asyncio.sleep(self.check_s)

    async def stop_watch(self) -> None:
        """End the worker discovery (within at most one discovery window)."""
        self._watching = False
        if self.watch is not None:
            await cancel_and_wait([self.watch], 2.0)

    async def end(self) -> None:
        """Every job has failed or been handed over by now: a tick still waiting on an expert (up to the step
        timeout and its retries) has nothing left to deliver, so it gets a moment, not that long."""
        await asyncio.wait({self.task}, timeout=STOP_GRACE_S)
        if not self.task.done():
            log.info("stopping: cancelling the tick still waiting on the experts")
            await cancel_and_wait([self.task], STOP_GRACE_S)
        elif not self.task.cancelled() and self.task.exception() is not None:
            log.error("engine ended with an error", exc_info=self.task.exception())
