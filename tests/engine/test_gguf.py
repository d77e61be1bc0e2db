"""GGUF files served straight from the file (engine/models/gguf.py), against HF transformers
loading the same file (fp32, dequantized by gguf-py as ours is).

The real catalogue models are installed by `make install` (`pdserve pull`), like the bundled
one: these tests assert they are there rather than skip. Exactness is claimed for the weights
dequantized to fp32 (``dequantize=True``): as shipped, the weights are INT4/INT8, and for those
the claim is that the 4-bit codes are the file's own (checked tensor by tensor below). HF's
greedy tokens come from tests/hf_reference.py: computed by transformers, recorded per input.
"""

from __future__ import annotations

import gc
import shutil
import struct

import pytest
import torch

from engine.config import CacheConfig, EngineConfig
from engine.errors import ModelLoadError
from engine.llm_engine import LLMEngine
from engine.models import gguf, gguf_codes, int4_blocks
from engine.request import SamplingParams
from tests import hf_reference
from tests.pulled import gguf_file as _gguf

N_NEW = 16


def _prompts(tok, long_words: int) -> list[list[int]]:
    chat = tok.apply_chat_template([{"role": "user", "content": "Write a Python function that reverses a string."}],
                                   add_generation_prompt=True) if tok.chat_template else None
    if chat is not None and not isinstance(chat, list):
        chat = chat["input_ids"]
    texts = ["def fibonacci(n):", "The capital of France is",
             " ".join(f"word{i}" for i in range(long_words)) + " Summarize the list above:"]
    return [tok(t)["input_ids"] for t in texts] + ([list(chat)] if chat else [])


@pytest.mark.parametrize("name,long_words", [("qwen2.5-coder-0.5b", 200), ("gemma3-270m", 300)])
def test_real_gguf_greedy_matches_transformers(name, long_words):
    """Greedy output through the engine equals HF's on the same GGUF, fp32, its decode steps
    (the requests together, then the last ones alone) on the native kernels; gemma's long prompt
    (about 1,100 tokens) is past its 512-token sliding window, which they apply."""
    eng = LLMEngine(EngineConfig(model=name, dequantize=True, cache=CacheConfig(memory_gb=0.3)), progress=False)
    st = eng.model.single_token
    assert st is not None and st.kernel == "native"
    steps: list[int] = []
    inner = st.forward
    st.forward = lambda ids, *a, **k: steps.append(ids.shape[0]) or inner(ids, *a, **k)
    prompts = _prompts(eng.tokenizer, long_words)
    if name == "gemma3-270m":
        assert max(map(len, prompts)) > 2 * 512
    outs = eng.generate(prompts, SamplingParams(max_tokens=N_NEW, temperature=0, ignore_eos=True))
    assert len(steps) >= N_NEW - 1 and max(steps) == len(prompts)  # every decode step, all rows at once
    got = [o.token_ids for o in outs]
    assert not eng.has_unfinished() and eng.block_manager.num_used_blocks == 0
    del eng
    gc.collect()
    assert got == hf_reference.greedy(_gguf(name), prompts, N_NEW)


def test_qwen_1p5b_greedy_matches_transformers():
    """The 1.5B through the engine (fp32, 6 GB: the eager path, no second copy for the fast
    decode path). HF's references first, then HF freed, so the two never share the memory."""
    name = "qwen2.5-coder-1.5b"
    from transformers import AutoTokenizer
    f = _gguf(name)
    prompts = hf_reference.recorded(f, "test-prompts", 60, lambda: _prompts(
        AutoTokenizer.from_pretrained(str(f.parent), gguf_file=f.name), 60))
    prompts = prompts[:1] + prompts[3:]
    want = hf_reference.greedy(f, prompts, 8)  # (HF's model, where it runs, is freed before ours loads)
    eng = LLMEngine(EngineConfig(model=name, dequantize=True, compile_decode=False,
                                 cache=CacheConfig(memory_gb=0.1)), progress=False)
    got = [o.token_ids for o in eng.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))]
    assert got == want


def test_chat_template_from_the_file_matches_transformers():
    """The prepared folder's tokenizer renders chats exactly as HF's tokenizer read from the GGUF."""
    from transformers import AutoTokenizer
    f = _gguf("qwen2.5-coder-0.5b")
    ours = AutoTokenizer.from_pretrained(str(gguf.prepare(f, progress=False)))
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Sort [3, 1, 2] in Python."},
            {"role": "assistant", "content": "sorted([3, 1, 2])"}, {"role": "user", "content": "And descending?"}]

    def hf() -> dict:
        ref = AutoTokenizer.from_pretrained(str(f.parent), gguf_file=f.name)
        return {"template": ref.chat_template, "eos": ref.eos_token_id,
                "ids": ref.apply_chat_template(msgs, add_generation_prompt=True)["input_ids"]}
    ref = hf_reference.recorded(f, "chat-template", msgs, hf)
    assert ours.chat_template and ours.chat_template == ref["template"]
    assert ours.apply_chat_template(msgs, add_generation_prompt=True)["input_ids"] == ref["ids"]
    assert ours.eos_token_id == ref["eos"]


