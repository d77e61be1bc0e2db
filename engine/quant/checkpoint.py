"""Quantized checkpoints: a model folder a decode worker loads directly.

Layout of ``DIR``:

    config.json, tokenizer files, generation_config.json   copied from the source model
    model.safetensors     our module names (fused qkv_proj / gate_up_proj); quantized layers as
                          ``<name>.qweight`` (INT8: int8 [N, K]; INT4: uint8 [N, K/2], two values
                          per byte, low nibble first), ``<name>.scale``, ``<name>.zero`` (fp32,
                          [N] or [N, K/g]), optional ``<name>.bias`` / ``<name>.in_scale``;
                          everything else (embeddings, norms, protected linears) in full precision
    pdserve_quant.json    the QuantConfig, the per-layer format, and the quality report

The folder is recognized by ``pdserve_quant.json`` (or, for a Hugging Face GPTQ/AWQ folder, by
``quantization_config`` in its config.json: engine/quant/hf_format.py); ``load_model`` hands it
here. Loading builds the kernels' packed layouts from the canonical integers.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from engine.config import ModelConfig
from engine.errors import ModelLoadError
from engine.layers.linear import can_prepack, prepack_linears
from engine.models.registry import build_model
from engine.quant.config import QuantConfig
from engine.quant.formats import QuantizedWeight, unpack_int4
from engine.quant.hf_format import hf_quant_config, is_hf_quantized, read_hf_quantized
from engine.quant.linear import Int4Linear, Int8Linear, QuantLinear, W8A8Linear
from engine.quant.linear.int4 import QuantEmbedding
from engine.quant.swap import set_module

META_FILE = "pdserve_quant.json"
WEIGHTS_FILE = "model.safetensors"
_KINDS = {Int8Linear: "int8", Int4Linear: "int4", W8A8Linear: "w8a8"}
_SKIP_COPY = (".safetensors", ".bin", ".gguf", ".pt", ".pth")


def is_quantized_checkpoint(path: str | Path) -> bool:
    """Ours (``pdserve_quant.json``) or a Hugging Face GPTQ/AWQ folder (engine/quant/hf_format.py)."""
    return (Path(path) / META_FILE).is_file() or is_hf_quantized(path)


def checkpoint_name(path: str | Path) -> str:
    """The format's short name ("int4-g128", ...), what model_info reports."""
    if (Path(path) / META_FILE).is_file():
        return read_meta(path)["name"]
    return hf_quant_config(path).name


def read_meta(path: str | Path) -> dict[str, Any]:
    return json.loads((Path(path) / META_FILE).read_text())


def copy_side_files(src: Path, out: Path) -> None:
    """Create ``out`` with the source folder's config, tokenizer and generation files (not its
    weights nor any quantization metadata)."""
    if out.resolve() == src.resolve():
        raise ValueError("the output folder must differ from the source model folder")
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(_SKIP_COPY) and f.name not in (META_FILE, "quantize_config.json"):
            shutil.copy2(f, out / f.name)


