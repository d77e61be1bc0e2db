"""What the status RPCs answer (``GetModelInfo``, ``GetClusterStatus``: `pdserve status`), built
from the pools as they are now. Roles and states are shown by their enums' values."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import msgspec

from pdserve.v1 import pdserve_pb2 as pb
from router.worker_state import Role, Worker
from worker.protocol import memory_now


def worker_memory(w: Worker) -> pb.WorkerMemory | None:
    """``w``'s memory (its account at load, its latest RSS and PSS), or None before it has one."""
    m = memory_now(w.info, w.status) if w.state.has_process else None  # (an old process's)
    return None if m is None else pb.WorkerMemory(worker_id=w.worker_id, role=w.role,
                                                  **msgspec.structs.asdict(m))


def model_info(pools: Any, served_name: str, context_length: int) -> pb.ModelInfo:
    info = pools.model_info
    workers = list(pools.workers.values())
    # Quantization and speculation are decode-side: a decode (or colocated) worker's say.
    dec = next((w.info for w in workers if w.role is not Role.PREFILL and w.info), info)
    return pb.ModelInfo(model=served_name, context_length=context_length,
                        vocab_size=info.vocab_size, dtype=info.dtype, quantization=dec.quantization,
                        speculative=dec.speculative, block_size=info.block_size, kernels=dec.kernels,
                        memory=[m for w in workers if (m := worker_memory(w)) is not None])


def worker_status(w: Worker, stranded: dict[str, int] | None) -> pb.WorkerStatus:
    ws = pb.WorkerStatus(worker_id=w.worker_id, role=w.role, state=w.state, restarts=w.restarts,
                         stranded_blocks=(stranded or {}).get(w.worker_id, 0), memory=worker_memory(w))
    if (s := w.status) is not None:
        spec = s.speculative or {}
        ws.MergeFrom(pb.WorkerStatus(
            running=s.running, waiting=s.waiting, kv_blocks_used=s.kv_blocks_used,
            kv_blocks_total=s.kv_blocks_total, tokens_per_s=s.tokens_per_s,
            metrics_address=s.metrics_address or "",
            speculative_acceptance=spec.get("acceptance_rate") or 0.0,
            speculative_tokens_per_verify=spec.get("mean_tokens_per_verify") or 0.0))
    return ws


def cluster_status(mode: str, workers: Iterable[Worker], stranded: dict[str, int] | None, metrics_address: str,
                   queued: int, active: int, events: Iterable[str]) -> pb.ClusterStatus:
    """``stranded``: per worker, the blocks the leak check found (None: not checked)."""
    return pb.ClusterStatus(mode=mode, workers=[worker_status(w, stranded) for w in workers],
                            metrics_address=metrics_address, queued_requests=queued, active_requests=active,
                            blocks_checked=stranded is not None, autoscale_events=list(events))
