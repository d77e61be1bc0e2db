"""A worker process's memory: the heap given back to the OS (``release_heap``) and the memory
account taken once the model is up (``load_memory``); the step loop calls both."""

from __future__ import annotations

import logging
from typing import Any

from engine.memory import account, process_memory, release_freed_memory
from worker.protocol import Memory

log = logging.getLogger("pdserve.worker")


def release_heap() -> bool:
    """Return the C heap's free memory to the OS (glibc ``malloc_trim``); False where the C
    library has none (musl, macOS): nothing to do there."""
    return release_freed_memory()


def load_memory(engine: Any) -> Memory | None:
    """The engine's memory account (engine.memory.account, by category) and this process's
    figures, now: called once the model is up, so its peak RSS is the loading peak. None if the
    account fails (it walks the engine's objects: a new layout must not stop a worker)."""
    try:
        gb = account(engine).gb()
    except Exception:
        log.exception("memory account failed; serving without it")
        return None
    proc = process_memory()
    return Memory(weights_gb=gb["weights"], packed_copies_gb=gb["packed_copies"], kv_cache_gb=gb["kv_cache"],
                  other_gb=gb["other"], rss_gb=proc["rss_gb"], pss_gb=proc["pss_gb"], peak_rss_gb=proc["peak_rss_gb"])
