"""The join-shortest-queue dispatch policy (coordinator/dispatch.py), pure: events in, picks out."""

from __future__ import annotations

import pytest

from coordinator.dispatch import DispatchPolicy
from schemas import subjects


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def token(worker_id: str) -> str:
    return f"t-{worker_id}"


def policy(**kw) -> tuple[DispatchPolicy, Clock]:
    clock = Clock()
    kw.setdefault("explore_every", 0)
    return DispatchPolicy(token, clock=clock, **kw), clock


def test_nothing_known_means_the_queue_group():
    p, _ = policy()
    assert p.pick(0) is None
    p.seen(1, "a")
    assert p.pick(0) is None  # experts are apart
    assert p.pick(1) == "t-a"


def test_pick_joins_the_shortest_queue_and_spreads_a_burst_evenly():
    p, _ = policy(depth=2)
    for w in ("a", "b", "c"):
        p.seen(0, w)
    picks = []
    for _ in range(6):  # a cohort of 2 W requests: each worker gets exactly 2
        t = p.pick(0)
        p.sent(0, t)
        picks.append(t)
    assert sorted(picks) == ["t-a", "t-a", "t-b", "t-b", "t-c", "t-c"]
    assert picks[:3] == ["t-a", "t-b", "t-c"]  # ties: the least recently sent to (never sent: first)
    assert p.pick(0) is None  # everyone has depth outstanding: the queue group
    p.finished(0, "t-b")
    assert p.pick(0) == "t-b" and p.outstanding(0, "t-b") == 1


def test_ties_go_to_the_least_recently_sent_to():
    p, _ = policy(depth=5)
    for w in ("a", "b"):
        p.seen(0, w)
    order = []
    for _ in range(4):  # each request finishes before the next: always a tie at 0 outstanding
        t = p.pick(0)
        p.sent(0, t)
        p.finished(0, t)
        order.append(t)
    assert order == ["t-a", "t-b", "t-a", "t-b"]


def test_every_nth_pick_explores_via_the_queue_group():
    p, _ = policy(explore_every=4, depth=100)
    p.seen(0, "a")
    picks = [p.pick(0) for _ in range(12)]
    assert [i for i, t in enumerate(picks) if t is None] == [3, 7, 11]
    assert all(p.pick(0, explore=False) == "t-a" for _ in range(8))  # hedges never explore


def test_exclude_keeps_a_hedge_off_the_primarys_worker():
    p, _ = policy()
    p.seen(0, "a")
    assert p.pick(0, ("t-a",)) is None
    p.seen(0, "b")
    p.sent(0, "t-b")
    assert p.pick(0, ("t-a",)) == "t-b"  # loaded, but not the excluded one


def test_workers_not_seen_for_ttl_expire():
    p, clock = policy(ttl_s=30.0)
    p.seen(0, "a")
    clock.now += 20
    p.seen(0, "b")
    clock.now += 15  # a: 35 s, b: 15 s
    assert p.known(0) == ["t-b"]
    assert p.pick(0) == "t-b"
    clock.now += 16
    assert p.pick(0) is None and p.snapshot() == {0: {}}


def test_forget_then_relearn_from_the_next_good_reply():
    p, _ = policy()
    p.seen(0, "a")
    p.sent(0, "t-a")
    p.forget(0, "t-a")  # e.g. its direct request timed out
    assert p.pick(0) is None
    assert p.outstanding(0, "t-a") == 1  # its request is still out: counted until finished
    assert p.seen(0, "a") == "t-a"
    assert p.pick(0) == "t-a" and p.outstanding(0, "t-a") == 1  # the count survived forget + relearn
    p.finished(0, "t-a")
    p.finished(0, "t-a")  # one too many: never below zero
    assert p.outstanding(0, "t-a") == 0


def test_a_banned_worker_is_not_relearned_until_ttl():
    p, clock = policy(ttl_s=30.0)
    p.seen(0, "old")
    p.forget(0, "t-old", ban=True)  # no responders on its direct subject
    assert p.seen(0, "old") is None and p.pick(0) is None  # its queue-group replies do not bring it back
    clock.now += 31
    assert p.seen(0, "old") == "t-old" and p.pick(0) == "t-old"


