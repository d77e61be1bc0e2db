"""Quantized self-draft: an INT4 copy of the target (same tokenizer by construction).

The copy is loaded from the target's own folder with round-to-nearest INT4 weights (the
quantization package's format, ``engine.quant``), with a KV cache of its own laid out like the
target's; the engine sizes its cache memory for both.
"""

from __future__ import annotations

from engine.kv_cache import allocate_kv_tensors
from engine.layers.attention import get_attention_backend
from engine.models.loader import load_model
from engine.quant.checkpoint import is_quantized_checkpoint
from engine.spec.model_draft import ModelDraft


def quant_self_draft(engine, quantization: str = "int4") -> ModelDraft:
    """A copy of ``engine``'s model quantized as ``quantization`` (INT4 by default) as a draft.

    Raises:
        ModelLoadError: the target cannot be reloaded.
    """
    mc = engine.model_config
    backend = get_attention_backend(engine.config.attention_backend)
    # A target that is already a quantized checkpoint is its own cheap copy: load it as saved.
    q = None if is_quantized_checkpoint(engine.model_path) else quantization
    model = load_model(engine.model_path, backend, engine.dtype, engine.config.device, quantization=q)
    bm = engine.block_manager
    kv = allocate_kv_tensors(mc.num_layers, bm.num_blocks, bm.block_size, mc.num_kv_heads, mc.head_dim,
                             engine.dtype, engine.config.device)
    draft = ModelDraft(model, backend, kv, bm.block_size, engine.config.device)
    draft.name = "quant_self"
    return draft
