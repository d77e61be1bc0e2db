"""Hugging Face GPTQ and AWQ folders: read into the INT4 path, and ours written as GPTQ.

The reference packers here follow each format's own description with plain loops over uint32
(AutoGPTQ's row packing with the v1 "zero - 1" offset; AutoAWQ's gemm packing with its
interleaved order), independent of the vectorized code under test."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from engine.config import CacheConfig, EngineConfig
from engine.errors import ModelLoadError
from engine.layers.attention import get_attention_backend
from engine.llm_engine import LLMEngine
from engine.models.loader import load_model
from engine.quant import QuantConfig, quantization_name, quantize
from engine.quant.calib import SequenceForward
from engine.quant.checkpoint import is_quantized_checkpoint, save_quantized
from engine.quant.hf_export import save_hf_gptq
from engine.quant.linear import Int4Linear
from engine.quant.offline import convert, load_plain
from engine.request import SamplingParams

IDS = list(range(300, 380))
SDPA = get_attention_backend("sdpa")
_HF = {"self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"), "mlp.gate_up_proj": ("gate_proj", "up_proj")}


def _logits(model):
    return SequenceForward(model).logits(IDS)


def _engine(path):
    return LLMEngine(EngineConfig(model=str(path), cache=CacheConfig(memory_gb=0.02)), progress=False)


# ---- reference packers (the formats' own layouts, one value at a time) ------------------------
def _ref_pack_gptq(q_kn: np.ndarray) -> np.ndarray:
    """[K, N] values 0..15 -> [K/8, N]: input row 8i+j in bits 4j.. of packed row i."""
    k, n = q_kn.shape
    out = np.zeros((k // 8, n), dtype=np.uint32)
    for i in range(k // 8):
        for j in range(8):
            out[i] |= q_kn[8 * i + j].astype(np.uint32) << np.uint32(4 * j)
    return out.view(np.int32)


def _ref_pack_cols(v_kn: np.ndarray, order=(0, 1, 2, 3, 4, 5, 6, 7)) -> np.ndarray:
    """[R, N] -> [R, N/8]: nibble j of packed column c holds column 8c + order[j]."""
    r, n = v_kn.shape
    out = np.zeros((r, n // 8), dtype=np.uint32)
    for c in range(n // 8):
        for j in range(8):
            out[:, c] |= v_kn[:, 8 * c + order[j]].astype(np.uint32) << np.uint32(4 * j)
    return out.view(np.int32)


def _write_hf_folder(model, src, out, method: str, group: int, sym: bool, g_idx_perm: bool = False) -> None:
    """Our INT4 model's integers as an HF folder in ``method``'s layout (HF names, unfused):
    "gptq" (v1: zeros stored minus one), "gptq_v2" (zeros as they are) or "awq"."""
    from safetensors.torch import save_file
    cfg = json.loads((src / "config.json").read_text())
    q_rows = cfg["num_attention_heads"] * (cfg["hidden_size"] // cfg["num_attention_heads"])
    kv_rows = cfg["num_key_value_heads"] * (cfg["hidden_size"] // cfg["num_attention_heads"])
    sizes = {"self_attn.qkv_proj": [q_rows, kv_rows, kv_rows], "mlp.gate_up_proj": [cfg["intermediate_size"]] * 2}
    sd = {}
    for name, mod in model.named_modules():
        if not isinstance(mod, Int4Linear):
            continue
        qw = mod.quantized_weight()
        fused = next((f for f in _HF if name.endswith(f)), None)
        rows = sizes[fused] if fused else [qw.q.shape[0]]
        hfs = [f"model.{name.replace(fused, fused.split('.')[0] + '.' + leaf)}" for leaf in _HF[fused]] if fused \
            else [name if name == "lm_head" else f"model.{name}"]
        for hf, q, s, z in zip(hfs, qw.q.split(rows), qw.scale.split(rows), qw.zero.split(rows)):
            q_kn, z_gn = q.T.numpy().astype(np.uint8), z.T.numpy().astype(np.int64)
            if method.startswith("gptq"):
                sd[f"{hf}.qweight"] = torch.from_numpy(_ref_pack_gptq(q_kn))
                stored = (z_gn - 1) & 0xF if method == "gptq" else z_gn
                sd[f"{hf}.qzeros"] = torch.from_numpy(_ref_pack_cols(stored.astype(np.uint8)))
                k = q_kn.shape[0]
                g_idx = torch.arange(k) // group
                sd[f"{hf}.g_idx"] = (g_idx[torch.randperm(k)] if g_idx_perm else g_idx).to(torch.int32)
            else:
                order = (0, 2, 4, 6, 1, 3, 5, 7)
                sd[f"{hf}.qweight"] = torch.from_numpy(_ref_pack_cols(q_kn, order))
                sd[f"{hf}.qzeros"] = torch.from_numpy(_ref_pack_cols(z_gn.astype(np.uint8), order))
            sd[f"{hf}.scales"] = s.T.contiguous().half()
    for name, t in model.state_dict().items():
        mod = name.rpartition(".")[0]
        if isinstance(model.get_submodule(mod), Int4Linear) or name == "lm_head.weight":
            continue
        sd[name if name.startswith("lm_head") else f"model.{name}"] = t.contiguous()
    out.mkdir()
    for f in src.iterdir():
        if f.name.endswith(".json") and f.name != "config.json":
            shutil.copy(f, out / f.name)
    save_file(sd, str(out / "model.safetensors"))
    qc = ({"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": g_idx_perm, "sym": sym,
           "checkpoint_format": method} if method.startswith("gptq")
          else {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"})
    (out / "config.json").write_text(json.dumps({**cfg, "quantization_config": qc}))


def _int4(tiny_dir, sym: bool):
    """The tiny model, RTN INT4 groups of 64, LM head fp (asymmetric: zero points spread over
    1..15 by the random weights; 0 would need every weight of a group >= 0)."""
    model = load_plain(tiny_dir)
    quantize(model, QuantConfig(bits=4, group_size=64, symmetric=sym, lm_head=False))
    return model


@pytest.fixture
def int4_model(tiny_dir):
    return _int4(tiny_dir, sym=False)


@pytest.mark.parametrize("method,sym", [("gptq", False), ("gptq", True), ("gptq_v2", False), ("awq", False)])
def test_hf_layouts_load_the_same_integers(tiny_dir, tmp_path, method, sym):
    model = _int4(tiny_dir, sym)
    hf = tmp_path / method
    _write_hf_folder(model, tiny_dir, hf, method, 64, sym=sym)
    name = "int4-g64" + ("" if sym else "-asym")
    assert is_quantized_checkpoint(hf) and quantization_name(None, hf) == name
    loaded = load_model(hf, SDPA, torch.float32)
    want = {n: m.quantized_weight() for n, m in model.named_modules() if isinstance(m, Int4Linear)}
    got = {n: m.quantized_weight() for n, m in loaded.named_modules() if isinstance(m, Int4Linear)}
    assert got.keys() == want.keys() and len(got) == 8  # 2 layers x (qkv, o, gate_up, down)
    for n, w in want.items():
        assert torch.equal(got[n].q, w.q), n
        assert torch.equal(got[n].scale, w.scale) and torch.equal(got[n].zero, w.zero), n
    ours = tmp_path / "ours"
    save_quantized(model, QuantConfig(bits=4, group_size=64, symmetric=sym, lm_head=False), ours, tiny_dir)
    assert torch.equal(_logits(loaded), _logits(load_model(ours, SDPA, torch.float32)))


def test_gptq_export_stores_all_zero_groups_and_refuses_mixed_groups(tiny_dir, model_path, tmp_path):
    """A group of zeros gets a scale below fp16's range (the 1e-10 floor): written as the
    same zeros with a storable scale. Layers of different group sizes: refused before any work."""
    model = load_plain(tiny_dir)
    with torch.no_grad():
        model.layers[0].mlp.down_proj.weight[:3] = 0.0  # three rows of zero groups
    quantize(model, QuantConfig(bits=4, group_size=64, symmetric=False, lm_head=False))
    save_hf_gptq(model, QuantConfig(bits=4, group_size=64, symmetric=False, lm_head=False), tmp_path / "z", tiny_dir)
    down = load_model(tmp_path / "z", SDPA, torch.float32).layers[0].mlp.down_proj.quantized_weight()
    want = model.layers[0].mlp.down_proj.quantized_weight()
    assert torch.equal(down.dequantize(), want.dequantize()) and (down.dequantize()[:3] == 0).all()
    with pytest.raises(ValueError, match="one group size"):  # SmolLM2: 576 inputs take 64, 1536 take 128
        convert(model_path, QuantConfig(bits=4, group_size=None), tmp_path / "g", layout="gptq", log=lambda _m: None)
    with pytest.raises(ValueError, match="--protect"):
        convert(tiny_dir, QuantConfig(bits=4, group_size=64, protect=("o_proj",)), tmp_path / "p", layout="gptq",
                log=lambda _m: None)


def test_pdserve_gptq_written_as_hf_gptq_serves_the_same_tokens(tiny_dir, tmp_path, greedy):
    """Our GPTQ (act order with static groups, LM head quantized) saved in both layouts: the HF
    folder reads back as the same integers (by the reference unpacking in the format's own
    terms) and decodes the same greedy tokens."""
    cfg = QuantConfig(bits=4, group_size=64, method="gptq")
    model, final, report = convert(tiny_dir, cfg, None, calib_tokens=512, heldout_tokens=128, log=lambda _m: None)
    save_quantized(model, final, tmp_path / "ours", tiny_dir, report)
    save_hf_gptq(model, final, tmp_path / "hf", tiny_dir, report)
    hf = tmp_path / "hf"
    qc = json.loads((hf / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "gptq" and qc["checkpoint_format"] == "gptq" and qc["lm_head"] is True
    assert json.loads((hf / "config.json").read_text())["tie_word_embeddings"] is False  # the head is its own
    from safetensors.torch import load_file
    sd = load_file(str(hf / "model.safetensors"))
    # the reference reading of one projection: w = s[g_idx[k], n] * (q[k, n] - (z[g_idx[k], n] + 1))
    p = "model.layers.1.self_attn.k_proj"
    qweight = sd[f"{p}.qweight"].numpy().view(np.uint32)
    q_kn = np.stack([(qweight >> np.uint32(4 * j)) & 15 for j in range(8)], 1).reshape(-1, qweight.shape[1])
    qz = sd[f"{p}.qzeros"].numpy().view(np.uint32)
    z_gn = np.stack([(qz >> np.uint32(4 * j)) & 15 for j in range(8)], 2).reshape(qz.shape[0], -1) + 1
    g_idx = sd[f"{p}.g_idx"].numpy()
    w_ref = sd[f"{p}.scales"].float().numpy()[g_idx] * (q_kn.astype(np.int64) - z_gn[g_idx])  # [K, N]
    qkv = model.layers[1].self_attn.qkv_proj.quantized_weight().dequantize()
    assert np.array_equal(w_ref.T, qkv[128:192].numpy())  # k rows: after q's 4 heads x 32, 2 kv heads x 32
    assert set(sd) >= {"model.embed_tokens.weight", "lm_head.qweight", "model.layers.0.mlp.up_proj.g_idx"}
    assert torch.equal(_logits(load_model(hf, SDPA, torch.float32)), _logits(load_model(tmp_path / "ours", SDPA,
                                                                                         torch.float32)))
    assert greedy(_engine(hf), IDS, 10) == greedy(_engine(tmp_path / "ours"), IDS, 10)


def test_what_the_int4_kernel_cannot_run_is_refused(tiny_dir, tmp_path, int4_model):
    act_order = tmp_path / "act_order"
    _write_hf_folder(int4_model, tiny_dir, act_order, "gptq", 64, sym=False, g_idx_perm=True)
    with pytest.raises(ModelLoadError, match="static_groups"):
        load_model(act_order, SDPA, torch.float32)
    for i, (change, match) in enumerate([({"bits": 8}, "8-bit"), ({"group_size": -1}, "group_size -1"),
                                         ({"quant_method": "bitsandbytes"}, "bitsandbytes"),
                                         ({"checkpoint_format": "marlin"}, "marlin")]):
        bad = tmp_path / f"bad{i}"
        shutil.copytree(act_order, bad)
        c = json.loads((bad / "config.json").read_text())
        c["quantization_config"].update(change)
        (bad / "config.json").write_text(json.dumps(c))
        with pytest.raises(ModelLoadError, match=match):
            load_model(bad, SDPA, torch.float32)
    with pytest.raises(ValueError, match="INT4"):  # INT8 stays in pdserve's layout
        m = load_plain(tiny_dir)
        quantize(m, "int8")
        save_hf_gptq(m, QuantConfig(bits=8), tmp_path / "int8", tiny_dir)


def test_real_model_rtn_int4_in_the_gptq_layout(model_path, tmp_path):
    """SmolLM2 INT4 (groups of 64, symmetric) through the GPTQ layout decodes what INT4 at load does."""
    model = load_plain(model_path)
    cfg = QuantConfig(bits=4, group_size=64)
    quantize(model, cfg)
    save_hf_gptq(model, cfg, tmp_path / "smol-gptq", model_path)
    eng = LLMEngine(EngineConfig(model=str(tmp_path / "smol-gptq"), cache=CacheConfig(memory_gb=0.05)),
                    progress=False)
    ref = LLMEngine(EngineConfig(model=str(model_path), quantization="int4-g64", cache=CacheConfig(memory_gb=0.05)),
                    progress=False)
    assert quantization_name(None, tmp_path / "smol-gptq") == "int4-g64"
    outs = []
    for e in (eng, ref):
        e.add_request(list(range(100, 140)), SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True),
                      request_id="r")
        toks: list[int] = []
        while e.has_unfinished():
            for o in e.step():
                toks.extend(o.new_token_ids)
        outs.append(toks)
    assert outs[0] == outs[1] and len(outs[0]) == 16


def test_quantize_command_writes_a_gptq_folder_the_engine_serves(tiny_dir, tmp_path):
    """`pdserve quantize --format gptq`, then `pdserve generate --local --model` on the folder,
    as a user runs them (subprocesses on the installed console script)."""
    import os
    import subprocess
    import sys
    pdserve = shutil.which("pdserve", path=os.path.dirname(sys.executable)) or "pdserve"
    out = tmp_path / "tiny-gptq"
    r = subprocess.run([pdserve, "quantize", "--model", str(tiny_dir), "--method", "gptq", "--bits", "4",
                        "--group-size", "64", "--calib-tokens", "256", "--format", "gptq", "--out", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "gptq layout" in r.stdout + r.stderr
    assert json.loads((out / "quantize_config.json").read_text())["group_size"] == 64
    r = subprocess.run([pdserve, "generate", "--local", "--model", str(out), "--max-tokens", "6", "--json",
                        "--ignore-eos", "hello"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1])["token_ids"] == _greedy_text(out, "hello", 6)
    r = subprocess.run([pdserve, "quantize", "--model", str(tiny_dir), "--bits", "8", "--format", "gptq",
                        "--out", str(tmp_path / "no")], capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "--bits 4" in r.stderr and "Traceback" not in r.stderr


def _greedy_text(path, prompt: str, n: int) -> list[int]:
    return _engine(path).generate([prompt], SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))[0].token_ids
