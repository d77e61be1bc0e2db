"""Integer formats and quantized linears against their dequantized reference."""

from __future__ import annotations

import pytest
import torch

from engine.quant.formats import pack_int4, quantize_weight, unpack_int4
from engine.quant.linear import Int4Linear, Int8Linear, W8A8Linear, reference_forward

FORMATS = [(8, None, True), (8, None, False), (4, 32, True), (4, 64, False), (4, 128, True), (4, 128, False)]


def test_int4_pack_unpack_round_trip_is_exact():
    g = torch.Generator().manual_seed(0)
    for shape in [(1, 2), (7, 64), (96, 576)]:
        q = torch.randint(0, 16, shape, generator=g, dtype=torch.uint8)
        p = pack_int4(q)
        assert p.shape == (shape[0], shape[1] // 2) and p.dtype == torch.uint8
        assert torch.equal(unpack_int4(p), q)
    assert pack_int4(torch.tensor([[3, 12]], dtype=torch.uint8)).item() == 3 | 12 << 4  # low nibble first
    with pytest.raises(ValueError, match="even"):
        pack_int4(torch.zeros(2, 3, dtype=torch.uint8))


@pytest.mark.parametrize("bits,group,sym", FORMATS)
def test_quantize_round_trip_and_error_bound(bits, group, sym):
    w = torch.randn(48, 256, generator=torch.Generator().manual_seed(1)) * 0.05
    w[:, 7] = 0.0  # zeros stay exactly zero
    qw = quantize_weight(w, bits, group, sym)
    deq = qw.dequantize()
    # re-quantizing the dequantized weight with the same parameters gives the same integers
    again = quantize_weight(deq, bits, group, sym, qw.scale, qw.zero)
    assert torch.equal(again.q, qw.q)
    # round to nearest: |r - deq(r)| <= scale / 2 everywhere
    scale = qw.scale[:, None] if bits == 8 else qw.scale.repeat_interleave(group, 1)
    assert ((w - deq).abs() <= scale / 2 + 1e-7).all()
    assert (deq[:, 7] == 0).all()
    lo, hi = (-128, 127) if bits == 8 else (0, 15)
    assert int(qw.q.min()) >= lo and int(qw.q.max()) <= hi


@pytest.mark.parametrize("bits,group,sym", FORMATS)
@pytest.mark.parametrize("rows", [1, 5])
def test_quantized_linear_matches_dequantized_reference(bits, group, sym, rows):
    g = torch.Generator().manual_seed(2)
    w = torch.randn(64, 256, generator=g) * 0.05
    bias = torch.randn(64, generator=g)
    qw = quantize_weight(w, bits, group, sym)
    mod = Int8Linear(qw, bias) if bits == 8 else Int4Linear(qw, bias)
    x = torch.randn(rows, 3, 256, generator=g)  # any leading shape
    ref = reference_forward(mod, x)
    mod.set_act_dtype(torch.float32)  # the kernel in fp32: same maths as the reference
    y = mod(x)
    assert y.shape == (rows, 3, 64) and y.dtype == torch.float32
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    mod.set_act_dtype(torch.bfloat16)  # the serving path: bf16 activations, fp32 out
    y16 = mod(x)
    assert y16.dtype == torch.float32
    assert (y16 - ref).abs().max() <= 0.02 * ref.abs().max()


def test_w8a8_linear_close_to_reference():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(64, 256, generator=g) * 0.05
    mod = W8A8Linear(quantize_weight(w, 8, None, True), torch.zeros(64))
    x = torch.randn(4, 256, generator=g)
    ref = reference_forward(mod, x)
    err = (mod(x) - ref).abs().max() / ref.abs().max()
    assert 0 < err < 0.03  # activations are quantized too: close, not exact


def test_bytes_per_weight():
    w = torch.randn(256, 512)
    i8 = Int8Linear(quantize_weight(w, 8, None, True))
    i4 = Int4Linear(quantize_weight(w, 4, 128, True))
    fp = w.numel() * 4
    assert i8.weight_bytes() < 0.26 * fp
    assert i4.weight_bytes() < 0.14 * fp
