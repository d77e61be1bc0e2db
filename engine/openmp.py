"""The OpenMP runtime's idle threads, given back by a thread that is done with parallel work.

libgomp (the runtime torch's ops and the native kernels both run on) keeps a pool of threads for
each thread that starts a parallel region. Once it manages more threads in all than the process
has cores, every wait in every team spins about 100 times instead of about 300,000 before it
sleeps: each barrier and each region's start then costs a futex wake-up. A worker loads its
engine on its actor's thread and steps it on its step loop's (worker/step_loop.py): two pools,
four threads on two cores. Measured (SmolLM2-135M, 2 threads, a 2-core Xeon): a decode step on
the second thread 34-36 ms against 22-23 on the first; with the first's pool given back, 22 ms.
Through a colocated cluster a lone stream took 40 ms a token where the engine alone steps in 21.

So the one thread that steps the engine keeps the only pool: the step loop gives the loading
thread's back as it starts (``release_pool``), and a side thread whose work is copies keeps its
parallel regions to itself (``one_thread``: the KV-stream thread, prefill_worker/kv_stream.py).
"""

from __future__ import annotations

import ctypes
import logging

import torch

log = logging.getLogger("pdserve.engine")

OMP_PAUSE_SOFT = 1  # OpenMP 5.0 omp_pause_soft: the threads exit; a later region starts new ones


def loaded_runtimes(maps: str = "/proc/self/maps") -> list[str]:
    """Paths of the libgomp copies this process has mapped (torch's own; none on a platform
    without /proc or another runtime)."""
    try:
        with open(maps) as f:
            fields = [line.split(None, 5) for line in f if "libgomp" in line]
    except OSError:
        return []
    paths = {x[5].strip() for x in fields if len(x) == 6}
    return sorted(p for p in paths if p.startswith("/") and ".so" in p)


def _call_each(name: str, *args: int, what: str) -> list[int]:
    """``name(*args)`` in every libgomp mapped here (dlopen of a mapped path returns the copy
    already loaded); the results of the calls that could be made. A runtime without ``name``
    (a libgomp before GCC 9 has no pause) is warned of as unable to ``what``."""
    results = []
    for path in loaded_runtimes():
        try:
            results.append(getattr(ctypes.CDLL(path), name)(*args))
        except (OSError, AttributeError) as e:
            log.warning("openmp: cannot %s (%s: %s)", what, path, e)
    return results


def release_pool() -> int:
    """Let the calling thread's OpenMP threads go (``omp_pause_resource_all``, soft, in every
    libgomp mapped here). Call it on a thread that starts no more parallel work, or that starts
    it rarely: a later region there makes a new pool. Returns how many runtimes paused (0: none
    found, or none would; where none can, steps pay the module doc's cost)."""
    return sum(r == 0 for r in _call_each("omp_pause_resource_all", OMP_PAUSE_SOFT,
                                          what="give back this thread's OpenMP threads"))


def one_thread() -> int:
    """Keep the calling thread's parallel regions to itself: its OpenMP ``nthreads`` ICV set to 1
    (``omp_set_num_threads`` is per thread in libgomp), so torch's ops here never start a pool
    beside the forward's (the module doc's cost). For a side thread whose work is copies (the
    KV-stream thread, prefill_worker/kv_stream.py). torch first sets a new thread's ICV from its
    process-wide count at the thread's first parallel call, which would undo this: that is made
    first (``torch.get_num_threads``). ``torch.set_num_threads(1)`` would not do: it changes the
    process-wide count (every later thread's) and MKL's. Returns how many runtimes were set."""
    torch.get_num_threads()  # torch's per-thread first-use setting, made now, not over ours later
    return len(_call_each("omp_set_num_threads", 1, what="keep this thread's parallel work to one thread"))
