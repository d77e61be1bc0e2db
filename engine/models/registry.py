"""Model families by name: ``ModelConfig.family`` (from the HF architecture, engine/config.py
ARCHITECTURE_FAMILIES) -> the class that implements it, and ``build_model`` to make one.

Every family has the same surface: ``forward(input_ids, positions, meta, kv_caches,
layer_done)``, ``compute_logits(hidden)``, ``embed(input_ids)``, ``rope_tables(positions,
dtype)``, ``reset_rotary(device)``, ``layers`` (each ``layer(x, rope, meta, kv_cache)``),
``embed_tokens``, ``norm``, ``lm_head``, ``config`` and ``single_token``.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.config import SUPPORTED_ARCHITECTURES, ModelConfig
from engine.errors import ModelLoadError
from engine.layers.attention import AttentionBackend
from engine.models.gemma3 import Gemma3ForCausalLM
from engine.models.llama import LlamaForCausalLM

MODEL_FAMILIES: dict[str, type[nn.Module]] = {
    "llama": LlamaForCausalLM,  # Llama 2/3, SmolLM2, Mistral, Qwen2
    "gemma3": Gemma3ForCausalLM,
}


def build_model(cfg: ModelConfig, backend: AttentionBackend, device: str | torch.device = "cpu") -> nn.Module:
    """An uninitialized model of ``cfg``'s family on ``device`` (weights: whatever memory held;
    the caller loads them), with a tied LM head tied and the rotary tables computed.

    Raises:
        ModelLoadError: a family no class implements.
    """
    cls = MODEL_FAMILIES.get(cfg.family)
    if cls is None:
        raise ModelLoadError(f"architecture {cfg.architecture!r} (family {cfg.family!r}) is not supported; "
                             f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    with torch.device("meta"):  # no time spent initializing weights that are overwritten
        model = cls(cfg, backend)
    model = model.to_empty(device=device)
    if cfg.tie_word_embeddings:  # to_empty materializes each module alone, which unties them
        model.lm_head.weight = model.embed_tokens.weight
    model.reset_rotary(device)
    return model
