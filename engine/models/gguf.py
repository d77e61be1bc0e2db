"""Serve a GGUF file (the llama.cpp / Ollama format) straight from the file.

``prepare(FILE.gguf)`` makes, once per file (keyed by a digest of its bytes), a small folder in
pdserve's cache holding what the rest of pdserve reads from a model folder: ``config.json``
(the hyper-parameters exactly as transformers reads them from the file's metadata, so the
reference and pdserve agree by construction), the tokenizer and chat template (from the file's
metadata: BPE or SentencePiece), ``generation_config.json`` (BOS/EOS and end-of-turn ids) and
``pdserve_gguf.json`` naming the file. The weights are not copied there: ``load_weights`` reads
them from the file (memory-mapped) tensor by tensor, so loading never holds more than the model
as served plus one fused tensor in float.

Precision (``engine/models/gguf_codes.py`` has the formats): by default each linear stays in
its precision class as shipped: 4-bit blocks become pdserve's INT4 with the file's own codes,
5- to 8-bit ones INT8; a fused module (q/k/v, gate/up) whose parts differ takes the wider
class. ``"int4"`` / ``"int8"`` put every linear in that format; ``"float"`` dequantizes all.
Embeddings and norms are always float (as HF keeps them).
"""

from __future__ import annotations

import hashlib
import json
import logging
import mmap
import os
from pathlib import Path

import torch
from tqdm import tqdm

from engine.errors import ModelLoadError
from engine.memory import release_freed_memory
from engine.models import gguf_codes as codes
from engine.models.gguf_convert import cache_dir, staged_dir, unpermute
from engine.models.gguf_reader import TensorReader
from engine.models.hf_weights import our_name
from engine.quant.linear import Int4Linear, Int8Linear
from engine.quant.linear.base import bias_copy

log = logging.getLogger(__name__)

META_FILE = "pdserve_gguf.json"
MAGIC = b"GGUF"
# general.architecture -> the HF architecture our engine serves it as
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "gemma3": "Gemma3ForCausalLM"}
PRECISIONS = ("as-shipped", "int4", "int8", "float")

# GGUF tensor name -> HF name ("{i}": layer); per architecture where they differ.
_COMMON = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_q.bias": "model.layers.{i}.self_attn.q_proj.bias",
    "blk.{i}.attn_k.bias": "model.layers.{i}.self_attn.k_proj.bias",
    "blk.{i}.attn_v.bias": "model.layers.{i}.self_attn.v_proj.bias",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}
_NAMES = {
    "llama": {**_COMMON, "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight"},
    "qwen2": {**_COMMON, "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight"},
    "gemma3": {**_COMMON,
               "blk.{i}.attn_q_norm.weight": "model.layers.{i}.self_attn.q_norm.weight",
               "blk.{i}.attn_k_norm.weight": "model.layers.{i}.self_attn.k_norm.weight",
               "blk.{i}.post_attention_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
               "blk.{i}.ffn_norm.weight": "model.layers.{i}.pre_feedforward_layernorm.weight",
               "blk.{i}.post_ffw_norm.weight": "model.layers.{i}.post_feedforward_layernorm.weight"},
}
_LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head")


def is_gguf(path: str | Path) -> bool:
    """A file that starts with the GGUF magic (or is named ``*.gguf``)."""
    p = Path(path)
    if not p.is_file():
        return False
    if p.suffix == ".gguf":
        return True
    with p.open("rb") as f:
        return f.read(4) == MAGIC


