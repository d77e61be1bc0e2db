"""Module swap, checkpoints, quantized decode in the engine and auto-protection, on a tiny
random Llama (hidden 128, 2 layers, tied embeddings, outlier channels)."""

from __future__ import annotations

import torch
from torch import nn

from engine.config import CacheConfig, EngineConfig
from engine.layers.linear import prepack_linears
from engine.llm_engine import LLMEngine
from engine.quant import QuantConfig, quantize
from engine.quant.calib import SequenceForward
from engine.quant.checkpoint import is_quantized_checkpoint, read_meta
from engine.quant.linear import Int4Linear, Int8Linear, W8A8Linear
from engine.quant.offline import convert

IDS = list(range(300, 380))
SEQS = [list(range(1000, 1200)), list(range(5000, 5150))]


def _logits(model):
    return SequenceForward(model).logits(IDS)


def test_quantize_swaps_the_targets(tiny_model):
    ref = _logits(tiny_model)
    quantize(tiny_model, QuantConfig(bits=4, group_size=64, protect=("o_proj",)))
    kinds = {n: type(m) for n, m in tiny_model.named_modules() if n.endswith(("_proj", "lm_head"))}
    assert kinds["layers.0.self_attn.o_proj"] is nn.Linear and kinds["layers.1.self_attn.o_proj"] is nn.Linear
    assert kinds["layers.0.mlp.down_proj"] is Int4Linear and kinds["lm_head"] is Int4Linear
    assert tiny_model.embed_tokens.weight.dtype == torch.float32  # the embedding stays fp
    out = _logits(tiny_model)
    rel = float((out - ref).norm() / ref.norm())
    assert 0 < rel < 0.3, rel  # changed, by about the INT4 rounding noise of random weights


def test_lm_head_can_stay_full_precision(tiny_model):
    quantize(tiny_model, QuantConfig(bits=8, lm_head=False))
    assert type(tiny_model.lm_head) is nn.Linear
    assert tiny_model.lm_head.weight is tiny_model.embed_tokens.weight  # still tied
    assert isinstance(tiny_model.layers[0].mlp.gate_up_proj, Int8Linear)


def test_checkpoint_round_trip_gives_identical_logits(tiny_dir, tmp_path):
    for i, cfg in enumerate([QuantConfig(bits=4, group_size=32, symmetric=False, method="gptq", act_order=True,
                                         lm_head=False),
                             QuantConfig(bits=8, method="awq", protect=("layers.1.mlp.down_proj",), lm_head=False),
                             QuantConfig(bits=8, activations="int8")]):
        out = tmp_path / f"q{i}"
        model, final_cfg, report = convert(tiny_dir, cfg, out, calib_tokens=512, heldout_tokens=128,
                                           log=lambda _m: None)
        assert is_quantized_checkpoint(out) and read_meta(out)["name"] == cfg.name
        assert QuantConfig.from_dict(read_meta(out)["quantization"]) == final_cfg
        assert set(report["before"]) == {"calib_ppl", "prose_ppl", "code_ppl"}
        prepack_linears(model)  # what the loader does to the fp32 linears left
        from engine.layers.attention import get_attention_backend
        from engine.models.loader import load_model
        # (as converted: the served-weights cache would add the one-token path's INT8 order)
        loaded = load_model(out, get_attention_backend("sdpa"), torch.float32, cache=False)
        assert torch.equal(_logits(model), _logits(loaded))
        if cfg.activations == "int8":
            assert isinstance(loaded.layers[0].mlp.down_proj, W8A8Linear)


def test_engine_decodes_quantized_and_from_a_checkpoint(tiny_dir, tmp_path, greedy):
    def engine(model, q=None):
        return LLMEngine(EngineConfig(model=str(model), quantization=q, cache=CacheConfig(memory_gb=0.02)),
                         progress=False)
    fp = greedy(engine(tiny_dir), IDS, 12)
    q = engine(tiny_dir, "int4-g64")
    assert isinstance(q.model.layers[0].self_attn.qkv_proj, Int4Linear)
    toks = greedy(q, IDS, 12)
    assert len(toks) == 12 and all(0 <= t < 49152 for t in toks)
    assert len(fp) == 12
    convert(tiny_dir, QuantConfig(bits=4, group_size=64), tmp_path / "ck", heldout_tokens=128, log=lambda _m: None)
    assert greedy(engine(tmp_path / "ck"), IDS, 12) == toks  # RTN offline == RTN at load


def test_w8a8_at_load_is_calibrated_on_the_bundled_sample(tiny_dir, greedy):
    """`decode.quantization: w8a8` used to fail at start: SmoothQuant needs calibration data,
    and none was passed at load. The loader now calibrates on the bundled sample."""
    eng = LLMEngine(EngineConfig(model=str(tiny_dir), quantization="w8a8", cache=CacheConfig(memory_gb=0.02)),
                    progress=False)
    assert isinstance(eng.model.layers[0].self_attn.qkv_proj, W8A8Linear)
    assert len(greedy(eng, IDS, 12)) == 12


def test_auto_protect_meets_the_budget(tiny_dir):
    from engine.quant.calib import mean_nll
    from engine.quant.quantize import compute_weights, plan_targets
    from engine.quant.sensitivity import choose_protection, scan
    from engine.quant.offline import load_plain

    model = load_plain(tiny_dir)
    cfg = QuantConfig(bits=4, group_size=32, symmetric=True)
    targets, _ = plan_targets(model, cfg)
    weights, _ = compute_weights(model, cfg, targets)
    base, rows = scan(model, cfg, weights, SEQS)
    assert len(rows) == len(targets) == 9 and rows[0].nll_increase >= rows[-1].nll_increase
    assert type(model.lm_head) is nn.Linear  # the scan restored every fp module
    assert abs(mean_nll(model, SEQS) - base) < 1e-6
    full = rows  # all quantized:
    from engine.quant.sensitivity import _Swapper
    sw = _Swapper(model, weights, cfg)
    sw.quantized(set(weights))
    all_q = torch.tensor(mean_nll(model, SEQS) - base).exp().item() - 1
    sw.restore()
    budget = all_q / 3
    chosen, inc = choose_protection(model, cfg, weights, SEQS, full, base, budget)
    assert inc <= budget and 1 <= len(chosen) < len(weights)
    assert chosen == [n for r in rows[:len(chosen)] for n in r.modules]  # the most sensitive first
