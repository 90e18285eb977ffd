"""Wait for a condition instead of sleeping a fixed time: tests order events by what happened,
not by how long it usually takes.

    await wait_until(lambda: job_id in coordinator.cancelled)           # asyncio tests
    wait_until_sync(lambda: proc.poll() is not None, timeout=30)        # plain tests

Both poll ``pred`` every ``interval`` seconds and raise AssertionError (naming ``what``, or the
predicate) once ``timeout`` seconds pass without it holding. ``pred`` may be a coroutine function
for `wait_until`. They return the first truthy value ``pred`` gave.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable
from typing import Any


def _describe(pred: Callable[[], Any], what: str | None) -> str:
    return what or getattr(pred, "__qualname__", repr(pred))


async def wait_until(
    pred: Callable[[], Any], timeout: float = 10.0, interval: float = 0.02, what: str | None = None
) -> Any:
    """Poll ``pred()`` (awaited if it returns an awaitable) until truthy; AssertionError after ``timeout`` s."""
    if timeout <= 0 or interval <= 0:
        raise ValueError(f"wait_until: timeout and interval must be positive, got {timeout}, {interval}")
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {_describe(pred, what)}")
        await asyncio.sleep(interval)


def wait_until_sync(
    pred: Callable[[], Any], timeout: float = 10.0, interval: float = 0.02, what: str | None = None
) -> Any:
    """Blocking `wait_until` for tests without an event loop."""
    if timeout <= 0 or interval <= 0:
        raise ValueError(f"wait_until_sync: timeout and interval must be positive, got {timeout}, {interval}")
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {_describe(pred, what)}")
        time.sleep(interval)
