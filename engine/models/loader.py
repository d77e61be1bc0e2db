"""Load an HF-format Llama-family folder (safetensors or PyTorch .bin) into our model."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import torch
from huggingface_hub import snapshot_download

from engine import weight_cache
from engine.config import ModelConfig
from engine.errors import ModelLoadError
from engine.layers.attention import AttentionBackend
from engine.layers.linear import can_prepack, prepack_linears
from engine.memory import file_mappings, release_freed_memory
from engine.models import catalog, gguf
from engine.models.gguf_convert import default_model_path
from engine.models.hf_weights import copy_parts, fused_parts, read_state_dict, weight_files
from engine.models.llama import LlamaForCausalLM
from engine.models.registry import build_model
from engine.models.single_token import SingleTokenDecoder
from engine.quant import QuantConfig, quantize
from engine.quant.calib import calib_sequences, load_calib_texts
from engine.quant.checkpoint import assemble, is_quantized_checkpoint, load_quantized
from engine.quant.linear.activations import set_int8_activations


def resolve_model_path(model: str | None, progress: bool = True) -> Path:
    """``None`` -> the bundled model (converted on first use); a catalogue name
    (engine/models/catalog.py, after ``pdserve pull NAME``); a GGUF file (served from a folder
    made once per file: engine/models/gguf.py); an existing folder; or a Hugging Face model id
    (``org/name``) already in this machine's Hugging Face cache (``HF_HOME``, ``HF_HUB_CACHE``;
    its latest snapshot). Nothing is downloaded at run time."""
    entry = catalog.lookup(model) if model is not None else None
    if model is None or (entry is not None and entry.bundled):  # served as before: fp32 HF folder
        return default_model_path(progress=progress)
    if entry is not None:  # verified when pulled: its sha256 is the cache key, no need to hash again
        return gguf.prepare(catalog.resolve(model), progress=progress, digest=entry.sha256[:16])
    path = Path(model).expanduser()
    if path.is_file():
        if not gguf.is_gguf(path):
            raise ModelLoadError(f"model {model!r} is a file but not a GGUF file: give a .gguf file, "
                                 "an HF-format folder or a catalogue name (`pdserve models`)")
        return gguf.prepare(path, progress=progress)
    if path.exists():
        return path
    if re.fullmatch(r"[\w.-]+/[\w.-]+", model):
        try:
            return Path(snapshot_download(model, local_files_only=True))
        except Exception:  # not cached (LocalEntryNotFoundError), or a bad cache entry
            raise ModelLoadError(
                f"model {model!r} does not exist as a folder and is not in this machine's Hugging Face "
                f"cache, and nothing is downloaded at run time: fetch it first (`huggingface-cli download {model}`, "
                "on every node) or give a local HF-format folder") from None
    raise ModelLoadError(f"model path {model!r} does not exist (no model hub at run time: give a "
                         f"catalogue name ({', '.join(catalog.names())}), a GGUF file, a local HF-format "
                         "folder or a cached Hugging Face model id, or omit it for the bundled model)")


DIGEST_SAMPLES = 16  # 64 KiB windows per weight file, evenly spaced, besides its first and last MiB


def weights_digest(path: Path) -> str:
    """A digest of a model folder's weights and config, cheap enough for any size: per weight
    file its name, size, first and last MiB (a safetensors file's header: every tensor's name,
    dtype, shape and offset) and ``DIGEST_SAMPLES`` evenly spaced 64 KiB windows; plus
    config.json. Two nodes with different conversions, checkpoints or truncated copies differ;
    it is a consistency check between a cluster's own nodes, not a defense against forgery."""
    h = hashlib.sha256()
    gguf_meta = path / gguf.META_FILE
    if gguf_meta.is_file():  # the GGUF file's sha256 stands for the weights; where it lies does not
        meta = json.loads(gguf_meta.read_text())
        h.update(f"gguf\0{meta['sha256_16']}\0{meta['size']}\0".encode())
    files = sorted(f for f in path.iterdir() if f.is_file() and (f.suffix in (".safetensors", ".bin")
                                                                 or f.name == "config.json"))
    for f in files:
        size = f.stat().st_size
        h.update(f"{f.name}\0{size}\0".encode())
        with f.open("rb") as fh:
            spots = [0, max(0, size - (1 << 20))] + [size * i // (DIGEST_SAMPLES + 1) for i in range(1, DIGEST_SAMPLES + 1)]
            for i, at in enumerate(spots):
                fh.seek(at)
                h.update(fh.read(1 << 20 if i < 2 else 1 << 16))
    return h.hexdigest()[:16]


def load_model(path: Path, backend: AttentionBackend, dtype: torch.dtype,
               device: str = "cpu", quantization=None, prepack: bool = True,
               single_token: bool = False, compile_rows: int | None = 1, min_rows: int = 1,
               dequantize: bool = False, activations: str = "float32",
               cache: bool = True) -> LlamaForCausalLM:
    """Build the model from ``path`` and load its weights, fusing q/k/v and gate/up.

    A GGUF folder (engine/models/gguf.py) loads its file's weights in their precision class as
    shipped (``quantization`` "int8" / "int4": every linear in that format; ``dequantize``: all
    in ``dtype``; any other format: dequantized, then quantized as below).

    A quantized checkpoint folder (engine/quant/checkpoint.py) loads as saved; otherwise
    ``quantization`` (an ``engine.quant.QuantConfig`` or short name like "int8") is applied
    with round-to-nearest (W8A8: SmoothQuant, calibrated here on the bundled sample) before the
    remaining fp32 linears are prepacked (``prepack=False``
    keeps plain ``nn.Linear``, e.g. for offline quantization). ``single_token`` adds the fast
    decode path (engine/models/single_token.py) for steps of up to ``compile_rows`` tokens (None:
    its default; at least ``min_rows``) where the model supports it, built here. ``activations``
    "int8": the INT4/INT8 linears' native GEMVs quantize their inputs (EngineConfig.activations).

    ``cache``: on CPU, the converted model comes from the served-weights cache
    (engine/weight_cache.py) where an entry for these weights and options exists, and is put
    there otherwise; either way its weights are then a mapping of the cache's file, shared with
    every process of this node that serves them. Only the prepacking and the native kernels are
    this process's own (``model.weights_from``: "cache", "built" or "uncached").

    Raises:
        ModelLoadError: unsupported config, or weights that do not match it.
    """
    caching = cache and device == "cpu"

    def build() -> LlamaForCausalLM:
        model = _convert(path, backend, dtype, device, quantization, dequantize)
        # cached, the one-token path's layouts are built whether this process uses them or not:
        # a prefill worker (no one-token path) then maps the same entry as the decode worker of
        # its node (for INT8/INT4 they are a move, not a copy; for fp32 the prepacked copy serves)
        return _attach(model, single_token or caching, activations)

    origin = "uncached"
    if caching:
        options = {"dtype": str(dtype), "quantization": repr(quantization), "dequantize": dequantize,
                   "activations": activations, "backend": type(backend).__name__}
        model, origin = weight_cache.cached(weight_cache.key(weights_digest(path), options), build,
                                            path.name, externals={"backend": backend})
    else:
        model = build()
    model.weights_from = origin
    return _serve(model, prepack and can_prepack(dtype, device), single_token, compile_rows, min_rows)


def _convert(path: Path, backend: AttentionBackend, dtype: torch.dtype, device: str, quantization,
             dequantize: bool) -> LlamaForCausalLM:
    """The model with its weights as served (before the one-token path and prepacking)."""
    if is_quantized_checkpoint(path):
        if quantization is not None:
            raise ValueError(f"{str(path)!r} is already a quantized checkpoint: leave quantization unset")
        return load_quantized(path, backend, dtype, device, prepack=False)
    if gguf.source(path) is not None:
        precision = "float" if dequantize else {None: "as-shipped", "none": "as-shipped", "int8": "int8",
                                                "int4": "int4"}.get(quantization, "float")
        sd, qmods, tied = gguf.load_weights(path, precision)
        model = assemble(path, sd, qmods, tied, backend, dtype, device, prepack=False)
        if precision == "float" and quantization not in (None, "none"):
            quantize(model, quantization, _load_calibration(path, quantization))
        return model
    cfg = ModelConfig.from_hf(path)
    model = build_model(cfg, backend, device)  # the config's family, tied head, rotary tables

    ours = fused_parts(read_state_dict(path))  # (views of the files: copied in place one by one)
    if cfg.tie_word_embeddings:
        ours.pop("lm_head.weight", None)
    expected = {n for n, _ in model.named_parameters()}
    missing, unexpected = expected - ours.keys(), ours.keys() - expected
    if missing or unexpected:
        raise ModelLoadError(f"weights in {str(path)!r} do not match {cfg.architecture}: "
                             f"missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}")
    params = dict(model.named_parameters())
    mapped = file_mappings([str(f) for f in weight_files(path)])
    with torch.no_grad():
        for name in list(ours):
            copy_parts(params[name], ours.pop(name), name, mapped)
    del ours, params  # (the files' mappings go with their last tensor; params would keep every
    # float weight alive through quantization, which frees each as its integer one arrives)
    model = model.to(dtype).eval().requires_grad_(False)
    if quantization is not None:
        quantize(model, quantization, _load_calibration(path, quantization))
    return model


LOAD_CALIB_TOKENS = 2048  # SmoothQuant at load: ~2 s on SmolLM2-135M, 2 CPU cores


def _load_calibration(path: Path, quantization) -> list[list[int]] | None:
    """Calibration sequences for a format quantized at load that needs them (W8A8's
    SmoothQuant scales): the bundled sample (engine/quant/data), tokenized with the model's
    tokenizer. None for round-to-nearest formats."""
    cfg = QuantConfig.parse(quantization) if isinstance(quantization, str) else quantization
    if cfg is None or (cfg.activations != "int8" and cfg.method == "rtn"):
        return None
    from transformers import AutoTokenizer  # heavy: transformers
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    return calib_sequences(tokenizer, load_calib_texts(None), max_tokens=LOAD_CALIB_TOKENS)


def _attach(model: LlamaForCausalLM, single_token: bool, activations: str = "float32") -> LlamaForCausalLM:
    """The fast decode path's layouts (if asked for and supported) and the activation mode: the
    last of what the served-weights cache holds."""
    release_freed_memory()  # the conversion's temporaries, before the layouts below are built
    if single_token and SingleTokenDecoder.supports(model):
        # copies the plain weights: before prepacking
        model.single_token = SingleTokenDecoder(model)
    if activations == "int8":
        # after the one-token path moved the INT8 weights into its interleaved copy (the modules
        # then need no reordering of their own), before warm_up builds its kernels (they read
        # the flag)
        set_int8_activations(model)
    return model


def _serve(model: LlamaForCausalLM, prepack: bool, single_token: bool, compile_rows: int | None,
           min_rows: int) -> LlamaForCausalLM:
    """What each process makes for itself: oneDNN's linears (prepacked copies, opaque and not
    mappable, only where no one-token layout holds the plain weight), the one-token path's step
    sizes, and its native kernels (pointers into this process's memory)."""
    # The one-token path's plain fp32 layout (built, cached or not, wherever it is supported) is
    # what the modules read: oneDNN takes it as is, not a packed copy beside it (one resident
    # layout, mapped from the cache and shared on the node: engine/layers/linear.py).
    plain = model.single_token is not None
    if not single_token:
        model.single_token = None  # (its layouts stay: the modules read them)
    if prepack:
        prepack_linears(model, pack=not plain)
    st = model.single_token
    if st is not None:
        st.set_rows(compile_rows, min_rows)
        if not st.warm_up():
            model.single_token = None
    return model


def read_generation_eos(path: Path) -> list[int]:
    """EOS ids from generation_config.json, if the folder has one."""
    f = path / "generation_config.json"
    if not f.is_file():
        return []
    eos = json.loads(f.read_text()).get("eos_token_id")
    return list(eos) if isinstance(eos, list) else ([eos] if eos is not None else [])
