"""An HF-format folder's weights: read, renamed to ours, q/k/v and gate/up fused.

A leaf: the loader, the GGUF reader and the quantized-checkpoint formats all name weights this
way, so it imports none of them.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from engine.errors import ModelLoadError
from engine.memory import drop_file_pages

_FUSED = {  # HF name suffix -> (our fused name, part index)
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}


def weight_files(path: Path) -> list[Path]:
    """The folder's safetensors files (Mistral folders also ship consolidated.safetensors: the
    same weights, other names)."""
    return sorted(f for f in path.glob("*.safetensors") if not f.name.startswith("consolidated"))


def read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """Every weight of the folder by its HF name; safetensors are views of the mapped files."""
    files = weight_files(path)
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


def fused_parts(sd: dict[str, torch.Tensor]) -> dict[str, list[torch.Tensor]]:
    """HF names -> ours, each with its parts in order (q/k/v and gate/up: fused along the output
    dim; every other weight: one part); rotary buffers dropped (recomputed, not weights). The
    parts are ``sd``'s tensors, not copies: a loader copies each into its place and drops it,
    so that no concatenated copy of a whole checkpoint exists at once (the loading peak).

    Raises:
        ModelLoadError: a fused module with a part missing.
    """
    parts: dict[str, list[torch.Tensor | None]] = {}
    for name, w in sd.items():
        if "rotary_emb" in name:
            continue
        key, idx, n = our_name(name)
        parts.setdefault(key, [None] * n)[0 if idx is None else idx] = w
    for key, ws in parts.items():
        if any(w is None for w in ws):
            raise ModelLoadError(f"checkpoint is missing a part of {key}")
    return parts  # type: ignore[return-value]


def fuse_state_dict(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``fused_parts`` with each fused weight concatenated (a new tensor)."""
    return {k: ws[0] if len(ws) == 1 else torch.cat(ws, 0) for k, ws in fused_parts(sd).items()}


def copy_parts(dest: torch.Tensor, ws: list[torch.Tensor], name: str,
               mappings: list[tuple[int, int]] = ()) -> None:
    """Write the parts ``ws`` of ``name`` into ``dest`` one after another along dim 0; parts
    that are views of a mapped file in ``mappings`` leave this process's resident memory once
    copied (engine.memory.drop_file_pages).

    Raises:
        ModelLoadError: their shapes do not add up to ``dest``'s.
    """
    rows = sum(w.shape[0] for w in ws) if all(w.dim() for w in ws) else -1
    if rows != dest.shape[0] or any(w.shape[1:] != dest.shape[1:] for w in ws):
        shape = tuple(ws[0].shape) if len(ws) == 1 else [tuple(w.shape) for w in ws]
        raise ModelLoadError(f"{name}: checkpoint shape {shape} != {tuple(dest.shape)}")
    at = 0
    for w in ws:
        dest[at:at + w.shape[0]].copy_(w)
        at += w.shape[0]
        drop_file_pages(w, mappings)
