"""INT4 / INT8 steps of AMX_ROWS rows or more on AMX (engine/models/native_amx.c): fp32 arithmetic.

The kernel multiplies the codes (exact in bf16) by x split into three bf16 limbs (exact), sums
the exact products in fp32 per group, then applies y = b + sum_g (s P_g + o X_g). Its error
against the exact sum is that of an fp32 dot product, bounded (Higham, sum of m terms: at most
(m - 1) u times the sum of their magnitudes, u = 2^-24) by counting the roundings each term
meets: 3g products summed within a group (the tile unit's fp32 accumulation), the group's sum
of x (g), s P and o X and their two accumulations (4 per group, so 4 ng; a chunk's part added
to y, fewer than the groups, fits in it), the bias (1), and for INT4 the reference's own fp32
offset o (1). Hence BOUND_TERMS below; the test asserts the error
stays under that many u times sum_k (|q s| + |o|) |x_k| per output. The fp32 GEMM on the
dequantized weight that it replaces meets the same kind of bound with k terms.

Runs where the CPU has AMX-BF16 (the kernel cannot run elsewhere, as the CUDA tests); the
switch that keeps every other CPU on the fp32 GEMM is tested everywhere.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import pytest

from engine.models import native
from engine.quant.formats import QuantizedWeight, interleave4, quantize_weight
from engine.quant.linear import Int4Linear, Int8Linear, base

U = 2.0 ** -24


def bound_terms(g: int, ng: int) -> int:
    return 3 * g + g + 4 * ng + 2


needs_amx = pytest.mark.skipif(native.amx_library() is None, reason="this CPU has no AMX-BF16 (or no AVX-512 build)")


def exact(q: torch.Tensor, s: torch.Tensor, o: torch.Tensor, g: int, x: torch.Tensor, b: torch.Tensor):
    """(sum_k (q s + o) x + b, sum_k (|q s| + |o|) |x|) in fp64, s and o per group of g."""
    n, k = q.shape
    qs = (q.double().view(n, k // g, g) * s.double()[..., None]).view(n, k)
    ow = o.double()[..., None].expand(n, k // g, g).reshape(n, k)
    xd = x.double()
    return xd @ (qs + ow).T + b.double(), xd.abs() @ (qs.abs() + ow.abs()).T + b.double().abs()


# (rows, inputs): 256 x 2048 holds 3 MB of limbs, more than a chunk: the kernel then sums in
# chunks of inputs and rows (uneven last ones), adding each chunk's part to y; 130 and 161 rows
# are more blocks of 16 than a chunk keeps sums for (AMX_CHUNK_MB, 8): chunks of rows, the last short
SHAPES = [(base.AMX_ROWS, 320), (130, 320), (161, 320), (256, 2048)]


@needs_amx
@pytest.mark.parametrize("rows,k", SHAPES)
def test_int4_prefill_is_fp32_arithmetic(rows, k):
    gen = torch.Generator().manual_seed(rows)
    n, g = 80, 32  # 80 rows: a panel of 64 and one of 16
    w, b = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    mod = Int4Linear(quantize_weight(w, 4, g, False), b)
    assert mod.kernel == "native"
    x = torch.randn(rows, k, generator=gen)
    y = mod(x)
    qw = mod.quantized_weight()
    o = (-(qw.zero * qw.scale)).float().view(n, -1)  # the kernel's offsets, rounded to fp32
    want, mag = exact(qw.q, qw.scale.view(n, -1), o, g, x, b)
    err = (y.double() - want).abs()
    assert (err <= bound_terms(g, k // g) * U * mag).all(), f"max error/bound {(err / (U * mag)).max():.1f} u"
    # the module's path is the kernel (bit for bit); a row fewer than AMX_ROWS, the GEMV's
    direct = native.amx_linear(native.amx_library(), mod.native_kernel().lin, x)
    assert torch.equal(y, direct)
    fewer = x[: base.AMX_ROWS - 1]
    assert torch.equal(mod(fewer), mod.native_kernel().linear(fewer))


@needs_amx
@pytest.mark.parametrize("symmetric,interleaved,rows,k", [(True, False, base.AMX_ROWS + 3, 256),
                                                          (False, False, base.AMX_ROWS + 3, 256),
                                                          (True, True, base.AMX_ROWS + 3, 256),
                                                          (False, False, *SHAPES[-1])])
def test_int8_prefill_is_fp32_arithmetic(symmetric, interleaved, rows, k):
    gen = torch.Generator().manual_seed(int(symmetric) * 2 + int(interleaved))
    n = 48
    w, b = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    mod = Int8Linear(quantize_weight(w, 8, None, symmetric), b)
    qw = mod.quantized_weight()
    if interleaved:
        mod.set_interleaved(interleave4(mod.qweight).contiguous())
    x = torch.randn(rows, k, generator=gen)
    y = mod(x)
    o = (-(qw.zero * qw.scale)).float()[:, None]
    want, mag = exact(qw.q, qw.scale[:, None], o, k, x, b)
    err = (y.double() - want).abs()
    # the kernel sums INT8 in groups of up to k inputs: k terms and k / 32 groups bound any of them
    assert (err <= bound_terms(k, k // 32) * U * mag).all(), f"max error/bound {(err / (U * mag)).max():.1f} u"
    # int8pack's bf16 activations, below AMX_ROWS rows, are far outside that bound: the path changed
    few = base.AMX_ROWS - 1
    assert ((mod(x[:few]).double() - want[:few]).abs() > bound_terms(k, k // 32) * U * mag[:few]).any()


def _one_input_per_row(rows: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """x with one non-zero input per row, a random fp32 value (24 significant bits: every limb
    of it non-zero for most values)."""
    x = torch.zeros(rows, k)
    x[torch.arange(rows), torch.randint(0, k, (rows,), generator=gen)] = torch.randn(rows, generator=gen)
    return x


@needs_amx
@pytest.mark.parametrize("bits", [4, 8])
def test_every_bit_of_x_is_multiplied(bits):
    """Codes that are powers of two (or zero), scales that are powers of two, no offset, and one
    non-zero input per row: every sum the kernel forms has one non-zero term, and every product
    of it is exact, so each output must be s q x exactly. A kernel that dropped or rounded a
    limb of x (multiplied x in bf16, or in two limbs: 16 bits) fails this where the bound above,
    scaled by the sum of magnitudes, could not tell."""
    gen = torch.Generator().manual_seed(bits)
    n, k, g, rows = 64, 256, 32, base.AMX_ROWS
    pick = torch.tensor([0, 1, 2, 4, 8] if bits == 4 else [-8, -2, -1, 1, 4, 16, 64])
    q = pick[torch.randint(0, len(pick), (n, k), generator=gen)]
    if bits == 4:
        scale = 2.0 ** torch.randint(-6, 3, (n, k // g), generator=gen).float()
        qw = QuantizedWeight(q.to(torch.uint8), scale, torch.zeros_like(scale), 4, g, False)
        mod, s = Int4Linear(qw), scale.repeat_interleave(g, 1)
    else:
        scale = 2.0 ** torch.randint(-6, 3, (n,), generator=gen).float()
        qw = QuantizedWeight(q.to(torch.int8), scale, torch.zeros_like(scale), 8, None, True)
        mod, s = Int8Linear(qw), scale[:, None].expand(n, k)
    x = _one_input_per_row(rows, k, gen)
    col = x.abs().argmax(1)
    want = x[torch.arange(rows), col][:, None] * (q.float() * s)[:, col].T  # exact: powers of two
    assert torch.equal(mod(x), want)


def test_off_switch_keeps_the_fp32_gemm(monkeypatch):
    """PDSERVE_AMX=0 (and every CPU without AMX): a prefill-sized INT4 step is the fp32 GEMM on
    the weight dequantized, bit for bit."""
    monkeypatch.setenv("PDSERVE_AMX", "0")
    native.amx_library.cache_clear()
    try:
        assert native.amx_library() is None
        gen = torch.Generator().manual_seed(7)
        w, b = torch.randn(64, 256, generator=gen), torch.randn(64, generator=gen)
        mod = Int4Linear(quantize_weight(w, 4, 32, False), b)
        x = torch.randn(base.DEQUANT_ROWS, 256, generator=gen)
        if mod.kernel != "native":
            pytest.fail(f"the native INT4 kernel did not build here ({mod.kernel})")
        assert torch.equal(mod(x), F.linear(x, mod.kernel_weight(), mod.bias))
    finally:
        monkeypatch.delenv("PDSERVE_AMX")
        native.amx_library.cache_clear()
