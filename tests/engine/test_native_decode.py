"""The native small-step decode kernels (engine/models/native_decode.c, built by native.py):
chosen where they build, logits equal to the eager path for every weight format and step shape
(one token, small batches, verify steps) with attention read in place from the paged cache, the
AVX2 build as well as this CPU's, and the compiled graphs kept where no library builds."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from engine.models import native
from engine.request import SamplingParams

from tests.engine.test_architectures import CASES, _save_tiny
from tests.engine.test_single_token import (_batched_same_as_eager, _count_calls, _quant_activations, _record_logits,
                                            _same_as_eager)

X86 = platform.machine().lower() in ("x86_64", "amd64")


def test_native_kernels_serve_small_steps_here(make_engine):
    """Every machine of this project's kind is x86-64 with gcc (inductor needs it too): the
    library builds for the ISA torch dispatches at, and the engine's small steps use it."""
    assert X86
    lib = native.library()
    assert lib is not None
    assert lib.pd_vector_width() == {"AVX512": 16, "AVX2": 8}[torch.backends.cpu.get_cpu_capability()]
    eng = make_engine(quantization="int4")
    assert eng.model.single_token.kernel == "native"
    assert "int4: native GEMV (steps <= 32 tokens)" in eng.kernels


@pytest.mark.parametrize("quant", [None, "int8", "int8-asym", "int4"])
@pytest.mark.parametrize("case", ["llama-gqa", "llama-tied", "qwen2-bias"])
def test_tiny_models_match_the_eager_path(case, quant, tmp_path, model_path, make_engine):
    """Three requests decoding together (different contexts, so different block tables per row),
    then one alone, through the native kernels against the eager forward, fp32 activations on
    both sides: only summation order differs (the 1e-4 bound of test_single_token)."""
    kind, extra = CASES[case]
    _save_tiny(kind, tmp_path, model_path, **extra)
    fast = make_engine(model=tmp_path, memory_gb=0.02, quantization=quant)
    eager = make_engine(model=tmp_path, memory_gb=0.02, quantization=quant, compile_decode=False, weight_cache=False)
    assert fast.model.single_token.kernel == "native"
    _quant_activations(fast, torch.float32)
    _quant_activations(eager, torch.float32)
    prompts = [list(range(400, 437)), list(range(600, 603)), list(range(800, 819))]
    assert _batched_same_as_eager(fast, eager, prompts, max_tokens=20).count(3) == 19
    assert _batched_same_as_eager(fast, eager, prompts[:1], max_tokens=8).count(1) == 7


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_quantized_real_model_matches_the_eager_path(make_engine, quant):
    fast = make_engine(quantization=quant)
    eager = make_engine(quantization=quant, compile_decode=False, weight_cache=False)
    assert fast.model.single_token.kernel == "native"
    _same_as_eager(fast, eager)


def test_verify_steps_run_natively(make_engine):
    """n-gram speculation at batch 1: each 1+K verify step's rows attend causally to their own
    positions, read from the paged cache; greedy output is the eager engine's."""
    from engine.config import SpeculativeConfig
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=4, adaptive=False)
    fast, eager = make_engine(speculative=spec), make_engine(speculative=spec, compile_decode=False, weight_cache=False)
    assert fast.model.single_token.kernel == "native"
    calls = _count_calls(fast)
    prompt = [11, 12, 13, 14, 15] * 8
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    assert fast.generate([prompt], sp)[0].token_ids == eager.generate([prompt], sp)[0].token_ids
    assert 5 in calls


_AVX2_SCRIPT = textwrap.dedent("""
    import json, sys, torch
    from engine.config import CacheConfig, EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.models import native
    from engine.request import SamplingParams
    out = {"capability": torch.backends.cpu.get_cpu_capability(), "lanes": native.library().pd_vector_width()}
    for model, quant in [(m, q) for m in sys.argv[1:] for q in (None, "int8", "int4")]:
        engines = []
        for fast in (True, False):
            eng = LLMEngine(EngineConfig(model=model, quantization=quant, compile_decode=fast,
                                         cache=CacheConfig(memory_gb=0.02)), progress=False)
            for m in eng.model.modules():
                if hasattr(m, "set_act_dtype"):
                    m.set_act_dtype(torch.float32)
            if eng.model.single_token is not None:
                eng.model.single_token.sync()
            seen = []
            inner = eng.model.compute_logits
            eng.model.compute_logits = lambda h, inner=inner, seen=seen: seen.append(inner(h)) or seen[-1]
            sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
            toks = [o.token_ids for o in eng.generate([list(range(400, 437)), list(range(600, 611))], sp)]
            assert not fast or len(eng.model.single_token.native.layers) == eng.model_config.num_layers
            engines.append((eng.model.single_token.kernel if fast else None, toks, seen))
        (kernel, a, la), (_, b, lb) = engines
        rel = max(((x - y).abs().max() / y.abs().max()).item() for x, y in zip(la, lb))
        out[f"{model}/{quant}"] = {"kernel": kernel, "same_tokens": a == b, "rel": rel, "steps": len(la)}
    print(json.dumps(out))
""")


