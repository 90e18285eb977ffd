"""Dynamic batching for one model: coalesce, pad to a bucket, run once off the loop, split.

Requests that arrive while the model is busy wait in a queue. When the model frees up, the
batcher takes as many queued requests as fit in `max_batch` rows, concatenates them, pads the
batch up to the smallest bucket size that holds it (XLA / jax compile once per shape), runs ONE
forward pass in an executor thread (so the asyncio loop keeps answering pings and taking
requests), and hands every request its own slice of the output.

A request larger than `max_batch` rows is split into chunks at submission; its future resolves
once every chunk has run. Requests whose deadline has passed when their batch is formed are
failed with `DeadlineExceeded` and never computed.

    batcher = Batcher(model_fn, buckets=(1, 2, 4, 8), max_batch=8)
    await batcher.start()
    result = await batcher.submit(x, t, y, deadline=None)   # x [B, C, H, W] -> result.velocity
    await batcher.close()                                   # finishes everything queued

`model_fn(x float32 [N, C, H, W], t float32 [N], y int64 [N]) -> float32 [N, C, H, W]` is a
plain blocking function; N is always one of the bucket sizes.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import numpy as np

log = logging.getLogger(__name__)

DEFAULT_BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128)

ModelFn = Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]


class DeadlineExceeded(Exception):
    """The request's deadline passed before its batch ran; it was not computed."""


class BatcherClosed(Exception):
    """The batcher no longer takes work (shutting down)."""


class ModelError(Exception):
    """The model call failed; the original exception is the __cause__."""


def parse_buckets(text: str | Sequence[int]) -> tuple[int, ...]:
    """"1,2,4,8" or [1, 2, 4, 8] -> sorted unique positive ints; ValueError with a hint otherwise."""
    if isinstance(text, str):
        try:
            values = [int(p) for p in text.split(",") if p.strip()]
        except ValueError:
            raise ValueError(f"buckets must be comma-separated positive integers like 1,2,4,8, got {text!r}") from None
    else:
        values = [int(v) for v in text]
    if not values:
        raise ValueError("buckets must list at least one batch size, e.g. 1,2,4,8")
    if any(v <= 0 for v in values):
        raise ValueError(f"bucket sizes must be positive, got {values}")
    return tuple(sorted(set(values)))


def plan_buckets(buckets: Sequence[int], max_batch: Optional[int]) -> tuple[tuple[int, ...], int]:
    """Buckets actually used for a `max_batch` row limit, and that limit.

    Buckets above the smallest one that holds `max_batch` are never used and are dropped, so
    they are not compiled. `max_batch` larger than the largest bucket is an error.
    """
    buckets = parse_buckets(buckets)
    if max_batch is None:
        return buckets, buckets[-1]
    if max_batch <= 0:
        raise ValueError(f"max_batch must be positive, got {max_batch}")
    if max_batch > buckets[-1]:
        raise ValueError(
            f"max_batch {max_batch} is larger than the largest bucket {buckets[-1]}: add a bucket >= {max_batch} "
            f"or lower max_batch"
        )
    cap = min(b for b in buckets if b >= max_batch)
    return tuple(b for b in buckets if b <= cap), max_batch


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
    parent: "_Request"
    index: int

    @property
    def rows(self) -> int:
        return self.x.shape[0]


@dataclass
class _Request:
    future: asyncio.Future
    deadline: Optional[float]
    n_chunks: int
    enqueued: float
    outputs: list = field(default_factory=list)
    infos: list = field(default_factory=list)
    done: int = 0

    def expired(self, now: float) -> bool:
        return self.deadline is not None and now > self.deadline


class Batcher:
    """Coalesce concurrent requests into bucket-sized forward passes (see module docstring).

    observer(rows, bucket, compute_s) is called after every pass (for metrics).
    """

    def __init__(
        self,
        model_fn: ModelFn,
        buckets: Sequence[int] = DEFAULT_BUCKETS,
        max_batch: Optional[int] = None,
        *,
        executor: Optional[concurrent.futures.Executor] = None,
        observer: Optional[Callable[[int, int, float], None]] = None,
        clock: Callable[[], float] = time.time,
    ):
        self.buckets, self.max_batch = plan_buckets(buckets, max_batch)
        self._model_fn = model_fn
        self._executor = executor
        self._own_executor = executor is None
        self._observer = observer
        self._clock = clock
        self._queue: collections.deque[_Chunk] = collections.deque()
        self._queued_rows = 0
        self._wakeup: Optional[asyncio.Event] = None
        self._task: Optional[asyncio.Task] = None
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

    def submit(self, x: np.ndarray, t: np.ndarray, y: np.ndarray, deadline: Optional[float] = None) -> asyncio.Future:
        """Queue x [B, C, H, W] float32, t [B] float32, y [B] int64; returns a future of `Result`.

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
        req = _Request(future=fut, deadline=deadline, n_chunks=len(starts), enqueued=time.perf_counter())
        req.outputs = [None] * len(starts)
        for i, s in enumerate(starts):
            e = s + self.max_batch
            self._queue.append(_Chunk(x[s:e], t[s:e], y[s:e], req, i))
        self._queued_rows += b
        self._wakeup.set()
        return fut

    # ------------------------------------------------------------------ loop

    def _take_batch(self) -> list[_Chunk]:
        """Pop queued chunks that fit in max_batch rows, in arrival order; fail expired ones."""
        now = self._clock()
        batch: list[_Chunk] = []
        rows = 0
        while self._queue:
            chunk = self._queue[0]
            req = chunk.parent
            if req.future.done():  # failed earlier (another chunk expired) or cancelled
                self._queued_rows -= self._queue.popleft().rows
                continue
            if req.expired(now):
                self._queued_rows -= self._queue.popleft().rows
                req.future.set_exception(DeadlineExceeded("deadline passed before the request was computed"))
                continue
            if rows + chunk.rows > self.max_batch:
                break
            batch.append(self._queue.popleft())
            self._queued_rows -= chunk.rows
            rows += chunk.rows
        return batch

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
            bucket = bucket_for(rows, self.buckets)
            x = pad_rows(np.concatenate([c.x for c in batch]) if len(batch) > 1 else batch[0].x, bucket)
            t = pad_rows(np.concatenate([c.t for c in batch]) if len(batch) > 1 else batch[0].t, bucket)
            y = pad_rows(np.concatenate([c.y for c in batch]) if len(batch) > 1 else batch[0].y, bucket)
            started = time.perf_counter()
            self.busy = True
            try:
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
            if self._observer is not None:
                try:
                    self._observer(rows, bucket, compute_s)
                except Exception:  # metrics must never break serving
                    log.exception("batch observer failed")
            offset = 0
            for c in batch:
                self._deliver(c, out[offset : offset + c.rows], BatchInfo(rows, bucket, compute_s, started - c.parent.enqueued))
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