def file_digest(path: Path) -> str:
    """A digest of the whole file's bytes (sha256, 16 hex digits): the cache key of its folder."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(16 << 20):
            h.update(chunk)
    return h.hexdigest()[:16]


def open_reader(path: Path):
    """The file's reader (memory-mapped; its tensors and scalar metadata, engine/models/gguf_reader.py),
    after checks that name the file and the problem.

    Raises:
        ModelLoadError: not a GGUF file, truncated, an unsupported version or architecture.
    """
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(4)
    if head != MAGIC:
        raise ModelLoadError(f"{str(path)!r} is not a GGUF file (it starts with {head!r}, not {MAGIC!r})")
    try:
        reader = TensorReader(str(path))
    except Exception as e:  # noqa: BLE001 - the reader raises ValueError, IndexError, ...: all mean a bad file
        raise ModelLoadError(f"{str(path)!r} is not a readable GGUF file ({type(e).__name__}: {e}); "
                             "truncated or corrupt? compare its size and sha256 with the source") from None
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size:
            raise ModelLoadError(f"{str(path)!r} is truncated: tensor {t.name} ends at byte "
                                 f"{t.data_offset + t.n_bytes:,}, the file has {size:,}")
    arch = field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelLoadError(f"GGUF architecture {arch!r} in {str(path)!r} is not supported; "
                             f"supported: {', '.join(ARCHITECTURES)}")
    return reader


def field(reader, key: str, default=None):
    """A scalar or string metadata value (open_reader steps over the arrays: asking for one is a bug)."""
    if key in getattr(reader, "skipped", ()):
        raise KeyError(f"GGUF metadata {key!r} is an array, which open_reader does not read")
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def cache_root() -> Path:
    return cache_dir() / "gguf"


def prepare(path: str | Path, progress: bool = True, digest: str | None = None) -> Path:
    """The folder that serves GGUF file ``path``, made on first use (see the module docstring);
    ``digest``: the file's sha256 (16 hex digits) where already verified, else computed here.

    Raises:
        ModelLoadError: a bad or unsupported file (``open_reader``).
    """
    path = Path(path).expanduser().resolve()
    digest = digest or file_digest(path)
    out = cache_root() / f"{path.stem}-{digest}"
    # the same bytes under another name: one folder per content, whatever the file is called
    known = sorted(p for p in cache_root().glob(f"*-{digest}") if (p / META_FILE).is_file())
    out = known[0] if known else out
    if (out / META_FILE).is_file():
        meta = json.loads((out / META_FILE).read_text())
        if meta.get("file") != str(path):  # the same bytes at another path: point the folder there
            meta["file"] = str(path)
            _write_atomic(out / META_FILE, json.dumps(meta, indent=2))
        return out
    reader = open_reader(path)
    with staged_dir(out) as tmp:
        if progress:
            log.info("reading config and tokenizer of %s", path.name)
        _write_config(path, reader, tmp)
        types: dict[str, int] = {}
        for t in reader.tensors:
            types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
        meta = {"version": 1, "file": str(path), "size": path.stat().st_size, "sha256_16": digest,
                "architecture": field(reader, "general.architecture"), "name": field(reader, "general.name"),
                "tensor_types": types}
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2))
    return out


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _write_config(path: Path, reader, out: Path) -> None:
    """config.json, generation_config.json and the tokenizer, as transformers reads them from
    the file (``from_pretrained(dir, gguf_file=...)``: the reference pdserve is checked against)."""
    # heavy: transformers
    from transformers import AutoConfig, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    arch = field(reader, "general.architecture")
    cfg_dict = dict(load_gguf_checkpoint(str(path), return_tensors=False)["config"])
    model_type = cfg_dict.pop("model_type")
    cfg = AutoConfig.for_model(model_type, **cfg_dict)
    cfg.architectures = [ARCHITECTURES[arch]]
    cfg.save_pretrained(str(out))
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tok.save_pretrained(str(out))
    eos = [field(reader, k) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                      "tokenizer.ggml.eom_token_id")]
    eos = list(dict.fromkeys(int(e) for e in eos if e is not None))
    gen = {"eos_token_id": eos}
    bos = field(reader, "tokenizer.ggml.bos_token_id")
    if bos is not None:
        gen["bos_token_id"] = int(bos)
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2))


def source(folder: str | Path) -> Path | None:
    """The GGUF file a prepared folder serves, or None for any other folder.

    Raises:
        ModelLoadError: the folder's file is gone.
    """
    meta_file = Path(folder) / META_FILE
    if not meta_file.is_file():
        return None
    f = Path(json.loads(meta_file.read_text())["file"])
    if not f.is_file():
        raise ModelLoadError(f"{str(folder)!r} serves {str(f)!r}, which no longer exists")
    return f


def hf_name(arch: str, gguf_name: str) -> str | None:
    """GGUF tensor name -> HF name for ``arch`` (None for tensors we do not load, e.g. rope_freqs)."""
    table = _NAMES[arch]
    parts = gguf_name.split(".")
    if parts[0] == "blk" and len(parts) > 2 and parts[1].isdigit():
        template = table.get("blk.{i}." + ".".join(parts[2:]))
        return template.format(i=parts[1]) if template else None
    return table.get(gguf_name)


def _linear_format(types: list[str], precision: str) -> str:
    """What a (fused) linear becomes: "int4", "int8" or "float" (module docstring)."""
    if precision != "as-shipped":
        return precision
    classes = {codes.precision_class(t) for t in types}
    return "float" if classes == {"float"} else "int4" if classes == {"int4"} else "int8"


def load_weights(folder: Path, precision: str = "as-shipped", progress: bool = True
                 ) -> tuple[dict[str, torch.Tensor], dict[str, object], bool]:
    """The weights of a prepared folder's GGUF file, in our names, ready for
    ``engine.quant.checkpoint.assemble``: (float tensors, quantized linears by module name,
    whether the LM head is the embedding).

    Raises:
        ModelLoadError: unknown precision, a tensor missing or of a type we cannot read.
    """
    if precision not in PRECISIONS:
        raise ModelLoadError(f"GGUF precision {precision!r} is not one of {', '.join(PRECISIONS)}")
    path = source(folder)
    reader = open_reader(path)
    arch = field(reader, "general.architecture")
    cfg = json.loads((Path(folder) / "config.json").read_text())
    n_head, n_kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    groups = _tensor_groups(reader, arch)
    tied = "lm_head.weight" not in groups
    if tied and precision != "float":  # the LM head as its own quantized copy of the embedding
        groups["lm_head.weight"] = groups.get("embed_tokens.weight")
    sd: dict[str, torch.Tensor] = {}
    out: dict[str, object] = {}  # integer linears by module name, made as each is read (below)
    bar = tqdm(groups.items(), desc=f"loading {path.name}", unit="tensor",
               disable=None if progress else True)  # None: off when stderr is not a terminal
    for ours, parts in bar:
        fmt, ws = _read_group(path, ours, parts, precision, arch, n_head, n_kv)
        if fmt == "float":
            sd[ours] = ws[0] if len(ws) == 1 else torch.cat(ws)
        else:
            # its module now: INT4 codes arrive a byte each and the module packs them two to a
            # byte, so holding every read weight until the end would peak at twice the model
            out[ours.rpartition(".")[0]] = _module(codes.concat_rows(ws) if len(ws) > 1 else ws[0])
        del ws
        _release(reader, [t for t, _ in parts])
    _attach_biases(out, sd)
    return sd, out, tied and "lm_head" not in out


def _tensor_groups(reader, arch: str) -> dict[str, list]:
    """Our module/tensor name -> [(reader tensor, hf name)] by part index (q, k, v of a fused qkv)."""
    groups: dict[str, list] = {}
    for t in reader.tensors:
        name = hf_name(arch, t.name)
        if name is None:
            continue
        ours, idx, n = our_name(name)
        groups.setdefault(ours, [None] * n)[idx or 0] = (t, name)
    return groups


def _read_group(path: Path, ours: str, parts: list | None, precision: str, arch: str, n_head: int,
                n_kv: int) -> tuple[str, list]:
    """(format, its parts converted) of one of our tensors: "float" or a linear's "int4"/"int8"."""
    if parts is None or any(p is None for p in parts):
        raise ModelLoadError(f"{str(path)!r} lacks a part of {ours}")
    module, _, leaf = ours.rpartition(".")
    is_linear = leaf == "weight" and module.rpartition(".")[2] in _LINEARS
    fmt = _linear_format([t.tensor_type.name for t, _ in parts], precision) if is_linear else "float"
    if ours == "embed_tokens.weight" and precision in ("as-shipped", "int4") and len(parts) == 1 \
            and codes.precision_class(parts[0][0].tensor_type.name) == "int4":
        fmt = "int4"  # the file's own codes, exactly: rows dequantized at lookup (QuantEmbedding)
    try:
        return fmt, [_one(t, hf, fmt, arch, n_head, n_kv) for t, hf in parts]
    except NotImplementedError as e:
        raise ModelLoadError(f"{str(path)!r}: tensor {parts[0][0].name} has a type pdserve cannot read "
                             f"({parts[0][0].tensor_type.name}: {e})") from None


