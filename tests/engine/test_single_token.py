"""The compiled decode path (engine/models/single_token.py: one token, small batches, verify
steps) against the eager path and HF: same logits, same greedy tokens, KV streaming hooks per
layer, and refusals."""

from __future__ import annotations

import sys

import pytest
import torch

from engine.models.hugepages import hugepage_empty
from engine.models.single_token import COMPILED_ROWS, NATIVE_ROWS, SingleTokenDecoder
from engine.request import SamplingParams

from tests.engine.test_architectures import CASES, _save_tiny


def _count_calls(eng) -> list[int]:
    """Wrap the engine's compiled path; the list holds the token count of each call made."""
    calls: list[int] = []
    st = eng.model.single_token
    inner = st.forward

    def counted(input_ids, *a, **k):
        calls.append(input_ids.shape[0])
        return inner(input_ids, *a, **k)
    st.forward = counted
    return calls


def _record_logits(eng) -> list[torch.Tensor]:
    seen: list[torch.Tensor] = []
    inner = eng.model.compute_logits

    def record(hidden):
        out = inner(hidden)
        seen.append(out.clone())
        return out
    eng.model.compute_logits = record
    return seen


@pytest.fixture(scope="module")
def small_model(tmp_path_factory, model_path):
    """A random Llama of 2 layers, hidden 256 (INT4 groups of 128 fit it): the quantized
    compiled-path tests below compare two paths on one model, or count compiled graphs, which
    its size does not change;
    on the real model each pair of engines cost 40-130 s of a slow machine's `make test`
    (quantizing, compiling, and the eager INT4 kernel's 7 ms per call on AVX2 with one thread)."""
    path = tmp_path_factory.mktemp("small")
    _save_tiny("llama", path, model_path, hidden_size=256, intermediate_size=512)
    return path


def test_single_request_greedy_matches_hf_through_the_compiled_path(make_engine, greedy_reference):
    prompt, ref = greedy_reference[0]
    eng = make_engine()
    assert eng.model.single_token is not None
    calls = _count_calls(eng)
    out = eng.generate([prompt], SamplingParams(max_tokens=64, temperature=0))[0]
    assert out.token_ids == ref
    assert calls.count(1) == len(ref) - 1  # every decode step after the prefill went through it


@pytest.mark.parametrize("case", ["llama-gqa", "llama-tied", "qwen2-bias", "llama3-rope-scaling"])
def test_logits_equal_the_eager_path(case, tmp_path, model_path, make_engine):
    kind, extra = CASES[case]
    _save_tiny(kind, tmp_path, model_path, **extra)
    fast = make_engine(model=tmp_path, memory_gb=0.02)
    eager = make_engine(model=tmp_path, memory_gb=0.02, compile_decode=False, weight_cache=False)
    assert fast.model.single_token is not None and eager.model.single_token is None
    ids = list(range(400, 437))  # 37 tokens: the decode context crosses block boundaries
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    got, want = _record_logits(fast), _record_logits(eager)
    a = fast.generate([ids], sp)[0]
    b = eager.generate([ids], sp)[0]
    assert a.token_ids == b.token_ids
    assert len(got) == len(want) == 24
    for x, y in zip(got, want):
        assert (x - y).abs().max().item() < 1e-4


def _batched_same_as_eager(fast, eager, prompts, max_tokens: int = 12, rel: float = 1e-4) -> list[int]:
    """Greedy tokens of ``prompts`` decoded together through both engines: the same tokens, every
    step's logits within ``rel`` of the largest. Returns the token counts of the compiled calls."""
    calls = _count_calls(fast)
    got, want = _record_logits(fast), _record_logits(eager)
    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    assert [o.token_ids for o in fast.generate(prompts, sp)] == [o.token_ids for o in eager.generate(prompts, sp)]
    assert len(got) == len(want) == max_tokens
    for x, y in zip(got, want):
        assert x.shape == y.shape
        assert (x - y).abs().max().item() < rel * y.abs().max().item()
    return calls


