"""Striped linear: a CPU weight layout that lets a batch-1 GEMV use every core.

MKL runs a single GEMV (``x @ W.T`` with one row of x) on one thread, which leaves decode at
~14 GB/s of weight bandwidth on a 2-core machine. A batched GEMM is parallelized across its
batch, so we store W^T as ``shards`` column stripes ``[S, K, N/S]`` and run one ``bmm``: each
thread streams its own stripe (measured on the 2-core AVX2 box: 29 ms -> 21 ms per SmolLM2
token for the decoder linears, see bench/engine.py). The transposed (K-major) stripe is also
the faster GEMV layout for MKL on its own.
"""

from __future__ import annotations

import torch
from torch import nn


class StripedLinear(nn.Module):
    """Drop-in for ``nn.Linear`` (same math) with the weight stored as ``[S, K, ceil(N/S)]``."""

    def __init__(self, linear: nn.Linear, shards: int) -> None:
        super().__init__()
        w = linear.weight.detach()
        n, k = w.shape
        self.in_features, self.out_features, self.shards = k, n, shards
        width = -(-n // shards)
        wt = torch.zeros(k, width * shards, dtype=w.dtype, device=w.device)
        wt[:, :n] = w.t()
        self.weight = nn.Parameter(wt.view(k, shards, width).permute(1, 0, 2).contiguous(),
                                   requires_grad=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(),
                                                                  requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = x.shape[0]
        out = torch.bmm(x.unsqueeze(0).expand(self.shards, m, self.in_features), self.weight)
        out = out.permute(1, 0, 2).reshape(m, -1)  # [S, M, N/S] -> [M, N]
        if out.shape[1] != self.out_features:
            out = out[:, :self.out_features]
        return out if self.bias is None else out + self.bias


def stripe_linears(model: nn.Module, shards: int) -> nn.Module:
    """Replace every ``nn.Linear`` in ``model`` by a StripedLinear with ``shards`` stripes."""
    for name, child in list(model.named_children()):
        if isinstance(child, nn.Linear):
            setattr(model, name, StripedLinear(child, shards))
        else:
            stripe_linears(child, shards)
    return model
