"""Keep freed memory in the process instead of handing it back to the kernel (glibc only).

glibc's malloc gives large blocks their own mmap and returns the free top of its heaps to the
kernel once it passes a threshold (128 KiB to 32 MiB, adjusted as the program runs). A torch
forward allocates and frees its activations on every call, so with those defaults each call can
map fresh pages and take a page fault for every 4 KiB of them, then give them back at the end.
For the router's 64-row chunks (a 4 MiB first activation, ~15 MiB in all) that doubled its CPU
time on this project's 2-core VM: 150 us of CPU per row against 63 us with the memory kept, about
70% of the difference in the kernel (docs/CAPACITY.md, "The allocator"). The coordinator's
router thread is its bottleneck at --route-every 1, so every ddm-fleet command calls
:func:`keep_freed_memory` at start-up (`infra/cli.py`).

The settings: blocks up to 32 MiB come from the heap (glibc's own ceiling for its adaptive
threshold), and a heap keeps up to 256 MiB of free memory at its top before trimming. The cost is
resident memory: a process holds on to what its busiest forward needed, up to that much per malloc
arena, instead of giving it back between calls. Set DDM_FLEET_MALLOC_TUNING=0 for glibc's
defaults (or to compare); other C libraries are left alone.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform

log = logging.getLogger(__name__)

ENV = "DDM_FLEET_MALLOC_TUNING"
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 256 << 20

# mallopt parameters, from glibc's malloc.h
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def _libc():
    """glibc's handle, or None on another C library (musl, macOS)."""
    name, _version = platform.libc_ver()
    if name != "glibc":
        return None
    try:  # the symbols already loaded into this process (no `ldconfig` subprocess as find_library runs)
        libc = ctypes.CDLL(None)
        libc.mallopt  # noqa: B018 - the symbol must exist
    except (OSError, AttributeError):
        return None
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.mallopt.restype = ctypes.c_int
    return libc


def keep_freed_memory(mmap_threshold: int = MMAP_THRESHOLD, trim_threshold: int = TRIM_THRESHOLD) -> bool:
    """Raise glibc's mmap and trim thresholds for this process (see the module docstring). Returns
    whether they were set: False where $DDM_FLEET_MALLOC_TUNING is 0 / off / false, where the C
    library is not glibc, or where glibc refused a value."""
    if os.environ.get(ENV, "").strip().lower() in {"0", "off", "false", "no"}:
        log.debug("malloc: %s=%s, glibc's defaults kept", ENV, os.environ[ENV])
        return False
    libc = _libc()
    if libc is None:
        log.debug("malloc: not glibc, nothing to tune")
        return False
    # mallopt returns 1 on success, 0 on error. Setting either threshold turns off glibc's adaptive
    # one, and either alone is worse than the defaults (a low fixed trim threshold, or every block
    # over 128 KiB mmapped), so the one glibc may refuse (mmap: at most 32 MiB) goes first, and the
    # trim threshold (never refused) only after it.
    # Not set: M_ARENA_MAX=1. A thread's own arena grows in heaps of at most 64 MiB, and a heap that
    # becomes entirely free is unmapped whatever the trim threshold says, so a thread whose first
    # heap long-lived blocks have nearly filled still maps and faults a fresh heap for each 4 MiB
    # activation (~1,000 faults each; one coordinator capacity run in about ten showed it, ~23,000
    # faults per 1000 rows). One arena for all threads prevents that, but cost the engine 8% in
    # every run (its loop and router threads then share and bounce the same memory): docs/CAPACITY.md.
    ok = bool(libc.mallopt(_M_MMAP_THRESHOLD, int(mmap_threshold))) and bool(
        libc.mallopt(_M_TRIM_THRESHOLD, int(trim_threshold))
    )
    if ok:
        log.debug("malloc: mmap threshold %d MiB, trim threshold %d MiB", mmap_threshold >> 20, trim_threshold >> 20)
    else:
        log.warning(
            "malloc: glibc refused the thresholds (mmap %d, trim %d); its defaults stay", mmap_threshold, trim_threshold
        )
    return ok
