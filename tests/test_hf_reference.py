"""tests/hf_reference.py: a recorded reference is returned for exactly the same inputs, and
only prompts without one run the model."""

from __future__ import annotations

import types

import torch

from tests import hf_reference


class _Counting:
    """A stand-in for transformers' model: the next token is (last token + 1) mod 50; counts
    its forwards."""

    def __init__(self) -> None:
        self.forwards = 0

    def __call__(self, x, past_key_values=None, use_cache=True):
        self.forwards += 1
        logits = torch.zeros(1, x.shape[1], 50)
        logits[0, -1, (int(x[0, -1]) + 1) % 50] = 1.0
        return types.SimpleNamespace(logits=logits, past_key_values=past_key_values)


def test_a_recorded_reference_is_reused_and_only_misses_run(tmp_path, monkeypatch):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + bytes(64))
    monkeypatch.setenv("PDSERVE_HF_REFERENCE_DIR", str(tmp_path / "refs"))
    loads = []
    monkeypatch.setattr(hf_reference, "load_hf", lambda f: loads.append(_Counting()) or loads[-1])
    assert hf_reference.greedy(gguf, [[1, 2], [7]], 3) == [[3, 4, 5], [8, 9, 10]]
    assert len(loads) == 1 and loads[0].forwards == 6
    # the same inputs: no load at all; one new prompt: one load, its forwards only
    assert hf_reference.greedy(gguf, [[7], [1, 2]], 3) == [[8, 9, 10], [3, 4, 5]]
    assert len(loads) == 1
    assert hf_reference.greedy(gguf, [[1, 2], [20]], 3) == [[3, 4, 5], [21, 22, 23]]
    assert len(loads) == 2 and loads[1].forwards == 3
    # another count of tokens, or other bytes in the file, is another reference
    hf_reference.greedy(gguf, [[1, 2]], 2)
    assert len(loads) == 3
    gguf.write_bytes(b"GGUF" + bytes(65))
    hf_reference.greedy(gguf, [[1, 2]], 3)
    assert len(loads) == 4


def test_off_computes_every_reference(tmp_path, monkeypatch):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + bytes(64))
    monkeypatch.setenv("PDSERVE_HF_REFERENCE_DIR", "off")
    loads = []
    monkeypatch.setattr(hf_reference, "load_hf", lambda f: loads.append(_Counting()) or loads[-1])
    for _ in range(2):
        assert hf_reference.greedy(gguf, [[1]], 2) == [[2, 3]]
    assert len(loads) == 2


class _Generating:
    """A stand-in for ``generate``: appends (last + 1) mod 50 until ``max_new_tokens`` or token 0
    (its EOS)."""

    def __init__(self) -> None:
        self.calls = 0

    def generate(self, x, attention_mask=None, max_new_tokens=1, do_sample=False):
        self.calls += 1
        out = x[0].tolist()
        for _ in range(max_new_tokens):
            out.append((out[-1] + 1) % 50)
            if out[-1] == 0:
                break
        return torch.tensor([out])


def test_generate_on_a_folder_is_keyed_by_its_files_and_recipe(tmp_path, monkeypatch):
    """HF ``generate``'s tokens (stopping at EOS) on an HF folder: recorded per config and
    weights bytes, never mixed up with the GGUF recipe's entries."""
    monkeypatch.setenv("PDSERVE_HF_REFERENCE_DIR", str(tmp_path / "refs"))
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(bytes(64))
    models: list[_Generating] = []

    def load():
        models.append(_Generating())
        return models[-1]
    assert hf_reference.generate(folder, [[1, 2], [47]], 4, load) == [[3, 4, 5, 6], [48, 49, 0]]
    assert hf_reference.generate(folder, [[47], [1, 2]], 4, load) == [[48, 49, 0], [3, 4, 5, 6]]
    assert len(models) == 1 and models[0].calls == 2
    (folder / "model.safetensors").write_bytes(bytes(65))  # other weights: another reference
    hf_reference.generate(folder, [[1, 2]], 4, load)
    assert len(models) == 2


def test_a_recorded_result_is_reused_for_the_same_file_recipe_and_inputs(tmp_path, monkeypatch):
    """``recorded``: what a tokenizer made of some inputs, computed once; other inputs, another
    recipe or other file bytes compute again; ``off`` always computes."""
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + bytes(64))
    monkeypatch.setenv("PDSERVE_HF_REFERENCE_DIR", str(tmp_path / "refs"))
    calls = []

    def compute(value):
        return lambda: calls.append(value) or {"ids": [value, value + 1], "text": "x"}
    assert hf_reference.recorded(gguf, "ids", ["a", 1], compute(5)) == {"ids": [5, 6], "text": "x"}
    assert hf_reference.recorded(gguf, "ids", ["a", 1], compute(9)) == {"ids": [5, 6], "text": "x"}
    assert calls == [5]
    hf_reference.recorded(gguf, "ids", ["a", 2], compute(1))
    hf_reference.recorded(gguf, "other", ["a", 1], compute(2))
    gguf.write_bytes(b"GGUF" + bytes(65))
    hf_reference.recorded(gguf, "ids", ["a", 1], compute(3))
    assert calls == [5, 1, 2, 3]
    monkeypatch.setenv("PDSERVE_HF_REFERENCE_DIR", "off")
    hf_reference.recorded(gguf, "ids", ["a", 1], compute(4))
    hf_reference.recorded(gguf, "ids", ["a", 1], compute(4))
    assert calls == [5, 1, 2, 3, 4, 4]
