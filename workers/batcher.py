"""Dynamic batching for one model: coalesce, pad to a bucket, run once off the loop, split.

Requests that arrive while the model is busy wait in a queue. When the model frees up, the
batcher takes the oldest queued request and adds the others that fit in `max_batch` rows (first
fit: a later small request may ride along where an earlier large one does not fit; the large one
then leads the next pass), concatenates them, pads the batch up to the smallest bucket size that
holds it (XLA / jax compile once per shape), runs ONE forward pass in an executor thread (so the
asyncio loop keeps answering pings and taking requests), and hands every request its own slice of
the output. A small pass (at most INLINE_ROWS rows, its forward estimated under `inline_max_s`) with nothing
queued behind it runs on the loop itself: one client's steps, where the two thread hand-offs cost more than the
loop waits.

Merging only where it pays (`merge="auto"`, the default): a request joins the pass being formed
if that pass stays in its bucket, or if the bigger bucket costs at least MERGE_MARGIN less than
the two passes apart would, by the batcher's running estimate of each bucket's forward time
(seeded with the backend's warm-up timings, `forward_s`, and updated after every pass). On a GPU
or an XLA device a forward's cost is mostly fixed, so queued requests merge as before; on a CPU
the cost grows with the rows, merging saves nothing, and running the requests one after another
lets the first one's answer go back while the next runs (the coordinator's cohorts then stay out
of step instead of being locked together by one shared forward). A bucket with no estimate yet
merges. `merge="always"` fills every pass up to `max_batch`.

A request larger than `max_batch` rows is split into chunks at submission; its future resolves
once every chunk has run. Requests whose deadline has passed when their batch is formed are
failed with `DeadlineExceeded` and never computed.

    batcher = Batcher(model_fn, buckets=(1, 2, 4, 8), max_batch=8)
    await batcher.start()
    result = await batcher.submit(x, t, y, deadline=None)   # x [B, C, H, W] -> result.velocity
    await batcher.close()                                   # finishes everything queued

`model_fn(x float32 [N, C, H, W], t float32 [N], y int64 [N]) -> float32 [N, C, H, W]` is a
plain blocking function; N is always one of the bucket sizes, unless the batcher was made with
`pad=False` (a runtime with no fixed shapes, like eager torch on a CPU, where padding would only
compute zeros): then N is the rows themselves, at most `max_batch`, and the buckets only key the
forward-time estimates.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from .config import DEFAULT_BUCKETS, MERGE_MODES, parse_buckets, plan_buckets  # noqa: F401 (re-exported)

log = logging.getLogger(__name__)


#: merge="auto": a pass grows into a bigger bucket only if that costs at least this fraction less
#: than the two passes apart (noise in the timings must not flip the decision back and forth).
MERGE_MARGIN = 0.1
#: Weight of the newest pass in a bucket's running forward-time estimate.
COST_EWMA = 0.2
#: A pass of at most INLINE_ROWS rows whose bucket's forward is estimated under INLINE_MAX_S seconds (the default
#: of `Batcher(inline_max_s=)`, `--inline-forward-ms`) runs on the event loop when nothing is queued behind it
#: (`Batcher._inline`), not in the model thread.
INLINE_ROWS = 4
INLINE_MAX_S = 0.02

ModelFn = Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]


class DeadlineExceeded(Exception):
    """The request's deadline passed before its batch ran; it was not computed."""


class BatcherClosed(Exception):
    """The batcher no longer takes work (shutting down)."""


class ModelError(Exception):
    """The model call failed; the original exception is the __cause__."""


def bucket_for(rows: int, buckets: Sequence[int]) -> int:
    """Smallest bucket >= rows (buckets sorted ascending)."""
    for b in buckets:
        if b >= rows:
            return b
    raise ValueError(f"{rows} rows do not fit the largest bucket {buckets[-1]}")


