"""Gemma 3 text (engine/models/gemma3.py) against transformers, greedy and token-identical in fp32.

One tiny random Gemma3ForCausalLM built in code (6 layers: 5 sliding, 1 full; window 8; norm
weights randomised so their ``1 + w`` form matters), served through every path a request can
take: a short prompt, prompts several windows long, chunked prefill, a prefix-cache hit, a
decode batch, speculative decoding, a disaggregated hop; quantized ones load and generate.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from engine.config import ModelConfig, SpeculativeConfig
from engine.request import SamplingParams

VOCAB = 49152  # the bundled tokenizer's size, so its files can be reused
WINDOW = 8
SHORT = list(range(300, 306))  # inside one window
LONG = [(i * 7919) % 20000 + 100 for i in range(50)]  # six windows
REPEATING = list(range(500, 512)) * 4
LOOPING = [5] * 20  # the model's greedy continuation repeats tokens: the n-gram proposer has drafts


def _save_tiny(path, tokenizer_dir, seed: int = 0, **extra) -> None:
    import transformers as tf
    cfg = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
               num_attention_heads=2, num_key_value_heads=1, head_dim=32, sliding_window=WINDOW,
               query_pre_attn_scalar=24, max_position_embeddings=1024, bos_token_id=1, eos_token_id=2,
               pad_token_id=0)
    cfg.update(extra)
    torch.manual_seed(seed)
    model = tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(**cfg)).eval()
    with torch.no_grad():  # HF initializes them to 0, where (1 + w) and w would agree on nothing
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0, 0.5)
    model.save_pretrained(str(path))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / f, path / f)


@pytest.fixture(scope="module")
def gemma(tmp_path_factory, model_path):
    path = tmp_path_factory.mktemp("gemma3")
    _save_tiny(path, model_path)
    return path


@pytest.fixture(scope="module")
def hf_gemma(gemma):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(str(gemma), dtype=torch.float32).eval()


def _hf_greedy(ref, ids: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        g = ref.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         max_new_tokens=n, do_sample=False)
    return g[0, len(ids):].tolist()


@pytest.fixture(scope="module")
def want(hf_gemma):
    """``want(ids, n)``: HF's greedy continuation of the tiny model, computed once per prompt."""
    seen: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def get(ids: list[int], n: int = 16) -> list[int]:
        key = (tuple(ids), n)
        if key not in seen:
            seen[key] = _hf_greedy(hf_gemma, ids, n)
        return seen[key]
    return get


GREEDY = SamplingParams(max_tokens=16, temperature=0)


def test_config_reads_the_layer_kinds(gemma):
    mc = ModelConfig.from_hf(gemma)
    assert mc.family == "gemma3" and mc.tie_word_embeddings and mc.hidden_act == "gelu_pytorch_tanh"
    assert mc.is_sliding == (True,) * 5 + (False,)
    assert (mc.sliding_window, mc.rope_theta, mc.rope_local_theta, mc.query_pre_attn_scalar) == (
        WINDOW, 1e6, 1e4, 24.0)


@pytest.mark.parametrize("ids", [SHORT, LONG], ids=["short", "six-windows"])
def test_prompt_logits_and_greedy_match_transformers(ids, gemma, hf_gemma, want, make_engine):
    eng = make_engine(model=gemma, memory_gb=0.02)
    with torch.inference_mode():
        logits = hf_gemma(torch.tensor([ids])).logits[0]
    assert (eng.prompt_logits(ids) - logits).abs().max().item() < 1e-4
    out = eng.generate([ids], GREEDY)[0]
    assert out.token_ids == want(ids, 16)


def test_chunked_prefill_and_decode_batch(gemma, want, make_engine):
    # 12-token budget: prompts go in chunks shorter than, and straddling, the window, beside
    # the decodes of the requests already running
    eng = make_engine(model=gemma, memory_gb=0.02, budget=12)
    prompts = [LONG, SHORT, LONG[7:40], REPEATING[:21]]
    outs = eng.generate(prompts, GREEDY)
    for ids, out in zip(prompts, outs):
        assert out.token_ids == want(ids, 16)


