"""Say what a process waits on when it has not exited some seconds after it was asked to stop.

A service asked to stop (SIGTERM) that hangs on the way out gets SIGKILLed by its supervisor, and its
log then ends at "signal received" with nothing on why. `watch_exit(after_s)`, called from the event
loop's thread once the stop began, starts a daemon timer: if the process is still alive after `after_s`
seconds it writes every thread's stack, then where each asyncio task of that loop waits, to stderr
(the service's log). A process that exits in time never prints anything.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import traceback

#: Seconds after the stop began before the stacks are written: a clean stop takes a few seconds, and
#: supervisors kill sooner or later after SIGTERM (`ddm-fleet up` after 20 s, systemd after 90 s).
EXIT_WATCH_S = 15.0

#: Frames shown per thread and per task (the innermost ones).
STACK_LIMIT = 12


def watch_exit(after_s: float = EXIT_WATCH_S, what: str = "process", *, file=None) -> threading.Timer:
    """Start the timer (a daemon thread; `cancel()` it when the exit completed)."""
    loop = asyncio.get_running_loop()
    timer = threading.Timer(after_s, _report, args=(loop, after_s, what, file))
    timer.daemon = True
    timer.name = "exit-watch"
    timer.start()
    return timer


def await_chain(task: asyncio.Task) -> list[str]:
    """Where `task` waits: its coroutine's frame, the frame of what that awaits, and so on down to the
    innermost one, then the future it waits on ("file:line in function" per frame)."""
    out, obj, depth = [], task.get_coro(), 0
    while obj is not None and depth < STACK_LIMIT:
        frame = getattr(obj, "cr_frame", None) or getattr(obj, "gi_frame", None)
        if frame is None:
            break
        out.append(f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}")
        obj = getattr(obj, "cr_await", None) or getattr(obj, "gi_yieldfrom", None)
        depth += 1
    waiter = getattr(task, "_fut_waiter", None)  # the future the task is blocked on (CPython's tasks)
    if waiter is not None:
        out.append(f"waiting on {waiter!r}"[:300])
    return out


def _report(loop: asyncio.AbstractEventLoop, after_s: float, what: str, file) -> None:
    """Threads first, then the tasks (a supervisor shows the tail of the log: the tasks say most)."""
    out = file if file is not None else sys.stderr
    lines = [f"{what} still exiting {after_s:g} s after it was asked to stop; its threads:"]
    names = {t.ident: t.name for t in threading.enumerate()}
    for ident, frame in sys._current_frames().items():
        if ident == threading.get_ident():
            continue  # this timer
        lines.append(f"  thread {names.get(ident, ident)}:")
        stack = traceback.extract_stack(frame)[-STACK_LIMIT:]
        lines.extend(f"    {f.filename}:{f.lineno} in {f.name}" for f in stack)
    try:
        tasks = sorted(asyncio.all_tasks(loop), key=lambda t: t.get_name())
    except RuntimeError:  # the loop's task set changed under us too often: the threads alone
        tasks = []
    lines.append(f"  {len(tasks)} asyncio task(s):")
    for task in tasks:
        lines.append(f"  task {task.get_name()}:")
        try:
            lines.extend("    " + s for s in await_chain(task))
        except Exception as err:  # read from another thread: the task may move on meanwhile
            lines.append(f"    (unavailable: {err!r})")
    print("\n".join(lines), file=out, flush=True)
