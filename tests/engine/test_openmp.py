"""engine/openmp.py: a thread done with parallel work gives its OpenMP threads back, so the one
thread that steps the engine (a worker's step loop) is the only one with a pool. Run in a fresh
interpreter: the test process's own pools would count."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch  # noqa: F401  (maps torch's OpenMP runtime: the skip below asks which it is)

from engine.openmp import loaded_runtimes

SCRIPT = r"""
import os, threading, time, torch
from engine.openmp import loaded_runtimes, release_pool

def tasks():
    return len(os.listdir("/proc/self/task"))

def parallel():  # an elementwise op big enough that torch runs it on its OpenMP team
    x = torch.ones(1 << 22)
    return float((x * 2).sum())

torch.set_num_threads(3)
alone = tasks()
parallel()
with_pool = tasks()
paused = release_pool()
end = time.monotonic() + 10
while tasks() > alone and time.monotonic() < end:
    time.sleep(0.01)
after = tasks()
t = threading.Thread(target=parallel)  # the next thread's region: a pool of its own, as before
t.start(); t.join()
print(len(loaded_runtimes()), paused, alone, with_pool, after, parallel() == 2 * (1 << 22))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self (Linux)")
@pytest.mark.skipif(not loaded_runtimes(), reason="torch here runs on another OpenMP runtime than libgomp")
def test_release_pool_lets_the_threads_of_this_thread_go():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120, check=True)
    runtimes, paused, alone, with_pool, after, right = out.stdout.split()
    assert int(runtimes) >= 1 and int(paused) == int(runtimes)  # torch's libgomp, found and paused
    assert int(with_pool) == int(alone) + 2  # a team of 3: two more threads
    assert int(after) == int(alone)  # gone once paused
    assert right == "True"  # parallel work after it still runs and is right


def test_no_runtime_named_in_a_maps_file_without_one(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text("7f00-7f01 r-xp 00000000 08:01 1 /usr/lib/libc.so.6\n"
                    "7f02-7f03 r-xp 00000000 08:01 2 /opt/torch/lib/libgomp.so.1\n"
                    "7f04-7f05 rw-p 00000000 00:00 0 \n")
    assert loaded_runtimes(str(maps)) == ["/opt/torch/lib/libgomp.so.1"]
    maps.write_text("7f00-7f01 r-xp 00000000 08:01 1 /usr/lib/libc.so.6\n")
    assert loaded_runtimes(str(maps)) == []
    assert loaded_runtimes(str(tmp_path / "missing")) == []


ONE_THREAD = r"""
import os, threading, torch
from engine.openmp import one_thread

def tasks():
    return len(os.listdir("/proc/self/task"))

def parallel():  # as above: big enough for torch's OpenMP team
    x = torch.ones(1 << 22)
    return float((x * 2).sum())

torch.set_num_threads(3)
parallel()
with_pool = tasks()  # the main thread's team: 2 threads beside it
seen = {}
def side():
    seen["set"] = one_thread()
    seen["right"] = parallel() == 2 * (1 << 22)
    seen["during"] = tasks()  # this thread counts itself
    seen["side_threads"] = torch.get_num_threads()
t = threading.Thread(target=side)
t.start(); t.join()
print(seen["set"], with_pool, seen["during"], seen["right"], seen["side_threads"], torch.get_num_threads())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self (Linux)")
@pytest.mark.skipif(not loaded_runtimes(), reason="torch here runs on another OpenMP runtime than libgomp")
def test_one_thread_keeps_a_side_threads_parallel_work_off_a_second_pool():
    out = subprocess.run([sys.executable, "-c", ONE_THREAD], capture_output=True, text=True, timeout=120,
                         check=True)
    runtimes, with_pool, during, right, side_threads, main_threads = out.stdout.split()
    assert int(runtimes) >= 1
    # without one_thread the side thread's region starts a team of 3 (2 more threads: the
    # release test above shows a second thread does); with it, only the side thread itself
    assert int(during) == int(with_pool) + 1
    assert right == "True" and int(side_threads) == 1
    assert int(main_threads) == 3  # the process-wide count (the forward's) is untouched
