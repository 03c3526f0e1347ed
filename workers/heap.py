"""The C heap of a long-running worker process (glibc malloc).

A trainer rank's resident memory grew from 580 MB to 1,209 MB over 100 quickstart iterations,
and kept growing, with no Python or tensor object left alive: glibc gives each thread that
allocates under contention an arena of its own (up to 8 per core), torch's intra-op, autograd
and RPC threads each filled one with the step's freed activations, and freed chunks in the
middle of an arena's heap are not returned to the kernel. Two arenas and a trim after each
step held it at 417 -> 451 MB over the same run (baseline 510 -> 1,076 MB); the step's speed
did not change.

* ``limit_arenas(n)``: at most ``n`` malloc arenas from now on (``mallopt(M_ARENA_MAX)``, the
  call behind ``MALLOC_ARENA_MAX``, which glibc reads only at process start). Call it before
  threads start allocating: arenas already made stay. An arena count the environment sets
  (``MALLOC_ARENA_MAX``, ``GLIBC_TUNABLES=glibc.malloc.arena_max=N``) is left as it is.
* ``trim()``: give free heap memory back to the kernel (``malloc_trim(0)``); returns whether
  any was.
* ``rss_mb()``: this process's resident memory in MB (Linux ``/proc``; 0.0 elsewhere), what
  the controller logs as ``train/rss_mb_max`` (the largest over the trainer ranks).

``limit_arenas`` and ``trim`` are no-ops (returning False) where the C library is not glibc (macOS, musl).
"""
from __future__ import annotations

import ctypes
import functools
import os

M_ARENA_MAX = -8  # glibc's malloc.h
DEFAULT_ARENAS = 2


@functools.cache
def _glibc():  # (trim() runs after every trainer step: the library is looked up once)
    try:
        libc = ctypes.CDLL(None)
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


def limit_arenas(n: int = DEFAULT_ARENAS) -> bool:
    """At most ``n`` (>= 1) malloc arenas for the threads that allocate from now on."""
    if n < 1:
        raise ValueError(f"limit_arenas: n must be >= 1, got {n}")
    if user_set_arenas():
        return False
    libc = _glibc()
    return bool(libc is not None and libc.mallopt(ctypes.c_int(M_ARENA_MAX), ctypes.c_int(n)) == 1)


def user_set_arenas() -> bool:
    """Whether the environment sets the arena count (``MALLOC_ARENA_MAX``, or
    ``glibc.malloc.arena_max`` in ``GLIBC_TUNABLES``): that setting is kept."""
    return "MALLOC_ARENA_MAX" in os.environ or "glibc.malloc.arena_max" in os.environ.get("GLIBC_TUNABLES", "")


def trim() -> bool:
    """Return free heap memory to the kernel; True if some was released."""
    libc = _glibc()
    return bool(libc is not None and libc.malloc_trim(ctypes.c_size_t(0)) == 1)


def rss_mb() -> float:
    """Resident memory of this process in MB (0.0 where /proc is absent)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6
    except (OSError, ValueError, IndexError):
        return 0.0
