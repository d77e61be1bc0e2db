"""Prepacked CPU linear: oneDNN matmul on a weight reordered once into its blocked layout.

``F.linear`` on CPU calls MKL on the plain ``[N, K]`` weight, which is slow for the shapes a
serving engine runs: a single GEMV uses one thread, and every call re-reads a layout the kernel
does not want. oneDNN with a weight reordered at load time uses both cores for GEMV and is the
fastest of the options we measured on the 2-core AVX2 box for all three regimes (SmolLM2
decoder linears, 30 layers; ms per forward):

    rows (M)            1      32     512
    F.linear (MKL)     38-48   90     -
    MKL GEMV on W^T    29      -      -
    2-stripe bmm       21-27   69     -
    oneDNN prepacked   22-29   44     516

Used for fp32 on CPU when torch has oneDNN; anything else keeps ``nn.Linear``.
"""

from __future__ import annotations

import torch
from torch import nn

# oneDNN picks the blocked layout for an expected row count; 2048 (a prefill chunk) also served
# decode and batch-32 best in our measurements.
_PACK_ROWS = 2048


def can_prepack(dtype: torch.dtype, device: str) -> bool:
    return device == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()


class PackedLinear(nn.Module):
    """Drop-in for ``nn.Linear`` (same math, fp32) with a oneDNN-prepacked weight."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        w = linear.weight.detach().contiguous()
        self.in_features, self.out_features = w.shape[1], w.shape[0]
        self.weight = nn.Parameter(torch.ops.mkldnn._reorder_linear_weight(w, _PACK_ROWS),
                                   requires_grad=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(),
                                                                  requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")


def prepack_linears(model: nn.Module) -> nn.Module:
    """Replace every ``nn.Linear`` in ``model`` (recursively) by a PackedLinear."""
    for name, child in list(model.named_children()):
        if isinstance(child, nn.Linear):
            setattr(model, name, PackedLinear(child))
        else:
            prepack_linears(child)
    return model
