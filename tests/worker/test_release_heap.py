"""The step loop's periodic heap trim (worker.step_loop.release_heap): memory a worker freed
goes back to the OS, so a long-running worker's RSS follows what it holds, not its peak."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# In a child process: it changes the allocator's settings, which must not leak into other tests.
CHILD = r"""
import ctypes, json
from worker.step_loop import release_heap

def rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20

libc = ctypes.CDLL("libc.so.6")
libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD 1 MiB: the 64 KiB blocks below come from the heap
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
blocks = [libc.malloc(64 << 10) for _ in range(3200)]  # 200 MiB in the heap, as activations are
for b in blocks:
    ctypes.memset(b, 1, 64 << 10)  # touched: resident
keep = libc.malloc(64 << 10)  # allocated above them: free() alone cannot shrink the heap's top
for b in blocks:
    libc.free(b)
held = rss_mb()
trimmed = release_heap()
print(json.dumps({"held": held, "after": rss_mb(), "trimmed": trimmed}))
"""


def test_freed_heap_memory_goes_back_to_the_os():
    out = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout.splitlines()[-1])
    assert r["trimmed"] is True  # glibc, as on every machine of this project's kind
    # The 200 MiB were freed but stayed resident until the trim; after it, at least half is back
    # with the OS (the rest: arena bookkeeping and pages the allocator may keep by design).
    assert r["held"] - r["after"] >= 100, r
