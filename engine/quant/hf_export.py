"""One of our INT4 models written as a Hugging Face GPTQ v1 folder (what vLLM, TGI,
transformers + optimum and GPTQModel read), so pdserve's quantized folders load elsewhere.

The layout (tensor shapes, packing, the v1 "zero - 1" offset) is described in hf_format.py,
which reads it; here our fused modules are split back into HF's (q/k/v, gate/up) and each
QuantizedWeight is packed into qweight / qzeros / scales / g_idx.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from engine.config import ModelConfig
from engine.quant.checkpoint import copy_side_files
from engine.quant.config import QuantConfig
from engine.quant.formats import QuantizedWeight
from engine.quant.hf_format import pack_int32
from engine.quant.linear import Int4Linear, QuantLinear

# our (fused) module name -> its rows [N, ...] under each HF module name
Splitter = Callable[[str, torch.Tensor], dict[str, torch.Tensor]]


def save_hf_gptq(model: nn.Module, cfg: QuantConfig, out_dir: str | Path, source_dir: str | Path,
                 report: dict[str, Any] | None = None) -> Path:
    """Write ``model`` (INT4-quantized, not prepacked) as a Hugging Face GPTQ v1 folder.

    HF module names (q/k/v and gate/up split again), ``quantization_config`` in config.json and
    a ``quantize_config.json`` beside it (what AutoGPTQ reads), the quality report as
    ``pdserve_report.json``. Layers kept in full precision are stored as plain weights.

    Raises:
        ValueError: a layer the layout cannot hold: not INT4, group sizes that differ between
            layers, a zero point of 0 (GPTQ v1 stores zero - 1 in 4 bits), a scale fp16 would round.
    """
    out, src = Path(out_dir), Path(source_dir)
    split = _hf_splitter(ModelConfig.from_hf(src))
    qmods = {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    group = _one_int4_group(qmods)
    sd = _quantized_tensors(qmods, split, group)
    sd.update(_plain_tensors(model, qmods, split))
    copy_side_files(src, out)
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt", "producer": "pdserve-quant"})
    _write_configs(out, src, cfg, group, "lm_head" in qmods, report)
    return out


def _hf_splitter(mc: ModelConfig) -> Splitter:
    q_rows, kv_rows = mc.num_heads * mc.head_dim, mc.num_kv_heads * mc.head_dim
    splits = {"self_attn.qkv_proj": (("q_proj", "k_proj", "v_proj"), [q_rows, kv_rows, kv_rows]),
              "mlp.gate_up_proj": (("gate_proj", "up_proj"), [mc.intermediate_size] * 2)}

    def split(name: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
        """Our (fused) module name -> HF module names, rows [N, ...] split where it was fused."""
        hf = name if name.startswith("lm_head") else f"model.{name}"
        for fused, (leaves, sizes) in splits.items():
            if hf.endswith(f".{fused}"):
                return {hf.replace(fused, fused.split(".")[0] + "." + leaf): p
                        for leaf, p in zip(leaves, torch.split(t, sizes))}
        return {hf: t}
    return split


def _one_int4_group(qmods: dict[str, nn.Module]) -> int:
    """The one group size of the model's quantized layers, all INT4 (the layout holds no other)."""
    bad = sorted(n for n, m in qmods.items() if not isinstance(m, Int4Linear))
    if bad:
        raise ValueError(f"the GPTQ layout holds INT4 weights only; {bad[0]} is {type(qmods[bad[0]]).__name__} "
                         "(save INT8/W8A8 in pdserve's layout)")
    groups = {m.group_size for m in qmods.values()}
    if len(groups) != 1:
        raise ValueError(f"the GPTQ layout has one group size; these layers use {sorted(groups)} "
                         "(quantize with an explicit --group-size)")
    return groups.pop()


