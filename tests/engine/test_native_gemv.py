"""The fp32 and INT8 GEMVs with fp32 activations (engine/models/native_decode.c, gemv_rows): each
thread's rows read as four streams side by side, up to four x rows a pass (more: in groups of
four); the documented arithmetic, y = s * (x . w) - zs * sum(x) + b, in fp32."""

from __future__ import annotations

import ctypes
import platform

import pytest
import torch

from engine.models import native
from engine.quant.formats import interleave4

X86 = platform.machine().lower() in ("x86_64", "amd64")
U = 2.0 ** -24  # fp32's unit roundoff


def isas() -> list[str]:
    return ["AVX2"] + (["AVX512"] if torch.backends.cpu.get_cpu_capability() == "AVX512" else [])


@pytest.mark.skipif(not X86, reason="the native kernels are x86-64 only")
@pytest.mark.parametrize("isa", isas())
# n: rows per thread (2 threads) in whole streams of four (40), with rows left over (9, 13), and
# fewer than four (3, 5: every row left over). k: tails of single inputs (100 = 96 + 4, 4100), of
# one vector (1552 = 1536 + 16 on AVX-512, 1544 = 1536 + 8 on AVX2), none (1536, 8960)
@pytest.mark.parametrize("n,k", [(9, 100), (40, 1536), (3, 1552), (5, 4100), (13, 8960), (9, 1544)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9])
@pytest.mark.parametrize("kind", ["int8", "fp32"])
def test_gemv_is_the_documented_arithmetic(isa, n, k, rows, kind):
    lib = native.build_library(isa, False)
    gen = torch.Generator().manual_seed(n * k + rows)
    w8 = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen)
    s, zs, b = torch.rand(n, generator=gen) * 0.01, torch.rand(n, generator=gen) * 0.1, torch.randn(n, generator=gen)
    x = torch.randn(rows, k, generator=gen)
    if kind == "int8":
        held = interleave4(w8).contiguous()  # the layout the kernel reads; it reorders x to match
    else:  # fp32 weights (here whole numbers, so the exact sum below has the same terms)
        held = w8.float().contiguous()
    code = native.W_I8 if kind == "int8" else native.W_F32
    lin = native.Lin(held.data_ptr(), s.data_ptr(), zs.data_ptr(), b.data_ptr(), n, k, code, 0, 0, None)
    y = torch.full((rows, n), float("nan"))  # (a row the kernel does not write stays NaN)
    lib.pd_linear(ctypes.addressof(lin), rows, x.data_ptr(), y.data_ptr(), 2)
    xd, wd = x.double(), w8.double()
    want = s.double() * (xd @ wd.T) - zs.double() * xd.sum(-1, keepdim=True) + b.double()
    # fp32 sums of k terms in any order are within (k - 1) u of the exact sum of magnitudes (plus
    # a rounding per product: k u), the scale, the subtraction and the bias add one u each
    mass = s.double() * (xd.abs() @ wd.abs().T) + zs.double() * xd.abs().sum(-1, keepdim=True) + b.double().abs()
    err = (y.double() - want).abs()
    assert (err <= (k + 3) * U * mass).all(), (err / mass).max().item()
