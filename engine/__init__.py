"""pdserve's shared engine core: model, paged KV cache, scheduler, sampler.

Imported by both worker kinds; imports no Ray, gRPC or UCX.
"""
