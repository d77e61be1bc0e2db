"""Bad speculative configs are refused with messages naming the problem."""

from __future__ import annotations

import json

import pytest

from engine.config import SpeculativeConfig
from engine.errors import ModelLoadError


@pytest.mark.parametrize("k", [0, 9, -1, 2.5, True])
def test_k_out_of_range_refused(k):
    with pytest.raises(ValueError, match="num_speculative_tokens must be an integer in 1..8"):
        SpeculativeConfig(method="ngram", num_speculative_tokens=k)


def test_bad_method_and_missing_draft_refused():
    with pytest.raises(ValueError, match="draft, ngram, layer_skip, quant_self"):
        SpeculativeConfig(method="medusa")
    with pytest.raises(ValueError, match="needs draft_model"):
        SpeculativeConfig(method="draft")
    with pytest.raises(ValueError, match="ngram_min"):
        SpeculativeConfig(method="ngram", ngram_min=3, ngram_max=2)
    assert SpeculativeConfig(method="ngram", num_speculative_tokens=8).label == "ngram-k8"


def test_draft_with_other_vocab_size_refused(make_spec_engine, tiny_llama):
    draft = tiny_llama("small-vocab-draft", 0, vocab=16)
    with pytest.raises(ModelLoadError, match="vocab_size 16.*same tokenizer"):
        make_spec_engine(dict(method="draft", draft_model=str(draft)))


def test_draft_with_other_tokens_refused(make_spec_engine, tiny_llama, tmp_path):
    import shutil
    src = tiny_llama("tiny-draft-tok", 5, layers=1)
    for f in src.iterdir():
        shutil.copy(f, tmp_path / f.name)
    tok = json.loads((tmp_path / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = (next(w for w, i in vocab.items() if i == n) for n in (1000, 1001))
    vocab[a], vocab[b] = 1001, 1000  # same size and tokens, two ids mean something else
    (tmp_path / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ModelLoadError, match="different tokenizer vocabulary"):
        make_spec_engine(dict(method="draft", draft_model=str(tmp_path)))


def test_layer_skip_needs_fewer_layers_than_the_target(make_spec_engine):
    with pytest.raises(ValueError, match="draft_layers must be in 1..29"):
        make_spec_engine(dict(method="layer_skip", draft_layers=30))