@pytest.mark.parametrize("name", ["qwen2.5-coder-0.5b", "smollm2-135m"])
def test_four_bit_blocks_keep_their_codes(name):
    """A Q4_K / Q4_1 tensor becomes INT4 g32 with the file's own codes: dequantizing our form gives
    the file's dequantized weights. Tolerance: both are scale*q + offset in fp32 with the products
    grouped differently (ours (q - zero)*scale, zero = -offset/scale): a few ulps of the largest
    |w| of the tensor, well under 1e-5 of it; a wrong code would move a weight by a whole scale."""
    reader = gguf.open_reader(_gguf(name))  # (tensors only: the vocabulary is not read)
    four = [t for t in reader.tensors if gguf_codes.precision_class(t.tensor_type.name) == "int4"][:6]
    assert four, "the file has 4-bit tensors"
    for t in four:
        qw = gguf_codes.int4_codes(t)
        assert qw.group_size == 32 and qw.bits == 4
        w = gguf_codes.dequantized(t)
        err = (qw.dequantize() - w).abs().max().item()
        assert err <= 1e-5 * w.abs().max().item(), (t.name, err)
        step = qw.scale[qw.scale > 0].min().item()
        assert err < step / 4
        if t.tensor_type.name == "Q4_K":  # its d*sc, dmin*m structure: the compact scales, exact
            n = qw.q.shape[0]
            s, z = qw.scale.view(n, -1), qw.zero.view(n, -1)
            meta = int4_blocks.compact(qw.q, s, z, 32)
            assert meta is not None, t.name
            s2, o2 = int4_blocks.expand(meta, s.shape[1])
            used = qw.q.view(n, -1, 32).amax(-1) > 0
            assert torch.equal(torch.where(used, s2, s), s) and torch.equal(o2, -z * s), t.name
    flat = [t for t in reader.tensors if gguf_codes.precision_class(t.tensor_type.name) == "int4"
            and (gguf_codes.int4_codes(t).zero == -8).any()][:1]
    for t in flat:  # groups of one value (scale 0 in the file): still exact
        assert torch.allclose(gguf_codes.int4_codes(t).dequantize(), gguf_codes.dequantized(t), rtol=0,
                              atol=1e-5 * gguf_codes.dequantized(t).abs().max().item())


def test_four_bit_embedding_is_served_from_its_codes():
    """Qwen2.5-Coder-1.5B ships its embedding in Q4_K: served as the file's INT4 codes (0.18 GB
    rather than 0.93 GB of fp32), a lookup dequantizing only its rows. Against gguf-py's values
    (d*sc*q - dmin*m in fp32): ours is (q - zero)*s, both a few fp32 roundings of terms no larger
    than max|w|, so 4 ulps of max|w| bound the difference."""
    from engine.quant.linear import Int4Linear
    from engine.quant.linear.int4 import QuantEmbedding
    reader = gguf.open_reader(_gguf("qwen2.5-coder-1.5b"))
    t = next(x for x in reader.tensors if x.name == "token_embd.weight")
    assert gguf_codes.precision_class(t.tensor_type.name) == "int4"
    emb = QuantEmbedding(Int4Linear(gguf_codes.as_int4(t)))
    ids = torch.tensor([[0, 198], [151643, 9707]])
    want = torch.stack([gguf_codes.dequantized(t, slice(i, i + 1))[0] for i in ids.flatten().tolist()])
    got = emb(ids)
    assert got.shape == (2, 2, 1536) and got.dtype == torch.float32
    tol = 4 * torch.finfo(torch.float32).eps * want.abs().max()
    assert (got.view(4, -1) - want).abs().max() <= tol
    table_bytes = emb.table.weight_bytes()
    assert table_bytes <= 151936 * 1536 * (0.5 + 2 * 4 / 32)  # codes + fp32 scale and zero per 32


def test_as_shipped_model_serves_the_files_codes():
    """As shipped, a fused linear whose parts are all 4-bit is an Int4Linear holding exactly
    their codes and scales; wider parts make it INT8; embeddings stay float."""
    from engine.quant.linear import Int4Linear, Int8Linear
    name = "qwen2.5-coder-0.5b"
    eng = LLMEngine(EngineConfig(model=name, compile_decode=False, cache=CacheConfig(memory_gb=0.05)),
                    progress=False)
    reader = gguf.open_reader(_gguf(name))
    by_name = {t.name: t for t in reader.tensors}
    checked = {"int4": 0, "int8": 0}
    fused = {"self_attn.qkv_proj": ("attn_q", "attn_k", "attn_v"), "self_attn.o_proj": ("attn_output",),
             "mlp.gate_up_proj": ("ffn_gate", "ffn_up"), "mlp.down_proj": ("ffn_down",)}
    for i, layer in enumerate(eng.model.layers):
        for module, gguf_names in fused.items():
            parts = [by_name[f"blk.{i}.{g}.weight"] for g in gguf_names]
            lin = layer.get_submodule(module)
            if {gguf_codes.precision_class(t.tensor_type.name) for t in parts} == {"int4"}:
                assert isinstance(lin, Int4Linear)
                want = gguf_codes.concat_rows([gguf_codes.int4_codes(t) for t in parts])
                got = lin.quantized_weight()
                assert torch.equal(got.q, want.q) and torch.equal(got.scale, want.scale)
                # Q4_K: the native kernels read its scales in the compact form (int4_blocks.py)
                assert lin.kernel != "native" or lin.scale_blocks is not None
                checked["int4"] += 1
            else:
                assert isinstance(lin, Int8Linear)
                checked["int8"] += 1
    assert checked["int4"] > 0 and checked["int8"] > 0  # Q4_K_M mixes both classes
    assert eng.model.embed_tokens.weight.dtype == torch.float32
    out = eng.generate(["def add(a, b):"], SamplingParams(max_tokens=8, temperature=0))[0]
    assert len(out.token_ids) >= 1