def _module(qw) -> object:
    return Int8Linear(qw) if qw.bits == 8 else Int4Linear(qw)


def _attach_biases(mods: dict[str, object], sd: dict[str, torch.Tensor]) -> None:
    """Each integer linear's bias, taken out of ``sd`` (biases may come after their weights in
    the file: attached once all are read)."""
    for module, mod in mods.items():
        bias = sd.pop(f"{module}.bias", None)
        if bias is not None:
            mod.bias = bias_copy(bias)


def _release(reader, tensors) -> None:
    """Memory a converted tensor no longer needs, given back now rather than at the end of the
    load: the file's pages it read (mapped pages count in resident memory, a whole 1.1 GB file
    by the last tensor) and the heap its conversion freed (glibc keeps freed temporaries for
    reuse: 3 GB retained by the end of a 1.5B load here). Peak resident memory while loading
    then stays near the weights kept plus one tensor's work."""
    mm = getattr(reader.data, "_mmap", None)
    if mm is not None and hasattr(mm, "madvise"):
        page = mmap.PAGESIZE
        for t in tensors:
            start = t.data_offset // page * page
            end = t.data_offset + t.n_bytes
            try:
                mm.madvise(mmap.MADV_DONTNEED, start, end - start)
            except (OSError, ValueError):  # beyond the mapping or not allowed: nothing to give back
                pass
    release_freed_memory()


def _one(t, hf: str, fmt: str, arch: str, n_head: int, n_kv: int):
    """One GGUF tensor as float (fp32) or as a QuantizedWeight in ``fmt``, in HF's row order."""
    if fmt == "float":
        w = codes.dequantized(t)
        if len(t.shape) == 1:
            w = w.reshape(-1)
        if arch == "gemma3" and hf.endswith("norm.weight"):
            w = w - 1  # llama.cpp stores gemma's (1 + w) norm weights with the 1 added
        return _unpermuted(w, hf, arch, n_head, n_kv)
    qw = codes.as_int4(t) if fmt == "int4" else codes.as_int8(t)
    rows = torch.arange(qw.q.shape[0])
    perm = _unpermuted(rows, hf, arch, n_head, n_kv)
    return qw if perm is rows else codes.permute_rows(qw, perm)


def _unpermuted(w, hf: str, arch: str, n_head: int, n_kv: int):
    """llama's q/k rows back in HF's order (engine/models/gguf_convert.py ``unpermute``); qwen2
    and gemma3 files are written unpermuted: ``w`` itself comes back."""
    if arch != "llama" or not (".q_proj." in hf or ".k_proj." in hf):
        return w
    return unpermute(w, n_head if ".q_proj." in hf else n_kv)

