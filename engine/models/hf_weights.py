"""An HF-format folder's weights: read, renamed to ours, q/k/v and gate/up fused.

A leaf: the loader, the GGUF reader and the quantized-checkpoint formats all name weights this
way, so it imports none of them.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from engine.errors import ModelLoadError

_FUSED = {  # HF name suffix -> (our fused name, part index)
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}


def read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    # Mistral folders also ship consolidated.safetensors (the same weights, other names).
    files = sorted(f for f in path.glob("*.safetensors") if not f.name.startswith("consolidated"))
    if files:
        sd: dict[str, torch.Tensor] = {}
        for f in files:
            sd.update(load_file(str(f)))
        return sd
    files = sorted(path.glob("pytorch_model*.bin"))
    if files:
        sd = {}
        for f in files:
            sd.update(torch.load(str(f), map_location="cpu", weights_only=True))
        return sd
    raise ModelLoadError(f"no *.safetensors or pytorch_model*.bin weights in {str(path)!r}")


def our_name(hf_name: str) -> tuple[str, int | None, int]:
    """An HF parameter or module name -> (our name, part index in a fused module or None, parts).

    ``model.layers.0.self_attn.k_proj.weight`` -> (``layers.0.self_attn.qkv_proj.weight``, 1, 3).
    """
    name = hf_name[len("model."):] if hf_name.startswith("model.") else hf_name
    for hf, (fused, idx) in _FUSED.items():
        if f".{hf}." in f".{name}.":
            return name.replace(hf, fused), idx, 3 if "qkv" in fused else 2
    return name, None, 1


def fuse_state_dict(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF names -> ours, q/k/v and gate/up concatenated along the output dim (rotary buffers
    dropped: they are recomputed, not weights).

    Raises:
        ModelLoadError: a fused module with a part missing.
    """
    parts: dict[str, list[torch.Tensor | None]] = {}
    ours: dict[str, torch.Tensor] = {}
    for name, w in sd.items():
        if "rotary_emb" in name:
            continue
        key, idx, n = our_name(name)
        if idx is None:
            ours[key] = w
        else:
            parts.setdefault(key, [None] * n)[idx] = w
    for key, ws in parts.items():
        if any(w is None for w in ws):
            raise ModelLoadError(f"checkpoint is missing a part of {key}")
        ours[key] = torch.cat(ws, 0)  # type: ignore[arg-type]
    return ours