def test_prepared_folder_is_cached_and_follows_the_file(tmp_path, monkeypatch):
    """One folder per file content: a second prepare reuses it; the same bytes at a new path
    point the folder there. (The bundled model's file: the smallest, and its tokenizer the
    quickest to convert; each prepare of gemma3-270m's took 30 s of the suite.)"""
    real = _gguf("smollm2-135m")
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path / "cache"))
    src = tmp_path / "a" / "model.gguf"
    src.parent.mkdir()
    shutil.copy(real, src)
    folder = gguf.prepare(src, progress=False)
    stamp = (folder / "config.json").stat().st_mtime_ns
    assert gguf.prepare(src, progress=False) == folder
    assert (folder / "config.json").stat().st_mtime_ns == stamp
    moved = tmp_path / "b.gguf"
    src.rename(moved)
    assert gguf.prepare(moved, progress=False) == folder
    assert gguf.source(folder) == moved.resolve()


def _write_gguf(path, arch: str) -> None:
    import numpy as np
    from gguf import GGUFWriter
    w = GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_bad_files_get_clear_errors(tmp_path):
    """A foreign file, a truncated GGUF and an unknown architecture each fail at load with an
    error naming the file and the problem, before anything is built."""
    from engine.models.loader import resolve_model_path
    foreign = tmp_path / "notes.gguf"
    foreign.write_bytes(b"hello, this is not a model\n" * 10)
    with pytest.raises(ModelLoadError, match=r"notes\.gguf.*not a GGUF file"):
        resolve_model_path(str(foreign))

    truncated = tmp_path / "cut.gguf"
    with _gguf("gemma3-270m").open("rb") as f:
        truncated.write_bytes(f.read(40 << 20))  # header, metadata and the first tensors only
    with pytest.raises(ModelLoadError, match=r"cut\.gguf.*(truncated|not a readable)"):
        resolve_model_path(str(truncated))

    phi = tmp_path / "phi.gguf"
    _write_gguf(phi, "phi3")
    with pytest.raises(ModelLoadError, match=r"architecture 'phi3'.*supported: llama, qwen2, gemma3"):
        resolve_model_path(str(phi))

    text = tmp_path / "weights.bin"
    text.write_bytes(struct.pack("<I", 0) * 4)
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        resolve_model_path(str(text))


def test_unknown_model_name_lists_the_catalogue():
    from engine.models.loader import resolve_model_path
    with pytest.raises(ModelLoadError, match="qwen2.5-coder-1.5b"):
        resolve_model_path("qwen9-giant")


def test_weights_digest_names_the_content_not_the_path(tmp_path):
    """Two nodes with the same GGUF in different places (own HOME or cache) agree on the digest
    the cluster checks; a different file does not."""
    import json

    from engine.models.loader import weights_digest
    folder = gguf.prepare(_gguf("gemma3-270m"), progress=False)
    moved = tmp_path / folder.name
    shutil.copytree(folder, moved)
    meta = json.loads((moved / gguf.META_FILE).read_text())
    meta["file"] = "/elsewhere/gemma.gguf"
    (moved / gguf.META_FILE).write_text(json.dumps(meta))
    assert weights_digest(moved) == weights_digest(folder)
    meta["sha256_16"] = "0" * 16
    (moved / gguf.META_FILE).write_text(json.dumps(meta))
    assert weights_digest(moved) != weights_digest(folder)


def test_model_info_names_how_a_gguf_is_served():
    """ModelInfo.quantization for a GGUF: as shipped, dequantized, or forced to one format."""
    from engine.quant import quantization_name
    folder = gguf.prepare(_gguf("gemma3-270m"), progress=False)
    assert quantization_name(None, folder) == "gguf-as-shipped"
    assert quantization_name("none", folder) == "gguf-as-shipped"  # a cluster's default spelling
    assert quantization_name(None, folder, dequantize=True) == "none"
    assert quantization_name("int8", folder) == "int8"
    assert quantization_name("int4", folder) == "int4-g32-asym"
