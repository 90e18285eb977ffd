"""What a durable coordinator does when its leases lapse (coordinator.durable_jobs, coordinator.durable_store),
pure: a fake bucket store and engine, the real DurableJobs, JobLedger and JobStore bookkeeping.

Whichever part notices the lapse first (the renewal loop, the watchdog, or the check before an event)
fences every held job and has their unsent events taken back once; a job taken back
after a lapse is not fenced again at once for a lapse that is over."""

from __future__ import annotations

import time

from coordinator.durable_jobs import DurableJobs
from coordinator.durable_store import JobStore
from coordinator.ledger import JobLedger
from schemas import FailedEvent


class FakeStore:
    """The JobStore surface DurableJobs uses, in memory: `lapsed` says whether the leases lapsed."""

    lease_s = 4.0

    def __init__(self, held, lost=()):
        self._held, self.lost, self.lapsed = list(held), list(lost), False

    @property
    def held(self):
        return list(self._held)

    def holds(self, job_id):
        return job_id in self._held

    def expired(self):
        return bool(self._held) and self.lapsed

    def forget(self, job_id):
        if job_id in self._held:
            self._held.remove(job_id)

    async def renew(self):
        lost = [j for j in self.lost if j in self._held]
        for j in lost:
            self.forget(j)
        return lost


class FakeScheduler:
    def __init__(self):
        self.dropped = []

    def drop(self, job_id):
        self.dropped.append(job_id)
        return True


class FakeEngine:
    def __init__(self):
        self.scheduler = FakeScheduler()


def durable(held, lost=()):
    ledger = JobLedger()
    for j in held:
        ledger.admit(j, "anon", j, steps=40, epoch=1)
    drops = []

    def on_fence(names, lapsed):
        drops.append(sorted(names) if lapsed else ("taken over", sorted(names)))
        return "dropped" if lapsed else "recalled"

    dj = DurableJobs(FakeStore(held, lost), ledger, name="ca", checkpoint_every=10, on_fence=on_fence)
    dj.engine = FakeEngine()
    return dj, drops


async def test_a_lapse_the_renewal_loop_sees_first_fences_every_job_and_takes_their_unsent_events_back():
    dj, drops = durable(["a", "b", "c"])
    dj.store.lapsed = True  # the round waited out bus timeouts on a cut link: the leases lapsed meanwhile
    await dj.renew()
    assert dj.store.held == [] and sorted(dj.engine.scheduler.dropped) == ["a", "b", "c"]
    assert all(dj.is_fenced("anon", j) for j in "abc")
    # the frames of every fenced job queued behind the cut are taken back, never sent to a client
    assert drops == [[("anon", "a"), ("anon", "b"), ("anon", "c")]]
    # the watchdog and the events that follow find nothing held: no second drop
    assert not dj.before_publish(FailedEvent(job_id="a", code="internal", reason="x"))
    assert len(drops) == 1


async def test_a_lease_another_coordinator_took_fences_that_job_only():
    dj, drops = durable(["a", "b"], lost=["a"])
    await dj.renew()
    assert dj.store.held == ["b"] and dj.engine.scheduler.dropped == ["a"] and dj.is_fenced("anon", "a")
    # its unsent events are taken back (the link works: never by dropping it); the other leases are alive
    assert drops == [("taken over", [("anon", "a")])]


def test_a_lapse_seen_before_an_event_fences_every_held_job_at_once():
    dj, drops = durable(["a", "b"])
    dj.store.lapsed = True
    assert not dj.before_publish(FailedEvent(job_id="b", code="internal", reason="x"))
    assert dj.store.held == [] and sorted(dj.engine.scheduler.dropped) == ["a", "b"]
    assert drops == [[("anon", "a"), ("anon", "b")]]


def test_a_lease_taken_back_after_a_lapse_counts_as_fresh():
    """Each lease expires lease_s after its own last write: leases adopted or taken back after a lapse are
    fresh, however many are written at once (several submits right after a wake-up; a rule keyed on 'the
    only lease held' fenced them again at their first event and dropped their submit replies with the
    connection), while a lease that was not renewed still expires."""
    store = JobStore(None, "ca", "run-1", lease_s=4.0)
    store.last_renewed = time.monotonic() - 60  # a lapse long ago: nothing held, no renewal since
    assert not store.expired()  # nothing held: nothing to lapse
    now = time.monotonic()
    for j, rev in (("j", 7), ("k", 8), ("l", 9)):  # adopt() / take() wrote these leases just now, concurrently
        store._lease_rev[j], store._lease_at[j] = rev, now - 0.1
    assert not store.expired()  # else the jobs would be fenced at their first event, their fresh leases left to lapse
    store._lease_rev["old"], store._lease_at["old"] = 3, now - 60  # one that no round renewed
    assert store.expired()
    store.forget("old")
    assert not store.expired() and store.held == ["j", "k", "l"]


async def test_a_round_that_loses_a_job_and_lapses_takes_every_fenced_jobs_events_back_at_once():
    dj, drops = durable(["a", "b", "c"], lost=["a"])
    dj.store.lapsed = True
    await dj.renew()
    assert drops == [[("anon", "a"), ("anon", "b"), ("anon", "c")]]


def test_a_finished_job_still_holding_its_lease_has_its_end_taken_back_at_a_lapse():
    """Its `failed` went out to the bus buffer (the ledger let its name go) but the release of its lease
    waits for the durable loop: another coordinator may resume it from its checkpoint, so that end must not
    reach the client late either."""
    dj, drops = durable(["a", "b"])
    ended = FailedEvent(job_id="a", code="internal", reason="x")
    assert dj.before_publish(ended)
    dj.ledger.remember("a", ended)
    assert dj.ledger.name_of("a") is None  # what fence() alone would have had to go on
    dj.lapse()
    assert drops == [[("anon", "a"), ("anon", "b")]]


def test_a_finished_job_whose_release_is_on_its_way_is_fenced_too():
    """The release of a finished job's lease takes it out of the store's held jobs before its bucket delete
    (a whole bus time-out on a cut link): a lapse meanwhile still takes that job's end back."""
    dj, drops = durable(["a", "b"])
    ended = FailedEvent(job_id="a", code="internal", reason="x")
    assert dj.before_publish(ended)
    dj.ledger.remember("a", ended)
    dj.store.forget("a")  # what JobStore.release does before it awaits the bus
    dj.lapse()
    assert drops == [[("anon", "a"), ("anon", "b")]] and dj.is_fenced("anon", "a")
    dj.lapse()  # nothing left to fence: no name twice
    assert drops[1] == []