def pad_rows(a: np.ndarray, n: int) -> np.ndarray:
    """Pad axis 0 of `a` with zeros up to n rows (returns `a` itself when already n rows)."""
    if a.shape[0] == n:
        return a
    out = np.zeros((n,) + a.shape[1:], dtype=a.dtype)
    out[: a.shape[0]] = a
    return out


@dataclass
class BatchInfo:
    """What the forward pass a request rode in looked like."""

    rows: int  # real rows in the pass
    bucket: int  # padded size actually computed
    compute_s: float  # wall time of the model call
    queue_s: float = 0.0  # time this request waited before its (first) pass started


@dataclass
class Result:
    """A request's answer: velocity [B, C, H, W] float32 plus the pass it rode in (the largest,
    if it was split into chunks)."""

    velocity: np.ndarray
    info: BatchInfo


@dataclass
class _Chunk:
    x: np.ndarray
    t: np.ndarray
    y: np.ndarray
    parent: _Request
    index: int

    @property
    def rows(self) -> int:
        return self.x.shape[0]


@dataclass
class _Request:
    future: asyncio.Future
    deadline: float | None
    n_chunks: int
    enqueued: float
    outputs: list = field(default_factory=list)
    infos: list = field(default_factory=list)
    done: int = 0
    solo: bool = False  # computed in a pass of its own, never merged with other requests

    def expired(self, now: float) -> bool:
        return self.deadline is not None and now > self.deadline