def test_known_workers_are_bounded_least_recently_seen_first():
    p, _ = policy(max_workers=3)
    for w in ("a", "b", "c"):
        p.seen(0, w)
    p.seen(0, "a")  # a is fresh again
    p.seen(0, "d")
    assert p.known(0) == ["t-c", "t-a", "t-d"]
    for i in range(1000):  # a reply stream claiming ever new ids
        p.seen(0, f"forged-{i}")
    assert len(p.known(0)) == 3
    for i in range(1000):
        p.forget(0, f"t-x{i}", ban=True)
    assert len(p._banned[0]) == 3


def test_ids_that_make_no_token_are_ignored():
    p = DispatchPolicy(subjects.worker_token, explore_every=0)
    assert p.seen(0, "") is None and p.seen(0, None) is None and p.pick(0) is None
    t = p.seen(0, "host.with.dots-12-ab")
    assert t == subjects.worker_token("host.with.dots-12-ab") and p.pick(0) == t


@pytest.mark.parametrize(
    "kw",
    [dict(depth=0), dict(explore_every=1), dict(explore_every=-1), dict(ttl_s=0), dict(max_workers=0), dict(depth=1.5)],
)
def test_bad_settings_are_refused(kw):
    with pytest.raises(ValueError):
        DispatchPolicy(token, **kw)


def test_worker_tokens_and_direct_subjects():
    t = subjects.worker_token("gpu-7.example.org-1234-abcdef")
    assert len(t) == 16 and all(c in "0123456789abcdef" for c in t) and subjects.is_worker_token(t)
    assert t == subjects.worker_token("gpu-7.example.org-1234-abcdef")  # stable
    assert t != subjects.worker_token("gpu-7.example.org-1234-abcdeg")
    assert subjects.expert_direct(3, t) == f"ddm.v1.expert.3.velocity.{t}"
    for bad in ("", None, 5):
        with pytest.raises(ValueError):
            subjects.worker_token(bad)
    for bad in ("", "*", ">", "ABCDEF0123456789", "0123456789abcde", "a.b", t + "0"):
        with pytest.raises(ValueError):
            subjects.expert_direct(3, bad)
    with pytest.raises(ValueError):
        subjects.expert_direct(-1, t)


def test_a_scoped_workers_direct_subject_lives_under_its_scope():
    """A worker id "<scope>:<rest>" (`scoped_worker_id`) gets the token "<scope>.<16 hex>", so its direct
    subject is ddm.v1.expert.<K>.velocity.<scope>.<hex>: a NATS user allowed `velocity.<scope>.*` only
    can serve it, and no wildcard one level deep (`velocity.*`) matches it."""
    wid = subjects.scoped_worker_id("trn1-a", "gpu-7.example.org-1234-abcdef")
    assert wid == "trn1-a:gpu-7.example.org-1234-abcdef" and subjects.worker_scope(wid) == "trn1-a"
    t = subjects.worker_token(wid)
    scope, hexpart = t.split(".")
    assert scope == "trn1-a" and len(hexpart) == 16 and subjects.is_worker_token(t)
    assert hexpart != subjects.worker_token("gpu-7.example.org-1234-abcdef")  # the scope is part of the id
    assert subjects.expert_direct(0, t) == f"ddm.v1.expert.0.velocity.trn1-a.{hexpart}"
    assert subjects.worker_scope("gpu-7-1234-ab") is None and subjects.worker_scope("bad.scope:x") is None
    for bad in ("", "a.b", "*", "x" * 65):
        with pytest.raises(ValueError, match="direct scope"):
            subjects.scoped_worker_id(bad, "w")
    for bad in ("a.b." + hexpart, "*." + hexpart, "trn1-a." + hexpart[:-1]):
        with pytest.raises(ValueError):
            subjects.expert_direct(0, bad)
    p = DispatchPolicy(subjects.worker_token, explore_every=0)
    assert p.seen(0, wid) == t and p.pick(0) == t  # the transport sends it to expert_direct(0, t)


def test_most_known_is_the_most_workers_of_any_expert_within_the_ttl():
    p, clock = policy(ttl_s=30.0)
    assert p.most_known() == 0
    for w in ("a", "b", "c"):
        p.seen(0, w)
    p.seen(1, "d")
    assert p.most_known() == 3
    clock.now += 20
    p.seen(1, "e")
    clock.now += 15  # a, b, c not seen for 35 s: forgotten; e seen 15 s ago
    assert p.most_known() == 1


