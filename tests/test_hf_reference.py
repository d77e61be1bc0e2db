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
