"""Fixtures for quantization tests: a tiny random Llama folder (hidden 128, so every INT4 group
size divides it) with the bundled tokenizer, and its plain (not prepacked) model."""

from __future__ import annotations

import shutil

import pytest
import torch


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory, model_path):
    import transformers as tf
    path = tmp_path_factory.mktemp("tiny-llama")
    cfg = tf.LlamaConfig(vocab_size=49152, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         bos_token_id=1, eos_token_id=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # a few outlier input channels, as real models have
        for layer in model.model.layers:
            layer.input_layernorm.weight[:4] = 8.0
    model.save_pretrained(str(path))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_path / f, path / f)
    return path


@pytest.fixture
def tiny_model(tiny_dir):
    """Our LlamaForCausalLM on the tiny weights, fp32, plain nn.Linear layers."""
    from engine.layers.attention import get_attention_backend
    from engine.models.loader import load_model
    return load_model(tiny_dir, get_attention_backend("sdpa"), torch.float32, prepack=False)


@pytest.fixture
def greedy():
    """greedy(eng, ids, n): ``n`` greedy tokens (ignore_eos) of ``ids`` through an LLMEngine,
    stepped by hand; checks that every KV block came back."""
    from engine.request import SamplingParams

    def run(eng, ids: list[int], n: int) -> list[int]:
        eng.add_request(ids, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True), request_id="r")
        toks: list[int] = []
        while eng.has_unfinished():
            for o in eng.step():
                toks.extend(o.new_token_ids)
        assert eng.block_manager.num_used_blocks == 0
        return toks
    return run
