"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2) over a paged KV cache.

One forward is one "extend" step: a flattened batch of new tokens from many requests, each
attending to its own cached context. Prefill, chunked prefill, decode and speculative verify
are all this same call. q/k/v and gate/up are fused into single matmuls (fewer, larger GEMMs:
at batch 1 on CPU per-op overhead is a real share of the step).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import ModelConfig
from engine.layers.attention import AttentionBackend, AttentionMetadata
from engine.layers.linear import PackedGateUp, PackedLinear
from engine.layers.rotary import RotaryEmbedding, apply_rotary


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # one fused op; bitwise equal to the steps below in fp32
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # HF normalizes in fp32 and casts back before the weight multiply; do the same.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    @torch.no_grad()
    def divide_(self, s: torch.Tensor) -> None:
        """Scale the output channels by 1 / s (AWQ/SmoothQuant fold a linear's input scale here)."""
        self.weight.div_(s)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.nq, self.nkv, self.hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, (self.nq + 2 * self.nkv) * self.hd, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.nq * self.hd, cfg.hidden_size, bias=False)
        self.backend = backend
        self.scale = self.hd ** -0.5

    def forward(self, x: torch.Tensor, residual: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata, kv_cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """``residual + attention(x)``."""
        t, nq, nqk = x.shape[0], self.nq, self.nq + self.nkv
        qkv = self.qkv_proj(x).view(t, nqk + self.nkv, self.hd)
        qk = apply_rotary(qkv[:, :nqk], *rope)
        o = self.backend.forward(qk[:, :nq], qk[:, nq:], qkv[:, nqk:], kv_cache, meta, self.scale)
        o = o.reshape(t, nq * self.hd)
        if isinstance(self.o_proj, PackedLinear):
            return self.o_proj.forward_add(o, residual)
        return residual + self.o_proj(o)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.inter = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``residual + mlp(x)``; prepacked linears do the activation and the add as post-ops."""
        if isinstance(self.gate_up_proj, PackedGateUp) and isinstance(self.down_proj, PackedLinear):
            return self.down_proj.forward_add(self.gate_up_proj.silu_mul(x), residual)
        gate, up = self.gate_up_proj(x).split(self.inter, -1)
        return residual + self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    # The norm whose output feeds the MLP (AWQ/SmoothQuant fold scales into it).
    mlp_norm_name = "post_attention_layernorm"

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, backend)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, rope, meta, kv_cache):
        x = self.self_attn(self.input_layernorm(x), x, rope, meta, kv_cache)
        return self.mlp(self.post_attention_layernorm(x), x)


class LlamaForCausalLM(nn.Module):
    """Decoder + LM head. ``forward`` returns hidden states; ``compute_logits`` only for rows asked."""

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.config = cfg
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta,
                                      cfg.rope_scaling)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, backend) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # the compiled one-token path (engine/models/single_token.py), attached by the loader
        self.single_token = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                layer_done: Callable[[int], None] | None = None) -> torch.Tensor:
        """input_ids, positions [T] -> hidden states [T, hidden] (before the final norm).

        ``layer_done(i)`` is called once layer i's K/V are in the cache, so a KV sender can
        stream layer i while layers i+1.. compute.
        """
        if self.single_token is not None and 1 <= input_ids.shape[0] <= self.single_token.max_rows:
            return self.single_token.forward(input_ids, positions, meta, kv_caches, layer_done)
        x = self.embed(input_ids)
        rope = self.rope_tables(positions, x.dtype)
        for i, (layer, kv) in enumerate(zip(self.layers, kv_caches)):
            x = layer(x, rope, meta, kv)
            if layer_done is not None:
                layer_done(i)
        return x

    # The per-family pieces that code driving the layers itself (engine/spec/layer_skip.py,
    # engine/quant/calib.py) uses: every family's layer is ``layer(x, rope, meta, kv_cache)``.
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] -> the first layer's input [T, hidden]."""
        return self.embed_tokens(input_ids)

    def rope_tables(self, positions: torch.Tensor, dtype: torch.dtype):
        """What every layer gets for ``positions`` [T]: the rotary cos/sin tables."""
        return self.rotary.tables(positions, dtype)

    def reset_rotary(self, device: str | torch.device) -> None:
        """Recompute the rotary tables on ``device`` (they are not weights: a model built on the
        meta device and materialized with ``to_empty`` has garbage there)."""
        cfg = self.config
        rot = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        self.rotary.cos, self.rotary.sin = rot.cos.to(device), rot.sin.to(device)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] of the positions that sample -> logits [N, vocab] in fp32."""
        if self.single_token is not None and 1 <= hidden.shape[0] <= self.single_token.max_rows:
            return self.single_token.logits(hidden)
        return self.lm_head(self.norm(hidden)).float()
