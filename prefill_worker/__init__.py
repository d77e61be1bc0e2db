"""Prefill worker: runs prompt prefill and pushes the KV cache to a decode worker."""
