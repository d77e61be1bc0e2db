"""The cluster config's pools as the engine configs their workers load (``engine_configs``)."""

from __future__ import annotations

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from router.config import ClusterConfig


def _fixed_gb(kv_cache_gb: float | str) -> float:
    """A pool's KV cache GiB; for ``auto`` the engine's default, which the worker replaces with
    its node's figure when it starts (``WorkerOptions.kv_cache_auto``, worker.actor)."""
    return CacheConfig().memory_gb if kv_cache_gb == "auto" else kv_cache_gb


def engine_configs(cfg: ClusterConfig, model_path: str) -> tuple[EngineConfig, EngineConfig]:
    """(prefill, decode) engine configs from the cluster config."""
    p, d = cfg.prefill, cfg.decode
    common = dict(model=model_path, dtype=cfg.dtype, dequantize=cfg.dequantize, activations=cfg.activations,
                  device=cfg.device)
    from engine.quant import split_quantization  # (heavy: torch, through the engine)
    prefill_model, prefill_quant = split_quantization(p.quantization, model_path)
    # A prefill worker never decodes: no compiled one-token path (its memory and compile time).
    prefill = EngineConfig(**{**common, "model": prefill_model}, quantization=prefill_quant, compile_decode=False,
                           cache=CacheConfig(block_size=p.block_size, memory_gb=_fixed_gb(p.kv_cache_gb)),
                           scheduler=SchedulerConfig(max_num_batched_tokens=p.max_batched_tokens))
    decode_model, quantization = split_quantization(d.quantization, model_path)  # a checkpoint replaces the model
    decode = EngineConfig(**{**common, "model": decode_model}, quantization=quantization,
                          compile_decode=d.compile_decode, compile_decode_rows=d.compile_decode_rows,
                          jump_forward=d.jump_forward,
                          cache=CacheConfig(block_size=d.block_size, memory_gb=_fixed_gb(d.kv_cache_gb)),
                          scheduler=SchedulerConfig(max_num_batched_tokens=d.max_batched_tokens,
                                                    max_num_seqs=d.max_num_seqs,
                                                    enable_chunked_prefill=d.chunked_prefill),
                          speculative=d.speculative.to_engine())
    return prefill, decode