def test_small_batches_take_the_compiled_path(make_engine):
    """Three requests decoding: 3-token steps through the compiled graphs. Summation order is all
    that differs: the bound of _same_as_eager below."""
    fast, eager = make_engine(), make_engine(compile_decode=False, weight_cache=False)
    st = fast.model.single_token
    assert st.max_rows == {"native": NATIVE_ROWS, "compiled": COMPILED_ROWS}[st.kernel]  # the defaults
    prompts = [list(range(300, 340)), list(range(500, 517)), list(range(700, 764))]
    calls = _batched_same_as_eager(fast, eager, prompts)
    assert calls.count(3) == 11  # every decode step after the first token, all three together


def test_steps_beyond_max_rows_keep_the_eager_path(make_engine):
    eng = make_engine(compile_decode_rows=2)
    assert eng.model.single_token.max_rows == 2
    calls = _count_calls(eng)
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [9, 10, 11, 12, 13, 14, 15, 16, 17], [20, 21, 22, 23, 24, 25, 26, 27, 28]]
    alone = [eng.generate([p], sp)[0].token_ids for p in prompts]
    calls.clear()
    together = [o.token_ids for o in eng.generate(prompts, sp)]
    assert calls == []  # three requests decoding: one eager batched forward, not the fast path
    assert together == alone


def test_verify_steps_take_the_compiled_path(make_engine):
    """n-gram speculation at batch 1: each 1+K verify step runs the compiled graphs, and greedy
    output is the eager engine's (speculation never changes greedy tokens)."""
    from engine.config import SpeculativeConfig
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=4, adaptive=False)
    fast, eager = make_engine(speculative=spec), make_engine(speculative=spec, compile_decode=False, weight_cache=False)
    assert fast.model.single_token.max_rows >= 5  # at least the 1+4 verify step
    calls = _count_calls(fast)
    prompt = [11, 12, 13, 14, 15] * 8  # repetitive: the n-gram draft always proposes
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    assert fast.generate([prompt], sp)[0].token_ids == eager.generate([prompt], sp)[0].token_ids
    assert 5 in calls  # verify steps of 1 + 4 draft tokens


