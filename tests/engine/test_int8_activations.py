"""INT8 activations (EngineConfig.activations="int8"): the native kernels' INT4 x INT8 and INT8 x
INT8 GEMVs (engine/models/native_decode.c) against an fp64 reference of the arithmetic their
comment documents, on every build this CPU runs (AVX-512 with and without VNNI, AVX2); the
engine's one-token path against its eager modules in that mode; the config's checks."""

from __future__ import annotations

import ctypes
import platform

import pytest
import torch

from engine.config import EngineConfig
from engine.models import native
from engine.quant.formats import interleave4
from engine.request import SamplingParams

X86 = platform.machine().lower() in ("x86_64", "amd64")
U = 2.0 ** -24  # fp32 unit roundoff


def builds() -> list[tuple[str, bool]]:
    """(ISA, VNNI) of each library this CPU can run: AVX2 always (every x86 CPU of this project's
    kind), AVX-512 where torch dispatches it, with and without VNNI where the CPU has VNNI."""
    out = [("AVX2", False)]
    if torch.backends.cpu.get_cpu_capability() == "AVX512":
        out.append(("AVX512", False))
        if native.cpu_has_vnni():
            out.append(("AVX512", True))
    return out


def _quantize_groups(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Groups of 32 along the last dim: (codes rint(x * (127 / max|x|)), d = max|x| / 127), in fp32
    as the kernel computes them (0 for an all-zero group)."""
    xa = x.view(*x.shape[:-1], -1, 32)
    m = xa.abs().amax(-1, keepdim=True)
    inv = torch.where(m > 0, torch.tensor(127.0) / m, torch.zeros_like(m))
    return torch.round(xa * inv).clamp(-127, 127), (m / 127.0).squeeze(-1)


def _ref_int4(x, q, s, z, g):
    """(y, sum of |terms|) in fp64: sum over activation groups a of s_g(a) d_a (q . xq)_a, minus
    sum over weight groups of s z (the group's sum of the quantized inputs, d_a times the sum of
    its codes: the weight taken centred, s (q - z), times the quantized x)."""
    r, k = x.shape
    xq, d = _quantize_groups(x)
    dots = torch.einsum("rak,nak->rna", xq.double(), q.view(q.shape[0], k // 32, 32).double())
    terms = dots * d.double()[:, None, :] * s.repeat_interleave(g // 32, dim=1).double()[None]
    xg = (xq.double().sum(-1) * d.double()).view(r, k // g, g // 32).sum(-1)
    zt = xg[:, None, :] * (s.double() * z.double())[None]
    return terms.sum(-1) - zt.sum(-1), terms.abs().sum(-1) + zt.abs().sum(-1)


def _bound(mass: torch.Tensor, k: int, groups: int) -> torch.Tensor:
    """The fp32 error of the kernel's sums: each term rounded at most twice (the scale product and
    its FMA; the int32 dot converts exactly, |dot| < 2^24), then summed in chains no longer than
    the k / 8 lane terms plus the zero-point terms: (k / 8 + groups + 2) u sum|terms| (the
    classic recursive summation bound)."""
    return (k / 8 + groups + 2) * U * mass


@pytest.mark.skipif(not X86, reason="the native kernels are x86-64 only")
@pytest.mark.parametrize("isa,vnni", builds())
@pytest.mark.parametrize("n,k,g,rows", [(64, 1536, 32, 1), (36, 896, 32, 3), (21, 512, 64, 5), (8, 1024, 128, 2)])
def test_int4_kernel_is_the_documented_arithmetic(isa, vnni, n, k, g, rows):
    lib = native.build_library(isa, vnni)
    lanes = lib.pd_vector_width()
    gen = torch.Generator().manual_seed(n * k + rows)
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
    s = torch.rand(n, k // g, generator=gen) * 0.02 + 1e-3
    z = torch.rand(n, k // g, generator=gen) * 15
    x = torch.randn(rows, k, generator=gen) * 3
    x[0, :32] = 0  # an all-zero group: d = 0, codes 0
    w, ss, zz = native.int4_weights(q, s, z, g, lanes, torch.empty(n, k // 2, dtype=torch.uint8))
    b = torch.randn(n, generator=gen)
    y = native.Int4Kernel(lib, w, ss, zz, b, g, int8_activations=True).linear(x)
    want, mass = _ref_int4(x, q, s, z, g)
    assert ((y.double() - b.double() - want).abs() <= _bound(mass, k, k // g)).all()
    # and it is not the fp32-activation kernel: quantizing x moved the result
    exact = native.Int4Kernel(lib, w, ss, zz, b, g).linear(x)
    assert not torch.equal(exact, y)


@pytest.mark.skipif(not X86, reason="the native kernels are x86-64 only")
@pytest.mark.parametrize("isa,vnni", builds())
@pytest.mark.parametrize("n,k,rows,sym", [(64, 1536, 1, True), (36, 896, 3, False), (21, 256, 5, True),
                                          (9, 8960, 2, False)])
def test_int8_kernel_is_the_documented_arithmetic(isa, vnni, n, k, rows, sym):
    """INT8 [n, k] in interleave4 order, -128 included (the VNNI path's +128 offset and the int16
    path both take it exactly); activations quantized in groups of 32 of the weight's byte order."""
    lib = native.build_library(isa, vnni)
    gen = torch.Generator().manual_seed(n * k + rows)
    w8 = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen)
    w8[0, :64] = -128
    s = torch.rand(n, generator=gen) * 0.01
    zs = torch.zeros(n) if sym else torch.rand(n, generator=gen) * 0.1
    b = torch.randn(n, generator=gen)
    x = torch.randn(rows, k, generator=gen)
    x[0, :8] = 0
    words = interleave4(w8).contiguous()
    y = native.Int8Kernel(lib, words, s, zs, b).linear(x)
    xq, d = _quantize_groups(interleave4(x))
    dots = torch.einsum("rak,nak->rna", xq.double(), words.view(n, k // 32, 32).double()) * d.double()[:, None, :]
    xs = x.double().sum(-1, keepdim=True)
    want = s.double() * dots.sum(-1) - zs.double() * xs + b.double()
    # the VNNI path adds 128 * sum(codes) per group and takes it off at the end: its terms are
    # up to 255/127 x larger, so the bound is taken over |w| + 128 (and the row scale's rounding)
    mass = s.double() * (torch.einsum("rak,nak->rna", xq.double().abs(), words.view(n, k // 32, 32).double().abs()
                                      + 128) * d.double()[:, None, :]).sum(-1) + (zs.double() * xs).abs() + b.abs()
    assert ((y.double() - want).abs() <= _bound(mass, k, 4)).all()


def test_int8_activations_is_checked():
    with pytest.raises(ValueError, match="activations must be one of float32, int8"):
        EngineConfig(activations="int4")


@pytest.mark.skipif(not X86, reason="the native kernels are x86-64 only")
@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_every_small_step_takes_it(make_engine, quant):
    """The engine in that mode: every linear of the one-token path and every INT4/INT8 module
    quantizes its activations, and the kernels line says so. (Its greedy tokens are not compared
    with the eager path's: quantizing amplifies the two paths' fp32 differences, a 1e-7
    change flipping a code's rounding; the kernels' arithmetic is pinned above.)"""
    from engine.quant.linear import Int4Linear, Int8Linear
    eng = make_engine(quantization=quant, activations="int8")
    st = eng.model.single_token
    assert st.kernel == "native"
    layer, lanes = st.native.layers[0], st.native.lanes
    lins = (layer.qkv, layer.o, layer.gu, layer.d, st.native.head)
    # every one its shape fits (INT4 with 576 inputs in groups of 64 is not whole chunks of
    # 8 x lanes on AVX-512: it keeps fp32 activations), and some
    assert all(lin.aq == native.int8_activations_fit(lin.kind, lin.k, lin.group, lanes) for lin in lins)
    assert any(lin.aq for lin in lins)
    mods = [m for m in eng.model.modules() if isinstance(m, (Int4Linear, Int8Linear))]
    assert mods and all(m.int8_activations for m in mods)
    assert "int8 activations" in eng.kernels
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    assert len(eng.generate([list(range(400, 437)), list(range(600, 603))], sp)[1].token_ids) == 8


# What the mode may cost: under 1% perplexity on held-out prose (SmolLM2-135M; measured +0.09%
# for INT8 weights; INT4 -0.39% on AVX2, where every INT4 linear takes it, +3.4% there while the
# zero-point term used the exact input sums; Qwen2.5-Coder-0.5B as shipped +0.23%, bench/gguf_ppl.py).
# A product floor, as the README's quantization floors are, not a rounding bound.
PPL_FLOOR = 0.01


@pytest.mark.skipif(not X86, reason="the native kernels are x86-64 only")
@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_it_costs_under_one_percent_perplexity(model_path, quant, monkeypatch):
    from transformers import AutoTokenizer

    from engine.layers.attention import get_attention_backend
    from engine.models.loader import load_model
    from engine.quant.linear import base as linear  # DEQUANT_ROWS: the kinds read it there
    from engine.quant.eval import HELDOUT, perplexity, read_text
    ids = AutoTokenizer.from_pretrained(str(model_path))(read_text(HELDOUT["prose"]))["input_ids"][:1024]
    ppl = {}
    for act in ("float32", "int8"):
        model = load_model(model_path, get_attention_backend("sdpa"), torch.float32, quantization=quant,
                           activations=act)
        # every call through the GEMV whatever its rows, as bench/gguf_ppl.py scores the mode
        monkeypatch.setattr(linear, "DEQUANT_ROWS", 1 << 30 if act == "int8" else linear.DEQUANT_ROWS)
        ppl[act] = perplexity(model, ids, 256, 128)
    assert ppl["int8"] != ppl["float32"]  # the mode is on
    assert ppl["int8"] / ppl["float32"] - 1 < PPL_FLOOR


@pytest.mark.skipif(not X86, reason="the native kernels are x86-64 only")
def test_prefill_sized_steps_multiply_in_bf16_where_the_cpu_does(monkeypatch):
    """A step of DEQUANT_ROWS rows or more in the mode: a bf16 GEMM of the dequantized weight
    where the CPU has native bf16 (products of two bf16 are exact in fp32, so the only error
    is fp32 accumulation over K: (K + 1) u sum|x w|, plus the final rounding of each input to
    bf16 done here the same way, plus the GEMM output's own rounding to bf16 before the bias, 2^-8
    relative: it returns bf16), the exact fp32 GEMM elsewhere (AVX2)."""
    from engine.quant import cpu_kernels
    from engine.quant.formats import quantize_weight
    from engine.quant.linear import Int4Linear
    from engine.quant.linear.base import DEQUANT_ROWS
    monkeypatch.setattr("engine.quant.linear.int4.amx_library", lambda: None)  # (AMX's: test_native_amx.py)
    gen = torch.Generator().manual_seed(7)
    n, k = 96, 512
    mod = Int4Linear(quantize_weight(torch.randn(n, k, generator=gen), 4, 32, False), torch.randn(n, generator=gen))
    if mod.kernel != "native":
        pytest.skip("no native INT4 kernel for this shape here")
    x = torch.randn(DEQUANT_ROWS, k, generator=gen)
    w = mod.kernel_weight()
    exact = torch.nn.functional.linear(x, w, mod.bias)
    assert torch.equal(mod(x), exact)  # off: fp32
    mod.int8_activations, mod._kernel = True, None
    for bf16 in (False, True):
        monkeypatch.setattr("engine.quant.linear.int4.native_bf16", lambda b=bf16: b)
        if bf16 and not cpu_kernels.native_bf16():
            continue  # torch's bf16 GEMM without native bf16 is emulated: not this path's case
        y = mod(x)
        if not bf16:
            assert torch.equal(y, exact)
            continue
        xb, wb = x.bfloat16().double(), w.bfloat16().double()
        want = xb @ wb.T + mod.bias.double()
        mass = xb.abs() @ wb.abs().T + mod.bias.double().abs()
        assert ((y.double() - want).abs() <= (k + 1) * U * mass + 2.0 ** -8 * (y.double() - mod.bias.double()).abs()).all()
        assert not torch.equal(y, exact)


@pytest.mark.skipif(not X86, reason="the native kernels are x86-64 only")
@pytest.mark.parametrize("sym", [True, False])
def test_int8_prefill_sized_steps_multiply_in_bf16_where_the_cpu_does(monkeypatch, sym):
    """INT8 weights likewise: (q - zero) * scale rounded to bf16, x rounded to bf16, fp32 sums and
    a bf16 output (the bound above), in the weight's interleaved order; without native bf16,
    int8pack."""
    from engine.quant import cpu_kernels
    from engine.quant.formats import quantize_weight
    from engine.quant.linear import Int8Linear
    from engine.quant.linear.activations import set_int8_activations
    from engine.quant.linear.base import DEQUANT_ROWS
    monkeypatch.setattr("engine.quant.linear.int8.amx_library", lambda: None)  # int8pack outside the mode here
    gen = torch.Generator().manual_seed(11)
    n, k = 80, 256
    mod = Int8Linear(quantize_weight(torch.randn(n, k, generator=gen), 8, None, sym), torch.randn(n, generator=gen))
    x = torch.randn(DEQUANT_ROWS, k, generator=gen)
    plain = mod(x)
    holder = torch.nn.Sequential(mod)
    set_int8_activations(holder)
    assert mod.interleaved
    monkeypatch.setattr("engine.quant.linear.int8.native_bf16", lambda: False)
    # int8pack as before: the same sums over reordered columns, each output rounded to bf16 (its
    # activation dtype here) on both sides: two roundings of 2^-8 relative at most
    got = mod(x)
    assert ((got - plain).abs() <= 2 * 2.0 ** -8 * torch.maximum(got.abs(), plain.abs()) + 1e-6).all()
    if not cpu_kernels.native_bf16():
        return
    monkeypatch.setattr("engine.quant.linear.int8.native_bf16", lambda: True)
    qw = mod.quantized_weight()
    w = ((qw.q.float() - qw.zero[:, None]) * qw.scale[:, None]).bfloat16().double()
    xb = x.bfloat16().double()
    want = xb @ w.T + mod.bias.double()
    mass = xb.abs() @ w.abs().T + mod.bias.double().abs()
    y = mod(x)
    assert ((y.double() - want).abs() <= (k + 1) * U * mass + 2.0 ** -8 * (y.double() - mod.bias.double()).abs()).all()
