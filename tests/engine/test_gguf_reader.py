"""The loading reader (engine/models/gguf_reader.py): the same tensors and scalar metadata as
gguf-py's GGUFReader, the arrays stepped over, and a file cut inside an array still refused."""

from __future__ import annotations

import numpy as np
import pytest

from engine.errors import ModelLoadError
from engine.models import gguf
from engine.models.gguf_reader import TensorReader
from tests.pulled import gguf_file


def _table(reader) -> list:
    return [(t.name, t.tensor_type, tuple(t.shape), t.data_offset, t.n_bytes) for t in reader.tensors]


def _scalars(reader, skip=()) -> dict:
    return {k: f.contents() for k, f in reader.fields.items() if k not in skip}


def _write(path, vocab: int) -> None:
    """A small GGUF with every kind of value: scalars, a string, string and number arrays (a
    vocabulary of ``vocab`` tokens), a nested array, then tensors."""
    from gguf import GGUFWriter
    w = GGUFWriter(str(path), "qwen2")
    w.add_block_count(2)
    w.add_float32("qwen2.rope.freq_base", 1e6)
    w.add_string("general.name", "tiny test model")
    w.add_token_list([f"tok{i}" * (1 + i % 5) for i in range(vocab)])
    w.add_token_types([1 + i % 3 for i in range(vocab)])
    w.add_array("test.nested", [[1, 2, 3], [4, 5]])
    w.add_uint32("general.alignment", 64)
    w.add_bool("test.flag", True)
    gen = np.random.default_rng(0)
    w.add_tensor("token_embd.weight", gen.standard_normal((vocab, 8), dtype=np.float32))
    w.add_tensor("blk.0.attn_q.weight", gen.standard_normal((8, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_same_tensors_and_scalars_as_the_library_arrays_skipped(tmp_path):
    import gguf as gguf_py
    path = tmp_path / "tiny.gguf"
    _write(path, 1000)
    ref, ours = gguf_py.GGUFReader(str(path)), TensorReader(str(path))
    assert _table(ours) == _table(ref) and ours.data_offset == ref.data_offset
    for a, b in zip(ours.tensors, ref.tensors):
        assert np.array_equal(a.data, b.data)
    assert ours.skipped == {"tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "test.nested"}
    assert _scalars(ours) == _scalars(ref, ours.skipped)
    assert gguf.field(ours, "general.name") == "tiny test model" and gguf.field(ours, "test.flag") is True
    with pytest.raises(KeyError, match="array"):
        gguf.field(ours, "tokenizer.ggml.tokens")


def test_a_file_cut_inside_its_vocabulary_is_refused_naming_it(tmp_path):
    path = tmp_path / "whole.gguf"
    _write(path, 5000)
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:data.index(b"tok2500")])  # inside the token list
    with pytest.raises(ModelLoadError, match=r"cut\.gguf.*not a readable GGUF"):
        gguf.open_reader(cut)


def test_a_real_vocabulary_file_reads_the_same_tensors():
    """Qwen2.5-Coder-0.5B (151,936 tokens, 151,387 merges): the tensor table gguf-py builds."""
    import gguf as gguf_py
    path = gguf_file("qwen2.5-coder-0.5b")
    ref, ours = gguf_py.GGUFReader(str(path)), gguf.open_reader(path)
    assert _table(ours) == _table(ref) and ours.data_offset == ref.data_offset
    assert ours.skipped == {k for k, f in ref.fields.items() if f.types and f.types[0] == gguf_py.GGUFValueType.ARRAY}
    assert _scalars(ours) == _scalars(ref, ours.skipped)