def _quantized_tensors(qmods: dict[str, nn.Module], split: Splitter, group: int) -> dict[str, torch.Tensor]:
    """qweight / qzeros / scales / g_idx (and bias) of every quantized layer, under HF names."""
    sd: dict[str, torch.Tensor] = {}
    for name, mod in qmods.items():
        qw = _dead_groups_storable(mod.quantized_weight())
        if (qw.zero == 0).any():
            raise ValueError(f"{name}: a zero point of 0, which GPTQ v1 (zero - 1 in 4 bits) cannot store")
        if not torch.equal(qw.scale.half().float(), qw.scale):
            raise ValueError(f"{name}: scales not exactly representable in fp16 (the layout's scale dtype)")
        # rows [N, ...] per HF projection, then each in the layout's orientation ([K or G, N])
        q, scale, zero = split(name, qw.q), split(name, qw.scale), split(name, qw.zero)
        for hf in q:
            sd[f"{hf}.qweight"] = pack_int32(q[hf].T, 0)
            sd[f"{hf}.qzeros"] = pack_int32((zero[hf].T - 1).to(torch.uint8), 1)
            sd[f"{hf}.scales"] = scale[hf].T.to(torch.float16).contiguous()
            sd[f"{hf}.g_idx"] = (torch.arange(mod.in_features) // group).to(torch.int32)
        if mod.bias is not None:
            sd.update({f"{hf}.bias": b.contiguous() for hf, b in split(name, mod.bias).items()})
    return sd


def _plain_tensors(model: nn.Module, qmods: dict[str, nn.Module], split: Splitter) -> dict[str, torch.Tensor]:
    """Every other tensor (norms, embeddings, layers kept in full precision) under HF names; a
    tied LM head is left to the embeddings."""
    tied = isinstance(model.lm_head, nn.Linear) and model.lm_head.weight is model.embed_tokens.weight
    sd: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        if name.rpartition(".")[0] in qmods or (tied and name == "lm_head.weight"):
            continue
        module, _, leaf = name.rpartition(".")
        sd.update({f"{hf}.{leaf}": w.contiguous() for hf, w in split(module, t.detach()).items()})
    return sd


def _write_configs(out: Path, src: Path, cfg: QuantConfig, group: int, quantized_head: bool,
                   report: dict[str, Any] | None) -> None:
    """config.json with its quantization_config, quantize_config.json, pdserve_report.json."""
    qc = {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": False, "sym": cfg.symmetric,
          "static_groups": cfg.method == "gptq" and cfg.act_order, "true_sequential": True,
          "damp_percent": cfg.damp, "checkpoint_format": "gptq", "lm_head": quantized_head}
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = qc
    if quantized_head:  # the quantized head is its own tensor now, no longer the embedding
        config["tie_word_embeddings"] = False
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "quantize_config.json").write_text(json.dumps(qc, indent=2) + "\n")
    (out / "pdserve_report.json").write_text(json.dumps({"method": cfg.method, "report": report or {}},
                                                        indent=2) + "\n")


def _dead_groups_storable(qw: QuantizedWeight) -> QuantizedWeight:
    """A group whose weights are all zero (q == zero throughout) has a scale floored at 1e-10
    (formats._EPS), below fp16's range, and may have a zero point of 0, which v1 cannot store:
    its scale does not matter, so store it as q = zero = 8 with scale 2^-14 (fp16's smallest
    normal), the same zeros."""
    n, k = qw.q.shape
    g = qw.group_size
    dead = (qw.q.view(n, k // g, g) == qw.zero[..., None].to(torch.uint8)).all(-1) & (qw.zero <= 15)
    if not dead.any():
        return qw
    q = torch.where(dead[..., None], torch.full_like(qw.q.view(n, k // g, g), 8), qw.q.view(n, k // g, g))
    return QuantizedWeight(q.view(n, k), torch.where(dead, 2.0 ** -14, qw.scale), torch.where(dead, 8.0, qw.zero),
                           4, g, qw.symmetric)
