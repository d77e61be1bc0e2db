"""The served-weights cache: a model as it serves, written once per content, mapped by every load.

Loading a model converts it: a GGUF file's K-quants into pdserve's INT4/INT8 layouts, an fp32
folder quantized, each linear moved into the native kernels' order. That costs time (25 s for
Qwen2.5-Coder-0.5B on 2 cores), a loading peak above the steady state, and, with two workers of
one model on a node, two private copies of the same bytes. Here the converted model (before its
oneDNN prepacking and its native kernels, which are per process) is written once: its object
graph pickled, every tensor's storage as raw bytes in one file, page aligned. Every later load,
in this process or another, maps that file (copy-on-write, ``MAP_PRIVATE``): nothing converts,
the loading peak is the steady state, and processes that map one file share its pages in the
page cache, so a node holds the weights once (a worker's PSS counts its share).

Key: what makes the bytes, and nothing else: the source weights' digest
(engine/models/loader.py ``weights_digest``: a GGUF file's sha256), the load options, the CPU
capability and vector width the layouts were made for, the torch version, and a digest of the
engine's own source (a change to any layout code makes a new entry, never a stale one).

Files, in ``$PDSERVE_CACHE/served`` (mode 0700: the object graph is a pickle, loaded only from
a directory this user alone can write): ``KEY.bin`` (storages) then ``KEY.pkl`` (graph +
storage index), the ``.pkl`` renamed into place last, so a half-written entry is never read;
``KEY.lock`` serialises the first conversion between processes (the second waits, then maps).
A bad entry (truncated, unreadable, from another build) is deleted and rebuilt, never served.
The oldest entries go when the cache passes ``PDSERVE_WEIGHT_CACHE_GB`` (default 24); an
unlinked file stays valid for the processes that map it. ``PDSERVE_WEIGHT_CACHE=0`` turns the
cache off.
"""

from __future__ import annotations

import ctypes
import fcntl
import gc
import hashlib
import importlib.metadata
import io
import json
import logging
import mmap
import os
import pickle
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from engine.memory import release_freed_memory
from engine.models.gguf_convert import cache_dir
from engine.models.native import enabled_library

log = logging.getLogger(__name__)

VERSION = 1
ALIGN = 4096  # each storage starts on a page: kernels want 64-byte alignment, mappings a page
DEFAULT_BUDGET_GB = 24.0


class _Unsupported(Exception):
    """The graph holds something the cache cannot map (an opaque oneDNN tensor, ...)."""


def enabled() -> bool:
    return os.environ.get("PDSERVE_WEIGHT_CACHE", "1") not in ("0", "false", "off", "")


def root() -> Path:
    return cache_dir() / "served"


def _source_digest() -> str:
    """The engine's own source (layouts, kernels, conversions), so that a code change keys anew."""
    h = hashlib.sha256()
    base = Path(__file__).resolve().parent
    for f in sorted([*base.rglob("*.py"), *base.rglob("*.c")]):
        h.update(str(f.relative_to(base)).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


# Read once, when the engine is imported (its loader imports this module): a process keys its
# entries by the code it runs. Read at each load, a process started before an edit stored
# objects of its old classes under the edited source's key, which processes of the new code
# then loaded (seen: a decoder pickled without an attribute the new class reads).
_SOURCE_DIGEST = _source_digest()


def _version(package: str) -> str | None:
    """An installed package's version (the GGUF reader and numpy take part in conversions)."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def key(source_digest: str, options: dict) -> str:
    """The entry for these weights loaded with these options on this machine's kind of CPU."""
    lib = enabled_library()
    what = {"v": VERSION, "weights": source_digest, "options": options, "torch": torch.__version__,
            "libraries": {name: _version(name) for name in ("gguf", "numpy", "safetensors")},
            "cpu": torch.backends.cpu.get_cpu_capability(), "lanes": lib.pd_vector_width() if lib else 0,
            "env": {k: os.environ.get(k) for k in ("PDSERVE_NATIVE_DECODE", "ATEN_CPU_CAPABILITY")},
            "engine": _SOURCE_DIGEST}
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=repr).encode()).hexdigest()[:24]


# ---- writing ------------------------------------------------------------------------------------

