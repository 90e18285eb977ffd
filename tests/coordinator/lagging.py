"""A coordinator that is slow to answer job status requests, for the tests of several coordinators
on one bus (tests/coordinator/test_multi_coordinator.py, tests/web/test_app_socket.py)."""

from __future__ import annotations

import asyncio

from coordinator.service import Coordinator


class LaggingCoordinator(Coordinator):
    """A coordinator whose job status answers leave `status_lag` seconds late (each request on its
    own, as on a host too loaded to answer at once); counts the status requests it got."""

    def __init__(self, *args, status_lag: float = 0.0, **kw):
        super().__init__(*args, **kw)
        self.status_lag = status_lag
        self.status_requests = 0
        self._lagging: set[asyncio.Task] = set()
        #: Cleared, the engine stops before its next tick (jobs keep their place, status still
        #: answers): a test can hold a job queued for as long as it needs, whatever the box's speed.
        self.ticking = asyncio.Event()
        self.ticking.set()
        self._answer_status = self.intake.on_job_status
        self.intake.on_job_status = self._lagged_job_status  # subscribed on entering

    async def __aenter__(self) -> LaggingCoordinator:
        await super().__aenter__()
        tick = self.engine.tick

        async def held_tick(**kw) -> bool:
            await self.ticking.wait()
            return await tick(**kw)

        self.engine.tick = held_tick
        return self

    async def _lagged_job_status(self, msg) -> None:
        self.status_requests += 1

        async def later() -> None:
            await asyncio.sleep(self.status_lag)
            await self._answer_status(msg)

        task = asyncio.ensure_future(later())
        self._lagging.add(task)
        task.add_done_callback(self._lagging.discard)

    async def __aexit__(self, *exc) -> None:
        self.ticking.set()  # a held engine must reach its stop
        for task in list(self._lagging):
            task.cancel()
        await super().__aexit__(*exc)
