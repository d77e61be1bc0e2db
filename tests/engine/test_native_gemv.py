"""The GEMVs with fp32 activations (engine/models/native_decode.c, gemv_rows): each thread's rows
read as four streams side by side, up to four x rows a pass (more: in groups of four); the
documented arithmetic in fp32: fp32 and INT8 y = s * (x . w) - zs * sum(x) + b, INT4 y = x . w + b
with w = q * s + o per group of 32 inputs."""

from __future__ import annotations

import ctypes
import platform

import pytest
import torch

from engine.models import int4_blocks, native
from engine.quant.formats import interleave4

from tests.engine.test_int4_blocks import q4k_like

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


@pytest.mark.skipif(not X86, reason="the native kernels are x86-64 only")
@pytest.mark.parametrize("isa", isas())
# n as above (whole streams, rows left over, fewer than four a thread); k: whole superblocks of 8
# groups (256, 1536, 8960: the compact scales too) and not (96, 1568)
@pytest.mark.parametrize("n,k", [(9, 256), (40, 1536), (3, 96), (5, 1568), (13, 8960)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9])
def test_int4_gemv_is_the_documented_arithmetic(isa, n, k, rows):
    lib = native.build_library(isa, False)
    gen = torch.Generator().manual_seed(n * k + rows)
    g = 32
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
    s = torch.rand(n, k // g, generator=gen) * 0.01 + 1e-4
    z = torch.randint(0, 16, (n, k // g), generator=gen).float()
    b, x = torch.randn(n, generator=gen), torch.randn(rows, k, generator=gen)
    w4, ss, zz = native.int4_weights(q, s, z, g, lib.pd_vector_width(), torch.empty(n, k // 2, dtype=torch.uint8))
    lin = native.Lin(w4.data_ptr(), ss.data_ptr(), zz.data_ptr(), b.data_ptr(), n, k, native.W_I4, g, 0, None)
    y = torch.full((rows, n), float("nan"))  # (a row the kernel does not write stays NaN)
    lib.pd_linear(ctypes.addressof(lin), rows, x.data_ptr(), y.data_ptr(), 2)
    o = -z * s  # in fp32, as the kernel forms it
    wd = (q.double().view(n, -1, g) * s.double()[..., None] + o.double()[..., None]).view(n, k)
    want = x.double() @ wd.T + b.double()
    # each weight rounded once to fp32 (u |w|), each of VW lanes sums k / VW terms (one rounding
    # per FMA), the lanes are added (log2 VW <= 4 roundings) and the bias (one): the recursive
    # summation bound, (k / VW + 7) u sum |w x| + u |b|
    mass = x.double().abs() @ wd.abs().T
    bound = (k / lib.pd_vector_width() + 7) * U * mass + U * b.double().abs()
    assert ((y.double() - want).abs() <= bound).all()
    if native.int4_meta_fits(k, g):  # the compact scales give the same outputs to the bit
        qb, sb, zb = q4k_like(n, k, rows)
        w4, ss, zz = native.int4_weights(qb, sb, zb, g, lib.pd_vector_width(), w4)
        meta = int4_blocks.compact(qb, sb, zb, g)
        assert meta is not None
        y1, y2 = torch.empty(rows, n), torch.empty(rows, n)
        for out, m in ((y1, None), (y2, meta)):
            lin = native.Lin(w4.data_ptr(), ss.data_ptr(), zz.data_ptr(), b.data_ptr(), n, k, native.W_I4, g, 0,
                             None if m is None else m.data_ptr())
            lib.pd_linear(ctypes.addressof(lin), rows, x.data_ptr(), out.data_ptr(), 2)
        assert torch.equal(y1, y2)
