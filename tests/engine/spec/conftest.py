"""Tiny random Llama models built in code for the speculative-decoding tests.

``tiny_llama(name, seed, vocab=...)`` saves an HF-format folder once per session: with the
bundled tokenizer (vocab 49152) for drafts of the real model, or with a word-level tokenizer of
``vocab`` tokens ("t0".."tN") for the small-vocabulary sampling tests.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

BUNDLED_VOCAB = 49152


def _small_tokenizer(path: Path, vocab: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", bos_token="t1", eos_token="t2")
    fast.save_pretrained(str(path))


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory, model_path) -> Callable[..., Path]:
    """Build (once) a tiny random Llama: ``tiny_llama(name, seed, vocab=None, logit_scale=1.0,
    layers=2)``; ``vocab=None`` uses the bundled tokenizer."""
    built: dict[str, Path] = {}

    def make(name: str, seed: int, vocab: int | None = None, logit_scale: float = 1.0,
             layers: int = 2) -> Path:
        if name in built:
            return built[name]
        import transformers as tf
        path = tmp_path_factory.mktemp(name)
        cfg = tf.LlamaConfig(vocab_size=vocab or BUNDLED_VOCAB, hidden_size=64, intermediate_size=128,
                             num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=8192, bos_token_id=1, eos_token_id=2,
                             tie_word_embeddings=False)
        torch.manual_seed(seed)
        model = tf.LlamaForCausalLM(cfg).eval()
        with torch.no_grad():
            model.lm_head.weight.mul_(logit_scale)
        model.save_pretrained(str(path))
        if vocab is None:
            for f in ("tokenizer.json", "tokenizer_config.json"):
                shutil.copy(model_path / f, path / f)
        else:
            _small_tokenizer(path, vocab)
        built[name] = path
        return path

    return make


P_SIGNIFICANCE = 1e-3  # chi-square tests reject at this p-value


def chi_square_p_value(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """p-value of Pearson's chi-square goodness-of-fit; cells expecting < 5 are pooled."""
    n = counts.sum()
    exp = expected_probs.double() * n
    small = exp < 5
    obs = torch.cat([counts[~small].double(), counts[small].double().sum().reshape(1)])
    exp = torch.cat([exp[~small], exp[small].sum().reshape(1)])
    keep = exp > 0
    if bool((obs[~keep] > 0).any()):  # a token with zero probability was drawn
        return 0.0
    obs, exp = obs[keep], exp[keep]
    stat = ((obs - exp) ** 2 / exp).sum()
    df = len(obs) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


def broken_resample_from_target(draft_ids, target, draft_probs, greedy, generator_at):
    """``accept_draft`` with a classic bug: on rejection it resamples from p instead of
    normalize(max(0, p - q)). Same signature, for monkeypatching."""
    from engine.sampler import sample_from_probs
    for j, x in enumerate(draft_ids):
        gen = generator_at(j)
        if float(torch.rand((), generator=gen)) * float(draft_probs[j, x]) < float(target[j, x]):
            continue
        return list(draft_ids[:j]) + [int(sample_from_probs(target[j:j + 1], [gen])[0])]
    return list(draft_ids) + [int(sample_from_probs(target[-1:], [generator_at(len(draft_ids))])[0])]


@pytest.fixture
def chi_square_p() -> Callable[[torch.Tensor, torch.Tensor], float]:
    return chi_square_p_value


@pytest.fixture
def broken_rule() -> Callable:
    return broken_resample_from_target


@pytest.fixture
def make_spec_engine(make_engine):
    """Engines with speculative decoding (tests/conftest.py's make_engine: each must end with no
    blocks or requests held)."""
    from engine.config import SpeculativeConfig

    def make(spec: SpeculativeConfig | dict | None = None, model: str | Path | None = None,
             memory_gb: float = 0.1, num_blocks: int | None = None, block_size: int = 16,
             budget: int = 2048, max_num_seqs: int = 64, prefix: bool = True):
        if isinstance(spec, dict):
            spec = SpeculativeConfig(**spec)
        return make_engine(model=model, memory_gb=memory_gb, num_blocks=num_blocks, block_size=block_size,
                           budget=budget, max_num_seqs=max_num_seqs, prefix=prefix, speculative=spec,
                           num_threads=1)  # 1 thread: robust on a busy box
    return make
