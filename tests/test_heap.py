"""workers/heap.py: the arena cap and the trim act on this process's glibc malloc (real libc,
in a subprocess, since an arena once made stays for the life of the process)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from workers import heap

ROOT = Path(__file__).resolve().parents[1]
GLIBC = heap._glibc() is not None

# 8 threads allocate at once (each holds its block until all have one), then malloc_stats()
# prints one "Arena N:" block per arena on stderr
SCRIPT = """
import ctypes, sys, threading
sys.path.insert(0, {root!r})
from workers import heap
if {limit}:
    heap.limit_arenas(2)
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
barrier = threading.Barrier(8)
def work():
    p = libc.malloc(1 << 16)
    barrier.wait()
    libc.free(ctypes.c_void_p(p))
ts = [threading.Thread(target=work) for _ in range(8)]
[t.start() for t in ts]
[t.join() for t in ts]
libc.malloc_stats()
"""


def _arenas(limit: bool, env: dict | None = None) -> int:
    base = {k: v for k, v in os.environ.items() if k not in ("MALLOC_ARENA_MAX", "GLIBC_TUNABLES")}
    out = subprocess.run([sys.executable, "-c", SCRIPT.format(root=str(ROOT), limit=limit)],
                         capture_output=True, text=True, timeout=60, env={**base, **(env or {})})
    assert out.returncode == 0, out.stderr
    return sum(1 for ln in out.stderr.splitlines() if ln.startswith("Arena "))


@pytest.mark.skipif(not GLIBC, reason="glibc malloc only (mallopt / malloc_trim)")
def test_arena_cap_holds_under_threads():
    assert _arenas(limit=False) > 2  # the default: a new arena per contending thread
    assert _arenas(limit=True) == 2


@pytest.mark.skipif(not GLIBC, reason="glibc malloc only (mallopt / malloc_trim)")
def test_an_arena_count_set_in_the_environment_is_kept():
    assert _arenas(limit=True, env={"MALLOC_ARENA_MAX": "4"}) == 4
    assert _arenas(limit=True, env={"GLIBC_TUNABLES": "glibc.malloc.arena_max=3"}) == 3


TRIM = """
import ctypes, os, sys
sys.path.insert(0, {root!r})
from workers import heap
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
rss = lambda: int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
blocks = [libc.malloc(100_000) for _ in range(500)]  # under the mmap threshold: on the heap
for b in blocks:
    ctypes.memset(b, 1, 100_000)  # resident
for b in blocks[::2]:  # every other one: free chunks between live ones, which free() keeps
    libc.free(ctypes.c_void_p(b))
before = rss()
released = heap.trim()
print(before, rss(), released)
"""


@pytest.mark.skipif(not GLIBC, reason="glibc malloc only (mallopt / malloc_trim)")
def test_trim_returns_freed_heap_to_the_kernel():
    out = subprocess.run([sys.executable, "-c", TRIM.format(root=str(ROOT))], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    before, after, released = out.stdout.split()
    assert released == "True"
    assert int(before) - int(after) > 20e6  # most of the 25 MB freed between live blocks


def test_arena_cap_refuses_nonsense():
    with pytest.raises(ValueError, match="n must be >= 1"):
        heap.limit_arenas(0)


def test_rss_is_this_process_resident_memory():
    # in a fresh process: in pytest's, the allocation may reuse pages freed earlier
    code = ("import sys; sys.path.insert(0, %r)\nimport torch\nfrom workers import heap\n"
            "b = heap.rss_mb()\nx = torch.ones(200 * 2**20 // 4)\nprint(heap.rss_mb() - b)" % str(ROOT))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert 190 < float(out.stdout) < 260  # the 200 MB tensor, touched
