"""bench/soak.py's memory sampling: the resident set split by kind adds up to it, and a SysV
shared-memory segment mapped into the process is counted (UCX's shared-memory transports map
their peers' segments that way: the soak tells those apart from heap growth)."""

from __future__ import annotations

import ctypes
import os

from bench.soak import grows, memory, slope_per_h

IPC_PRIVATE, IPC_CREAT, IPC_RMID = 0, 0o1000, 0


def test_kinds_add_up_to_the_resident_set():
    m = memory(os.getpid())
    # VmRSS is by definition RssAnon + RssFile + RssShmem, each in whole kB: exact in MB floats
    # up to float rounding of three kB/1024 divisions.
    assert abs(m["anon"] + m["file"] + m["shmem"] - m["rss"]) < 1e-6 and m["anon"] > 0


def test_a_mapped_sysv_segment_is_counted_and_its_touched_pages_are_shmem():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.shmat.restype = ctypes.c_void_p
    libc.shmat.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
    libc.shmdt.argtypes = [ctypes.c_void_p]
    size = 8 << 20
    before = memory(os.getpid())
    shmid = libc.shmget(IPC_PRIVATE, ctypes.c_size_t(size), IPC_CREAT | 0o600)
    assert shmid >= 0, os.strerror(ctypes.get_errno())
    addr = libc.shmat(shmid, None, 0)
    try:
        libc.shmctl(shmid, IPC_RMID, None)  # gone once detached, whatever happens below
        ctypes.memset(addr, 1, size)  # touch every page: resident now
        during = memory(os.getpid())
        assert during["sysv"] == before["sysv"] + 1
        # 8 MB touched; other shared pages of this process may come or go meanwhile (none here
        # do on their own, but allow 1 MB either way rather than assume it).
        assert abs(during["shmem"] - before["shmem"] - 8) < 1
    finally:
        libc.shmdt(ctypes.c_void_p(addr))
    assert memory(os.getpid())["sysv"] == before["sysv"]


def test_a_process_that_is_gone_reads_as_nothing():
    import subprocess
    import sys
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    assert memory(p.pid) == {}


def test_only_growth_beyond_noise_and_the_floor_counts():
    rising = [(t, 1000 + t / 360) for t in range(0, 1800, 60)]  # +10 MB/h, no noise
    falling = [(t, 1000 - t / 36) for t in range(0, 1800, 60)]  # -100 MB/h: a start-up peak given back
    slope, se = slope_per_h(rising)
    assert abs(slope - 10) < 1e-6 and grows(slope, se, 5.0) and not grows(slope, se, 20.0)
    assert not grows(*slope_per_h(falling), 5.0)
    noisy = [(t, 1000 + t / 360 + (40 if (t // 60) % 2 else -40)) for t in range(0, 1800, 60)]
    slope, se = slope_per_h(noisy)  # the same 10 MB/h under +-40 MB of noise: within two errors
    assert 2 * se > slope and not grows(slope, se, 5.0)


def test_samples_are_kept_compactly_and_fitted_after_the_warm_up():
    """A process's samples are flat doubles (48 bytes each in the process the soak weighs, which
    is also the router's); growth is fitted on those after the warm-up, and the change split by kind."""
    import sys
    from types import SimpleNamespace

    from bench.soak import Soak
    soak = object.__new__(Soak)
    soak.rows, soak.args = {}, SimpleNamespace(warmup_s=100.0, fault_every_s=60.0, flat_mb_per_h=5.0)
    for i in range(61):  # one sample a minute for an hour: 500 MB, +10 MB/h of heap after a start-up step
        anon = 400.0 + (50.0 if i >= 1 else 0.0) + 10.0 * i / 60
        soak.record("w 1", 60.0 * i, {"rss": anon + 100.0, "anon": anon, "file": 100.0, "shmem": 0.0, "sysv": 2})
    g = soak.growth()["w 1"]
    assert abs(g["growth_mb_per_h"] - 10.0) < 1e-6 and not g["flat"]  # exact: a straight line after the warm-up
    assert g["change"] == {"anon": round(10.0 * 58 / 60, 1), "shmem": 0.0, "file": 0.0, "sysv": 0.0}
    assert soak.parts("w 1")[0] == (0.0, {"rss": 500.0, "anon": 400.0, "file": 100.0, "shmem": 0.0, "sysv": 2.0})
    # 61 rows of 6 doubles, the array's header (64 bytes) and its over-allocation (~1/16)
    assert sys.getsizeof(soak.rows["w 1"]) < 61 * 6 * 8 * 17 / 16 + 64
    soak.record("w 2", 0.0, {"rss": 1.0})  # what was not read stays unread
    assert soak.parts("w 2") == [(0.0, {"rss": 1.0})]
    # A process started mid-run (a fault's replacement) warms up from its own first sample: its
    # start-up climb (100 MB over its first 90 s) is not fitted, its flat rest is
    for i in range(31):
        soak.record("w 3", 1800.0 + 10.0 * i, {"rss": 300.0 + min(i, 9) * 100.0 / 9})
    g3 = soak.growth()["w 3"]
    assert g3["growth_mb_per_h"] == 0.0 and g3["flat"] and g3["rss_mb_first"] == 400.0, g3
