"""Quality on the real bundled model (SmolLM2-135M-Instruct): INT8 within 1% perplexity on the
held-out prose and code, GPTQ beats RTN at INT4, the auto-protect budget is met, checkpoints
reload to identical logits, and the engine decodes quantized with high greedy agreement."""

from __future__ import annotations

import math

import pytest
import torch

from engine.config import CacheConfig, EngineConfig
from engine.layers.attention import get_attention_backend
from engine.llm_engine import LLMEngine
from engine.models.loader import load_model
from engine.quant import QuantConfig, quantize
from engine.quant.calib import SequenceForward, calib_sequences, load_calib_texts, mean_nll
from engine.quant.checkpoint import save_quantized
from engine.quant.eval import HELDOUT, greedy_agreement, perplexity
from engine.quant.offline import load_plain
from engine.request import SamplingParams


@pytest.fixture(scope="module")
def heldout(tokenizer):
    return {k: tokenizer(f.read_text())["input_ids"][:768] for k, f in HELDOUT.items()}


@pytest.fixture(scope="module")
def calib(tokenizer):
    return calib_sequences(tokenizer, load_calib_texts(None), seq_len=256, max_tokens=512)


@pytest.fixture(scope="module")
def fp_ppl(model_path, heldout):
    model = load_plain(model_path)
    return {k: perplexity(model, ids) for k, ids in heldout.items()}


def test_int8_perplexity_within_one_percent(model_path, heldout, fp_ppl):
    model = load_plain(model_path)
    quantize(model, "int8")
    for kind, ids in heldout.items():
        inc = perplexity(model, ids) / fp_ppl[kind] - 1
        assert inc <= 0.01, f"{kind}: INT8 perplexity +{100 * inc:.2f}% (fp {fp_ppl[kind]:.3f})"


def test_int4_gptq_beats_rtn(model_path, heldout, tokenizer):
    calib = calib_sequences(tokenizer, load_calib_texts(None), seq_len=512, max_tokens=2048)  # all of it
    results = {}
    for method in ("rtn", "gptq"):
        model = load_plain(model_path)
        quantize(model, QuantConfig(bits=4, method=method, lm_head=False), calib)
        results[method] = [perplexity(model, ids[:512]) for ids in heldout.values()]
    # held-out prose and code perplexity (GPTQ with act-order, the default)
    assert all(g < r for g, r in zip(results["gptq"], results["rtn"])), results


def test_auto_protect_meets_the_budget_on_the_real_model(model_path, calib):
    from engine.quant.quantize import compute_weights, plan_targets
    from engine.quant.sensitivity import choose_protection, scan
    model = load_plain(model_path)
    cfg = QuantConfig(bits=4)
    seqs = [calib[0][:128]]
    targets, _ = plan_targets(model, cfg)
    weights, _ = compute_weights(model, cfg, targets)
    base, rows = scan(model, cfg, weights, seqs, unit="layer")
    assert len(rows) == 31  # 30 decoder layers + the LM head
    chosen, inc = choose_protection(model, cfg, weights, seqs, rows, base, max_ppl_increase=0.05)
    assert inc <= 0.05 and 0 < len(chosen) < len(weights)
    quantize(model, QuantConfig(bits=4, protect=tuple(chosen)))
    assert math.exp(mean_nll(model, seqs) - base) - 1 == pytest.approx(inc, abs=1e-6)


def test_checkpoint_reload_identical_logits_and_engine_decode(model_path, tmp_path, tokenizer):
    model = load_plain(model_path)
    quantize(model, "int8")
    save_quantized(model, QuantConfig(bits=8), tmp_path / "int8", model_path)
    ref = load_model(model_path, get_attention_backend("sdpa"), torch.float32, quantization="int8")
    loaded = load_model(tmp_path / "int8", get_attention_backend("sdpa"), torch.float32)
    ids = tokenizer("The lighthouse keeper wrote in her ledger every day")["input_ids"]
    assert torch.equal(SequenceForward(ref).logits(ids), SequenceForward(loaded).logits(ids))

    prompts = [tokenizer(p)["input_ids"] for p in ("The capital of France is", "def add(a, b):\n",
                                                     "Q: What is 17 times 3?\nA:")]

    def run(eng: LLMEngine) -> list[list[int]]:
        sp = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
        rids = [eng.add_request(p, sp) for p in prompts]
        out: dict[str, list[int]] = {r: [] for r in rids}
        while eng.has_unfinished():
            for o in eng.step():
                out[o.request_id].extend(o.new_token_ids)
        assert eng.block_manager.num_used_blocks == 0
        return [out[r] for r in rids]

    cc = CacheConfig(memory_gb=0.05)
    fp_tokens = run(LLMEngine(EngineConfig(model=str(model_path), cache=cc), progress=False))
    q_eng = LLMEngine(EngineConfig(model=str(tmp_path / "int8"), cache=cc), progress=False)
    q_tokens = run(q_eng)
    assert all(len(t) == 16 for t in q_tokens)
    agreement = greedy_agreement(q_eng.model, prompts, fp_tokens)
    print(f"INT8 greedy agreement with fp32: {agreement:.3f}")
    assert agreement >= 0.9
