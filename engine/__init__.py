"""pdserve's shared engine core: model, paged KV cache, scheduler, sampler.

Imported by both worker kinds; knows no network (no Ray, zmq, HTTP, gRPC or UCX: the worker
runtime in ``worker/`` does; ``tests/test_layout.py`` checks).
"""

import os

# oneDNN (the prepacked linears, engine/layers/linear.py) JIT-compiles a primitive per input
# shape and keeps it in two caches, oneDNN's own and ideep's LRU, 1,024 entries each by default
# and about 0.5 MB per entry here. A prefill chunk's row count is the prompt's length, so a
# server sees every length and those caches only fill: a prefill worker's RSS grew by ~100 MB/h
# in bench/soak.py and an engine fed prompts of random length grew by ~0.9 GB in 240 prompts;
# with 128 entries each it stays within ~0.1 GB. 128 still holds the shapes that repeat (7
# primitives per row count: a decode batch size or a verify step), and a miss costs one JIT per
# distinct shape per step, not per layer (all layers share it). Both are read once, at the
# first primitive, so they are set on import; a value in the environment wins.
ONEDNN_CACHE_ENTRIES = 128
# A prefill-only worker's row counts are its prompts' lengths (and a re-run's prompt is the
# prompt plus what was streamed: a length never seen), so its entries hardly ever hit: an engine
# fed new lengths grew ~1 MB per length up to ~150 MB over a fixed load's with 128 entries, flat
# with 16, and prefill ms per token was the same both ways (repeated lengths 1.86 vs 1.83:
# noise). 16 still holds a chunked prompt's full-chunk shape and one tail (7 primitives each).
PREFILL_ONEDNN_CACHE_ENTRIES = 16
_ONEDNN_VARS = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")
# What pdserve set them to (``VAR=value,...``): a process's children, Ray's local workers, inherit
# it with them. A variable still at the value recorded there is a default a worker may change;
# any other value is the user's.
_DEFAULTED = "PDSERVE_ONEDNN_CACHE_DEFAULTED"


def bound_onednn_caches(entries: int) -> None:
    """Size both oneDNN caches to ``entries`` unless the user's environment sized them (that
    wins). Takes effect only before the process's first oneDNN primitive."""
    ours = dict(kv.split("=", 1) for kv in os.environ.get(_DEFAULTED, "").split(",") if "=" in kv)
    for var in _ONEDNN_VARS:
        if not os.environ.get(var) or ours.get(var) == os.environ[var]:
            os.environ[var] = ours[var] = str(entries)
    os.environ[_DEFAULTED] = ",".join(f"{k}={v}" for k, v in sorted(ours.items()))


bound_onednn_caches(ONEDNN_CACHE_ENTRIES)