def test_layer_done_is_called_for_every_layer(make_engine):
    eng = make_engine()
    calls = _count_calls(eng)
    seen: list[int] = []
    eng.add_request([42], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    while eng.has_unfinished():
        seen.clear()
        eng.step(layer_done=lambda i, plan: seen.append(i))
        assert seen == list(range(eng.model_config.num_layers))
    assert calls == [1, 1]  # the 1-token prompt and the one decode step


@pytest.mark.parametrize("kw", [{"dtype": "bfloat16"}, {"quantization": "w8a8"}, {"compile_decode": False}],
                         ids=["bf16", "w8a8", "off"])
def test_not_used_where_unsupported_or_off(make_engine, small_model, kw):
    eng = make_engine(model=small_model, memory_gb=0.02, **kw)
    assert eng.model.single_token is None
    assert not SingleTokenDecoder.supports(eng.model) or kw.get("compile_decode") is False
    out = eng.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 3


def test_hugepage_buffer():
    t = hugepage_empty(3 << 20, torch.float32)
    assert t.numel() == 3 << 20 and t.dtype == torch.float32 and t.is_contiguous()
    if sys.platform.startswith("linux"):
        assert t.data_ptr() % (2 << 20) == 0
    t.fill_(1.5)
    assert t.sum().item() == 1.5 * (3 << 20)


def test_compile_failure_falls_back_to_eager(make_engine, monkeypatch):
    import engine.models.single_token as st
    monkeypatch.setenv("PDSERVE_NATIVE_DECODE", "0")  # the graphs, which then fail to compile

    def broken(name):
        raise RuntimeError("no C++ compiler here")
    monkeypatch.setattr(st, "compiled", broken)
    eng = make_engine()
    assert eng.model.single_token is None
    ref = make_engine(compile_decode=False, weight_cache=False)
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    assert eng.generate([[5, 6, 7]], sp)[0].token_ids == ref.generate([[5, 6, 7]], sp)[0].token_ids


def _quant_activations(eng, dtype: torch.dtype) -> None:
    from engine.quant.linear import Int4Linear, Int8Linear
    for mod in eng.model.modules():
        if isinstance(mod, (Int8Linear, Int4Linear)):
            mod.set_act_dtype(dtype)
    if eng.model.single_token is not None:
        eng.model.single_token.sync()


def _same_as_eager(fast, eager) -> SamplingParams:
    """16 greedy tokens of a short prompt (the eager kernels with fp32 activations are slow for
    many rows) through the one-token path and eagerly, fp32 activations on both: the same
    tokens, every step's logits within the bound below. Returns the sampling params used."""
    calls = _count_calls(fast)
    _quant_activations(fast, torch.float32)
    _quant_activations(eager, torch.float32)
    got, want = _record_logits(fast), _record_logits(eager)
    sp = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    ids = list(range(1000, 1006))
    assert fast.generate([ids], sp)[0].token_ids == eager.generate([ids], sp)[0].token_ids
    assert calls.count(1) == 15
    # Only the fp32 summation order differs (vectorized GEMV vs the kernel's blocked sums): a sum
    # of K terms is off by ~sqrt(K) * 2^-24 relative, and the real model's 30 layers keep that
    # near 1e-6 of the largest logit (measured 3e-6 under both AVX2 and AVX-512 dispatch; fewer
    # layers, less). 1e-4 leaves 30x room, while one bf16 rounding anywhere (2^-8 = 4e-3
    # relative) would fail it.
    for x, y in zip(got, want):
        assert (x - y).abs().max().item() < 1e-4 * y.abs().max().item()
    return sp


def test_int4_weights_take_the_compiled_path_too(make_engine, small_model, monkeypatch):
    """INT4 linears call the int4pack kernel from inside the compiled graphs, on the packed
    weight moved into the huge-page buffer (shared with the batched path); then a batch of
    three through them (test_quantized_small_batches_take_the_compiled_path's INT4 case, on the
    same two engines: each pair costs ~20 s of loading and compiling)."""
    monkeypatch.setenv("PDSERVE_NATIVE_DECODE", "0")  # the graphs (test_native_decode: the native kernels)
    fast = make_engine(model=small_model, memory_gb=0.02, quantization="int4")
    eager = make_engine(model=small_model, memory_gb=0.02, quantization="int4", compile_decode=False, weight_cache=False)
    assert fast.model.single_token is not None and eager.model.single_token is None
    assert "inside the compiled graphs" in fast.kernels
    st, qkv = fast.model.single_token, fast.model.layers[0].self_attn.qkv_proj
    assert st.lin["0.qkv"][0].data_ptr() == qkv._packed.data_ptr()
    # fp32 activations on both sides: the same kernel on inputs that differ only by the fp32
    # rounding of the fused norms and rotary, so the bound of _same_as_eager.
    _same_as_eager(fast, eager)
    _small_batches_same_as_eager(fast, eager)


@pytest.mark.parametrize("quant", ["int8", "int8-asym"])
def test_int8_weights_take_the_compiled_path_too(make_engine, small_model, quant, monkeypatch):
    monkeypatch.setenv("PDSERVE_NATIVE_DECODE", "0")  # the graphs (test_native_decode: the native kernels)
    fast = make_engine(model=small_model, memory_gb=0.02, quantization=quant, compile_decode_rows=1)  # batched: INT8 kernel
    eager = make_engine(model=small_model, memory_gb=0.02, quantization=quant, compile_decode=False, weight_cache=False)
    assert fast.model.single_token is not None and eager.model.single_token is None
    assert fast.model.single_token.kernel == "compiled"  # (PDSERVE_NATIVE_DECODE=0 keeps the compiled graphs)
    assert "compiled fp32 GEMV" in fast.kernels and "compiled" not in eager.kernels
    st = fast.model.single_token
    qkv = fast.model.layers[0].self_attn.qkv_proj
    # moved into the huge-page buffer (interleave4 order, read as int32 words), not copied
    assert st.lin["0.qkv"][0].data_ptr() == qkv.qweight.data_ptr() and qkv.interleaved
    assert st.lin["0.qkv"][0].dtype == torch.int32
    assert torch.equal(qkv.quantized_weight().q, eager.model.layers[0].self_attn.qkv_proj.qweight)
    # The same INT8 model on both sides: the compiled GEMV takes fp32 activations and sums in
    # fp32; so does the eager kernel once given fp32 activations (its serving default, bf16,
    # rounds every output to bf16: 2^-8 relative, enough to move a near-tie on any CPU class).
    sp = _same_as_eager(fast, eager)
    ids = list(range(1000, 1006))
    # Batched steps run the INT8 kernel on the moved weights, activations interleaved the same
    # way: the same products summed in another order, so (fp32 activations) the same 1e-4 bound
    # and the same tokens. (Served with bf16 activations, each linear's output is rounded to bf16
    # in both orders, and a near-tie may then break either way: tokens are not compared there.)
    two = [ids, list(range(2000, 2030))]
    got, want = _record_logits(fast), _record_logits(eager)
    assert [o.token_ids for o in fast.generate(two, sp)] == [o.token_ids for o in eager.generate(two, sp)]
    assert len(got) == len(want) and any(x.shape[0] == 2 for x in got)  # batched steps were compared
    for x, y in zip(got, want):
        assert (x - y).abs().max().item() < 1e-4 * y.abs().max().item()
    _quant_activations(fast, torch.bfloat16)
    assert all(len(o.token_ids) == 16 for o in fast.generate(two, sp))


def test_interleaved_int8_state_dict_stays_canonical(make_engine):
    """The one-token path moves INT8 weights in interleaved order; the module's state dict (what
    a checkpoint would save or load) keeps the canonical column order."""
    fast, eager = make_engine(quantization="int8"), make_engine(quantization="int8", compile_decode=False, weight_cache=False)
    mod, ref = fast.model.layers[1].mlp.down_proj, eager.model.layers[1].mlp.down_proj
    assert mod.interleaved and not torch.equal(mod.qweight, ref.qweight)
    assert torch.equal(mod.state_dict()["qweight"], ref.qweight)
    ptr = mod.qweight.data_ptr()
    mod.load_state_dict(ref.state_dict())  # loads in place, into the shared buffer, reordered
    assert mod.qweight.data_ptr() == ptr and torch.equal(mod.quantized_weight().q, ref.qweight)


def test_quantized_small_batches_take_the_compiled_path(make_engine, small_model, monkeypatch):
    """A batch of three through the compiled graphs, INT8 (one pass over the weight words
    updating every row); INT4 (the int4pack kernel on all rows) in
    test_int4_weights_take_the_compiled_path_too."""
    monkeypatch.setenv("PDSERVE_NATIVE_DECODE", "0")  # the graphs (test_native_decode: the native kernels)
    fast = make_engine(model=small_model, memory_gb=0.02, quantization="int8")
    eager = make_engine(model=small_model, memory_gb=0.02, quantization="int8", compile_decode=False, weight_cache=False)
    _small_batches_same_as_eager(fast, eager)


def _small_batches_same_as_eager(fast, eager) -> None:
    """Three prompts decoded together, fp32 activations on both sides, so only summation order
    and the fused norms' rounding differ (the bound of _same_as_eager)."""
    _quant_activations(fast, torch.float32)
    _quant_activations(eager, torch.float32)
    prompts = [list(range(1000, 1006)), list(range(2000, 2011)), list(range(3000, 3004))]
    calls = _batched_same_as_eager(fast, eager, prompts, max_tokens=8)
    assert calls.count(3) == 7


def test_serving_from_another_thread_compiles_nothing_after_load(make_engine, small_model, monkeypatch):
    """A worker steps the engine on its own thread: every variant a step of 1..max_rows tokens
    (a decode batch, a verify step) runs must have been compiled at load, with the inputs made
    as serving makes them. (torch's config overrides are per thread: a graph first compiled on
    the step thread meets dynamo's default recompile limit of 8 there, and a worker with
    speculation on INT8 weights died of it.)"""
    import threading

    from torch._dynamo.utils import counters

    from engine.config import SpeculativeConfig
    monkeypatch.setenv("PDSERVE_NATIVE_DECODE", "0")  # the graphs (the native kernels compile nothing)
    eng = make_engine(model=small_model, memory_gb=0.02, quantization="int8",
                      speculative=SpeculativeConfig(method="ngram", adaptive=False))
    assert eng.model.single_token.max_rows == 5
    graphs = counters["stats"]["unique_graphs"]
    done: list[int] = []

    def serve() -> None:
        sp = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
        for b in (1, 2, 3, 4):  # repetitive prompts: the n-gram draft proposes, verify steps run
            done.extend(len(o.token_ids) for o in eng.generate([[5 + i, 6, 7, 8] * 6 for i in range(b)], sp))
    t = threading.Thread(target=serve)
    t.start()
    t.join()
    assert done == [10] * 10
    assert counters["stats"]["unique_graphs"] == graphs
