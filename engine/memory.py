"""Where a worker's memory goes: every tensor an engine holds, once, by what it is for.

A serving process's resident memory is its weights as served, its KV cache, and whatever else it
keeps: packed copies of the weights that fast paths read in their own layouts (oneDNN's
prepacked fp32 linears, torch's int4pack, the native kernels' layouts in huge pages), scratch
buffers, and the runtime (Python, torch, the tokenizer). ``account`` walks the engine's object
graph and finds each tensor by the first path that reaches it; storages shared between paths
(a module's INT8 weight that is also the native kernel's) count once, under the first path.

Categories (``Account.by_category``):
    weights        what the model's own modules hold: the format as served (a checkpoint's bytes)
    packed_copies  tensors reached only through a fast path's private attributes: a second copy
                   of weights already counted, or a layout derived from them
    kv_cache       the paged KV cache tensors
    other          scratch buffers, rotary tables, anything else
Process-level figures (RSS, PSS, peak) come from /proc and getrusage: ``process_memory``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import mmap
from pathlib import Path
import resource
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

CATEGORIES = ("weights", "packed_copies", "kv_cache", "other")
_MAX_DEPTH = 8  # object graph depth walked from the engine (the deepest tensor seen is at 6)


class _Covered:
    """Byte ranges already counted. Tensors are views (a tied embedding may be a slice of one
    huge-page buffer holding every weight), so a storage counts by the ranges its tensors
    cover, each byte once; opaque (oneDNN) tensors have no address and count whole, once."""

    def __init__(self) -> None:
        self.ranges: list[tuple[int, int]] = []  # disjoint, unsorted (a few thousand at most)
        self.opaque: set[int] = set()

    def new_bytes(self, t: torch.Tensor) -> int:
        try:
            start = t.data_ptr()
        except (RuntimeError, NotImplementedError):
            start = None
        if start is None or t.is_mkldnn:
            if id(t) in self.opaque:
                return 0
            self.opaque.add(id(t))
            return t.numel() * t.element_size()
        if t.numel() == 0:
            return 0
        extent = 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
        lo, hi = start, start + extent * t.element_size()
        new = hi - lo
        for a, b in self.ranges:
            new -= max(0, min(b, hi) - max(a, lo))
        if new > 0:
            self.ranges.append((lo, hi))
        return max(new, 0)


@dataclass
class Account:
    """Bytes by category, and the largest items (path, bytes) in each."""

    by_category: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0))
    items: dict[str, list[tuple[str, int]]] = field(default_factory=lambda: {c: [] for c in CATEGORIES})

    def add(self, category: str, path: str, nbytes: int) -> None:
        self.by_category[category] += nbytes
        self.items[category].append((path, nbytes))

    def top(self, category: str, n: int = 5) -> list[tuple[str, int]]:
        return sorted(self.items[category], key=lambda kv: -kv[1])[:n]

    def gb(self) -> dict[str, float]:
        return {k: round(v / 1e9, 3) for k, v in self.by_category.items()}


def _children(obj) -> Iterator[tuple[str, object]]:
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield f"[{k!r}]", v
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield f"[{i}]", v
    elif isinstance(obj, nn.Module):
        for name, p in obj.named_parameters(recurse=False):
            yield f".{name}", p
        for name, b in obj.named_buffers(recurse=False):
            if b is not None:
                yield f".{name}", b
        for name, m in obj.named_children():
            yield f".{name}", m
        for name, v in vars(obj).items():  # private tensors and helpers a module keeps itself
            if name not in ("_parameters", "_buffers", "_modules") and not name.endswith("hooks"):
                yield f".{name}", v
    elif hasattr(obj, "__dict__") and not isinstance(obj, type) and type(obj).__module__.split(".")[0] in (
            "engine", "kvtransfer", "worker", "prefill_worker", "decode_worker", "adaptive_worker"):
        for name, v in vars(obj).items():
            yield f".{name}", v


def account(engine) -> Account:
    """Every tensor reachable from ``engine`` (an LLMEngine or anything holding ``model`` and a
    runner with a KV cache), each byte once, categorised (see the module docstring)."""
    acc, covered, visiting = Account(), _Covered(), set()
    kv = _kv_tensors(engine)
    kv_ptrs = {t.data_ptr() for t in kv}

    def visit(obj, path: str, depth: int) -> None:
        if isinstance(obj, torch.Tensor):
            n = covered.new_bytes(obj)
            if n:
                acc.add(_category(obj, path, kv_ptrs), path, n)
            return
        if depth >= _MAX_DEPTH or id(obj) in visiting:
            return
        visiting.add(id(obj))
        for name, child in _children(obj):
            visit(child, path + name, depth + 1)
        visiting.discard(id(obj))

    model = getattr(engine, "model", engine)
    # the modules' registered tensors first: the format as served (not state_dict(), which may
    # hand back canonical copies of weights a module holds in a kernel's layout)
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        n = covered.new_bytes(t)
        if n:
            acc.add("weights", f"model.{name}", n)
    visit(engine, "engine", 0)
    return acc


def _category(t: torch.Tensor, path: str, kv_ptrs: set[int]) -> str:
    try:
        if t.data_ptr() in kv_ptrs:
            return "kv_cache"
    except (RuntimeError, NotImplementedError):
        pass
    if any(k in path for k in ("packed", "single_token", "native", "_scales", "_scale_act", "_zs", "weight")):
        return "packed_copies"
    return "other"


def _kv_tensors(engine) -> list[torch.Tensor]:
    runner = getattr(engine, "runner", None)
    caches = getattr(runner, "kv_caches", None) or getattr(runner, "kv", None) or []
    out = []
    for item in caches:
        out += list(item) if isinstance(item, (list, tuple)) else [item]
    return [t for t in out if isinstance(t, torch.Tensor)]


def process_memory() -> dict[str, float]:
    """This process's resident set, proportional set (shared pages split between the processes
    mapping them) and peak resident set, in GB (Linux; zeros where /proc is missing)."""
    # The peak is this process's memory's own high-water mark (VmHWM), not ru_maxrss: a process
    # started by another inherits its parent's peak there (exec records the replaced memory's;
    # a worker forked by Ray's, a bench child its runner's).
    out = {"rss_gb": 0.0, "pss_gb": 0.0, "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9}
    for path, keys in (("/proc/self/smaps_rollup", {"Rss": "rss_gb", "Pss": "pss_gb"}),
                       ("/proc/self/status", {"VmHWM": "peak_rss_gb"})):
        try:
            with open(path) as f:
                for line in f:
                    key, _, rest = line.partition(":")
                    if key in keys:
                        out[keys[key]] = int(rest.split()[0]) * 1024 / 1e9
        except OSError:
            pass
    return {k: round(v, 3) for k, v in out.items()}


# glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
# A step's buffers up to this size come from the heap (see keep_step_buffers); larger ones are
# mapped as before. A 512-token prefill of a 1.5B model allocates ~37 MB ones (gate/up's output).
STEP_HEAP_MAX_BYTES = 1 << 30


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return lib if hasattr(lib, "malloc_trim") and hasattr(lib, "mallopt") else None
    except OSError:
        return None


def release_freed_memory() -> bool:
    """Hand the heap's free pages back to the OS (glibc's malloc_trim). Loading converts weights
    through large temporaries that glibc keeps for reuse once freed: 1.1 GB of a 1.5B GGUF
    load's resident memory on this machine was such free heap. False (nothing done) without glibc."""
    lib = _libc()
    if lib is None:
        return False
    lib.malloc_trim(0)
    return True


