"""Loading an HF folder's weights: fused in place part by part, the file's pages let go once
copied (the loading peak holds one copy of a checkpoint, not two: issue 47)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from engine.errors import ModelLoadError
from engine.memory import drop_file_pages, file_mappings
from engine.models.hf_weights import copy_parts, fuse_state_dict, fused_parts, read_state_dict, weight_files


def _folder(tmp_path):
    g = torch.Generator().manual_seed(0)
    sd = {f"model.layers.0.self_attn.{p}_proj.weight": torch.randn(n, 256, generator=g)
          for p, n in (("q", 256), ("k", 64), ("v", 64))}
    sd["model.norm.weight"] = torch.randn(256, generator=g)
    sd["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.randn(8, generator=g)
    save_file(sd, str(tmp_path / "model.safetensors"))
    return sd


def test_parts_copy_in_place_equal_to_the_concatenation_and_the_file_reads_back(tmp_path):
    sd = _folder(tmp_path)
    parts = fused_parts(read_state_dict(tmp_path))
    assert set(parts) == {"layers.0.self_attn.qkv_proj.weight", "norm.weight"}  # (rotary dropped)
    mapped = file_mappings([str(f) for f in weight_files(tmp_path)])
    assert mapped, "safetensors are read as views of a mapped file"
    dest = torch.empty(384, 256)
    qkv = parts["layers.0.self_attn.qkv_proj.weight"]
    copy_parts(dest, qkv, "qkv", mapped)
    want = torch.cat([sd[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(dest, want)
    assert torch.equal(fuse_state_dict(read_state_dict(tmp_path))["layers.0.self_attn.qkv_proj.weight"], want)
    # the copied parts' pages left this process, not the file: read again, they are the same
    assert torch.equal(torch.cat(qkv), want)


def test_shapes_that_do_not_add_up_are_named(tmp_path):
    _folder(tmp_path)
    parts = fused_parts(read_state_dict(tmp_path))
    with pytest.raises(ModelLoadError, match=r"qkv: checkpoint shape \[\(256, 256\), \(64, 256\), \(64, 256\)\] != "
                                             r"\(400, 256\)"):
        copy_parts(torch.empty(400, 256), parts["layers.0.self_attn.qkv_proj.weight"], "qkv")
    with pytest.raises(ModelLoadError, match=r"norm: checkpoint shape \(256,\) != \(128,\)"):
        copy_parts(torch.empty(128), parts["norm.weight"], "norm")


def test_a_missing_part_is_named():
    with pytest.raises(ModelLoadError, match="missing a part of layers.0.mlp.gate_up_proj.weight"):
        fused_parts({"model.layers.0.mlp.gate_proj.weight": torch.zeros(2, 2)})


def test_memory_that_is_not_a_mapping_of_the_files_is_never_dropped(tmp_path):
    """DONTNEED on heap memory would zero it: only views of the named files' mappings qualify."""
    _folder(tmp_path)
    heap = torch.arange(1 << 20, dtype=torch.float32)
    drop_file_pages(heap, file_mappings([str(tmp_path / "model.safetensors")]))
    assert torch.equal(heap, torch.arange(1 << 20, dtype=torch.float32))
    drop_file_pages(heap, [])
    assert torch.equal(heap, torch.arange(1 << 20, dtype=torch.float32))