class _Writer(pickle.Pickler):
    """Pickles an object graph with every tensor as a reference into the storage file."""

    def __init__(self, f: io.BytesIO, externals: dict[str, object]) -> None:
        super().__init__(f, protocol=pickle.HIGHEST_PROTOCOL)
        self.storages: dict[int, tuple[torch.UntypedStorage, int]] = {}  # data_ptr -> (storage, index)
        self.externals = {id(v): k for k, v in externals.items()}

    def persistent_id(self, obj):
        if id(obj) in self.externals:  # the loader's own object, handed back by name
            return ("x", self.externals[id(obj)])
        if not isinstance(obj, torch.Tensor):
            return None
        if obj.is_mkldnn or obj.is_quantized or obj.device.type != "cpu" or obj.layout != torch.strided:
            raise _Unsupported(f"a {'quantized ' if obj.is_quantized else ''}{obj.layout} tensor on {obj.device}")
        if obj.requires_grad:
            raise _Unsupported("a tensor that requires grad")
        s = obj.untyped_storage()
        ptr = s.data_ptr()
        if ptr not in self.storages:
            self.storages[ptr] = (s, len(self.storages))
        return ("t", id(obj), self.storages[ptr][1], str(obj.dtype).removeprefix("torch."), tuple(obj.shape),
                tuple(obj.stride()), obj.storage_offset(), isinstance(obj, nn.Parameter))

    def reducer_override(self, obj):
        if isinstance(obj, ctypes.CDLL):
            raise _Unsupported(f"a native library handle ({obj!r})")
        if isinstance(obj, torch.ScriptObject):  # e.g. W8A8's packed params: opaque
            raise _Unsupported(f"a TorchScript object ({obj!r})")
        return NotImplemented


def save(obj, path_stem: Path, externals: dict[str, object] | None = None) -> None:
    """Write ``obj``'s graph and storages as one entry (``.bin`` first, ``.pkl`` last); objects
    in ``externals`` are written as their names (``load`` is given them again)."""
    buf = io.BytesIO()
    w = _Writer(buf, externals or {})
    w.dump(obj)
    index, off = [], 0
    tmp_bin = path_stem.with_suffix(f".bin.{os.getpid()}.tmp")
    tmp_pkl = path_stem.with_suffix(f".pkl.{os.getpid()}.tmp")
    try:
        with open(tmp_bin, "wb") as f:
            for s, i in sorted(w.storages.values(), key=lambda si: si[1]):
                n = s.nbytes()
                index.append((off, n))
                if n:
                    f.write(memoryview(torch.empty(0, dtype=torch.uint8).set_(s, 0, (n,), (1,)).numpy()))
                pad = -(off + n) % ALIGN
                f.write(b"\0" * pad)
                off += n + pad
        with open(tmp_pkl, "wb") as f:
            f.write(pickle.dumps({"version": VERSION, "bin_bytes": off, "index": index, "graph": buf.getvalue()},
                                 protocol=pickle.HIGHEST_PROTOCOL))
        os.replace(tmp_bin, path_stem.with_suffix(".bin"))
        os.replace(tmp_pkl, path_stem.with_suffix(".pkl"))
    finally:
        for t in (tmp_bin, tmp_pkl):
            t.unlink(missing_ok=True)


# ---- reading ------------------------------------------------------------------------------------

class _Reader(pickle.Unpickler):
    def __init__(self, graph: bytes, mm: mmap.mmap | None, index: list[tuple[int, int]],
                 externals: dict[str, object]) -> None:
        super().__init__(io.BytesIO(graph))
        self.mm, self.index, self.externals, self.tensors, self.storages = mm, index, externals, {}, {}

    def _storage(self, si: int) -> torch.Tensor:
        """Storage ``si`` as its own torch storage over its bytes of the mapping: tensors that
        shared one when saved share one again, and no others (safetensors, for one, refuses to
        save tensors that share memory)."""
        if si not in self.storages:
            start, n = self.index[si]
            self.storages[si] = torch.frombuffer(self.mm, dtype=torch.uint8, count=n, offset=start)
        return self.storages[si]

    def persistent_load(self, pid):
        if pid[0] == "x":
            return self.externals[pid[1]]
        kind, tid, si, dtype, shape, stride, offset, param = pid
        if kind != "t":
            raise pickle.UnpicklingError(f"unknown reference {kind!r}")
        if tid in self.tensors:  # the same tensor object reached twice stays one object (tied weights)
            return self.tensors[tid]
        start, n = self.index[si]
        dt = getattr(torch, dtype)
        if n:
            t = self._storage(si).view(dt).as_strided(shape, stride, offset)
        else:
            t = torch.empty(0, dtype=dt).as_strided(shape, stride, offset)
        if param:
            t = nn.Parameter(t, requires_grad=False)
        self.tensors[tid] = t
        return t


