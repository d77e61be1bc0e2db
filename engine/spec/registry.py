"""Draft sources by name (``SpeculativeConfig.method``)."""

from __future__ import annotations

from engine.config import SPECULATIVE_METHODS, SpeculativeConfig
from engine.spec.draft_model import draft_kv_bytes_per_block, load_draft_model
from engine.spec.layer_skip import layer_skip_draft
from engine.spec.ngram import NgramProposer
from engine.spec.proposer import Proposer
from engine.spec.quant_self import quant_self_draft


def build_proposer(config: SpeculativeConfig, engine) -> Proposer:
    """The proposer for ``config.method``; ``engine`` is the LLMEngine being built."""
    m = config.method
    if m == "ngram":
        return NgramProposer(config.ngram_max, config.ngram_min)
    if m == "layer_skip":
        r = engine.runner
        return layer_skip_draft(engine.model, r.backend, r.kv_caches, r.block_size, config.draft_layers,
                                engine.config.device)
    if m == "draft":
        return load_draft_model(config.draft_model, engine.tokenizer, engine.model_config,
                                engine.block_manager.num_blocks, engine.block_manager.block_size,
                                engine.dtype, engine.config.device, engine.max_model_len,
                                engine.config.attention_backend)
    if m == "quant_self":
        return quant_self_draft(engine, config.draft_quantization)
    raise ValueError(f"unknown speculative method {m!r}; valid: {', '.join(SPECULATIVE_METHODS)}")


def extra_kv_bytes_per_block(config: SpeculativeConfig | None, engine_model_path, block_size: int, dtype) -> int:
    """KV bytes per block a draft with a cache of its own adds (0 for ngram and layer_skip)."""
    if config is None or config.method in ("ngram", "layer_skip"):
        return 0
    path = config.draft_model if config.method == "draft" else engine_model_path
    return draft_kv_bytes_per_block(path, block_size, dtype)
