"""The INT8 GEMV with fp32 activations (engine/models/native_decode.c): one x row reads rows of up
to ROW_AT_A_TIME_K inputs one at a time (dot_rows_i8), batches and longer rows four side by side
(dot_block); both are the documented arithmetic, y = s * (x . w) - zs * sum(x) + b, in fp32."""

from __future__ import annotations

import ctypes
import platform

import pytest
import torch

from engine.models import native
from engine.quant.formats import interleave4

X86 = platform.machine().lower() in ("x86_64", "amd64")
U = 2.0 ** -24  # fp32's unit roundoff
ROW_AT_A_TIME_K = 4096  # native_decode.c's


def isas() -> list[str]:
    return ["AVX2"] + (["AVX512"] if torch.backends.cpu.get_cpu_capability() == "AVX512" else [])


@pytest.mark.skipif(not X86, reason="the native kernels are x86-64 only")
@pytest.mark.parametrize("isa", isas())
# k: a whole number of 64-input steps, tails of 16 and of single inputs (100 = 64 + 2 x 16 + 4),
# the one-row path's longest rows (4096) and one past them (4100: dot_block)
@pytest.mark.parametrize("n,k", [(9, 100), (40, 1536), (8, ROW_AT_A_TIME_K), (5, ROW_AT_A_TIME_K + 4)])
@pytest.mark.parametrize("rows", [1, 3])
def test_int8_gemv_is_the_documented_arithmetic(isa, n, k, rows):
    lib = native.build_library(isa, False)
    gen = torch.Generator().manual_seed(n * k + rows)
    w8 = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen)
    s, zs, b = torch.rand(n, generator=gen) * 0.01, torch.rand(n, generator=gen) * 0.1, torch.randn(n, generator=gen)
    x = torch.randn(rows, k, generator=gen)
    words = interleave4(w8).contiguous()  # the layout the kernel reads; it reorders x to match
    lin = native.Lin(words.data_ptr(), s.data_ptr(), zs.data_ptr(), b.data_ptr(), n, k, native.W_I8, 0, 0, None)
    y = torch.empty(rows, n)
    lib.pd_linear(ctypes.addressof(lin), rows, x.data_ptr(), y.data_ptr(), 2)
    xd, wd = x.double(), w8.double()
    want = s.double() * (xd @ wd.T) - zs.double() * xd.sum(-1, keepdim=True) + b.double()
    # fp32 sums of k terms in any order are within (k - 1) u of the exact sum of magnitudes (plus
    # a rounding per product: k u), the scale, the subtraction and the bias add one u each
    mass = s.double() * (xd.abs() @ wd.abs().T) + zs.double() * xd.abs().sum(-1, keepdim=True) + b.double().abs()
    err = (y.double() - want).abs()
    assert (err <= (k + 3) * U * mass).all(), (err / mass).max().item()
