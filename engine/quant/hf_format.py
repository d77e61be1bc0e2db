"""Hugging Face quantized folders (GPTQ and AWQ layouts): read into our INT4 form, write ours out.

What users already have: folders whose config.json carries ``quantization_config`` with
``quant_method`` "gptq" (AutoGPTQ, GPTQModel, optimum) or "awq" (AutoAWQ), weights under HF
module names (q_proj, k_proj, ... unfused). Each quantized linear W [N out, K in] is stored as:

    GPTQ  qweight int32 [K/8, N]  8 4-bit values per int32 along the INPUT dim: input row 8i+j
                                  sits in bits 4j..4j+3 of qweight[i]
          qzeros  int32 [G, N/8]  zero points, packed the same way along the OUTPUT dim; layout
                                  "gptq" (v1, what most tools write and read) stores zero - 1
                                  (AutoGPTQ's historical offset), "gptq_v2" the zero itself
          scales  fp16  [G, N]    G = K / group_size
          g_idx   int32 [K]       the group of each input column
    AWQ   qweight int32 [K, N/8]  8 values per int32 along the OUTPUT dim, interleaved: nibble j
                                  of packed column c holds output 8c + AWQ_ORDER[j] ("gemm")
          qzeros  int32 [G, N/8]  the same packing; the zero itself
          scales  fp16  [G, N]

In both, ``w[n, k] = (q[n, k] - zero[n, g]) * scale[n, g]`` with g the group of k: exactly our
canonical QuantizedWeight (formats.py), so reading is unpacking, and the kernel layout is then
built as for our own folders. Only what our INT4 kernel runs is accepted: 4 bits, groups of
32, 64 or 128 *contiguous* inputs (GPTQ act order without static groups permutes them: refused,
with how to re-quantize); anything else is refused with the reason. One rounding remains: the
CPU kernel keeps each group's scale and offset in bf16 (as for pdserve's own INT4), so a
folder's fp16 scales lose their last 3 mantissa bits (<= 2^-9 relative per group).

Writing ours in the GPTQ v1 layout is hf_export.py (``save_hf_gptq``), with the packing here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from engine.config import ModelConfig
from engine.errors import ModelLoadError
from engine.models.hf_weights import fuse_state_dict, our_name, read_state_dict
from engine.quant.config import GROUP_SIZES, QuantConfig
from engine.quant.formats import QuantizedWeight
from engine.quant.linear import Int4Linear

METHODS = ("gptq", "awq")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)
_PARTS = ("qweight", "qzeros", "scales", "g_idx", "bias")


# ---- recognizing -------------------------------------------------------------------------------
def _raw_quant_config(path: str | Path) -> dict[str, Any] | None:
    f = Path(path) / "config.json"
    try:
        qc = json.loads(f.read_text()).get("quantization_config") if f.is_file() else None
    except (ValueError, AttributeError):
        return None  # not our problem here: ModelConfig.from_hf reports a bad config.json
    return qc if isinstance(qc, dict) else None


def is_hf_quantized(path: str | Path) -> bool:
    """Does config.json declare a quantization (any method: unsupported ones fail on load)?"""
    return _raw_quant_config(path) is not None


def hf_quant_config(path: str | Path) -> QuantConfig:
    """Our QuantConfig for the folder's ``quantization_config``.

    Raises:
        ModelLoadError: a method, bit width, group size or layout our kernels cannot run.
    """
    qc = _raw_quant_config(path) or {}
    where = f"{str(path)!r}: quantization_config"
    method = str(qc.get("quant_method", "")).lower()
    if method not in METHODS:
        raise ModelLoadError(f"{where}: quant_method {qc.get('quant_method')!r} is not supported "
                             f"(supported: {', '.join(METHODS)} at 4 bits; or a pdserve quantize folder)")
    bits, group = qc.get("bits", qc.get("w_bit")), qc.get("group_size", qc.get("q_group_size"))
    if bits != 4:
        raise ModelLoadError(f"{where}: {bits!r}-bit {method} is not supported (4-bit only)")
    if group not in GROUP_SIZES:
        raise ModelLoadError(f"{where}: group_size {group!r} is not supported by the INT4 kernel "
                             f"(supported: {', '.join(map(str, GROUP_SIZES))})")
    if method == "gptq":
        fmt = qc.get("checkpoint_format", "gptq")
        if fmt not in ("gptq", "gptq_v2"):
            raise ModelLoadError(f"{where}: checkpoint_format {fmt!r} is not supported (gptq or gptq_v2)")
        if qc.get("dynamic"):
            raise ModelLoadError(f"{where}: per-module 'dynamic' overrides are not supported")
        sym = bool(qc.get("sym", True))
        act_order = bool(qc.get("desc_act", False)) and not qc.get("static_groups", False)
    else:
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise ModelLoadError(f"{where}: AWQ version {version!r} is not supported (gemm only)")
        if not qc.get("zero_point", True):
            raise ModelLoadError(f"{where}: AWQ without zero points is not supported")
        sym, act_order = False, False
    return QuantConfig(bits=4, group_size=group, symmetric=sym, method=method, act_order=act_order)


# ---- packing -----------------------------------------------------------------------------------
def unpack_int32(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 [..., A, ...] -> uint8 [..., 8A, ...] along ``dim``: nibble j of element i -> 8i + j."""
    x = (packed.to(torch.int32).unsqueeze(-1) >> _SHIFTS) & 0xF  # [..., 8]
    shape = list(packed.shape)
    shape[dim] *= 8
    return x.movedim(-1, dim + 1).reshape(shape).to(torch.uint8)


