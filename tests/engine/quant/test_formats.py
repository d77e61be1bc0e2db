"""Integer formats and quantized linears against their dequantized reference."""

from __future__ import annotations

import pytest
import torch

from engine.quant.formats import pack_int4, quantize_weight, unpack_int4
from engine.quant.linear import Int4Linear, Int8Linear, W8A8Linear
from engine.quant.linear.base import reference_forward

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


def _activation_rounding_bound(mod: W8A8Linear, x: torch.Tensor, bits: int) -> torch.Tensor:
    """Worst-case error of y = x W^T from quantizing x alone, per output [rows, N].

    The kernel quantizes x per tensor on a grid of step d = (max(x, 0) - min(x, 0)) / (2^bits - 1)
    (the range always holds 0; the zero point, rounded to the grid, moves its ends by at most
    d/2): every |x_k - xq_k| <= d/2, so |y_n - yq_n| <= d/2 * sum_k |W_nk|. The weight error is
    not counted: the reference uses the dequantized weight. fp32 accumulation adds ~1e-6
    relative; 1e-4 of the same sum covers it.
    """
    d = (x.max().clamp_min(0) - x.min().clamp_max(0)) / (2 ** bits - 1)
    w_abs = mod.quantized_weight().dequantize().abs().sum(1)  # [N]
    return (d / 2 + 1e-4 * x.abs().max()) * w_abs.expand(x.shape[0], -1)


def _w8a8_cases():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(64, 256, generator=g) * 0.05
    x = torch.randn(4, 256, generator=g)
    # the worst case for int16 pair sums: positive activations (they quantize near 255) against
    # positive weights, pairs of them side by side
    w_pos, x_pos = w.abs(), x.abs() + 1.0
    return [(w, x), (w_pos, x_pos)]


@pytest.mark.parametrize("bits", [8, 7], ids=["8-bit-act", "7-bit-act"])
def test_w8a8_kernel_variants_within_the_activation_rounding_bound(bits):
    """Both activation widths, on every CPU: 7 bits always holds its bound; 8 bits holds it
    where this CPU's GEMM does not saturate, and where it does the layer must not use 8 bits."""
    from engine.quant.cpu_kernels import w8a8_reduce_range
    for w, x in _w8a8_cases():
        mod = W8A8Linear(quantize_weight(w, 8, None, True), torch.zeros(w.shape[0]))
        assert mod.reduce_range == w8a8_reduce_range()
        y = torch.ops.quantized.linear_dynamic(x, mod._packed, bits == 7)
        within = bool(((y - reference_forward(mod, x)).abs() <= _activation_rounding_bound(mod, x, bits)).all())
        if bits == 7 or not mod.reduce_range:
            assert within
    if bits == 8 and mod.reduce_range:  # the saturating CPU class: the worst case shows it
        assert not within


def test_w8a8_layer_holds_the_bound_of_the_width_it_chose():
    for w, x in _w8a8_cases():
        mod = W8A8Linear(quantize_weight(w, 8, None, True), torch.zeros(w.shape[0]))
        bits = 7 if mod.reduce_range else 8
        err = (mod(x) - reference_forward(mod, x)).abs()
        assert (err <= _activation_rounding_bound(mod, x, bits)).all()
        assert err.max() > 0  # activations are quantized: close, not exact


_NO_VNNI_PROBE = """
import json, torch
from engine.quant.cpu_kernels import w8a8_reduce_range
from engine.quant.formats import quantize_weight
from engine.quant.linear import W8A8Linear
from engine.quant.linear.base import reference_forward
w = torch.randn(64, 256, generator=torch.Generator().manual_seed(3)).abs() * 0.05
x = torch.rand(4, 256, generator=torch.Generator().manual_seed(4)) + 1.0
mod = W8A8Linear(quantize_weight(w, 8, None, True), torch.zeros(64))
err = (mod(x) - reference_forward(mod, x)).abs().max() / reference_forward(mod, x).abs().max()
print(json.dumps({"reduce_range": mod.reduce_range, "err": err.item()}))
"""


def test_w8a8_on_the_avx2_code_path_uses_7_bit_activations():
    """fbgemm and oneDNN can be held to AVX2 (no VNNI) on any x86-64 CPU: there the probe must
    find the saturation and the layer stay accurate. What an AVX2-only machine runs, here too."""
    import json
    import os
    import platform
    import subprocess
    import sys
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the AVX2 code paths exist on x86-64 only")
    env = dict(os.environ, FBGEMM_ENABLE_INSTRUCTIONS="AVX2", ONEDNN_MAX_CPU_ISA="AVX2",
               ATEN_CPU_CAPABILITY="avx2")
    out = subprocess.run([sys.executable, "-c", _NO_VNNI_PROBE], env=env, capture_output=True, text=True,
                         timeout=120, cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__)))))
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["reduce_range"] is True
    # x in [1, 2], W >= 0: 7-bit step d = 2/127, |y_n - yq_n| <= d/2 * sum_k W_nk <= y_n / 127,
    # so the error is below 1/127 of the largest output (measured 0.0007; 8-bit activations on
    # this path saturate: 0.025)
    assert got["err"] < 1 / 127


def test_bytes_per_weight():
    w = torch.randn(256, 512)
    i8 = Int8Linear(quantize_weight(w, 8, None, True))
    i4 = Int4Linear(quantize_weight(w, 4, 128, True))
    fp = w.numel() * 4
    assert i8.weight_bytes() < 0.26 * fp
    # INT4: half a byte a weight, plus a scale and a zero point per group of 128, fp32 at most
    # (the native kernels' layout; torch's int4pack keeps them in bf16): 0.5625 B, 14% of fp32
    assert i4.weight_bytes() <= w.numel() * (0.5 + 2 * 4 / 128)


@pytest.mark.parametrize("bits", [8, 4])
def test_a_to_that_changes_nothing_keeps_every_tensor(bits):
    """``.to(cpu, float32)`` over a quantized module already there (the loader's model.to over
    the assembled model) keeps its tensors: no copy of the weights, no second conversion through
    the canonical layout; a real change still converts and computes the same."""
    torch.manual_seed(0)
    w, x = torch.randn(64, 256), torch.randn(3, 256)
    qw = quantize_weight(w, bits, 32 if bits == 4 else None, False)
    mod = Int8Linear(qw) if bits == 8 else Int4Linear(qw)
    want = mod(x)
    before = {n: t.data_ptr() for n, t in mod.named_buffers()}
    assert mod.to(device="cpu", dtype=torch.float32) is mod
    assert {n: t.data_ptr() for n, t in mod.named_buffers()} == before
    assert torch.equal(mod(x), want)
    mod.to(torch.float64)  # a change: the scales follow, as before
    assert mod.scale.dtype == torch.float64
