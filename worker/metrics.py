"""Prometheus metric families built from a worker's status (``worker.protocol.WorkerStatus``).

One definition serves both places that show worker metrics: each worker's own ``/metrics``
and the router's, which repeats every worker's (labelled ``worker``, ``role``) so that one
scrape target shows the whole cluster. Names follow Prometheus conventions: ``pdserve_``
prefix, base units in the name, ``_total`` on counters (added by the client library).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from worker.protocol import ModelInfo, WorkerStatus, memory_now

# name, kind, help, value from a status (None: not reported by this worker)
_WORKER_SERIES: list[tuple[str, str, str, Callable[[WorkerStatus], Any]]] = [
    ("pdserve_worker_running_requests", "gauge", "Requests in the worker's running batch", lambda s: s.running),
    ("pdserve_worker_waiting_requests", "gauge", "Requests waiting for compute or for their KV",
     lambda s: s.waiting),
    ("pdserve_worker_queued_prompt_tokens", "gauge", "Prompt tokens not yet prefilled",
     lambda s: s.queued_prompt_tokens),
    ("pdserve_worker_kv_blocks_used", "gauge", "KV cache blocks in use", lambda s: s.kv_blocks_used),
    ("pdserve_worker_kv_blocks_free", "gauge", "KV cache blocks free", lambda s: s.kv_blocks_free),
    ("pdserve_worker_generated_tokens", "counter", "Tokens this worker sent to the router",
     lambda s: s.generated_tokens),
    ("pdserve_worker_tokens_per_second", "gauge", "Tokens sent over the last 5 s, per second",
     lambda s: s.tokens_per_s),
    ("pdserve_worker_prefix_cache_query_tokens", "counter", "Prompt tokens looked up in the prefix cache",
     lambda s: s.prefix_query_tokens),
    ("pdserve_worker_prefix_cache_hit_tokens", "counter", "Prompt tokens found in the prefix cache",
     lambda s: s.prefix_hit_tokens),
    ("pdserve_worker_prefix_cache_hit_ratio", "gauge", "Prefix cache hit tokens / query tokens",
     lambda s: s.prefix_hit_tokens / s.prefix_query_tokens if s.prefix_query_tokens else None),
    ("pdserve_kv_transfer_bytes", "counter", "KV bytes sent (prefill) or received (decode)",
     lambda s: s.kv_transfer.bytes if s.kv_transfer else None),
    ("pdserve_kv_transfer_seconds", "counter", "Time from first byte to completion, completed transfers",
     lambda s: s.kv_transfer.seconds if s.kv_transfer else None),
    ("pdserve_kv_transfer_completed", "counter", "KV transfers acknowledged complete",
     lambda s: s.kv_transfer.done if s.kv_transfer else None),
    ("pdserve_kv_transfer_failed", "counter", "KV transfers failed (lease, bad frame, abort, dead peer)",
     lambda s: s.kv_transfer.failed if s.kv_transfer else None),
    ("pdserve_kv_transfer_forged", "counter", "KV plane messages dropped for a missing or wrong MAC (not from this "
     "cluster's workers, or replayed)", lambda s: s.kv_transfer.forged if s.kv_transfer else None),
    ("pdserve_kv_transfer_bytes_per_second", "gauge", "Mean KV transfer rate of completed transfers",
     lambda s: s.kv_transfer.bytes / s.kv_transfer.seconds if s.kv_transfer and s.kv_transfer.seconds else None),
    ("pdserve_speculative_acceptance_ratio", "gauge", "Draft tokens accepted / proposed",
     lambda s: s.speculative.get("acceptance_rate") if s.speculative else None),
]

WorkerView = tuple[dict[str, str], WorkerStatus | None, ModelInfo | None]

# pdserve_memory_bytes{kind}: worker.protocol.Memory's fields (GB) by kind
MEMORY_KINDS = ("weights", "packed_copies", "kv_cache", "other", "rss", "pss", "peak_rss")


def worker_families(workers: Iterable[WorkerView]) -> list:
    """Metric families for ``(labels, status, model info)`` of each worker (labels e.g.
    ``{"worker": "decode-0", "role": "decode"}``; every worker carries the same label names;
    status and info are None until it has reported them)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily  # (optional: /metrics only)
    workers = list(workers)
    if not workers:
        return []
    names = sorted(workers[0][0])
    out = []
    for name, kind, doc, get in _WORKER_SERIES:
        fam = (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(name, doc, labels=names)
        for labels, status, _ in workers:
            value = get(status) if status is not None else None
            if value is not None:
                fam.add_metric([labels[n] for n in names], float(value))
        out.append(fam)
    info = GaugeMetricFamily("pdserve_worker_info", "Worker identity: role, model, quantization, "
                             "speculative method (value 1)", labels=names + ["quantization", "speculative"])
    for labels, _, model in workers:
        if model is not None:
            info.add_metric([labels[n] for n in names] + [model.quantization, model.speculative], 1.0)
    out.append(info)
    memory = GaugeMetricFamily("pdserve_memory_bytes", "Worker memory by kind: its engine's account at load "
                               "(weights as served, packed copies of them, kv_cache, other tensors) and the "
                               "process's resident (rss), proportional (pss) and loading peak (peak_rss) sets",
                               labels=names + ["kind"])
    for labels, status, model in workers:
        if (m := memory_now(model, status)) is not None:
            for kind in MEMORY_KINDS:
                memory.add_metric([labels[n] for n in names] + [kind], getattr(m, f"{kind}_gb") * 1e9)
    out.append(memory)
    return out


class WorkerCollector:
    """A prometheus_client collector reading one worker's status at scrape time."""

    def __init__(self, labels: dict[str, str], status: Callable[[], WorkerStatus | None],
                 info: Callable[[], ModelInfo]) -> None:
        self.labels, self.status, self.info = labels, status, info

    def collect(self):
        yield from worker_families([(self.labels, self.status(), self.info())])


def serve_metrics(source: Any, host: str, port: int) -> tuple[Any, int]:
    """Serve ``/metrics`` on ``host:port`` (0: a free port) in a thread, for a
    ``CollectorRegistry`` or a single collector.

    Returns:
        (the HTTP server, to ``shutdown()``; the bound port)
    """
    from prometheus_client import CollectorRegistry, start_http_server  # (optional: /metrics only)
    registry = source
    if not isinstance(source, CollectorRegistry):
        registry = CollectorRegistry(auto_describe=False)
        registry.register(source)
    server, _ = start_http_server(port, addr=host, registry=registry)
    return server, server.server_port
