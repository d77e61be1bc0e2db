"""oneDNN linears on a prepacked copy or on the plain weight as is (engine/layers/linear.py): the
same results up to the order of summation, and the plain form holds no second copy (one resident
layout: issue 47)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.layers.linear import PackedGateUp, PackedLinear, can_prepack

pytestmark = pytest.mark.skipif(not can_prepack(torch.float32, "cpu"), reason="torch built without oneDNN")


def _linear(n: int, k: int, bias: bool, seed: int) -> nn.Linear:
    torch.manual_seed(seed)
    lin = nn.Linear(k, n, bias=bias)
    lin.requires_grad_(False)
    return lin


def _bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """How far two fp32 sums of the same K products may be apart when summed in different
    orders (oneDNN picks its blocking per weight layout and row count): each is within
    K * 2^-24 * sum|x_i w_i| of the exact value, so twice that apart at most."""
    return 2 * x.shape[-1] * 2.0**-24 * (x.abs() @ w.abs().T)


@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_the_plain_weight_gives_the_packed_results(rows):
    lin = _linear(384, 256, True, 0)
    x, res = torch.randn(rows, 256), torch.randn(rows, 384)
    packed, plain = PackedLinear(lin), PackedLinear(lin, pack=False)
    assert plain.weight.data_ptr() == lin.weight.data_ptr()  # the module's own weight, not a copy
    tol = _bound(x, lin.weight)
    assert ((plain(x) - packed(x)).abs() <= tol).all()
    assert ((plain.forward_add(x, res) - packed.forward_add(x, res)).abs() <= tol + 2.0**-23 * res.abs()).all()
    assert ((plain(x) - nn.functional.linear(x, lin.weight, lin.bias)).abs() <= tol).all()


@pytest.mark.parametrize("rows", [1, 64])
def test_gate_up_on_the_plain_weight_shares_it_and_matches(rows):
    lin = _linear(2 * 192, 128, False, 1)
    x = torch.randn(rows, 128)
    packed, plain = PackedGateUp(lin), PackedGateUp(lin, pack=False)
    start, row = lin.weight.data_ptr(), lin.weight.stride(0) * 4
    assert (plain.gate.data_ptr(), plain.up.data_ptr()) == (start, start + 192 * row)
    g, u = (x @ lin.weight.T).split(192, -1)
    eg, eu = _bound(x, lin.weight).split(192, -1)
    # silu(g) * u with g, u each off by eg, eu: |silu'| <= 1.1, so the product moves by at most
    # 1.1 |u| eg + |silu(g)| eu + (the products' own rounding, a few ulps)
    tol = 1.1 * u.abs() * eg + nn.functional.silu(g).abs() * eu + 4 * 2.0**-24 * (nn.functional.silu(g) * u).abs()
    assert ((plain.silu_mul(x) - packed.silu_mul(x)).abs() <= tol).all()
    assert ((plain(x) - packed(x)).abs() <= _bound(x, lin.weight)).all()
