"""The durable-jobs loops stop when cancelled, even when the cancel reaches them disguised.

nats-py reports a wait cancelled on a connection it has closed as `ConnectionClosedError`; the renewal
and bucket-write loops catch `Exception` to survive bus trouble, so without `bus.cancel.raise_if_cancelled`
they went round again and `hand_over` (which cancels and awaits them) waited forever. And 3.11's
`asyncio.wait_for` can drop a cancel altogether (the call just returns): the loops check at each round's
head too, and `hand_over` waits for them a bounded time."""

from __future__ import annotations

import asyncio

import pytest

from coordinator.durable_jobs import DurableJobs
from coordinator.ledger import JobLedger


async def _raise_cancel():
    raise asyncio.CancelledError()


class DisguisingStore:
    """A store whose bus call, once cancelled, raises what nats-py raises on a closed connection."""

    lease_s = 0.03
    held: tuple = ()
    swallows = False

    def __init__(self):
        self.calls = 0
        self.entered = asyncio.Event()

    async def renew(self):
        self.calls += 1
        self.entered.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            if not self.swallows:
                raise ConnectionError("nats: connection closed") from None
        return []  # swallowed: the cancel is gone, only Task.cancelling() still says it was asked

    def expired(self) -> bool:
        return False


class SwallowingStore(DisguisingStore):
    """A store whose bus call, once cancelled, returns normally: what 3.11's `asyncio.wait_for` does when
    the awaited reply lands in the same loop iteration as the cancel (nats-py's requests wait that way)."""

    swallows = True


@pytest.mark.parametrize(
    "store_type",
    [DisguisingStore, SwallowingStore],
    ids=["disguised as a closed connection", "swallowed by the bus call"],
)
async def test_renewals_stop_on_a_cancel(store_type):
    store = store_type()
    jobs = DurableJobs(store, JobLedger(), name="c1", checkpoint_every=4)
    task = asyncio.create_task(jobs._renewals())
    await asyncio.wait_for(store.entered.wait(), 5)
    task.cancel()
    await asyncio.wait({task}, timeout=2)
    stopped = task.done()
    if not stopped:  # before the fixes: the loop renewed again, forever; end it for the next test
        store.renew = _raise_cancel
        task.cancel()
        await asyncio.wait({task}, timeout=2)
    assert stopped, "the renewal loop survived its cancel"
    assert task.cancelled() and store.calls == 1


async def test_a_failed_renewal_that_is_not_a_cancel_keeps_the_loop_going():
    class Failing(DisguisingStore):
        async def renew(self):
            self.calls += 1
            if self.calls >= 3:
                self.entered.set()
            raise ConnectionError("nats: timeout")

    store = Failing()
    jobs = DurableJobs(store, JobLedger(), name="c1", checkpoint_every=4)
    task = asyncio.create_task(jobs._renewals())
    await asyncio.wait_for(store.entered.wait(), 5)  # it went on after two failures
    assert not task.done()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 2)


async def test_hand_over_returns_even_if_a_loop_never_stops(monkeypatch, caplog):
    import coordinator.durable_jobs as durable_jobs

    monkeypatch.setattr(durable_jobs, "HAND_OVER_WAIT_S", 0.2)
    release = asyncio.Event()

    async def stubborn():  # a loop that ignores its cancels (a bug elsewhere must not hang the exit)
        while not release.is_set():
            try:
                await asyncio.sleep(0.01)
            except asyncio.CancelledError:
                pass

    jobs = DurableJobs(DisguisingStore(), JobLedger(), name="c1", checkpoint_every=4)
    task = jobs._renew_task = asyncio.create_task(stubborn(), name="stubborn-loop")
    try:
        await asyncio.wait_for(jobs.hand_over(), 3)
        assert "stubborn-loop did not stop when cancelled" in caplog.text
        assert not task.done() and jobs._renew_task is None
    finally:
        release.set()
        await asyncio.wait({task}, timeout=2)


async def test_a_loop_that_ends_before_the_hand_over_says_so(caplog):
    jobs = DurableJobs(DisguisingStore(), JobLedger(), name="c1", checkpoint_every=4)

    async def loop():
        await asyncio.sleep(3600)

    early = asyncio.create_task(loop(), name="coordinator-durable")
    early.add_done_callback(jobs._loop_ended)
    early.cancel()
    await asyncio.wait({early})
    await asyncio.sleep(0)  # done callbacks run on the next loop turn
    assert "coordinator-durable ended before the hand-over (cancelled)" in caplog.text
    caplog.clear()
    jobs._closing = True  # at the hand-over, the same end is the expected one
    late = asyncio.create_task(loop(), name="coordinator-durable")
    late.add_done_callback(jobs._loop_ended)
    late.cancel()
    await asyncio.wait({late})
    await asyncio.sleep(0)
    assert "ended before the hand-over" not in caplog.text