def pack_int32(q: torch.Tensor, dim: int) -> torch.Tensor:
    """Inverse of :func:`unpack_int32`: values 0..15 -> int32, 8 per element along ``dim``."""
    if q.shape[dim] % 8:
        raise ValueError(f"packing 8 per int32 needs a multiple of 8 along dim {dim}, got {q.shape[dim]}")
    x = q.to(torch.int64)
    x = x.reshape(*x.shape[:dim], x.shape[dim] // 8, 8, *x.shape[dim + 1:]).movedim(dim + 1, -1)
    v = (x << _SHIFTS.to(torch.int64)).sum(-1)
    return torch.where(v >= 2 ** 31, v - 2 ** 32, v).to(torch.int32)  # the same 32 bits, signed


def _awq_natural_order(n: int) -> torch.Tensor:
    # unpacked column 8c + j holds output 8c + AWQ_ORDER[j]: output 8c + r is at 8c + inv[r]
    inv = torch.argsort(torch.tensor(AWQ_ORDER))
    return (torch.arange(n).view(-1, 8)[:, inv]).reshape(-1)


# ---- one linear --------------------------------------------------------------------------------
def _check(name: str, t: dict[str, torch.Tensor], shapes: dict[str, tuple[int, ...]]) -> None:
    for part, shape in shapes.items():
        if part not in t:
            raise ModelLoadError(f"{name}: quantized linear lacks {part}")
        if tuple(t[part].shape) != shape:
            raise ModelLoadError(f"{name}.{part}: shape {tuple(t[part].shape)}, expected {shape}")
        if part in ("qweight", "qzeros", "g_idx") and t[part].dtype not in (torch.int32, torch.uint32):
            raise ModelLoadError(f"{name}.{part}: dtype {t[part].dtype}, expected int32")


def gptq_weight(name: str, t: dict[str, torch.Tensor], cfg: QuantConfig, v1: bool) -> QuantizedWeight:
    """One GPTQ linear -> our canonical form (``v1``: zeros stored minus one)."""
    g = cfg.group_size
    k, n = t["qweight"].shape[0] * 8, t["qweight"].shape[1]
    if k % g or n % 8:
        raise ModelLoadError(f"{name}: [{n}, {k}] is not a whole number of groups of {g} / packs of 8")
    _check(name, t, {"qweight": (k // 8, n), "qzeros": (k // g, n // 8), "scales": (k // g, n)}
           | ({"g_idx": (k,)} if "g_idx" in t else {}))
    if "g_idx" not in t and cfg.act_order:
        raise ModelLoadError(f"{name}: desc_act is set but the layer has no g_idx (its column groups are unknown)")
    if "g_idx" in t and not torch.equal(t["g_idx"].long(), torch.arange(k) // g):
        raise ModelLoadError(
            f"{name}: g_idx is not sequential (GPTQ act order without static groups): the INT4 kernel needs "
            "contiguous groups; re-quantize with desc_act=False or static_groups=True (or `pdserve quantize "
            "--method gptq`, which keeps act order with static groups)")
    q = unpack_int32(t["qweight"], 0)  # [K, N]
    # v1: zero = stored + 1, unmasked: a stored 15 (what v1 writers make of a zero point of 0)
    # reads as 16, as the "+1" readers compute it; readers that mask it to 0 disagree, so such
    # a folder means different weights to different tools (gptq_v2 has no such case).
    zero = unpack_int32(t["qzeros"], 1).float() + (1.0 if v1 else 0.0)  # [G, N]
    return QuantizedWeight(q.T.contiguous(), t["scales"].float().T.contiguous(), zero.T.contiguous(), 4, g,
                           cfg.symmetric)


def awq_weight(name: str, t: dict[str, torch.Tensor], cfg: QuantConfig) -> QuantizedWeight:
    """One AWQ (gemm) linear -> our canonical form."""
    g = cfg.group_size
    k, n = t["qweight"].shape[0], t["qweight"].shape[1] * 8
    if k % g:
        raise ModelLoadError(f"{name}: input size {k} is not a whole number of groups of {g}")
    _check(name, t, {"qweight": (k, n // 8), "qzeros": (k // g, n // 8), "scales": (k // g, n)})
    order = _awq_natural_order(n)
    q = unpack_int32(t["qweight"], 1)[:, order]  # [K, N]
    zero = unpack_int32(t["qzeros"], 1)[:, order].float()  # [G, N]
    return QuantizedWeight(q.T.contiguous(), t["scales"].float().T.contiguous(), zero.T.contiguous(), 4, g, False)


def _cat(name: str, parts: list[QuantizedWeight | None]) -> QuantizedWeight:
    if any(p is None for p in parts):
        raise ModelLoadError(f"{name}: some of its projections are quantized and some are not")
    first = parts[0]
    return QuantizedWeight(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]),
                           torch.cat([p.zero for p in parts]), 4, first.group_size, first.symmetric)


# ---- a whole folder ----------------------------------------------------------------------------
def read_hf_quantized(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, nn.Module], bool]:
    """(full-precision tensors by our names, our Int4Linear modules by our names, tied LM head).

    Raises:
        ModelLoadError: unsupported quantization_config, or tensors that do not fit it.
    """
    cfg = hf_quant_config(path)
    v1 = (_raw_quant_config(path) or {}).get("checkpoint_format", "gptq") == "gptq"
    sd = read_state_dict(path)
    qnames = {k.rpartition(".")[0] for k in sd if k.endswith(".qweight")}
    if not qnames:
        raise ModelLoadError(f"{str(path)!r} declares {cfg.method} quantization but has no *.qweight tensors")
    fused: dict[str, list[QuantizedWeight | None]] = {}
    biases: dict[str, list[torch.Tensor | None]] = {}
    for hf in sorted(qnames):
        t = {p: sd.pop(f"{hf}.{p}") for p in _PARTS if f"{hf}.{p}" in sd}
        qw = gptq_weight(hf, t, cfg, v1) if cfg.method == "gptq" else awq_weight(hf, t, cfg)
        ours, idx, nparts = our_name(hf)
        fused.setdefault(ours, [None] * nparts)[idx or 0] = qw
        biases.setdefault(ours, [None] * nparts)[idx or 0] = t.get("bias")
    rest = fuse_state_dict(sd)
    qmods: dict[str, nn.Module] = {}
    for name, parts in fused.items():
        if f"{name}.weight" in rest:
            raise ModelLoadError(f"{name}: some of its projections are quantized and some are not")
        bs = biases[name]
        if any(b is None for b in bs) and not all(b is None for b in bs):
            raise ModelLoadError(f"{name}: some of its projections have a bias and some do not")
        bias = None if bs[0] is None else torch.cat([b.float() for b in bs])  # type: ignore[union-attr]
        qmods[name] = Int4Linear(_cat(name, parts), bias)
    tied = ModelConfig.from_hf(path).tie_word_embeddings and "lm_head" not in qmods
    if tied:
        rest.pop("lm_head.weight", None)
    return rest, qmods, tied
