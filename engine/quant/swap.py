"""Quantized modules in place of linears: which module a :class:`QuantizedWeight` becomes, and
putting a module at a dotted name.

The bottom of the quantization methods: ``quantize``, the layer-by-layer calibration and the
methods that scale weights before rounding (AWQ, SmoothQuant) all swap modules through here.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.quant.config import QuantConfig
from engine.quant.formats import QuantizedWeight
from engine.quant.linear import Int4Linear, Int8Linear, QuantLinear, W8A8Linear


def make_module(qw: QuantizedWeight, bias: torch.Tensor | None, cfg: QuantConfig,
                in_scale: torch.Tensor | None = None) -> QuantLinear:
    if cfg.activations == "int8":
        return W8A8Linear(qw, bias, in_scale)
    return Int8Linear(qw, bias) if qw.bits == 8 else Int4Linear(qw, bias)


def set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, module)


def swap_in(model: nn.Module, weights: dict[str, QuantizedWeight], cfg: QuantConfig,
            in_scales: dict[str, torch.Tensor] | None = None) -> None:
    """Replace each named ``nn.Linear`` by its quantized module (keeping its bias)."""
    for n, qw in weights.items():
        lin = model.get_submodule(n)
        set_module(model, n, make_module(qw, lin.bias, cfg, (in_scales or {}).get(n)))
