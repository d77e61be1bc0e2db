"""A separate draft model: any Llama-family checkpoint whose tokenizer equals the target's."""

from __future__ import annotations

from pathlib import Path

import torch

from engine.config import ModelConfig
from engine.errors import ModelLoadError
from engine.kv_cache import allocate_kv_tensors, kv_bytes_per_block
from engine.layers.attention import get_attention_backend
from engine.models.loader import load_model, resolve_model_path
from engine.spec.model_draft import ModelDraft


def check_same_tokenizer(target_tok, draft_tok, target_vocab: int, draft_vocab: int, where: str) -> None:
    """Refuse a draft whose token ids could mean something else than the target's.

    Raises:
        ModelLoadError: vocabularies, special tokens or model vocab sizes differ.
    """
    if target_vocab != draft_vocab:
        raise ModelLoadError(f"draft model {where!r} has vocab_size {draft_vocab}, the target {target_vocab}: "
                             "speculative decoding needs the same tokenizer")
    tv, dv = target_tok.get_vocab(), draft_tok.get_vocab()
    if tv != dv:
        diff = sorted(set(tv.items()) ^ set(dv.items()))[:3]
        raise ModelLoadError(f"draft model {where!r} has a different tokenizer vocabulary than the target "
                             f"({len(dv)} vs {len(tv)} entries; e.g. {diff}): speculative decoding needs "
                             "the same tokenizer")
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        a, b = getattr(target_tok, attr, None), getattr(draft_tok, attr, None)
        if a != b:
            raise ModelLoadError(f"draft model {where!r}: {attr} is {b!r}, the target's {a!r}: "
                                 "speculative decoding needs the same special tokens")
    if sorted(map(str, target_tok.all_special_tokens)) != sorted(map(str, draft_tok.all_special_tokens)):
        raise ModelLoadError(f"draft model {where!r} has different special tokens than the target")


def draft_kv_bytes_per_block(path: str | Path, block_size: int, dtype: torch.dtype) -> int:
    """KV bytes per block the draft adds (the engine sizes its cache for both)."""
    c = ModelConfig.from_hf(Path(path))
    return kv_bytes_per_block(c.num_layers, block_size, c.num_kv_heads, c.head_dim, dtype)


def load_draft_model(path: str | Path, target_tokenizer, target_config: ModelConfig, num_blocks: int,
                     block_size: int, dtype: torch.dtype, device: str, max_model_len: int,
                     attention_backend: str = "sdpa") -> ModelDraft:
    """Load the draft checkpoint at ``path`` with a KV cache of ``num_blocks`` blocks of its own.

    Raises:
        ModelLoadError: unsupported checkpoint, a different tokenizer, or too short a context.
    """
    from transformers import AutoTokenizer  # heavy: transformers
    path = resolve_model_path(str(path), progress=False)
    cfg = ModelConfig.from_hf(path)
    try:
        tok = AutoTokenizer.from_pretrained(str(path))
    except Exception as e:  # noqa: BLE001 - any failure means we cannot check the tokenizer
        raise ModelLoadError(f"draft model {str(path)!r} has no loadable tokenizer ({e}); "
                             "speculative decoding needs one equal to the target's") from e
    check_same_tokenizer(target_tokenizer, tok, target_config.vocab_size, cfg.vocab_size, str(path))
    if cfg.max_position_embeddings < max_model_len:
        raise ModelLoadError(f"draft model {str(path)!r} handles {cfg.max_position_embeddings} positions, "
                             f"the engine's context is {max_model_len}: set max_model_len lower")
    backend = get_attention_backend(attention_backend)
    model = load_model(path, backend, dtype, device)
    kv = allocate_kv_tensors(cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim, dtype, device)
    draft = ModelDraft(model, backend, kv, block_size, device)
    draft.name = "draft"
    return draft