def save_quantized(model: nn.Module, cfg: QuantConfig, out_dir: str | Path, source_dir: str | Path,
                   report: dict[str, Any] | None = None) -> Path:
    """Write ``model`` (quantized in place, not prepacked) as a checkpoint folder.

    Args:
        model: our LlamaForCausalLM after :func:`engine.quant.quantize`.
        cfg: the config it was quantized with (saved beside the weights).
        out_dir: target folder (created; existing weights in it are replaced).
        source_dir: the full-precision model folder, whose config/tokenizer files are copied.
        report: extra JSON-able facts to keep (quality before/after, protected layers).
    """

    out, src = Path(out_dir), Path(source_dir)
    copy_side_files(src, out)
    layers: dict[str, dict[str, Any]] = {}
    for name, mod in model.named_modules():
        if isinstance(mod, QuantLinear):
            layers[name] = {"kind": _KINDS[type(mod)], "group_size": getattr(mod, "group_size", None),
                            "symmetric": mod.symmetric if hasattr(mod, "symmetric") else True,
                            "in_features": mod.in_features, "out_features": mod.out_features}
        elif type(mod).__name__ == "PackedLinear":
            raise ValueError(f"{name} is prepacked (oneDNN layout): quantize and save before prepacking")
    tied = isinstance(model.lm_head, nn.Linear) and model.lm_head.weight is model.embed_tokens.weight
    sd = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    if tied:
        sd.pop("lm_head.weight", None)
    save_file(sd, str(out / WEIGHTS_FILE), metadata={"format": "pt", "producer": "pdserve-quant"})
    meta = {"version": 1, "name": cfg.name, "quantization": cfg.to_dict(), "tied_lm_head": tied,
            "layers": layers, "report": report or {}}
    (out / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    return out


def _module(kind: str, sd: dict[str, torch.Tensor], name: str, info: dict[str, Any]) -> QuantLinear:
    q = sd.pop(f"{name}.qweight")
    scale, zero = sd.pop(f"{name}.scale").float(), sd.pop(f"{name}.zero").float()
    bias = sd.pop(f"{name}.bias", None)
    in_scale = sd.pop(f"{name}.in_scale", None)
    sym = bool(info.get("symmetric", True))
    if kind == "int4":
        qw = QuantizedWeight(unpack_int4(q), scale, zero, 4, info["group_size"], sym)
        return Int4Linear(qw, bias)
    qw = QuantizedWeight(q, scale, zero, 8, None, sym)
    return W8A8Linear(qw, bias, in_scale) if kind == "w8a8" else Int8Linear(qw, bias)


def load_quantized(path: str | Path, backend, dtype: torch.dtype, device: str = "cpu",
                   prepack: bool = True) -> nn.Module:
    """Build our model from a quantized checkpoint folder, ours or a Hugging Face GPTQ/AWQ one
    (``prepack``: the fp32 linears left get oneDNN layouts, as ``load_model`` does).

    Raises:
        ModelLoadError: the weights do not match the config or the layer list, or a layout
            our kernels cannot run.
    """
    path = Path(path)
    if not (path / META_FILE).is_file():
        sd, qmods, tied = read_hf_quantized(path)
        return assemble(path, sd, qmods, tied, backend, dtype, device, prepack)
    meta = read_meta(path)
    if meta.get("version") != 1:
        raise ModelLoadError(f"{META_FILE} in {str(path)!r} has unsupported version {meta.get('version')!r}")
    QuantConfig.from_dict(meta["quantization"])  # validates
    sd = load_file(str(path / WEIGHTS_FILE))
    qmods: dict[str, QuantLinear] = {}
    try:
        for name, info in meta["layers"].items():
            qmods[name] = _module(info["kind"], sd, name, info)
    except KeyError as e:
        raise ModelLoadError(f"quantized checkpoint {str(path)!r} lacks tensor {e}") from None
    return assemble(path, sd, qmods, bool(meta.get("tied_lm_head")), backend, dtype, device, prepack)


def assemble(path: Path, sd: dict[str, torch.Tensor], qmods: dict[str, QuantLinear], tied: bool, backend,
             dtype: torch.dtype, device: str = "cpu", prepack: bool = True) -> nn.Module:
    """Our model from ``config.json`` at ``path``, full-precision tensors ``sd`` (our names) and
    the quantized modules ``qmods`` (our module names); ``tied``: the LM head is the embedding.

    Raises:
        ModelLoadError: tensors missing, unexpected or of the wrong shape.
    """
    cfg = ModelConfig.from_hf(path)
    model = build_model(cfg, backend, "cpu")
    if tied:
        model.lm_head.weight = model.embed_tokens.weight
    elif cfg.tie_word_embeddings:  # the config ties it, but the checkpoint has a head of its own
        model.lm_head.weight = nn.Parameter(torch.empty_like(model.embed_tokens.weight))
    qmods = dict(qmods)
    embedding = qmods.pop("embed_tokens", None)  # an INT4 table (engine/models/gguf.py): not a linear
    _check_quantized_shapes(model, path, qmods, embedding)
    _take_tensors(model, path, sd, qmods, embedding is not None, tied)
    for name in qmods:  # drop the placeholder fp weights before casting
        set_module(model, name, nn.Identity())
    if embedding is not None:
        model.embed_tokens = QuantEmbedding(embedding)
    model = model.to(device=device, dtype=dtype)
    for name, mod in qmods.items():
        set_module(model, name, mod.to(device))
    model = model.eval().requires_grad_(False)
    if prepack and can_prepack(dtype, device):
        prepack_linears(model)
    return model


def _check_quantized_shapes(model: nn.Module, path: Path, qmods: dict[str, QuantLinear],
                            embedding: QuantLinear | None) -> None:
    """Each quantized module replaces a linear of its shape (the table: the embedding's shape)."""
    if embedding is not None and (embedding.out_features, embedding.in_features) != tuple(
            model.embed_tokens.weight.shape):
        raise ModelLoadError(f"embed_tokens: quantized table [{embedding.out_features}, {embedding.in_features}] "
                             f"in {str(path)!r} does not fit the model {tuple(model.embed_tokens.weight.shape)}")
    modules = dict(model.named_modules())
    for name, mod in qmods.items():
        lin = modules.get(name)
        if not isinstance(lin, nn.Linear) or (lin.out_features, lin.in_features) != (mod.out_features, mod.in_features):
            want = "no such linear" if not isinstance(lin, nn.Linear) else f"[{lin.out_features}, {lin.in_features}]"
            raise ModelLoadError(f"{name}: quantized weight [{mod.out_features}, {mod.in_features}] in {str(path)!r} "
                                 f"does not fit the model ({want})")


def _take_tensors(model: nn.Module, path: Path, sd: dict[str, torch.Tensor], qmods: dict[str, QuantLinear],
                  quantized_embedding: bool, tied: bool) -> None:
    """Every full-precision parameter the quantized modules leave, from ``sd`` (emptied: each
    tensor taken over where it can be, so no second copy is held while loading)."""
    params = dict(model.named_parameters())
    expected = {n for n in params if n.rpartition(".")[0] not in qmods}
    if quantized_embedding:
        expected.discard("embed_tokens.weight")
    if tied:
        expected.discard("lm_head.weight")
    missing, unexpected = expected - sd.keys(), sd.keys() - expected
    if missing or unexpected:
        raise ModelLoadError(f"weights in {str(path)!r} do not match: missing {sorted(missing)[:5]}, "
                             f"unexpected {sorted(unexpected)[:5]}")
    with torch.no_grad():
        for name in list(sd):
            w = sd.pop(name)
            if params[name].shape != w.shape:
                raise ModelLoadError(f"{name}: checkpoint shape {tuple(w.shape)} != {tuple(params[name].shape)}")
            if w.dtype == params[name].dtype and w.is_contiguous():
                params[name].data = w  # take the tensor over: no second copy while loading
            else:
                params[name].copy_(w)