def test_the_avx2_build_matches_the_eager_path_too(tmp_path, model_path):
    """The kernels an AVX2-only CPU runs (8-lane vectors, its own INT4 layout), on any x86-64:
    a process with torch's dispatch held to AVX2 builds that variant and serves a tiny Llama and
    a tiny Gemma 3 (its prompt several windows long) in fp32, INT8 and INT4 with the eager path's
    tokens and logits (the 1e-4 bound above)."""
    from tests.engine.test_gemma3 import _save_tiny as save_gemma
    assert X86
    _save_tiny("llama", tmp_path / "m", model_path)
    save_gemma(tmp_path / "g", model_path, **GEMMA_TINY)
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2", "PDSERVE_NATIVE_CACHE": str(tmp_path / "cache"),
           "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    models = [str(tmp_path / "m"), str(tmp_path / "g")]
    r = subprocess.run([sys.executable, "-c", _AVX2_SCRIPT, *models], env=env, capture_output=True,
                       text=True, timeout=600, cwd=Path(__file__).parents[2])
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["capability"] == "AVX2" and out["lanes"] == 8
    built = list((tmp_path / "cache").glob("native_decode_avx2_*.so"))
    assert len(built) == 1 and built[0].stat().st_mode & 0o777 == 0o644  # readable from a shared cache
    for key in [f"{m}/{q}" for m in models for q in ("None", "int8", "int4")]:
        got = out[key]
        assert got["kernel"] == "native" and got["same_tokens"] and got["steps"] == 12, (key, got)
        assert got["rel"] < 1e-4, (key, got)


def test_without_a_compiler_the_compiled_graphs_serve(make_engine, monkeypatch, tmp_path, model_path, caplog):
    """No library builds (here: a compiler that fails, an empty cache): a warning, and the
    compiled graphs run the small steps with the same tokens (a tiny model: the real one's
    graphs cost ~1 min of a slow machine's `make test` to compile, and compare the same paths)."""
    _save_tiny("llama", tmp_path / "m", model_path)
    monkeypatch.setenv("CC", "false")
    monkeypatch.setenv("PDSERVE_NATIVE_CACHE", str(tmp_path / "native"))
    native.library.cache_clear()
    try:
        with caplog.at_level("WARNING", logger="engine.models.native"):
            eng = make_engine(model=tmp_path / "m", memory_gb=0.02)
        assert native.library() is None
    finally:
        native.library.cache_clear()
    assert eng.model.single_token.kernel == "compiled" and "compiled GEMV" in eng.kernels
    assert "native decode kernels unavailable" in caplog.text
    ref = make_engine(model=tmp_path / "m", memory_gb=0.02, compile_decode=False, weight_cache=False)
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    assert eng.generate([[5, 6, 7]], sp)[0].token_ids == ref.generate([[5, 6, 7]], sp)[0].token_ids


def test_a_library_that_fails_at_load_leaves_the_compiled_graphs(make_engine, monkeypatch, caplog):
    """Built and loaded but failing its load-time check: the compiled graphs serve, with their
    own default rows (each row count is compiled), not the eager path."""
    from engine.models.single_token import COMPILED_ROWS, SingleTokenDecoder

    def broken(self):
        raise RuntimeError("illegal instruction in a test")
    monkeypatch.setattr(SingleTokenDecoder, "_check_native", broken)
    with caplog.at_level("WARNING", logger="engine.models.single_token"):
        eng = make_engine()
    st = eng.model.single_token
    assert st.kernel == "compiled" and st.max_rows == COMPILED_ROWS
    assert "native decode kernels failed at load (illegal instruction in a test)" in caplog.text


# PDSERVE_NATIVE_DECODE=0 keeping the compiled graphs: tests/engine/test_single_token.py (every
# compiled-path test there turns the native kernels off and asserts the compiled kernels serve).


# ---- Gemma 3 on the same kernels (engine/models/layer_specs.py) ----------------------------------
# A tiny random Gemma 3 (tests/engine/test_gemma3.py: 5 local layers of window 8, 1 global, norms
# randomised so that 1 + w matters), wide enough that every linear fits the INT8-activation
# kernels on both ISAs (inputs in chunks of 8 x 16); prompts run several windows past 8.
GEMMA_TINY = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, head_dim=32)
GEMMA_PROMPTS = [list(range(400, 437)), list(range(600, 603)), list(range(800, 819))]


@pytest.fixture(scope="module")
def tiny_gemma(tmp_path_factory, model_path):
    from tests.engine.test_gemma3 import _save_tiny as save_gemma
    path = tmp_path_factory.mktemp("gemma3-native")
    save_gemma(path, model_path, **GEMMA_TINY)
    return path


