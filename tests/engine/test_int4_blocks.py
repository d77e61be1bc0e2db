"""INT4 scales in their compact form (engine/models/int4_blocks.py): found exactly for Q4_K's
structure, refused for arbitrary fp32 scales, and served by the native kernels with outputs bit
for bit those of the fp32 pair, on every build this CPU runs (AVX2 always, AVX-512 with and
without VNNI where it can), fp32 and INT8 activations; and against a float reference."""

from __future__ import annotations

import platform

import pytest
import torch

from engine.models import int4_blocks, native

from tests.engine.test_int8_activations import builds

X86 = platform.machine().lower() in ("x86_64", "amd64")
U = 2.0 ** -24  # fp32 unit roundoff


def q4k_like(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes, scales and zero points as engine/models/gguf_codes.py makes them from a Q4_K tensor:
    fp16 d, dmin per 256 inputs, 6-bit sc, m per 32 (the largest 63, as llama.cpp's quantizer
    gives), scale = d*sc, offset = -(dmin*m), zero = -offset/scale; flat groups (sc = 0) as
    codes 0, zero -8, scale offset/8."""
    gen = torch.Generator().manual_seed(seed)
    d = (torch.rand(n, k // 256, 1, generator=gen) * 2e-3 + 1e-4).half().float()
    dmin = (torch.rand(n, k // 256, 1, generator=gen) * 2e-3).half().float()
    sc = torch.randint(0, 64, (n, k // 256, 8), generator=gen).float()
    m = torch.randint(0, 64, (n, k // 256, 8), generator=gen).float()
    sc[..., 0], m[..., 1] = 63, 63
    sc[torch.rand(sc.shape, generator=gen) < 0.03] = 0
    scale, offset = (d * sc).reshape(n, -1), -(dmin * m).reshape(n, -1)
    q = torch.randint(0, 16, (n, k // 32, 32), dtype=torch.uint8, generator=gen)
    flat = scale == 0
    q[flat] = 0
    zero = torch.where(flat, -8.0, -offset / torch.where(flat, 1.0, scale))
    return q.reshape(n, k), torch.where(flat, offset / 8, scale), zero


def test_q4k_scales_factor_exactly():
    """Every group's s (where its codes are used) and o = -zero*s come back bit for bit, though
    about one o in ten is not the file's offset (the division by the scale rounds)."""
    q, s, z = q4k_like(96, 1536, 0)
    meta = int4_blocks.compact(q, s, z, 32)
    assert meta is not None and meta.shape == (96, 1536 // 256 * 24) and meta.dtype == torch.uint8
    s2, o2 = int4_blocks.expand(meta, 48)
    used = q.view(96, 48, 32).amax(-1) > 0
    assert torch.equal(torch.where(used, s2, s), s) and torch.equal(o2, -z * s)
    assert (~used).any()  # flat groups were there


def test_arbitrary_scales_keep_the_fp32_pair():
    """pdserve's own INT4 (any fp32 scale, integer zero points) has no such factoring; nor a
    weight whose groups do not make whole superblocks of 8."""
    gen = torch.Generator().manual_seed(1)
    q = torch.randint(0, 16, (64, 512), dtype=torch.uint8, generator=gen)
    s, z = torch.rand(64, 16, generator=gen) * 0.01 + 1e-4, torch.randint(0, 16, (64, 16), generator=gen).float()
    assert int4_blocks.compact(q, s, z, 32) is None
    q2, s2, z2 = q4k_like(8, 256, 2)
    assert int4_blocks.compact(q2[:, :128], s2[:, :4], z2[:, :4], 32) is None


def _kernels(lib, q, s, z, g, aq, with_meta):
    """(kernel, the tensors it reads: the caller holds them while it runs)."""
    n, k = q.shape
    w, ss, zz = native.int4_weights(q, s, z, g, lib.pd_vector_width(), torch.empty(n, k // 2, dtype=torch.uint8))
    meta = int4_blocks.compact(q, s, z, g) if with_meta else None
    assert (meta is not None) == with_meta
    b = torch.linspace(-1, 1, n)
    return native.Int4Kernel(lib, w, ss, zz, b, g, int8_activations=aq, meta=meta), (w, ss, zz, b, meta)


@pytest.mark.skipif(not X86, reason="the native kernels are x86-64 only")
@pytest.mark.parametrize("isa,vnni", builds())
@pytest.mark.parametrize("n,k,rows", [(64, 1536, 1), (37, 2048, 3), (9, 8960, 5)])
def test_kernels_read_the_compact_form_bit_for_bit(isa, vnni, n, k, rows):
    """The same s and o, so the same outputs to the bit: GEMV with fp32 and INT8 activations, and
    the dequantized weight of prefill-sized steps."""
    lib = native.build_library(isa, vnni)
    q, s, z = q4k_like(n, k, n + k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)) * 2
    for aq in (False, True):
        (compact, held), (pair, held2) = _kernels(lib, q, s, z, 32, aq, True), _kernels(lib, q, s, z, 32, aq, False)
        assert torch.equal(compact.linear(x), pair.linear(x)), (isa, vnni, aq)
    assert torch.equal(compact.dequantize(torch.empty(n * k)), pair.dequantize(torch.empty(n * k)))


@pytest.mark.skipif(not X86, reason="the native kernels are x86-64 only")
@pytest.mark.parametrize("isa,vnni", builds())
def test_compact_kernel_against_a_float_reference(isa, vnni):
    """y against fp64 sum_i w_i x_i + b, w_i = q_i s + o (the served weight before its one fp32
    rounding). The kernel's error: w_i rounded once (u |w_i|), then each lane of VW sums its K/VW
    terms with one rounding per FMA, the VW lanes are added (log2 VW <= 4 roundings) and the bias
    added (one): the recursive summation bound, (K/VW + 7) u sum_i |w_i x_i| + u |b|, over each
    output."""
    lib = native.build_library(isa, vnni)
    n, k = 48, 4096
    q, s, z = q4k_like(n, k, 7)
    kern, held = _kernels(lib, q, s, z, 32, False, True)
    b = held[3]
    x = torch.randn(2, k, generator=torch.Generator().manual_seed(3))
    y = kern.linear(x).double()
    o = (-z * s).double()
    w = (q.double().view(n, -1, 32) * s.double()[..., None] + o[..., None]).view(n, k)
    want = x.double() @ w.T + b.double()
    mass = x.double().abs() @ w.abs().T
    bound = (k / lib.pd_vector_width() + 7) * U * mass + U * b.double().abs()
    assert ((y - want).abs() <= bound).all()


def test_compact_scales_are_refused_unless_the_kernel_reads_whole_superblocks():
    """The kernel reads compact scales a superblock (8 groups) at a time: a weight whose groups
    do not fill whole superblocks (which compact() never factors) is refused, not half-read."""
    native.check_int4_meta(torch.zeros((4, 24), dtype=torch.uint8), 4, 256, 32)  # one superblock a row
    with pytest.raises(ValueError, match="compact INT4 scales"):
        native.check_int4_meta(torch.zeros((4, 0), dtype=torch.uint8), 4, 128, 32)  # 4 groups: none whole
    with pytest.raises(ValueError, match="compact INT4 scales"):
        native.check_int4_meta(torch.zeros((4, 24), dtype=torch.uint8), 4, 384, 32)  # 12 groups
