"""SmoothQuant (W8A8): move activation outliers into the weights before quantizing both.

Per input channel j of a linear (or of linears sharing an input),
``s_j = max|x_j|^alpha / max|W_:j|^(1 - alpha)``; then ``y = (x / s) (W * s)^T`` is exact in full
precision, but x / s has no outlier channels left, so per-tensor INT8 activations lose little
(Xiao et al., 2022). 1/s is folded into the producer (norm weight, or gate_up's "up" rows for
down_proj); o_proj has no foldable producer under GQA and keeps s = 1.

Where it runs: the W8A8 GEMM is ``quantized::linear_dynamic`` (fbgemm/x86 engines, int8 x int8
with int32 accumulation), which exists in torch's CPU builds for x86. It quantizes activations
per tensor, dynamically, on every call. There is no int8 x int8 path here for CUDA (use
weight-only INT8/INT4 there); :func:`engine.quant.cpu_kernels.w8a8_available` says which.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from engine.quant.fold import fold_order, own_linear, producers
from engine.quant.layerwise import run_layerwise


def smooth_scale(x_absmax: torch.Tensor, ws: list[torch.Tensor], alpha: float) -> torch.Tensor:
    """``s = max|x|^alpha / max|W|^(1-alpha)`` per input channel (clamped away from 0)."""
    w_absmax = torch.stack([w.detach().float().abs().amax(0) for w in ws]).amax(0)
    s = x_absmax.clamp_min(1e-5).pow(alpha) / w_absmax.clamp_min(1e-5).pow(1 - alpha)
    return s.clamp_min(1e-5)


@torch.no_grad()
def smooth_model(model: nn.Module, targets: dict[str, nn.Linear], seqs: list[list[int]], alpha: float,
                 progress: Callable[[str], None] | None = None) -> dict[str, torch.Tensor]:
    """Fold SmoothQuant scales into ``model`` in place (exact in fp).

    Returns:
        per-layer input scales that could not be folded (none with this model family).
    """
    def handle(prefix: str, inputs: dict[str, torch.Tensor]) -> None:
        fold = producers(model, prefix)
        for name in fold_order(n for n in inputs if n in fold):
            lin = own_linear(model, name)
            s = smooth_scale(inputs[name].abs().amax(0), [lin.weight], alpha)
            fold[name](s)
            lin.weight.mul_(s)

    run_layerwise(model, seqs, targets, handle, progress)
    return {}
