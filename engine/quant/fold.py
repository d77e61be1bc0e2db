"""Folding a per-input-channel scale into the op that feeds a linear (AWQ and SmoothQuant).

Both methods scale weight column j up by s_j and the linear's input down by s_j, which is exact
in full precision: ``y = (x / s) (W * s)^T``. The 1/s goes into the producer of x, so serving
pays nothing: a norm's weight, or the "up" rows of gate_up for down_proj. Linears with no
foldable producer (o_proj under GQA) are left out of :func:`producers` and keep s = 1.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from engine.quant.swap import set_module


def producers(model: nn.Module, prefix: str) -> dict[str, Callable[[torch.Tensor], None]]:
    """For each linear of a layer, a function that divides its inputs by s (folded upstream)."""
    if prefix == "lm_head":
        return {"lm_head": lambda s: model.norm.divide_(s.to(model.norm.weight.dtype))}
    layer = model.get_submodule(prefix.rstrip("."))
    inter = layer.mlp.inter

    def div_up_rows(s: torch.Tensor) -> None:
        layer.mlp.gate_up_proj.weight[inter:].div_(s[:, None].to(layer.mlp.gate_up_proj.weight.dtype))

    # the norms' own divide_ knows their form (Llama: w / s; Gemma: (1 + w) / s - 1); the MLP's
    # input norm is named per family
    return {
        prefix + "self_attn.qkv_proj": lambda s: layer.input_layernorm.divide_(s),
        prefix + "mlp.gate_up_proj": lambda s: layer.get_submodule(layer.mlp_norm_name).divide_(s),
        prefix + "mlp.down_proj": div_up_rows,
    }


def fold_order(names: Iterable[str]) -> list[str]:
    """down_proj first: folding its 1/s into gate_up's rows must happen before gate_up is
    scaled or quantized."""
    return sorted(names, key=lambda n: not n.endswith("down_proj"))


def untie(lin: nn.Linear) -> nn.Linear:
    """A copy of ``lin`` with a weight of its own."""
    new = nn.Linear(lin.in_features, lin.out_features, bias=False, dtype=lin.weight.dtype)
    new.weight = nn.Parameter(lin.weight.detach().clone(), requires_grad=False)
    return new


def own_linear(model: nn.Module, name: str) -> nn.Linear:
    """The linear at ``name``, first untied if it shares the embeddings' weight (a tied LM
    head): scaling must change a copy, not the embeddings."""
    lin = model.get_submodule(name)
    if lin.weight is model.embed_tokens.weight:
        lin = untie(lin)
        set_module(model, name, lin)
    return lin
