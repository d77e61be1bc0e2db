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

Where the one-token path already keeps the plain ``[N, K]`` weight (its native kernels read it,
engine/models/single_token.py), the same oneDNN calls take that plain weight instead of a
reordered copy (``pack=False``): one resident fp32 layout, mapped from the served-weights cache
and so shared by every worker of the model on a node (issue 47), for the batched steps paying
oneDNN's per-call reorder of weight blocks as it goes. Results are the same bits (the same
kernel runs after the reorder); the cost is in ``docs/bench/`` (memory_fp32_layout).

The elementwise work around the GEMMs rides along as oneDNN post-ops: ``silu(gate(x)) * up(x)``
is a GEMM with a swish post-op followed by a GEMM with a multiply post-op, and the residual adds
after ``o_proj``/``down_proj`` are add post-ops. Each saves a pass over the activations; on a
2,048-token prefill the MLP block drops from 68 to 52 ms per layer.
"""

from __future__ import annotations

import torch
from torch import nn

# oneDNN picks the blocked layout for an expected row count; 2048 (a prefill chunk) also served
# decode and batch-32 best in our measurements.
_PACK_ROWS = 2048


def can_prepack(dtype: torch.dtype, device: str) -> bool:
    return device == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()


def _onednn_weight(w: torch.Tensor, pack: bool) -> nn.Parameter:
    """oneDNN's reordered copy of ``w`` (``pack``), or ``w`` itself, its storage shared."""
    return nn.Parameter(torch.ops.mkldnn._reorder_linear_weight(w, _PACK_ROWS) if pack else w,
                        requires_grad=False)


class PackedLinear(nn.Module):
    """Drop-in for ``nn.Linear`` (same math, fp32) through oneDNN, its weight prepacked
    (``pack``) or the plain one as is (the module docstring says when)."""

    def __init__(self, linear: nn.Linear, pack: bool = True) -> None:
        super().__init__()
        w = linear.weight.detach().contiguous()
        self.in_features, self.out_features = w.shape[1], w.shape[0]
        self.weight = _onednn_weight(w, pack)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(),
                                                                  requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``residual + self(x)`` in one call."""
        return torch.ops.mkldnn._linear_pointwise.binary(x, residual, self.weight, self.bias, "add")


class PackedGateUp(nn.Module):
    """A fused ``gate_up_proj`` [2I, H] split into two oneDNN GEMMs so that
    ``silu(gate) * up`` happens inside them (see the module docstring)."""

    def __init__(self, linear: nn.Linear, pack: bool = True) -> None:
        super().__init__()
        inter = linear.out_features // 2
        w = linear.weight.detach().contiguous()  # (row slices of it are contiguous views)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.gate = _onednn_weight(w[:inter], pack)
        self.up = _onednn_weight(w[inter:], pack)

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """``silu(x @ gate.T) * (x @ up.T)``."""
        g = torch.ops.mkldnn._linear_pointwise(x, self.gate, None, "swish", [], "")
        return torch.ops.mkldnn._linear_pointwise.binary(x, g, self.up, None, "mul")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Same output as the fused linear it replaced: ``[gate | up]``."""
        g = torch.ops.mkldnn._linear_pointwise(x, self.gate, None, "none", [], "")
        return torch.cat([g, torch.ops.mkldnn._linear_pointwise(x, self.up, None, "none", [], "")], -1)


def prepack_linears(model: nn.Module, pack: bool = True) -> nn.Module:
    """Replace every ``nn.Linear`` in ``model`` (recursively) by a PackedLinear (a bias-free
    ``gate_up_proj`` by a PackedGateUp); ``pack=False`` keeps their plain weights."""
    for name, child in list(model.named_children()):
        if isinstance(child, nn.Linear) and name == "gate_up_proj" and child.bias is None:
            setattr(model, name, PackedGateUp(child, pack))
        elif isinstance(child, nn.Linear):
            setattr(model, name, PackedLinear(child, pack))
        else:
            prepack_linears(child, pack)
    return model
