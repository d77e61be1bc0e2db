"""The engine on the real model against HF transformers: logits and greedy tokens."""

from __future__ import annotations

import pytest
import torch

from engine.request import SamplingParams

NEW_TOKENS = 64


@pytest.fixture(scope="module")
def prompts(greedy_reference) -> list[str]:
    return [p for p, _ in greedy_reference]


@pytest.fixture(scope="module")
def hf_greedy(greedy_reference) -> list[list[int]]:
    return [ids for _, ids in greedy_reference]


def test_logits_match_hf(make_engine, hf_model, tokenizer, prompts):
    eng = make_engine()
    for p in prompts[:3]:
        ids = tokenizer(p)["input_ids"]
        ours = eng.prompt_logits(ids)
        with torch.inference_mode():
            ref = hf_model(torch.tensor([ids])).logits[0].float()
        assert ours.shape == ref.shape
        assert (ours - ref).abs().max().item() <= 1e-3


def _greedy(eng, prompts):
    sp = SamplingParams(max_tokens=NEW_TOKENS, temperature=0)
    return eng.generate(prompts, sp)


@pytest.mark.parametrize("budget,chunked", [(2048, False), (16, True), (7, True)],
                         ids=["no-chunking", "chunked-16", "chunked-7"])
def test_greedy_batch_matches_hf(make_engine, hf_greedy, prompts, budget, chunked):
    eng = make_engine(budget=budget, chunked=chunked)
    outs = _greedy(eng, prompts)
    for out, ref in zip(outs, hf_greedy):
        assert out.token_ids == ref
        # HF stops at EOS before the budget; so must we, with the right reason.
        assert out.finish_reason == ("length" if len(ref) == NEW_TOKENS else "stop")


def test_greedy_with_prefix_cache_hit(make_engine, hf_greedy, tokenizer, prompts):
    eng = make_engine(budget=64)
    # Warm the cache with one prompt, then run the batch: prompt 2 (>= one full block) is a hit.
    _greedy(eng, [prompts[2]])
    outs = _greedy(eng, prompts)
    assert outs[2].num_cached_tokens >= 16
    assert eng.block_manager.prefix_hits > 0
    for out, ref in zip(outs, hf_greedy):
        assert out.token_ids == ref


def test_bf16_close_to_fp32(make_engine, tokenizer, prompts):
    fp32, bf16 = make_engine(), make_engine(dtype="bfloat16")
    for p in prompts[:3]:
        ids = tokenizer(p)["input_ids"]
        a, b = fp32.prompt_logits(ids)[-1], bf16.prompt_logits(ids)[-1]
        assert a.argmax() == b.argmax()
        assert torch.nn.functional.cosine_similarity(a, b, dim=0) > 0.99
