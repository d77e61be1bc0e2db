"""GPTQ: quantize a weight column by column, pushing each column's rounding error onto the
columns not yet quantized, weighted by the inverse Hessian of the layer's inputs.

For a linear with inputs X [n, K] the layer-wise loss of a weight change dW is
``||X dW^T||^2 = tr(dW H dW^T)`` with ``H = 2 X^T X / n``. Quantizing column j to q_j leaves an
error ``e = (w_j - q_j) / [H^-1]_jj``; the optimal update of the remaining columns is
``W[:, j+1:] -= e [H^-1]_{j, j+1:}`` (Frantar et al., 2022). We use the upper Cholesky factor
of H^-1 (numerically stable), damping ``H += damp * mean(diag H) * I``, lazy block updates of
128 columns, and optionally act-order: columns in decreasing diag(H). With act-order, group
scales are computed up front on the original contiguous groups ("static groups"), so the
packed layout the kernels need is unchanged.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from engine.quant.config import QuantConfig
from engine.quant.formats import QuantizedWeight, group_view, qparams, qrange
from engine.quant.layerwise import QuantizedSwap, run_layerwise

BLOCK = 128  # a multiple of every group size, so each group starts inside one block


def hessian(x: torch.Tensor) -> torch.Tensor:
    """``H = 2 X^T X / n`` for inputs X [n, K] (float64 accumulation)."""
    x = x.double()
    return (2.0 / x.shape[0]) * (x.T @ x)


@torch.no_grad()
def gptq_quantize(w: torch.Tensor, h: torch.Tensor, bits: int, group_size: int | None, symmetric: bool,
                  damp: float = 0.01, act_order: bool = False) -> QuantizedWeight:
    """GPTQ on one weight W [N, K] given its input Hessian H [K, K].

    Returns:
        The integer weight (same format as round-to-nearest produces).
    """
    w = w.detach().float().clone()
    n, k = w.shape
    h = h.double().clone()
    dead = torch.diag(h) == 0  # inputs that are always zero: their weights do not matter
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    g = group_size or k
    n_groups = k // g
    qmin, qmax = qrange(bits, symmetric)
    scale = torch.empty(n, n_groups)
    zero = torch.empty(n, n_groups)
    if act_order or group_size is None:
        # static parameters from the original weight (per channel: the whole row)
        s0, z0 = qparams(group_view(w, group_size), bits, symmetric)
        scale.copy_(s0)
        zero.copy_(z0)
    perm = torch.argsort(torch.diag(h), descending=True) if act_order else torch.arange(k)
    w = w[:, perm]
    h = h[perm][:, perm]
    h += damp * torch.mean(torch.diag(h)) * torch.eye(k, dtype=h.dtype)
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True).float()

    q = torch.zeros_like(w)
    group_of = perm // g  # the (original) group of each permuted column
    dynamic = not act_order and group_size is not None
    for b0 in range(0, k, BLOCK):
        b1 = min(b0 + BLOCK, k)
        w1 = w[:, b0:b1].clone()
        err1 = torch.zeros_like(w1)
        hinv1 = hinv[b0:b1, b0:b1]
        for i in range(b1 - b0):
            col = b0 + i
            gi = int(group_of[col])
            if dynamic and col % g == 0:
                # parameters of a new group from its current (error-updated) weights
                s, z = qparams(w1[:, i:i + g], bits, symmetric)
                scale[:, gi], zero[:, gi] = s, z
            s, z = scale[:, gi], zero[:, gi]
            wc = w1[:, i]
            qc = torch.clamp(torch.round(wc / s) + z, qmin, qmax)
            q[:, col] = qc
            d = hinv1[i, i]
            e = (wc - (qc - z) * s) / d
            w1[:, i:] -= e[:, None] * hinv1[i, i:][None, :]
            err1[:, i] = e
        w[:, b1:] -= err1 @ hinv[b0:b1, b1:]
    q = q[:, torch.argsort(perm)]
    dtype = torch.int8 if bits == 8 else torch.uint8
    if bits == 8:
        return QuantizedWeight(q.to(dtype), scale[:, 0].contiguous(), zero[:, 0].contiguous(), 8, None, symmetric)
    return QuantizedWeight(q.to(dtype), scale, zero, 4, group_size, symmetric)


def reconstruction_error(w: torch.Tensor, qw: QuantizedWeight, x: torch.Tensor) -> float:
    """``||X W^T - X Wq^T||^2 / ||X W^T||^2`` on inputs X: the layer-wise loss GPTQ minimizes."""
    ref = x.float() @ w.float().T
    return float(((x.float() @ qw.dequantize().T - ref) ** 2).sum() / (ref ** 2).sum())


def gptq_model(model: nn.Module, cfg: QuantConfig, targets: dict[str, nn.Linear], seqs: list[list[int]],
               progress: Callable[[str], None] | None = None, swap: bool = True) -> dict[str, QuantizedWeight]:
    """Sequential GPTQ over the whole model (layer i calibrates on quantized layers < i).

    Args:
        swap: leave the quantized modules in the model; False restores the fp linears after.
    """
    sw = QuantizedSwap(model, cfg)

    def handle(prefix: str, inputs: dict[str, torch.Tensor]) -> None:
        for name, x in inputs.items():
            lin = model.get_submodule(name)
            sw.put(name, lin, gptq_quantize(lin.weight, hessian(x), cfg.bits, cfg.group_for(lin.in_features, name),
                                            cfg.symmetric, cfg.damp, cfg.act_order))

    run_layerwise(model, seqs, targets, handle, progress)
    return sw.finish(swap)
