"""Join-shortest-queue dispatch of expert requests (pure: feed it events, ask it).

NATS hands a queue-group request to a random member, so with W workers per expert and ~1.5 W
requests per cohort some workers get 3-4 requests while others idle, and a cohort waits for its
slowest request. The coordinator balances itself instead: each worker also serves a direct subject
of its own (`schemas.subjects.expert_direct(k, token)`), and this policy says which worker a request
goes to, from what this coordinator alone knows:

* the known workers of each expert, learned from the worker id of every good reply (`seen`, queue
  group replies included), at most `max_workers` per expert (the least recently seen dropped first),
  each dropped when not seen for `ttl_s` seconds;
* the requests this coordinator has outstanding at each (`sent` ... `finished`).

`pick(k)` returns the token of the known worker with the fewest outstanding requests (ties: the one
least recently sent to), or None, meaning "send it to the queue group", when
  - no worker of k is known,
  - the least loaded known worker already has `depth` outstanding (everyone is busy: NATS's random
    pick is as good, and it reaches workers this coordinator does not know yet),
  - or this is the `explore_every`-th pick of k (so new workers are discovered under steady load).
A retry after a time-out picks with `insist=True`: a known worker however busy, the queue group only
when none is known. A queue group may hold a worker that can no longer answer but whose interest is
still on the bus (behind a cut route, until nats-server's pings give up on it, a minute by default):
NATS hands a client's request to a random member, local or remote, so retries through the queue group
can land there again and again, while a known worker answered this coordinator within `ttl_s`.
`fence(experts)`: those experts' queue groups hold a worker of another model spec (the coordinator's
worker discovery says so), so their picks go to a known worker however busy, and to the queue group
only when none is known.
`unanswered(k)`: a worker of k did not answer in time (a try timed out, or its hedge copy answered
first). Such a worker usually keeps its interest in the queue group for a while (a cut host: until
nats-server's pings give up on it, a minute by default), so for `ttl_s` seconds from the last such event
k's picks avoid the queue group as a fenced expert's do: a known worker however busy, never the queue
group to explore or because the known ones are busy; the queue group only when none is known. Only while
a worker discovery feeds the known workers (`discovered`, within `ttl_s`): exploring is then not how
workers are found, whereas a policy that learns only from replies would otherwise shrink to the few
workers it knows.
`forget(k, token)` drops a worker that timed out or answered badly (it is learned again from its
next good reply); with `ban=True` (no responders on its direct subject: gone, or a worker that
predates direct subjects) its replies are not learned from for `ttl_s` seconds.

Only direct legs are counted: a leg sent to the queue group (exploring, everyone at `depth`, a hedge
copy with no other known worker) lands on a worker this policy cannot name until it replies, so a
worker may hold more than `depth` requests of this coordinator.

The policy only counts; the transport (coordinator/try_legs.py) does the sending, and calls
`finished` for every `sent`, also on failure and cancellation. Workers are named by token, made from
the worker id by `token_of` (the transport passes `schemas.subjects.worker_token`).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Collection

from .choices import DISPATCH_MODES  # noqa: F401 (re-exported: the one list, coordinator/choices.py)

log = logging.getLogger(__name__)

#: Outstanding requests at the least loaded known worker from which on the queue group is used.
DEFAULT_DEPTH = 2
#: Every n-th pick of an expert goes to the queue group, to discover workers (0: never).
DEFAULT_EXPLORE_EVERY = 8
#: Seconds a worker stays known without a good reply (and a banned worker stays banned).
DEFAULT_TTL_S = 30.0
#: Known (and banned) workers kept per expert.
MAX_WORKERS_PER_EXPERT = 256


class _Known:
    __slots__ = ("last_seen", "last_sent")

    def __init__(self, last_seen: float):
        self.last_seen = last_seen
        self.last_sent = -1  # sequence number of the last send; -1: never sent to (preferred)


class DispatchPolicy:
    """Per-expert join-shortest-queue over the workers this coordinator knows (module docstring)."""

    def __init__(
        self,
        token_of: Callable[[str], str],
        *,
        depth: int = DEFAULT_DEPTH,
        explore_every: int = DEFAULT_EXPLORE_EVERY,
        ttl_s: float = DEFAULT_TTL_S,
        max_workers: int = MAX_WORKERS_PER_EXPERT,
        clock: Callable[[], float] = time.monotonic,
        only_fenced: bool = False,
    ):
        if not callable(token_of):
            raise ValueError("token_of must be a function worker id -> token")
        if not isinstance(depth, int) or depth < 1:
            raise ValueError(f"depth must be an int >= 1, got {depth!r}")
        if not isinstance(explore_every, int) or explore_every < 0 or explore_every == 1:
            raise ValueError(f"explore_every must be 0 (never) or an int >= 2, got {explore_every!r}")
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0 seconds, got {ttl_s!r}")
        if not isinstance(max_workers, int) or max_workers < 1:
            raise ValueError(f"max_workers must be an int >= 1, got {max_workers!r}")
        self.token_of, self.depth, self.explore_every = token_of, depth, explore_every
        self.ttl_s, self.max_workers, self.clock = float(ttl_s), max_workers, clock
        self._known: dict[int, OrderedDict[str, _Known]] = {}  # expert -> token -> entry, least recently seen first
        self._banned: dict[int, OrderedDict[str, float]] = {}  # expert -> token -> banned until
        self._outstanding: dict[int, dict[str, int]] = {}  # expert -> token -> requests out (> 0 only)
        self._picks: dict[int, int] = {}
        self._seq = 0
        #: experts whose queue group holds a worker of another model spec: their picks avoid the queue group
        self._fenced: frozenset[int] = frozenset()
        #: expert -> until when its picks avoid the queue group (a worker of it did not answer: `unanswered`)
        self._shunned: dict[int, float] = {}
        #: when a worker discovery last told the live workers (`discovered`); None: never
        self._discovered_at: float | None = None
        #: dispatch="queue": this policy only steers the fenced experts; every other pick is the queue group
        self.only_fenced = only_fenced

    # ------------------------------------------------------------ questions
    def pick(
        self, expert: int, exclude: Collection[str] = (), *, explore: bool = True, insist: bool = False
    ) -> str | None:
        """The token of the worker of `expert` to send the next request to, or None: the queue group.
        exclude: tokens not to pick (a hedge's primary); explore=False: this pick never goes to the
        queue group just to explore (and does not count towards `explore_every`); insist=True (a retry
        after a time-out): a known worker however busy, the queue group only when none is known."""
        fenced = expert in self._fenced
        if self.only_fenced and not fenced:
            return None
        if not fenced and expert in self._shunned:
            if self._shunned[expert] <= self.clock():
                del self._shunned[expert]
            else:
                fenced = self._discovering()
        known = self._expire(expert)
        if explore and not insist and self.explore_every and not fenced:
            n = self._picks[expert] = self._picks.get(expert, 0) + 1
            if n % self.explore_every == 0:
                return None
        if not known:
            return None
        out = self._outstanding.get(expert, {})
        best, best_key = None, None
        for token, entry in known.items():
            if token in exclude:
                continue
            key = (out.get(token, 0), entry.last_sent)
            if best_key is None or key < best_key:
                best, best_key = token, key
        if best is None or (best_key[0] >= self.depth and not (fenced or insist)):
            return None
        return best

    def fence(self, experts: Collection[int]) -> None:
        """Experts whose queue group holds a worker that must not be used (another model spec): their picks
        never go to the queue group to explore or because every known worker is busy; only when none is known."""
        self._fenced = frozenset(experts)

    def fenced(self) -> frozenset[int]:
        return self._fenced

    def outstanding(self, expert: int, token: str) -> int:
        """Requests this coordinator has out at that worker."""
        return self._outstanding.get(expert, {}).get(token, 0)

    def known(self, expert: int) -> list[str]:
        """The tokens of `expert`'s known workers, least recently seen first."""
        return list(self._expire(expert))

    def most_known(self) -> int:
        """The most known workers of any one expert (0 when none is known)."""
        return max((len(self._expire(k)) for k in list(self._known)), default=0)

    def snapshot(self) -> dict[int, dict[str, int]]:
        """expert -> {token: outstanding} over the known workers (for status and tests)."""
        return {k: {t: self.outstanding(k, t) for t in self.known(k)} for k in sorted(self._known)}

    # ------------------------------------------------------------ events
    def sent(self, expert: int, token: str) -> None:
        """A request of `expert` went to worker `token`'s direct subject."""
        out = self._outstanding.setdefault(expert, {})
        out[token] = out.get(token, 0) + 1
        self._seq += 1
        entry = self._known.get(expert, {}).get(token)
        if entry is not None:
            entry.last_sent = self._seq

    def finished(self, expert: int, token: str) -> None:
        """A request `sent` to `token` is over (answered, failed, timed out or cancelled)."""
        out = self._outstanding.get(expert)
        n = out.get(token, 0) if out is not None else 0
        if n > 1:
            out[token] = n - 1
        elif n == 1:
            del out[token]

    def seen(self, expert: int, worker_id: str) -> str | None:
        """A good reply of `expert` from `worker_id`: that worker is alive (learned if new). Returns
        its token, or None when the id makes none or the worker is banned."""
        try:
            token = self.token_of(worker_id)
        except (TypeError, ValueError):
            return None
        now = self.clock()
        banned = self._banned.get(expert)
        if banned is not None and token in banned:
            if banned[token] > now:
                return None
            del banned[token]
        known = self._known.setdefault(expert, OrderedDict())
        entry = known.get(token)
        if entry is None:
            entry = known[token] = _Known(now)
            while len(known) > self.max_workers:
                known.popitem(last=False)
        else:
            entry.last_seen = now
            known.move_to_end(token)
        return token

    def discovered(self) -> None:
        """A worker discovery told the live workers (each one `seen`): while it does, `unanswered` applies."""
        self._discovered_at = self.clock()

    def _discovering(self) -> bool:
        return self._discovered_at is not None and self.clock() - self._discovered_at <= self.ttl_s

    def unanswered(self, expert: int) -> None:
        """A try of `expert` got no reply in time (timed out, or its hedge copy answered first), from a known
        worker or through the queue group: for `ttl_s` seconds its picks avoid the queue group, while a worker
        discovery feeds the known workers (module docstring)."""
        if self.only_fenced or not self._discovering():  # dispatch="queue" (its unfenced picks are the queue
            return  # group anyway), or no discovery names the live workers: nothing to keep off
        now = self.clock()
        if self._shunned.get(expert, now) <= now:
            log.info(
                "expert %d: a worker took a request and did not answer in time; its requests go only to workers "
                "that answer for %g s (not to the queue group, which may still hold the silent one)",
                expert,
                self.ttl_s,
            )
        self._shunned[expert] = now + self.ttl_s

    def shunned(self) -> list[int]:
        """The experts whose picks avoid the queue group because a worker of theirs did not answer."""
        if not self._discovering():
            return []
        now = self.clock()
        return sorted(k for k, until in self._shunned.items() if until > now)

    def forget(self, expert: int, token: str, *, ban: bool = False) -> None:
        """Stop picking worker `token` (timed out, bad or error reply); ban=True (no responders on its
        direct subject): also ignore its replies for `ttl_s` seconds. Its outstanding count is kept
        until each request is `finished`."""
        known = self._known.get(expert)
        if known is not None:
            known.pop(token, None)
        if ban:
            banned = self._banned.setdefault(expert, OrderedDict())
            banned[token] = self.clock() + self.ttl_s
            banned.move_to_end(token)
            while len(banned) > self.max_workers:
                banned.popitem(last=False)

    # ------------------------------------------------------------ housekeeping
    def _expire(self, expert: int) -> OrderedDict[str, _Known]:
        known = self._known.get(expert)
        if not known:
            return OrderedDict()
        oldest = self.clock() - self.ttl_s
        while known:
            token, entry = next(iter(known.items()))
            if entry.last_seen >= oldest:
                break
            del known[token]
        return known
