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
for _var in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
    os.environ.setdefault(_var, str(ONEDNN_CACHE_ENTRIES))