def test_prefix_cache_hit(gemma, want, make_engine):
    eng = make_engine(model=gemma, memory_gb=0.02, block_size=4)
    first, second = LONG[:40] + [11, 12, 13], LONG[:40] + [21, 22]
    assert eng.generate([first], GREEDY)[0].token_ids == want(first, 16)
    out = eng.generate([second], GREEDY)[0]
    assert out.num_cached_tokens >= 36  # the shared 40 tokens, in whole blocks
    assert out.token_ids == want(second, 16)


@pytest.mark.parametrize("method", ["ngram", "layer_skip"])
def test_speculative_decoding_is_exact(method, gemma, want, make_engine):
    eng = make_engine(model=gemma, memory_gb=0.02, speculative=SpeculativeConfig(method=method, adaptive=False))
    prompts = [SHORT, LOOPING, LONG]  # verify steps inside and past the window
    outs = eng.generate(prompts, SamplingParams(max_tokens=24, temperature=0))
    for ids, out in zip(prompts, outs):
        assert out.token_ids == want(ids, 24)
    assert eng.spec.stats()["verify_steps"] > 0


def _copy_kv(src, src_blocks, dst, dst_blocks, n):
    def slots(blocks, bs):
        return torch.tensor([blocks[p // bs] * bs + p % bs for p in range(n)])
    s, d = slots(src_blocks, src.block_manager.block_size), slots(dst_blocks, dst.block_manager.block_size)
    for (sk, sv), (dk, dv) in zip(src.runner.kv_caches, dst.runner.kv_caches):
        dk[d], dv[d] = sk[s], sv[s]


def test_disaggregated_hop(gemma, want, make_engine):
    """Prefill on one engine, the KV copied into another's blocks (another block size), decode there."""
    prefill, decode = make_engine(model=gemma, memory_gb=0.02, block_size=4), \
        make_engine(model=gemma, memory_gb=0.02, block_size=16)
    assert prefill.model_config.fingerprint() == decode.model_config.fingerprint()
    prefill.add_request(LONG, GREEDY, request_id="r", prefill_only=True)
    first = [o for o in prefill.stream() if o.finished][0].token_ids[0]
    req = prefill.scheduler.requests["r"]
    blocks = decode.add_remote(LONG, GREEDY, request_id="r").block_ids
    _copy_kv(prefill, req.block_ids, decode, blocks, len(LONG))
    assert prefill.release("r")
    decode.kv_arrived("r", first_token=first)
    final = [o for o in decode.stream() if o.finished][0]
    assert final.token_ids == want(LONG, 16)


def _rounded_like(ref, quantization: str):
    """A copy of the HF model whose linears hold the weights our quantizer rounds to (fake
    quantization: the reference an INT8/INT4 weight-only engine should track closely)."""
    import copy

    from engine.quant.config import QuantConfig
    from engine.quant.formats import quantize_weight
    cfg = QuantConfig.parse(quantization)
    q = copy.deepcopy(ref)
    with torch.no_grad():
        q.lm_head.weight = torch.nn.Parameter(q.lm_head.weight.clone())  # the head is quantized, the embedding not
        for name, m in q.named_modules():
            if isinstance(m, torch.nn.Linear):  # per output row: fusing q/k/v or gate/up changes nothing
                g = cfg.group_for(m.in_features, name)
                m.weight.copy_(quantize_weight(m.weight, cfg.bits, g, cfg.symmetric).dequantize())
    return q


@pytest.mark.parametrize("quantization", ["int8", "int4", "w8a8"])
def test_quantized_loads_and_generates(quantization, gemma, hf_gemma, make_engine):
    """Not exact: weight-only formats track HF on the rounded weights; W8A8 (SmoothQuant folded
    into the (1 + w) norms, activations rounded too) stays close to full precision."""
    eng = make_engine(model=gemma, memory_gb=0.02, quantization=quantization)
    ref = hf_gemma if quantization == "w8a8" else _rounded_like(hf_gemma, quantization)
    with torch.inference_mode():
        logits = ref(torch.tensor([LONG])).logits[0]
    got = eng.prompt_logits(LONG)
    assert torch.isfinite(got).all()
    budget = 0.02  # 1 - cosine per position
    if quantization == "w8a8":
        from engine.quant.cpu_kernels import w8a8_reduce_range
        if w8a8_reduce_range():
            # this CPU's int8 GEMM saturates (no VNNI): activations get 7 bits, twice the step:
            # 4x the rounding noise power, and 1 - cosine grows with the noise power
            budget *= 4
    assert torch.nn.functional.cosine_similarity(got, logits, dim=-1).min().item() > 1 - budget
    assert len(eng.generate([LONG], GREEDY)[0].token_ids) == 16


def test_softcapping_and_global_rope_scaling(tmp_path, model_path, make_engine):
    """final_logit_softcapping applies; attn_logit_softcapping is read but, as in transformers'
    Gemma3, not applied; linear rope scaling acts on the global layers only."""
    from transformers import AutoModelForCausalLM
    _save_tiny(tmp_path, model_path, seed=1, final_logit_softcapping=0.5, attn_logit_softcapping=5.0,
               rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e4},
                                "sliding_attention": {"rope_type": "default", "rope_theta": 1e3}})
    ref = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    mc = ModelConfig.from_hf(tmp_path)
    assert mc.rope_scaling["factor"] == 4.0 and mc.rope_local_scaling is None and mc.rope_local_theta == 1e3
    eng = make_engine(model=tmp_path, memory_gb=0.02)
    with torch.inference_mode():
        logits = ref(torch.tensor([LONG])).logits[0]
    assert logits.abs().max() <= 0.5
    assert (eng.prompt_logits(LONG) - logits).abs().max().item() < 1e-5
    assert eng.generate([LONG], GREEDY)[0].token_ids == _hf_greedy(ref, LONG, 16)


def test_transformers_4_config_keys(tmp_path, gemma):
    """A config.json as transformers 4.5x wrote it (rope_theta, rope_local_base_freq,
    rope_scaling for the global layers, sliding_window_pattern, no layer_types)."""
    c = json.loads((gemma / "config.json").read_text())
    for k in ("rope_parameters", "layer_types"):
        c.pop(k)
    c.update(rope_theta=1e6, rope_local_base_freq=1e4, sliding_window_pattern=3,
             rope_scaling={"rope_type": "linear", "factor": 8.0})
    (tmp_path / "config.json").write_text(json.dumps(c))
    mc = ModelConfig.from_hf(tmp_path)
    assert mc.is_sliding == (True, True, False) * 2
    assert (mc.rope_theta, mc.rope_local_theta, mc.rope_scaling, mc.rope_local_scaling) == (
        1e6, 1e4, {"rope_type": "linear", "factor": 8.0}, None)
    assert mc.fingerprint() != ModelConfig.from_hf(gemma).fingerprint()  # layer kinds are part of it


def test_unsupported_gemma_configs_are_refused(tmp_path, gemma):
    from engine.errors import ModelLoadError
    c = json.loads((gemma / "config.json").read_text())
    for change, match in [({"architectures": ["Gemma3ForConditionalGeneration"]}, "Gemma3ForCausalLM"),
                          ({"hidden_activation": "gelu"}, "hidden_activation"),
                          ({"use_bidirectional_attention": True}, "bidirectional"),
                          ({"layer_types": ["sliding_attention"] * 5}, "layer_types")]:
        (tmp_path / "config.json").write_text(json.dumps({**c, **change}))
        with pytest.raises(ModelLoadError, match=match):
            ModelConfig.from_hf(tmp_path)
