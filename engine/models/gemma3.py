"""Gemma 3 text decoder (HF ``Gemma3ForCausalLM``, model_type ``gemma3_text``) over a paged KV cache.

Same contract as the Llama family (engine/models/llama.py): one forward is one extend step over
a flattened batch, ``forward`` returns hidden states before the final norm, ``compute_logits``
fp32 logits. What differs, each as transformers computes it:

- embeddings times sqrt(hidden_size) (cast to the embedding dtype first, as HF does);
- RMSNorm is ``norm(x) * (1 + w)`` in fp32, then cast; q and k get one per head (q_norm,
  k_norm) before rotary;
- each layer is sandwiched: ``h + post_norm(attn(pre_norm(h)))``, the same around the MLP;
- attention scale ``query_pre_attn_scalar ** -0.5``; local layers ("sliding_attention") see
  the last ``sliding_window`` positions and use rotary base ``rope_local_theta``, global layers
  see everything and use ``rope_theta`` (with the rope scaling, if any);
- MLP ``down(gelu_tanh(gate) * up)``; optional final logit soft-capping ``c * tanh(z / c)``.

Small steps (decode, small batches, verify) run on the native kernels where they build
(engine/models/single_token.py; the layer as they read it: engine/models/layer_specs.py), the
rest, and every step where they do not build, through this eager forward.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import ModelConfig
from engine.layers.attention import AttentionBackend, AttentionMetadata
from engine.layers.rotary import RotaryEmbedding, apply_rotary

Rope = tuple[torch.Tensor, torch.Tensor]


class GemmaRMSNorm(nn.Module):
    """``x / rms(x) * (1 + weight)``, computed in fp32 and cast back (HF Gemma3RMSNorm)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = 1.0 + self.weight.float()
        if x.dtype == torch.float32:  # one fused op; the same steps as below in fp32
            return F.rms_norm(x, w.shape, w, self.eps)
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * w).to(x.dtype)

    @torch.no_grad()
    def divide_(self, s: torch.Tensor) -> None:
        """Scale the output channels by 1 / s (AWQ/SmoothQuant fold a linear's input scale here)."""
        self.weight.copy_((1.0 + self.weight.float()) / s.float() - 1.0)


class Gemma3Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, sliding: bool) -> None:
        super().__init__()
        self.nq, self.nkv, self.hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, (self.nq + 2 * self.nkv) * self.hd, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.nq * self.hd, cfg.hidden_size, bias=cfg.attention_bias)
        self.q_norm = GemmaRMSNorm(self.hd, cfg.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.hd, cfg.rms_norm_eps)
        self.backend = backend
        self.scale = (cfg.query_pre_attn_scalar or self.hd) ** -0.5
        self.window = cfg.sliding_window if sliding else None  # None: full attention

    def forward(self, x: torch.Tensor, rope: Rope, meta: AttentionMetadata,
                kv_cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """``attention(x)`` (no residual: Gemma normalizes the output before adding it)."""
        t, nq, nqk = x.shape[0], self.nq, self.nq + self.nkv
        qkv = self.qkv_proj(x).view(t, nqk + self.nkv, self.hd)
        qk = apply_rotary(torch.cat((self.q_norm(qkv[:, :nq]), self.k_norm(qkv[:, nq:nqk])), 1), *rope)
        o = self.backend.forward(qk[:, :nq], qk[:, nq:], qkv[:, nqk:], kv_cache, meta, self.scale,
                                 window=self.window)
        return self.o_proj(o.reshape(t, nq * self.hd))


class Gemma3MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.inter = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Plain [gate | up] from any gate_up_proj: a PackedGateUp's fused activation (silu_mul)
        # is SiLU, not this one.
        gate, up = self.gate_up_proj(x).split(self.inter, -1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class Gemma3DecoderLayer(nn.Module):
    # The norm whose output feeds the MLP (AWQ/SmoothQuant fold scales into it).
    mlp_norm_name = "pre_feedforward_layernorm"

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, sliding: bool) -> None:
        super().__init__()
        self.sliding = sliding
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Gemma3Attention(cfg, backend, sliding)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = Gemma3MLP(cfg)
        self.post_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, ropes: tuple[Rope, Rope], meta: AttentionMetadata,
                kv_cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """``ropes``: (global, local) tables; this layer takes the one of its kind."""
        h = self.self_attn(self.input_layernorm(x), ropes[self.sliding], meta, kv_cache)
        x = x + self.post_attention_layernorm(h)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3ForCausalLM(nn.Module):
    """Decoder + LM head. ``forward`` returns hidden states; ``compute_logits`` only for rows asked."""

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.config = cfg
        self.rotary, self.rotary_local = self._rotaries(cfg)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_scale = math.sqrt(cfg.hidden_size)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(cfg, backend, s) for s in cfg.is_sliding)
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # the native small-step path (engine/models/single_token.py), attached by the loader
        self.single_token = None

    @staticmethod
    def _rotaries(cfg: ModelConfig) -> tuple[RotaryEmbedding, RotaryEmbedding]:
        """(global, local) rotary tables: rope scaling, if any, is per kind (HF rope_parameters)."""
        n = cfg.max_position_embeddings
        return (RotaryEmbedding(cfg.head_dim, n, cfg.rope_theta, cfg.rope_scaling),
                RotaryEmbedding(cfg.head_dim, n, cfg.rope_local_theta or cfg.rope_theta, cfg.rope_local_scaling))

    def reset_rotary(self, device: str | torch.device) -> None:
        """Recompute both rotary tables on ``device`` (not weights; see LlamaForCausalLM)."""
        for mine, fresh in zip((self.rotary, self.rotary_local), self._rotaries(self.config)):
            mine.cos, mine.sin = fresh.cos.to(device), fresh.sin.to(device)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] -> embeddings * sqrt(hidden), the scale rounded to their dtype first."""
        w = self.embed_tokens.weight
        scale = torch.tensor(self.embed_scale, dtype=torch.float32, device=w.device).to(w.dtype)
        return self.embed_tokens(input_ids) * scale

    def rope_tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[Rope, Rope]:
        """(global, local) cos/sin tables for ``positions``; indexed by ``layer.sliding``."""
        return self.rotary.tables(positions, dtype), self.rotary_local.tables(positions, dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                layer_done: Callable[[int], None] | None = None) -> torch.Tensor:
        """input_ids, positions [T] -> hidden states [T, hidden] (before the final norm).

        ``layer_done(i)`` is called once layer i's K/V are in the cache.
        """
        if self.single_token is not None and 1 <= input_ids.shape[0] <= self.single_token.max_rows:
            return self.single_token.forward(input_ids, positions, meta, kv_caches, layer_done)
        x = self.embed(input_ids)
        ropes = self.rope_tables(positions, x.dtype)
        for i, (layer, kv) in enumerate(zip(self.layers, kv_caches)):
            x = layer(x, ropes, meta, kv)
            if layer_done is not None:
                layer_done(i)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] of the positions that sample -> logits [N, vocab] in fp32."""
        if self.single_token is not None and 1 <= hidden.shape[0] <= self.single_token.max_rows:
            return self.single_token.logits(hidden)
        logits = self.lm_head(self.norm(hidden))
        cap = self.config.final_logit_softcapping
        if cap is not None:  # in the model's dtype, as HF does
            logits = torch.tanh(logits / cap) * cap
        return logits.float()
