"""A cancel that reached a task disguised as another error.

nats-py turns a cancelled wait on a connection it has closed into `ConnectionClosedError` (and 3.11's
`asyncio.wait_for` can drop a cancel that races its timeout). A loop that catches `Exception` to
survive bus trouble then goes round again, and whoever cancelled it and awaits it waits forever.
Such loops call `raise_if_cancelled()` in their `except Exception` branch:

    while True:
        raise_if_cancelled()
        try:
            await renew()
        except Exception:
            raise_if_cancelled()   # asked to stop: stop, whatever the error looked like
            log.exception("renewal failed")

and, since a cancel 3.11's `wait_for` dropped leaves no error at all (the call just returns), at the
head of each round too: `Task.cancelling()` still counts the request.
"""

from __future__ import annotations

import asyncio


async def cancel_and_wait(tasks, timeout: float) -> list[asyncio.Task]:
    """Cancel `tasks` and wait at most `timeout` s for them to end (a task that outlives its cancel must
    not hold up whoever stops it); returns those still running."""
    tasks = [t for t in tasks if not t.done()]
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.wait(tasks, timeout=timeout)
    return [t for t in tasks if not t.done()]


def raise_if_cancelled() -> None:
    """Raise CancelledError if the current task has been asked to stop (`Task.cancelling()`)."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError()
