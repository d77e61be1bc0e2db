"""Each model family's layers as the native decode kernels read them (engine/models/native.py
``LayerSpec``, native_decode.c ``layer_t``): which norms there are and the weights they multiply
by, the MLP's activation, the attention window, and which rotary table each layer takes.

- Llama family (engine/models/llama.py: Llama, Mistral, Qwen2, SmolLM2): the input norm and the
  post-attention norm (the one before the MLP), SiLU, full attention, one rotary table.
- Gemma 3 (engine/models/gemma3.py): QK-norm, the sandwich norms, GeGLU with gelu-tanh, the
  sliding window on local layers, which take the local rotary table; the embedding scale and the
  logit soft-capping are the model's own steps (``embed``; ``softcap`` here).

GemmaRMSNorm is HF's ``x * rsqrt(mean(x^2) + eps)`` in fp32, times ``(1.0 + w)`` computed in
fp32: ``1 + w`` stored once is that same fp32 add, so the kernel's product with it is HF's bit
for bit, and the kernel's plain RMSNorm serves both families.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engine.models.native import ACT_GELU_TANH, LayerSpec

FAMILIES = ("llama", "gemma3")


@dataclass(frozen=True)
class Layout:
    """One model's layers for the small-step path.

    Attributes:
        specs: per layer, what its C struct holds besides the linears.
        norm: the final norm's weight, as multiplied.
        rotaries: the model's rotary modules (their tables are read per step: reset_rotary
            replaces them in place).
        rope: per layer, the index of its table in ``rotaries``.
        softcap: final logit soft-capping ``c * tanh(z / c)``, or None.
        graphs: whether the compiled graphs (engine/models/step_graphs.py, Llama-shaped) can
            serve this family where the native kernels do not; otherwise its eager forward does.
    """

    specs: list[LayerSpec]
    norm: torch.Tensor
    rotaries: tuple[nn.Module, ...]
    rope: list[int]
    softcap: float | None
    graphs: bool


def _gemma_weight(norm: nn.Module) -> torch.Tensor:
    """GemmaRMSNorm's multiplier, ``1.0 + w`` in fp32 exactly as its forward computes it."""
    return 1.0 + norm.weight.detach().float()


def layout(model: nn.Module) -> Layout:
    """``model``'s layout (a family of FAMILIES)."""
    cfg = model.config
    if cfg.family == "llama":
        specs = [LayerSpec(l.input_layernorm.weight, l.post_attention_layernorm.weight) for l in model.layers]
        return Layout(specs, model.norm.weight, (model.rotary,), [0] * len(specs), None, graphs=True)
    if cfg.family == "gemma3":
        specs = []
        for l in model.layers:
            a = l.self_attn
            specs.append(LayerSpec(
                _gemma_weight(l.input_layernorm), _gemma_weight(l.pre_feedforward_layernorm),
                q_norm=_gemma_weight(a.q_norm), k_norm=_gemma_weight(a.k_norm),
                post_attn=_gemma_weight(l.post_attention_layernorm),
                post_ffn=_gemma_weight(l.post_feedforward_layernorm),
                act=ACT_GELU_TANH, window=a.window or 0))
        return Layout(specs, _gemma_weight(model.norm), (model.rotary, model.rotary_local),
                      [int(l.sliding) for l in model.layers], cfg.final_logit_softcapping, graphs=False)
    raise ValueError(f"no small-step layout for family {cfg.family!r} (have {', '.join(FAMILIES)})")


def fits(model: nn.Module) -> bool:
    """``model`` is of a family here, with its layers as :func:`layout` reads them (Gemma: the
    gelu-tanh GeGLU, every norm a module with an fp32 weight)."""
    cfg = model.config
    if cfg.family not in FAMILIES:
        return False
    if cfg.family == "llama":
        return True
    if cfg.hidden_act != "gelu_pytorch_tanh":
        return False
    for l in model.layers:
        norms = (l.input_layernorm, l.post_attention_layernorm, l.pre_feedforward_layernorm,
                 l.post_feedforward_layernorm, l.self_attn.q_norm, l.self_attn.k_norm, model.norm)
        if any(getattr(n, "weight", None) is None or n.weight.dtype != torch.float32 for n in norms):
            return False
    return True
