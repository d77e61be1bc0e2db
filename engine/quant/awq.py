"""AWQ: activation-aware per-input-channel scaling before round-to-nearest.

A few input channels carry much larger activations than the rest; their weights matter more.
Scaling weight column j up by s_j (and the input down by s_j) is exact in full precision,
``y = (x / s) (W * s)^T``, but gives those columns finer quantization steps. AWQ searches
``s = mean|x|^alpha`` (normalized), alpha in a grid over [0, 1], for the least output error
``||x W^T - (x / s) Q(W * s)^T||^2`` on calibration inputs (Lin et al., 2023). The 1/s is folded
into the op that feeds the linear (a norm's weight, or the "up" rows of gate_up for
down_proj), so serving pays nothing. Linears with no foldable producer (o_proj under GQA, the
LM head when it is tied and shared) keep s = 1, i.e. plain RTN.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from engine.quant.config import QuantConfig
from engine.quant.formats import QuantizedWeight, quantize_weight
from engine.quant.layerwise import QuantizedSwap, run_layerwise

GRID = 20


def search_scale(ws: list[torch.Tensor], x: torch.Tensor, bits: int, groups: list[int | None],
                 symmetric: bool, grid: int = GRID, max_rows: int = 512) -> tuple[torch.Tensor, float]:
    """Best per-input-channel scale for weights ``ws`` (each [N_i, K]) sharing inputs x [n, K].

    The statistic mean|x| uses every row; the error search a random subset of ``max_rows``
    (the LM head's outputs are large).

    Returns:
        (s [K], relative output error at s on that subset); alpha = 0 (s = 1) is in the grid,
        so the result is never worse than RTN on these inputs.
    """
    x = x.float()
    x_mean = x.abs().mean(0).clamp_min(1e-8)
    if x.shape[0] > max_rows:
        x = x[torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(0))[:max_rows]]
    refs = [x @ w.float().T for w in ws]
    norm = sum(float((r ** 2).sum()) for r in refs) or 1.0
    best, best_s = float("inf"), torch.ones_like(x_mean)
    for a in range(grid + 1):
        alpha = a / grid
        s = x_mean.pow(alpha)
        s = s / (s.max() * s.min()).sqrt()
        xs = x / s
        err = 0.0
        for w, g, r in zip(ws, groups, refs):
            q = quantize_weight(w.float() * s, bits, g, symmetric).dequantize()
            err += float(((xs @ q.T - r) ** 2).sum())
        if err < best:
            best, best_s = err, s
    return best_s, best / norm


def awq_quantize(w: torch.Tensor, x: torch.Tensor, bits: int, group_size: int | None,
                 symmetric: bool) -> tuple[QuantizedWeight, torch.Tensor]:
    """AWQ for one linear alone: (integer weight of W * s, s). The caller divides inputs by s."""
    s, _ = search_scale([w], x, bits, [group_size], symmetric)
    return quantize_weight(w.float() * s, bits, group_size, symmetric), s


def _producers(model: nn.Module, prefix: str) -> dict[str, Callable[[torch.Tensor], None]]:
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


def _untie(lin: nn.Linear) -> nn.Linear:
    new = nn.Linear(lin.in_features, lin.out_features, bias=False, dtype=lin.weight.dtype)
    new.weight = nn.Parameter(lin.weight.detach().clone(), requires_grad=False)
    return new


@torch.no_grad()
def awq_model(model: nn.Module, cfg: QuantConfig, targets: dict[str, nn.Linear], seqs: list[list[int]],
              progress: Callable[[str], None] | None = None, swap: bool = True) -> dict[str, QuantizedWeight]:
    """Sequential AWQ over the model; rescales norms/weights in place (exact in fp)."""
    from engine.quant.quantize import set_module

    sw = QuantizedSwap(model, cfg)

    def handle(prefix: str, inputs: dict[str, torch.Tensor]) -> None:
        fold = _producers(model, prefix)
        # down_proj first: folding its 1/s into gate_up's rows must happen before gate_up is
        # quantized
        for name in sorted(inputs, key=lambda n: not n.endswith("down_proj")):
            lin = model.get_submodule(name)
            if lin.weight is model.embed_tokens.weight:  # tied: scale a copy, not the embeddings
                lin = _untie(lin)
                set_module(model, name, lin)
            g = cfg.group_for(lin.in_features, name)
            if name in fold:
                s, _ = search_scale([lin.weight], inputs[name], cfg.bits, [g], cfg.symmetric)
                fold[name](s)
                lin.weight.mul_(s)
            sw.put(name, lin, quantize_weight(lin.weight, cfg.bits, g, cfg.symmetric))

    run_layerwise(model, seqs, targets, handle, progress)
    return sw.finish(swap)