def keep_step_buffers() -> bool:
    """Serve a step's large buffers from the heap, and keep them there once freed, for the next
    step. By default glibc maps every buffer over its mmap threshold (128 KiB, rising to 32 MiB
    at most) afresh and unmaps it at free, so each step faults in and zeroes every page of its
    activations again: in a 512-token prefill of the 1.5B up to a tenth of the time
    (docs/bench/README.md, "Prefill's page faults"). What a step freed
    goes back to the OS at ``release_freed_memory`` (a worker's step loop calls it every 30 s,
    worker.heap), so RSS still follows what is held. Called once the model is loaded, so the first
    load's temporaries keep glibc's defaults (a later load in the same process does not). Where it
    falls short: a thread other than the main one (a worker's step loop) allocates from an arena
    of its own, and glibc unmaps such an arena's extra heaps (64 MiB each) once they empty,
    whatever the thresholds: there a step may fault its buffers in again (measured in
    docs/bench/README.md, "Prefill's page faults"). False (nothing done) without glibc."""
    lib = _libc()
    if lib is None:
        return False
    # (the trim threshold too: else free() itself trims the heap's top past 2x the threshold)
    return bool(lib.mallopt(M_MMAP_THRESHOLD, STEP_HEAP_MAX_BYTES) and lib.mallopt(M_TRIM_THRESHOLD, 2**31 - 1))


def file_mappings(files: list[str]) -> list[tuple[int, int]]:
    """Address ranges [start, end) where this process maps any of ``files`` (/proc/self/maps;
    empty where there is none to read)."""
    names = {str(Path(f).resolve()) for f in files}
    out = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[5].strip() in names:
                    lo, hi = fields[0].split("-")
                    out.append((int(lo, 16), int(hi, 16)))
    except OSError:
        pass
    return out


_MADV_DONTNEED = 4  # Linux


def drop_file_pages(t: torch.Tensor, mappings: list[tuple[int, int]]) -> None:
    """Unmap from this process the whole pages of ``t``, a view of a read-only file mapping in
    ``mappings`` (file_mappings), once it has been copied and will not be read again: they stay
    in the page cache (a later read faults them back unchanged) but leave this process's
    resident set, so a loader copying a checkpoint holds one copy, not two. Anything else (heap
    memory, which DONTNEED would zero) is left alone."""
    start, end = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    page = mmap.PAGESIZE  # (4 KiB on x86-64; 16 or 64 KiB on some arm64 kernels)
    lo, hi = -(-start // page) * page, end // page * page  # whole pages inside the tensor only
    if hi <= lo or not any(a <= lo and hi <= b for a, b in mappings):
        return
    try:
        ctypes.CDLL(None).madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), _MADV_DONTNEED)
    except (OSError, AttributeError):
        pass
