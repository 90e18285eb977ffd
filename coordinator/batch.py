"""One engine tick's batch: router inputs, per-expert groups, received velocities.

Pure bookkeeping, no I/O. The engine drives it:

    batch.x, batch.t, batch.y                  router inputs for all R rows
    batch.route(router_w [R, K])               choose experts per row by its strategy
    for k, idx in batch.requests().items():    rows (indices into the batch) expert k must evaluate
        batch.record(k, idx, v [len(idx), C, H, W])   ... or batch.mark_failed(k, reason, code)
    (before route(): batch.guess_requests() names likely requests; after it, batch.record_guess
    keeps the rows of their answers that the routing needs)
    (repeat while batch.requests() is not empty: a failed expert reroutes its rows)
    u = batch.combined()                        [R, C, H, W]  u_r = sum_k w[r, k] v_k[r]

The batch's rows are the rows of its `groups` (one RowGroup per job), concatenated in order;
`bounds[g]:bounds[g + 1]` are group g's rows.
"""

from __future__ import annotations

import numpy as np

from schemas import ErrorCode

from . import strategies
from .rows import RowGroup


class Batch:
    """The rows of one tick. x: [R, C, H, W] float32, t: [R] float32, y: [R] int64, guidance: [R] float32
    (each row's job's classifier-free guidance scale, 1 = off; the engine sends it with the rows)."""

    def __init__(self, groups: list[RowGroup], num_experts: int, unavailable: frozenset[int] | set[int] = frozenset()):
        if not groups:
            raise ValueError("a batch needs at least one row group")
        self.groups = groups
        self.num_experts = num_experts
        sizes = np.array([g.n for g in groups], np.int64)
        self.bounds = np.concatenate([[0], np.cumsum(sizes)])
        pts = [g.eval_point() for g in groups]
        self.x = np.concatenate([p[0] for p in pts]).astype(np.float32, copy=False)
        self.t = np.repeat(np.array([p[1] for p in pts], np.float32), sizes)
        self.y = np.concatenate([g.y for g in groups])
        self.row_ids = [rid for g in groups for rid in g.row_ids]
        self.index_in_job = np.arange(int(self.bounds[-1])) - np.repeat(self.bounds[:-1], sizes)  # [R]
        strategies_ = [g.strategy for g in groups]
        self._strategies = sorted(set(strategies_))  # the strategies present
        self.strategy = np.repeat(np.array(strategies_), sizes)  # [R] str
        self.top_k = np.repeat(np.array([g.top_k for g in groups], np.int64), sizes)  # [R]
        self.guidance = np.repeat(np.array([g.guidance for g in groups], np.float32), sizes)  # [R]
        self.owner = np.concatenate([g.oracle_expert for g in groups])  # [R]
        self._draws: np.ndarray | None = None  # [R] routing uniforms, built on first use (`draws`)
        self.available = np.ones(num_experts, bool)
        for k in unavailable:
            if 0 <= k < num_experts:
                self.available[k] = False
        self.failed_reasons: dict[int, str] = {}
        self.failed_codes: dict[int, ErrorCode] = {}  # why each failed expert failed, for the jobs it strands
        self.router_w: np.ndarray | None = None  # [R, K]
        self.weights: np.ndarray | None = None  # [R, K] combination weights
        self.ideal: np.ndarray | None = None  # [R, K] weights with every expert up
        #: some job of the batch asked for `report_dtypes`: the engine notes which workers answered
        self.reports_dtypes = any(g.answered is not None for g in groups)
        self.workers: dict[int, set[str]] = {}  # expert -> ids of the workers that answered it this tick
        self._v = np.zeros((num_experts,) + self.x.shape, np.float32)  # [K, R, C, H, W]
        self._have = np.zeros((len(self.y), num_experts), bool)
        #: groups (indices) the engine updated before the tick's end (on a `subset`: its early update):
        #: the tick's own update and failures leave them alone
        self.released: set[int] = set()
        #: the engine may update complete groups before the tick ends (`Engine._update_answered`; set per tick)
        self.update_early = False
        self.early_pending = False  # an early update is scheduled for the next pass of the event loop

    @property
    def job_ids(self) -> list[str]:
        """[R] the job id of every row (built on use)."""
        return [g.job_id for g in self.groups for _ in range(g.n)]

    def __len__(self) -> int:
        return len(self.y)

    def group_rows(self, g: int) -> slice:
        return slice(int(self.bounds[g]), int(self.bounds[g + 1]))

    def complete_groups(self) -> list[int]:
        """The groups (indices), not yet released, whose every row has all the velocities its routing needs."""
        done = self.row_complete()
        return [
            gi
            for gi in range(len(self.groups))
            if gi not in self.released and done[self.bounds[gi] : self.bounds[gi + 1]].all()
        ]

    def subset(self, gis: list[int]) -> Batch:
        """A batch of the groups `gis` (indices, in order) alone, as routed and answered so far: their rows'
        inputs, weights, velocities, the experts marked failed and the workers that answered. Copies
        (the scheduler's update of it does not touch this batch's rows)."""
        sub = object.__new__(Batch)
        rows = np.concatenate([np.arange(self.bounds[gi], self.bounds[gi + 1]) for gi in gis])
        sub.groups = [self.groups[gi] for gi in gis]
        sub.num_experts = self.num_experts
        sizes = np.array([g.n for g in sub.groups], np.int64)
        sub.bounds = np.concatenate([[0], np.cumsum(sizes)])
        for name in ("x", "t", "y", "index_in_job", "strategy", "top_k", "guidance", "owner", "_have"):
            setattr(sub, name, getattr(self, name)[rows])
        sub.row_ids = [self.row_ids[i] for i in rows]
        sub._strategies = sorted({g.strategy for g in sub.groups})
        sub._draws = None if self._draws is None else self._draws[rows]
        sub.available = self.available.copy()
        sub.failed_reasons = dict(self.failed_reasons)
        sub.failed_codes = dict(self.failed_codes)
        for name in ("router_w", "weights", "ideal"):
            a = getattr(self, name)
            setattr(sub, name, None if a is None else a[rows])
        sub.reports_dtypes = any(g.answered is not None for g in sub.groups)
        sub.workers = {k: set(w) for k, w in self.workers.items()}
        sub._v = np.zeros((self.num_experts, len(rows), *self.x.shape[1:]), np.float32)  # (pages on first write)
        for k in np.nonzero(sub._have.any(axis=0))[0]:  # only the experts that answered these rows
            sub._v[k] = self._v[k, rows]
        sub.released = set()
        sub.update_early = sub.early_pending = False
        return sub

    # ------------------------------------------------------------ routing
    def routing_plan(self, every: int = 1) -> tuple[np.ndarray, np.ndarray]:
        """(fresh [R] bool, w [R, K] float64): the rows whose groups ask the router afresh at this
        evaluation (`RowGroup.needs_routing(every)`), and the weights of the others, reused from the
        group's last routing (fresh rows hold zeros: the router fills them)."""
        if every < 1:
            raise ValueError(f"route every must be >= 1 evaluation, got {every}")
        fresh = np.zeros(len(self), bool)
        w = np.zeros((len(self), self.num_experts), np.float64)
        for gi, g in enumerate(self.groups):
            rows = self.group_rows(gi)
            if g.needs_routing(every):
                fresh[rows] = True
            else:
                w[rows] = g.route_w
        return fresh, w

    def route(self, router_w: np.ndarray, fresh: np.ndarray | None = None) -> Batch:
        """Set router weights [R, K] and choose each row's experts by its strategy. `fresh` [R] bool
        (default: every row) marks the rows whose weights the router just computed: their groups
        remember them for the evaluations that reuse them (see `routing_plan`)."""
        router_w = np.array(router_w, dtype=np.float64)  # the batch's own copy, read-only: its groups
        router_w.setflags(write=False)  # keep slices of it (RowGroup.remember_route)
        if router_w.shape != (len(self), self.num_experts):
            raise ValueError(
                f"router weights must be [R, K] = [{len(self)}, {self.num_experts}], got {list(router_w.shape)}"
            )
        if not np.isfinite(router_w).all():
            raise ValueError("router weights contain NaN/Inf")
        self.router_w = router_w
        for gi, g in enumerate(self.groups):
            rows = self.group_rows(gi)
            if fresh is None or fresh[rows.start]:
                g.remember_route(router_w[rows])
        self.ideal = self._select(np.ones(self.num_experts, bool))
        self.weights = self._select(self.available)
        return self

    def draws(self) -> np.ndarray:
        """[R] float64 uniforms of the drawn strategies (`strategies.DRAWN`): row r's depends only on its
        job's seed and its index in the job (`strategies.draw_uniforms`), never on the batch or the
        evaluation; NaN for rows of other strategies. Built once per batch."""
        if self._draws is None:
            u = np.full(len(self), np.nan)
            for gi, g in enumerate(self.groups):
                if g.strategy in strategies.DRAWN:
                    rows = self.group_rows(gi)
                    u[rows] = strategies.draw_uniforms(g.seed, self.index_in_job[rows])
            self._draws = u
        return self._draws

    def _u(self, strategy: str, idx: np.ndarray) -> np.ndarray | None:
        return self.draws()[idx] if strategy in strategies.DRAWN else None

    def _select(
        self, available: np.ndarray, rows: np.ndarray | None = None, router_w: np.ndarray | None = None
    ) -> np.ndarray:
        """Combination weights [len(rows), K] of `rows` (default: all) by their strategies, from
        `router_w` ([len(rows), K]; default: the batch's routed weights of those rows)."""
        idx = np.arange(len(self)) if rows is None else rows
        if router_w is None:
            assert self.router_w is not None
            router_w = self.router_w[idx]
        out = np.zeros((len(idx), self.num_experts), np.float64)
        if len(self._strategies) == 1:  # the usual case: no per-strategy masks to build
            s = self._strategies[0]
            out[:] = strategies.select(
                s, router_w, available, top_k=self.top_k[idx], owner=self.owner[idx], u=self._u(s, idx)
            )
            return out
        strat = self.strategy[idx]
        for s in np.unique(strat):
            sel = np.nonzero(strat == s)[0]
            rows_s = idx[sel]
            out[sel] = strategies.select(
                str(s),
                router_w[sel],
                available,
                top_k=self.top_k[rows_s],
                owner=self.owner[rows_s],
                u=self._u(str(s), rows_s),
            )
        return out

    def guess_requests(self) -> dict[int, np.ndarray]:
        """{expert: row indices} the rows will most likely need before the router has weighed them:
        what each row's strategy picks, among the experts available now, from the router weights its
        job was last routed with (`RowGroup.route_w`; exact for rows that reuse them, see
        `routing_plan`). Rows never routed yet are left out. The engine sends these requests while
        the router runs (speculation); `record_guess` then keeps what the routing really needs."""
        spans = [(self.group_rows(gi), g.route_w) for gi, g in enumerate(self.groups) if g.route_w is not None]
        if not spans or not self.available.any():
            return {}
        idx = np.concatenate([np.arange(s.start, s.stop) for s, _ in spans])
        w = self._select(self.available, idx, np.concatenate([rw for _, rw in spans]))
        return {k: idx[w[:, k] > 0] for k in range(self.num_experts) if (w[:, k] > 0).any()}

    def requests(self) -> dict[int, np.ndarray]:
        """{expert: row indices [n] (into this batch)} still needing that expert's velocity."""
        if self.weights is None:
            raise RuntimeError("call route() before requests()")
        need = (self.weights > 0) & ~self._have & self.available[None, :]
        return {k: np.nonzero(need[:, k])[0] for k in range(self.num_experts) if need[:, k].any()}

    def note_workers(self, expert: int, workers) -> None:
        """The workers (ids) whose replies gave expert's velocities this tick."""
        self.workers.setdefault(expert, set()).update(w for w in workers if w)

    def record(self, expert: int, idx: np.ndarray, v: np.ndarray) -> None:
        """Store expert's velocity v [len(idx), C, H, W] for batch rows idx."""
        idx = np.asarray(idx, dtype=np.int64)
        v = np.asarray(v)
        if v.shape != (len(idx),) + self.x.shape[1:]:
            raise ValueError(
                f"expert {expert} velocity has shape {list(v.shape)}, expected {[len(idx), *self.x.shape[1:]]}"
            )
        self._v[expert, idx] = v
        self._have[idx, expert] = True

    def record_guess(self, expert: int, idx: np.ndarray, v: np.ndarray) -> int:
        """Keep, from a speculative call to `expert` for rows idx (velocities v [len(idx), C, H, W]),
        the rows whose routing needs that expert and has no velocity from it yet; returns how many."""
        if self.weights is None:
            raise RuntimeError("call route() before record_guess()")
        idx = np.asarray(idx, dtype=np.int64)
        v = np.asarray(v)
        if v.shape != (len(idx),) + self.x.shape[1:]:
            raise ValueError(
                f"expert {expert} velocity has shape {list(v.shape)}, expected {[len(idx), *self.x.shape[1:]]}"
            )
        keep = (self.weights[idx, expert] > 0) & ~self._have[idx, expert]
        if keep.all():
            self.record(expert, idx, v)
        elif keep.any():
            self.record(expert, idx[keep], v[keep])
        return int(keep.sum())

    def mark_failed(self, expert: int, reason: str = "unavailable", code: ErrorCode = ErrorCode.UNAVAILABLE) -> None:
        """Expert could not serve this tick: reroute the rows that still need it. `code` is how the
        jobs left without any expert fail (`bad_reply` when the expert answered only garbage)."""
        self.available[expert] = False
        self.failed_reasons[expert] = reason
        self.failed_codes[expert] = ErrorCode(code)
        assert self.weights is not None
        waiting = np.nonzero((self.weights[:, expert] > 0) & ~self._have[:, expert])[0]
        if len(waiting):
            self.weights[waiting] = self._select(self.available, waiting)

    # ------------------------------------------------------------ results
    def row_complete(self) -> np.ndarray:
        """[R] bool: the row has every velocity its weights need (and at least one expert)."""
        assert self.weights is not None
        needed = self.weights > 0
        return needed.any(axis=1) & ~(needed & ~self._have).any(axis=1)

    def combined(self) -> np.ndarray:
        """u [R, C, H, W] float32 = sum_k w[r, k] v_k[r]; rows not complete are zero."""
        assert self.weights is not None
        w = np.where(self.row_complete()[:, None], self.weights, 0.0).astype(np.float32)  # [R, K]
        u = np.zeros(self.x.shape, np.float32)
        tmp = np.empty_like(u)
        for k in range(self.num_experts):  # dense per expert: row r's sum never depends on other rows
            if w[:, k].any():
                np.multiply(self._v[k], w[:, k, None, None, None], out=tmp)
                u += tmp
        return u

    def experts_used(self) -> np.ndarray:
        """[R] the single expert each row used, or -1 when several contributed."""
        assert self.weights is not None
        nz = self.weights > 0
        return np.where(nz.sum(axis=1) == 1, np.argmax(nz, axis=1), -1)

    def fallback_notes(self) -> dict[int, str]:
        """{batch row: note} for rows whose experts differ from the all-experts-up choice."""
        assert self.weights is not None and self.ideal is not None
        notes: dict[int, str] = {}
        for i in np.nonzero(((self.weights > 0) != (self.ideal > 0)).any(axis=1))[0]:
            want = [int(k) for k in np.nonzero(self.ideal[i] > 0)[0]]
            got = [int(k) for k in np.nonzero(self.weights[i] > 0)[0]]
            lost = [k for k in want if k not in got]
            why = ", ".join(f"expert {k} {self.failed_reasons.get(k, 'unavailable')}" for k in lost)
            row = int(self.index_in_job[i])
            if got:
                notes[int(i)] = f"row {row}: {why}, fell back to {' + '.join(map(str, got))}"
            else:
                notes[int(i)] = f"row {row}: {why}, no expert left"
        return notes