def load(path_stem: Path, externals: dict[str, object] | None = None):
    """The entry's object graph, its tensors views of the mapped storage file."""
    meta = pickle.loads(path_stem.with_suffix(".pkl").read_bytes())
    if meta.get("version") != VERSION:
        raise ValueError(f"version {meta.get('version')} (this build reads {VERSION})")
    binf = path_stem.with_suffix(".bin")
    size = binf.stat().st_size
    if size != meta["bin_bytes"]:
        raise ValueError(f"{binf.name} is {size} bytes, its index says {meta['bin_bytes']}")
    with open(binf, "rb") as f:
        # private, copy-on-write: pages stay the page cache's (shared) until written. Not
        # MAP_POPULATE: on a writable private mapping it write-faults every page, i.e. copies them
        mm = mmap.mmap(f.fileno(), size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE) \
            if size else None
    if mm is not None:
        mm.madvise(mmap.MADV_WILLNEED)
        # read once now (read faults map the shared pages) so that the first request does not wait
        torch.frombuffer(mm, dtype=torch.uint8)[::ALIGN].sum()
    return _Reader(meta["graph"], mm, meta["index"], externals or {}).load()


# ---- the cache ----------------------------------------------------------------------------------

def _evict(directory: Path, keep: str, budget: int) -> None:
    """The oldest entries but ``keep`` removed until the cache fits ``budget`` bytes. Processes
    share the cache and evict each other's entries: one listed here may be gone by its stat (it
    is then skipped), each is stat'ed once."""
    entries = []
    for p in directory.glob("*.pkl"):
        try:
            st = p.stat()
        except FileNotFoundError:
            continue  # (another process evicted it since the listing)
        entries.append((st.st_mtime, p, st.st_size + _size(p.with_suffix(".bin"))))
    entries.sort(key=lambda e: e[0])
    total = sum(size for _, _, size in entries)
    for _, p, size in entries:
        if total <= budget:
            break
        if p.stem == keep:
            continue
        total -= size
        for f in (p, p.with_suffix(".bin"), p.with_suffix(".lock")):
            f.unlink(missing_ok=True)
        log.info("served-weights cache: evicted %s", p.stem)


def _size(p: Path) -> int:
    try:
        return p.stat().st_size
    except OSError:
        return 0


def _budget() -> int:
    return int(float(os.environ.get("PDSERVE_WEIGHT_CACHE_GB", DEFAULT_BUDGET_GB)) * 1e9)


def _private_dir() -> Path:
    d = root()
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    st = d.stat()
    if st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise PermissionError(f"{d} must belong to this user and be writable by no one else (it holds pickles)")
    return d


def cached(cache_key: str, build: Callable[[], object], describe: str,
           externals: dict[str, object] | None = None) -> tuple[object, str]:
    """``build()``'s result from the cache, or built, stored and then mapped (``externals``: as
    in ``save``, objects of the caller's that the graph refers to, not copied). Returns the object
    and where it came from: "cache", "built" (now stored and mapped) or "uncached" (the cache
    is off, or the object holds something it cannot map: built and kept in memory)."""
    if not enabled():
        return build(), "uncached"
    d = _private_dir()
    stem = d / cache_key
    with open(stem.with_suffix(".lock"), "a+") as lock:
        t0 = time.monotonic()
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process converting the same model: wait, then map
        waited = time.monotonic() - t0
        if waited > 1:
            log.info("waited %.0f s for another process converting %s", waited, describe)
        if stem.with_suffix(".pkl").is_file():
            try:
                obj = load(stem, externals)
                os.utime(stem.with_suffix(".pkl"))  # recently used: evicted last
                return obj, "cache"
            except Exception as e:  # noqa: BLE001 - any bad entry is rebuilt, never served
                log.warning("served-weights cache entry %s unreadable (%s): rebuilding", cache_key, e)
                for f in (stem.with_suffix(".pkl"), stem.with_suffix(".bin")):
                    f.unlink(missing_ok=True)
        obj = build()
        try:
            save(obj, stem, externals)
        except _Unsupported as e:
            log.info("%s not cached: it holds %s", describe, e)
            return obj, "uncached"
        except OSError as e:  # a full disk is no reason to fail the load
            log.warning("%s not cached: %s", describe, e)
            return obj, "uncached"
        _evict(d, cache_key, _budget())
    del obj  # the built copy goes (its cycles too); this process maps the file like any other
    gc.collect()
    release_freed_memory()
    return load(stem, externals), "built"
