"""pdserve's shared engine core: model, paged KV cache, scheduler, sampler.

Imported by both worker kinds; knows no network (no Ray, zmq, HTTP, gRPC or UCX: the worker
runtime in ``worker/`` does; ``tests/test_layout.py`` checks).
"""
