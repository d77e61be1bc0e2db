"""Every Llama-family layout we claim loads from an HF folder and matches transformers.

Tiny random models built in code (no hub): Llama with GQA and Llama-3 rope scaling, Mistral
(full attention), Qwen2 (q/k/v bias; untied and tied LM head), sharded safetensors and .bin weights.
Gemma 3 has its own file (test_gemma3.py).
"""

from __future__ import annotations

import shutil

import pytest
import torch

from engine.request import SamplingParams

VOCAB = 49152  # the bundled tokenizer's size, so its files can be reused


def _save_tiny(kind: str, path, tokenizer_dir, **extra) -> None:
    import transformers as tf
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    common.update(extra)
    cls = {"llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
           "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
           "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM)}[kind]
    if kind == "mistral":
        common.setdefault("sliding_window", None)
    torch.manual_seed(0)
    model = cls[1](cls[0](**common)).eval()
    if kind == "qwen2":  # make the q/k/v biases matter
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    model.save_pretrained(str(path))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / f, path / f)


CASES = {
    "llama-gqa": ("llama", {}),
    "llama3-rope-scaling": ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                                                        "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                        "original_max_position_embeddings": 64}}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "mistral": ("mistral", {}),
    "qwen2-bias": ("qwen2", {}),  # untied LM head, as every case here unless it says tied
    "qwen2-tied": ("qwen2", {"tie_word_embeddings": True}),  # as Qwen2-0.5B ships
}


@pytest.mark.parametrize("case", list(CASES))
def test_tiny_model_matches_transformers(case, tmp_path, model_path, make_engine):
    import transformers as tf
    kind, extra = CASES[case]
    _save_tiny(kind, tmp_path, model_path, **extra)
    ref = tf.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    eng = make_engine(model=tmp_path, memory_gb=0.02)
    ids = list(range(300, 300 + 100))
    with torch.inference_mode():
        want = ref(torch.tensor([ids])).logits[0]
    assert (eng.prompt_logits(ids) - want).abs().max().item() < 1e-4

    with torch.inference_mode():
        g = ref.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False,
                         attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    out = eng.generate([ids], SamplingParams(max_tokens=12, temperature=0))[0]
    assert out.token_ids == g[0, len(ids):].tolist()


def test_pytorch_bin_weights_load(tmp_path, model_path, make_engine):
    from safetensors.torch import load_file
    _save_tiny("llama", tmp_path, model_path)
    for f in tmp_path.glob("*.safetensors"):  # rewrite as an old-style PyTorch checkpoint
        torch.save(load_file(str(f)), str(tmp_path / "pytorch_model.bin"))
        f.unlink()
    assert list(tmp_path.glob("pytorch_model*.bin")) and not list(tmp_path.glob("*.safetensors"))
    eng = make_engine(model=tmp_path, memory_gb=0.02)
    assert eng.prompt_logits([5, 6, 7]).shape == (3, VOCAB)


def test_sliding_window_mistral_is_refused(tmp_path, model_path):
    from engine.config import EngineConfig
    from engine.errors import ModelLoadError
    from engine.llm_engine import LLMEngine
    _save_tiny("mistral", tmp_path, model_path, sliding_window=32)
    with pytest.raises(ModelLoadError, match="sliding"):
        LLMEngine(EngineConfig(model=str(tmp_path)), progress=False)
