"""bus.exit_watch: a process still exiting after the limit says where each asyncio task waits."""

from __future__ import annotations

import asyncio
import io

from bus.exit_watch import watch_exit


async def _stuck_on(event: asyncio.Event) -> None:
    await event.wait()


async def test_reports_each_task_and_where_it_waits():
    event = asyncio.Event()
    task = asyncio.create_task(_stuck_on(event), name="the-stuck-one")
    out = io.StringIO()
    timer = watch_exit(0.05, "test service", file=out)
    try:
        for _ in range(100):
            await asyncio.sleep(0.02)
            if out.getvalue():
                break
        text = out.getvalue()
        assert "test service still exiting 0.05 s after it was asked to stop; its threads:" in text
        assert "thread MainThread:" in text and "exit-watch" not in text  # the loop's thread, not the timer
        assert "task the-stuck-one:" in text
        block = text.split("task the-stuck-one:")[1]
        assert "in _stuck_on" in block and "in wait" in block  # down through Event.wait to its future
        assert "waiting on <Future pending" in block
    finally:
        timer.cancel()
        event.set()
        await task


async def test_silent_when_cancelled_in_time():
    out = io.StringIO()
    timer = watch_exit(0.05, file=out)
    timer.cancel()
    await asyncio.sleep(0.15)
    assert out.getvalue() == ""