def test_a_fenced_expert_never_uses_its_queue_group_while_a_worker_is_known():
    p, _ = policy(explore_every=4, depth=1)
    p.seen(0, "a")
    p.seen(1, "b")
    p.fence({0})
    assert p.fenced() == {0}
    picks = []
    for _ in range(8):  # no exploring, and busy beyond depth still goes to the known worker
        t = p.pick(0)
        p.sent(0, t)
        picks.append(t)
    assert picks == ["t-a"] * 8
    assert p.pick(1) == "t-b" and p.pick(1) == "t-b" and p.pick(1) == "t-b" and p.pick(1) is None  # 1: not fenced
    assert p.pick(2) is None  # nothing known: the queue group is the last resort
    p.fence(())
    p.sent(0, "t-a")
    assert p.pick(0, explore=False) is None  # unfenced: at depth means the queue group again


def test_an_insisting_pick_takes_a_busy_known_worker_and_never_explores():
    """A retry after a time-out: a known worker however busy; the queue group only when none is known."""
    p, _ = policy(depth=1, explore_every=2)
    assert p.pick(0, insist=True) is None  # nothing known
    p.seen(0, "a")
    p.sent(0, "t-a")
    assert p.pick(0, explore=False) is None  # at depth: the queue group
    assert [p.pick(0, insist=True) for _ in range(6)] == ["t-a"] * 6  # busy, and every 2nd would explore
    p.seen(0, "b")
    assert p.pick(0, insist=True) == "t-b"  # still the shortest queue first


def test_an_unanswered_try_keeps_the_experts_picks_off_the_queue_group_for_ttl():
    """A worker took a request and never answered (a cut host keeps its interest in the queue group until
    nats-server's pings give up on it): for ttl_s the expert's picks go to known workers however busy, never
    to the queue group to explore or because they are busy; the queue group only when none is known. Only
    while a worker discovery feeds the known workers: a policy that learns only from replies explores as before."""
    p, clock = policy(explore_every=2, depth=1, ttl_s=30.0)
    p.seen(0, "a")
    p.seen(1, "b")
    p.sent(0, "t-a")
    p.unanswered(0)  # no discovery yet: nothing changes
    assert p.shunned() == [] and p.pick(0, explore=False) is None  # at depth: the queue group
    p.discovered()
    p.unanswered(0)
    assert p.shunned() == [0]
    assert [p.pick(0) for _ in range(6)] == ["t-a"] * 6  # busy, and every 2nd pick would explore
    assert [p.pick(1) for _ in range(2)] == ["t-b", None]  # every 2nd pick of expert 1 still explores ...
    p.sent(1, "t-b")
    assert p.pick(1, explore=False) is None  # ... and at depth it goes to the queue group: not shunned
    p.forget(0, "t-a")  # the silent worker itself is forgotten
    assert p.pick(0) is None  # none known: the queue group is the last resort
    clock.now += 20
    p.seen(0, "a")
    p.discovered()
    p.unanswered(0)  # a second silence re-arms the window
    clock.now += 20
    p.seen(0, "a")  # (a known worker is one seen within ttl_s)
    p.discovered()
    assert p.shunned() == [0] and p.pick(0, explore=False) == "t-a"
    clock.now += 10.5
    p.seen(0, "a")
    p.discovered()
    assert p.shunned() == []
    assert p.pick(0, explore=False) is None  # the window is over: at depth means the queue group again
    p.unanswered(0)
    assert p.pick(0, explore=False) == "t-a"
    clock.now += 31  # the discovery stopped (its last one over ttl_s ago): the window no longer applies
    p.seen(0, "a")
    assert p.shunned() == [] and p.pick(0, explore=False) is None


def test_a_queue_only_policy_never_shuns():
    """dispatch="queue" steers only fenced experts: an unanswered try changes nothing for the others."""
    p = DispatchPolicy(token, only_fenced=True)
    p.discovered()
    p.seen(0, "a")
    p.unanswered(0)
    assert p.shunned() == [] and p.pick(0) is None
