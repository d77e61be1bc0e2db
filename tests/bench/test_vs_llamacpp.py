"""bench/vs_llamacpp.py and bench/gguf_ppl.py: key names, medians and the JSON line, without
running a model or llama.cpp."""

from __future__ import annotations

import json

from bench.gguf_ppl import ppl_results
from bench.vs_llamacpp import FORMATS, WORKLOADS, build_parser, model_results, model_table, ratio_key, spread

META = {"model_file": "m.gguf", "threads": 2, "rounds": 3, "quick": False, "cpu_class": "AVX2",
        "cpu_capability": "AVX2", "isa": "native", "prompt_tokens": 128, "new_tokens": 128,
        "prefill_tokens": 512, "batch": 8, "int8_from": "shipped"}


def test_the_headline_keys_of_the_1p5b_run():
    keys = {ratio_key("qwen2.5-coder-1.5b", f, w) for f, w in
            [("shipped", "decode"), ("int8", "decode"), ("shipped", "prefill"), ("shipped", "batch8")]}
    assert keys == {"decode_ratio_vs_llamacpp_q4km_1p5b", "int8_decode_ratio_vs_llamacpp_q8_0_1p5b",
                    "prefill_ratio_vs_llamacpp_q4km_1p5b", "batch8_ratio_vs_llamacpp_q4km_1p5b"}


def test_other_models_change_only_the_suffix_and_the_shipped_type():
    assert ratio_key("qwen2.5-coder-0.5b", "shipped", "decode") == "decode_ratio_vs_llamacpp_q4km_0p5b"
    assert ratio_key("gemma3-270m", "int8", "batch8") == "int8_batch8_ratio_vs_llamacpp_q8_0_gemma3_270m"
    assert ratio_key("smollm2-135m", "shipped", "prefill") == "prefill_ratio_vs_llamacpp_q4_1_smollm2"


def test_medians_ratios_and_rounds_make_one_json_line():
    ours = {(f, w): [10.0, 30.0, 20.0] for w in WORKLOADS for f in FORMATS}
    peer = {(f, w): [5.0, 10.0, 40.0] for w in WORKLOADS for f in FORMATS}
    res = model_results("qwen2.5-coder-1.5b", ours, peer, [20.0, 18.0, 25.0])
    assert res["decode_ratio_vs_llamacpp_q4km_1p5b"] == 2.0  # median 20 / median 10
    assert res["pdserve_shipped_decode_tok_s_1p5b"] == 20.0
    assert res["llamacpp_q8_0_batch8_tok_s_1p5b"] == 10.0
    assert res["pdserve_int8_prefill_rounds_1p5b"] == [10.0, 30.0, 20.0]  # in round order
    assert res["read_bandwidth_gb_s_1p5b"] == 20.0
    assert spread([3.0, 1.0, 2.0]) == (2.0, 1.0, 3.0)
    res["copy_bandwidth_gb_s_1p5b"] = 12.0
    table = model_table("qwen2.5-coder-1.5b", res, META)
    assert "20.0 [10.0-30.0]" in table and "2.00x" in table and "Q4_K_M" in table and "Q8_0" in table
    assert "\n" not in json.dumps(res) and json.loads(json.dumps(res)) == res


def test_a_partial_run_reports_what_it_measured():
    ours = {("shipped", "decode"): [10.0]}
    res = model_results("gemma3-270m", ours, {("shipped", "decode"): [8.0]}, [20.0])
    assert [k for k in res if "ratio" in k] == ["decode_ratio_vs_llamacpp_q4km_gemma3_270m"]
    res["copy_bandwidth_gb_s_gemma3_270m"] = 12.0
    assert "int8" not in model_table("gemma3-270m", res, META)


def test_without_model_the_old_run_is_the_default():
    args = build_parser().parse_args([])
    assert args.model is None and args.precisions == "fp32,int8,int4" and args.rounds == 3


def test_perplexity_keys():
    res = ppl_results("0p5b", {"float": 10.0, "shipped": 10.5, "int8": 10.1, "int4": 12.0})
    assert res["ppl_float_0p5b"] == 10.0 and res["ppl_increase_int4_0p5b"] == 0.2
    assert "ppl_increase_float_0p5b" not in res and res["ppl_increase_shipped_0p5b"] == 0.05
