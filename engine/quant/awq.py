"""AWQ: activation-aware per-input-channel scaling before round-to-nearest.

A few input channels carry much larger activations than the rest; their weights matter more.
Scaling weight column j up by s_j (and the input down by s_j) is exact in full precision,
``y = (x / s) (W * s)^T``, but gives those columns finer quantization steps. AWQ searches
``s = mean|x|^alpha`` (normalized), alpha in a grid over [0, 1], for the least output error
``||x W^T - (x / s) Q(W * s)^T||^2`` on calibration inputs (Lin et al., 2023). The 1/s is folded
into the op that feeds the linear (fold.py: a norm's weight, or the "up" rows of gate_up for
down_proj), so serving pays nothing. Linears with no foldable producer (o_proj under GQA, the
LM head when it is tied and shared) keep s = 1, i.e. plain RTN.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from engine.quant.config import QuantConfig
from engine.quant.fold import fold_order, own_linear, producers
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


@torch.no_grad()
def awq_model(model: nn.Module, cfg: QuantConfig, targets: dict[str, nn.Linear], seqs: list[list[int]],
              progress: Callable[[str], None] | None = None, swap: bool = True) -> dict[str, QuantizedWeight]:
    """Sequential AWQ over the model; rescales norms/weights in place (exact in fp)."""
    sw = QuantizedSwap(model, cfg)

    def handle(prefix: str, inputs: dict[str, torch.Tensor]) -> None:
        fold = producers(model, prefix)
        for name in fold_order(inputs):
            lin = own_linear(model, name)
            g = cfg.group_for(lin.in_features, name)
            if name in fold:
                s, _ = search_scale([lin.weight], inputs[name], cfg.bits, [g], cfg.symmetric)
                fold[name](s)
                lin.weight.mul_(s)
            sw.put(name, lin, quantize_weight(lin.weight, cfg.bits, g, cfg.symmetric))

    run_layerwise(model, seqs, targets, handle, progress)
    return sw.finish(swap)
