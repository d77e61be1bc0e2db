"""Greedy output with speculation is token-identical to plain decoding, for every draft source,
including a draft with random weights (acceptance ~0): correctness never depends on the draft."""

from __future__ import annotations

import pytest

from engine.request import SamplingParams

PROMPTS = [
    # repetitive: the answer copies the input, so n-gram lookup and good drafts get accepted
    "Copy the list exactly.\nList: apples, pears, plums, figs, dates, limes, kiwis.\n"
    "Copy: apples, pears, plums,",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
]
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def plain_outputs(model_path):
    from engine.config import CacheConfig, EngineConfig
    from engine.llm_engine import LLMEngine
    eng = LLMEngine(EngineConfig(model=str(model_path), num_threads=1, cache=CacheConfig(memory_gb=0.1)),
                    progress=False)
    outs = [o.token_ids for o in eng.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0))]
    assert eng.block_manager.num_used_blocks == 0
    return outs


SOURCES = {
    "ngram": dict(method="ngram"),
    "draft-self": dict(method="draft"),  # the target as its own draft: everything accepted
    "draft-random": dict(method="draft"),  # random weights, same tokenizer: nearly nothing accepted
    "layer-skip": dict(method="layer_skip", draft_layers=3),
    "quant-self": dict(method="quant_self"),  # INT4 copy of the target (engine.quant)
}


@pytest.mark.parametrize("source", list(SOURCES))
def test_greedy_identical_to_plain(source, plain_outputs, make_spec_engine, model_path, tiny_llama):
    spec = dict(SOURCES[source], num_speculative_tokens=4, adaptive=False)
    if source == "draft-self":
        spec["draft_model"] = str(model_path)
    elif source == "draft-random":
        spec["draft_model"] = str(tiny_llama("random-draft", 7))
    eng = make_spec_engine(spec)
    outs = eng.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
    assert [o.token_ids for o in outs] == plain_outputs
    st = eng.spec.stats()
    assert st["verify_steps"] > 0 and st["draft_tokens"] > 0
    if source == "draft-self":
        assert st["acceptance_rate"] > 0.9
    if source == "draft-random":
        assert st["acceptance_rate"] < 0.2
    if source == "ngram":
        assert st["mean_tokens_per_verify"] > 1.5  # the copied list is accepted in runs