def _gemma_engines(make_engine, path, **kw):
    fast = make_engine(model=path, memory_gb=0.02, **kw)
    eager = make_engine(model=path, memory_gb=0.02, compile_decode=False, weight_cache=False, **kw)
    st = fast.model.single_token
    assert st.kernel == "native" and eager.model.single_token is None
    layers = st.native.layers
    assert [l.window for l in layers] == [8] * 5 + [0] and {l.act for l in layers} == {native.ACT_GELU_TANH}
    assert all(l.q_norm and l.k_norm and l.post_attn and l.post_ffn for l in layers)
    return fast, eager


@pytest.mark.parametrize("quant", [None, "int8", "int4"])
def test_tiny_gemma3_matches_the_eager_path(quant, tiny_gemma, make_engine):
    """Gemma 3's small steps on the native kernels: three requests decoding together past the
    sliding window (different contexts and block tables per row), then one alone, against its
    eager forward with fp32 activations on both: the bound of the Llama cases above."""
    fast, eager = _gemma_engines(make_engine, tiny_gemma, quantization=quant)
    _quant_activations(fast, torch.float32)
    _quant_activations(eager, torch.float32)
    assert _batched_same_as_eager(fast, eager, GEMMA_PROMPTS, max_tokens=20).count(3) == 19
    assert _batched_same_as_eager(fast, eager, GEMMA_PROMPTS[:1], max_tokens=8).count(1) == 7


def test_tiny_gemma3_greedy_matches_transformers(tiny_gemma, make_engine):
    """fp32 through the native kernels: HF's own Gemma3ForCausalLM's greedy tokens, for a prompt
    inside one window and one six windows long (tests/engine/test_gemma3.py's)."""
    from transformers import AutoModelForCausalLM

    from tests.engine.test_gemma3 import LONG, SHORT, _hf_greedy
    ref = AutoModelForCausalLM.from_pretrained(str(tiny_gemma), dtype=torch.float32).eval()
    eng, _ = _gemma_engines(make_engine, tiny_gemma)
    calls = _count_calls(eng)
    outs = eng.generate([SHORT, LONG], SamplingParams(max_tokens=16, temperature=0))
    assert [o.token_ids for o in outs] == [_hf_greedy(ref, SHORT, 16), _hf_greedy(ref, LONG, 16)]
    assert 2 in calls


def test_tiny_gemma3_verify_steps_run_natively(tiny_gemma, make_engine):
    """n-gram speculation: 1+K verify steps, past the window too, on the native kernels, with the
    eager engine's greedy tokens."""
    from engine.config import SpeculativeConfig

    from tests.engine.test_gemma3 import LONG, LOOPING
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=4, adaptive=False)
    fast, eager = _gemma_engines(make_engine, tiny_gemma, speculative=spec)
    calls = _count_calls(fast)
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    for prompt in (LOOPING, LONG):
        assert fast.generate([prompt], sp)[0].token_ids == eager.generate([prompt], sp)[0].token_ids
    assert fast.spec.stats()["verify_steps"] > 0 and max(calls) > 1


@pytest.mark.parametrize("vnni", [True, False] if native.cpu_has_vnni() else [False])
@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_tiny_gemma3_int8_activations_track_the_eager_path(quant, vnni, tiny_gemma, make_engine, monkeypatch):
    """INT8 activations (AVX-512 with and without VNNI where this CPU has it): every linear of the
    native layers quantizes its inputs, with the kernels the eager modules call too, but the fp32
    around them (norms, attention) is summed in another order, and a 1e-7 change can flip a
    code's rounding, which this tiny random model (norm weights up to 2) amplifies layer after
    layer. So the first decode step's logits (after the same eager prefill) are compared by
    cosine, as are the prompts': measured at worst 0.996 (INT4) and 0.9999 (INT8), where ignoring the window gives
    0.34 and dropping the post-feedforward norm 0.64. (Small errors are the fp32 tests' to find.)"""
    if not vnni:
        monkeypatch.setenv("PDSERVE_NATIVE_VNNI", "0")
    native.library.cache_clear()
    try:
        fast, eager = _gemma_engines(make_engine, tiny_gemma, quantization=quant, activations="int8")
        assert native.library()._name.endswith(".so") and ("_vnni_" in native.library()._name) == vnni
        lins = [lin for l in fast.model.single_token.native.layers for lin in (l.qkv, l.o, l.gu, l.d)]
        assert all(lin.aq for lin in lins)
        got, want = _record_logits(fast), _record_logits(eager)
        sp = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
        assert len(fast.generate(GEMMA_PROMPTS, sp)[0].token_ids) == len(eager.generate(GEMMA_PROMPTS, sp)[0].token_ids)
    finally:
        native.library.cache_clear()
    assert all(bool(torch.isfinite(x).all()) for x in got)
    for x, y in zip(got[:2], want[:2]):  # the prompts' logits (the LM head alone natively), the first step's
        assert torch.nn.functional.cosine_similarity(x, y, dim=-1).min().item() > 0.99