class Batcher:
    """Coalesce concurrent requests into bucket-sized forward passes (see module docstring).

    observer(rows, bucket, compute_s) is called after every pass (for metrics). forward_s:
    {bucket: seconds} of a warm forward (the backend's `warmup_s`), the start of the cost
    estimates `merge="auto"` decides with. quantum: an unpadded backend computes rows in multiples of
    this (a batch-invariant one, `BackendBase.make_batch_invariant`): the costs and the observer's
    `bucket` count the rows it computes. inline_max_s: a small pass with nothing queued behind it whose
    bucket's estimate is at most this runs on the event loop (`_inline`); 0: every pass in the executor.
    """

    def __init__(
        self,
        model_fn: ModelFn,
        buckets: Sequence[int] = DEFAULT_BUCKETS,
        max_batch: int | None = None,
        *,
        executor: concurrent.futures.Executor | None = None,
        observer: Callable[[int, int, float], None] | None = None,
        clock: Callable[[], float] = time.time,
        forward_s: Mapping[int, float] | None = None,
        merge: str = "auto",
        pad: bool = True,
        quantum: int = 1,
        inline_max_s: float = INLINE_MAX_S,
    ):
        self.buckets, self.max_batch = plan_buckets(buckets, max_batch)
        self.quantum = max(1, int(quantum))
        if merge not in MERGE_MODES:
            raise ValueError(f"merge must be one of {', '.join(MERGE_MODES)}, got {merge!r}")
        self.merge = merge
        self.pad = bool(pad)  # False: forward exactly the rows (see the module docstring)
        #: bucket -> running estimate of one warm forward's seconds (see the module docstring)
        self.cost_s: dict[int, float] = {
            int(b): float(s) for b, s in (forward_s or {}).items() if int(b) in self.buckets and float(s) > 0
        }
        self.inline_max_s = float(inline_max_s)  # small quick passes run on the loop (`_inline`); 0: never
        self.merges_declined = 0  # times a queued chunk was kept for a later pass because merging would not pay
        self._model_fn = model_fn
        self._executor = executor
        self._own_executor = executor is None
        self._observer = observer
        self._clock = clock
        self._queue: collections.deque[_Chunk] = collections.deque()
        self._queued_rows = 0
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._closing = False
        self.busy = False

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        if self._task is not None:
            return
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")
        self._wakeup = asyncio.Event()
        self._task = asyncio.create_task(self._loop(), name="batcher")

    async def close(self) -> None:
        """Stop taking work, finish every queued request, stop the loop."""
        self._closing = True
        if self._task is None:
            return
        self._wakeup.set()
        try:
            await self._task
        finally:
            self._task = None
            if self._own_executor and self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None

    @property
    def queued_rows(self) -> int:
        """Rows waiting for a forward pass (not counting the pass running now)."""
        return self._queued_rows

    # ------------------------------------------------------------------ submit

    def submit(
        self, x: np.ndarray, t: np.ndarray, y: np.ndarray, deadline: float | None = None, solo: bool = False
    ) -> asyncio.Future:
        """Queue x [B, C, H, W] float32, t [B] float32, y [B] int64; returns a future of `Result`.
        `solo`: never merge it with other requests (a step run ahead: whether the coordinator uses it
        depends on timing, so it must not change what a request beside it computes).

        Raises BatcherClosed when shutting down. The future fails with DeadlineExceeded or
        ModelError.
        """
        if self._closing or self._task is None:
            raise BatcherClosed("the worker is shutting down and takes no new work")
        b = x.shape[0]
        if b == 0 or t.shape != (b,) or y.shape != (b,):
            raise ValueError(f"submit needs x [B, ...], t [B], y [B] with B > 0; got {x.shape}, {t.shape}, {y.shape}")
        fut = asyncio.get_running_loop().create_future()
        starts = list(range(0, b, self.max_batch))
        req = _Request(future=fut, deadline=deadline, n_chunks=len(starts), enqueued=time.perf_counter(), solo=solo)
        req.outputs = [None] * len(starts)
        for i, s in enumerate(starts):
            e = s + self.max_batch
            self._queue.append(_Chunk(x[s:e], t[s:e], y[s:e], req, i))
        self._queued_rows += b
        self._wakeup.set()
        return fut

    # ------------------------------------------------------------------ loop

    def _take_batch(self) -> list[_Chunk]:
        """Pop the oldest live chunk and the queued chunks that fit with it in max_batch rows and
        are worth merging (see the module docstring); fail expired ones, drop cancelled ones."""
        now = self._clock()
        batch: list[_Chunk] = []
        kept: collections.deque[_Chunk] = collections.deque()
        rows = 0
        while self._queue:
            chunk = self._queue.popleft()
            req = chunk.parent
            if req.future.done():  # failed earlier (another chunk expired) or cancelled
                self._queued_rows -= chunk.rows
                continue
            if req.expired(now):
                self._queued_rows -= chunk.rows
                req.future.set_exception(DeadlineExceeded("deadline passed before the request was computed"))
                continue
            if batch and (req.solo or batch[0].parent.solo or rows + chunk.rows > self.max_batch):
                kept.append(chunk)
                continue
            if batch and not self._merge_pays(rows, chunk.rows):
                self.merges_declined += 1
                kept.append(chunk)
                continue
            batch.append(chunk)
            self._queued_rows -= chunk.rows
            rows += chunk.rows
        self._queue = kept
        return batch

    def _merge_pays(self, rows: int, more: int) -> bool:
        """Is one pass of rows + more rows cheaper than a pass of `rows` and one of `more`?"""
        if self.merge == "always":
            return True
        now, alone, both = (bucket_for(n, self.buckets) for n in (rows, more, rows + more))
        if both == now and self.pad:
            return True  # the padding is computed anyway
        cost = self.cost_s
        if now not in cost or alone not in cost or both not in cost:
            return True  # no estimate yet: merge, as a fixed-cost device wants
        if self.pad:
            return cost[both] <= (1.0 - MERGE_MARGIN) * (cost[now] + cost[alone])
        # unpadded: n rows cost about their share of their bucket's estimate
        share = lambda n, b: cost[b] * self._computed(n) / b  # noqa: E731
        return share(rows + more, both) <= (1.0 - MERGE_MARGIN) * (share(rows, now) + share(more, alone))

    def _observe_cost(self, rows: int, compute_s: float) -> None:
        """Fold one pass's time into its bucket's estimate (an unpadded pass scaled up to the bucket)."""
        bucket = bucket_for(rows, self.buckets)
        if not self.pad:
            compute_s *= bucket / self._computed(rows)
        old = self.cost_s.get(bucket)
        self.cost_s[bucket] = compute_s if old is None else (1.0 - COST_EWMA) * old + COST_EWMA * compute_s

    def _computed(self, rows: int) -> int:
        """Rows an unpadded backend computes for `rows` (up to a multiple of the quantum)."""
        return -(-rows // self.quantum) * self.quantum

    def _inline(self, rows: int, bucket: int) -> bool:
        """Run this pass on the event loop instead of the model thread? Only a small pass (at most
        INLINE_ROWS rows, its bucket's forward estimated under `inline_max_s`) with nothing queued behind it:
        handing it to the thread and back costs more than the loop is blocked, and no request waits to be
        decoded meanwhile (one client's steps, or a request running ahead)."""
        if self.inline_max_s <= 0 or rows > INLINE_ROWS or self._queue:
            return False
        return self.cost_s.get(bucket_for(rows, self.buckets), math.inf) <= self.inline_max_s

    def _run_model(self, x: np.ndarray, t: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, float]:
        start = time.perf_counter()
        out = np.asarray(self._model_fn(x, t, y))
        return out, time.perf_counter() - start

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self._queue:
                if self._closing:
                    return
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            batch = self._take_batch()
            if not batch:
                continue
            rows = sum(c.rows for c in batch)
            bucket = bucket_for(rows, self.buckets) if self.pad else rows
            x = pad_rows(np.concatenate([c.x for c in batch]) if len(batch) > 1 else batch[0].x, bucket)
            t = pad_rows(np.concatenate([c.t for c in batch]) if len(batch) > 1 else batch[0].t, bucket)
            y = pad_rows(np.concatenate([c.y for c in batch]) if len(batch) > 1 else batch[0].y, bucket)
            started = time.perf_counter()
            self.busy = True
            try:
                if self._inline(rows, bucket):
                    for _ in range(2):  # the last pass's replies go out first (published, then flushed)
                        await asyncio.sleep(0)
                    out, compute_s = self._run_model(x, t, y)
                else:
                    out, compute_s = await loop.run_in_executor(self._executor, self._run_model, x, t, y)
                if out.shape[0] != bucket:
                    raise ValueError(f"model returned {out.shape[0]} rows for a batch of {bucket}")
            except Exception as err:  # the model failed: fail this batch, keep serving
                log.exception("model call failed on a batch of %d rows (bucket %d)", rows, bucket)
                for c in batch:
                    if not c.parent.future.done():
                        failure = ModelError(f"{type(err).__name__}: {err}")
                        failure.__cause__ = err
                        c.parent.future.set_exception(failure)
                continue
            finally:
                self.busy = False
            self._observe_cost(rows if not self.pad else bucket, compute_s)
            if self._observer is not None:
                try:
                    self._observer(rows, bucket if self.pad else self._computed(rows), compute_s)
                except Exception:  # metrics must never break serving
                    log.exception("batch observer failed")
            offset = 0
            for c in batch:
                self._deliver(
                    c, out[offset : offset + c.rows], BatchInfo(rows, bucket, compute_s, started - c.parent.enqueued)
                )
                offset += c.rows

    @staticmethod
    def _deliver(chunk: _Chunk, velocity: np.ndarray, info: BatchInfo) -> None:
        req = chunk.parent
        if req.future.done():
            return
        req.outputs[chunk.index] = velocity
        req.infos.append(info)
        req.done += 1
        if req.done == req.n_chunks:
            v = req.outputs[0] if req.n_chunks == 1 else np.concatenate(req.outputs)
            best = max(req.infos, key=lambda i: i.bucket)
            req.future.set_result(Result(np.ascontiguousarray(v, dtype=np.float32), best))
