"""Small frozen configs, one per component, validated when built."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from engine.errors import ModelLoadError

# HF architecture -> the model family that implements it exactly (engine/models/registry.py).
ARCHITECTURE_FAMILIES = {
    "LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "llama",
    "Gemma3ForCausalLM": "gemma3",
}
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURE_FAMILIES)
# config.json without "architectures": its model_type names one
_MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                "gemma3_text": "Gemma3ForCausalLM"}
SLIDING, FULL = "sliding_attention", "full_attention"  # HF layer_types
DTYPES = ("float32", "bfloat16", "float16")
ACTIVATIONS = ("float32", "int8")
MAX_JUMP_FORWARD = 64  # forced tokens appended after one sampled token, at most


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a decoder of one of our families, read from an HF ``config.json``.

    The fields after ``eos_token_ids`` are Gemma 3's (``family="gemma3"``); a Llama-family
    config keeps their defaults.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # Qwen2 has q/k/v bias
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False, compare=False)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    family: str = "llama"
    hidden_act: str = "silu"  # the MLP's gate activation: silu or gelu_pytorch_tanh
    # per layer "sliding_attention" (keys within sliding_window of the query) or
    # "full_attention"; None: every layer full
    layer_types: tuple[str, ...] | None = None
    sliding_window: int | None = None
    rope_local_theta: float | None = None  # rotary base of sliding layers (None: rope_theta)
    rope_local_scaling: dict[str, Any] | None = field(default=None, hash=False, compare=False)
    query_pre_attn_scalar: float | None = None  # attention scale is this ** -0.5 (None: head_dim)
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap)
    # read but not applied: transformers' Gemma3 does not apply it either (Gemma 3 has q/k norms
    # instead; released checkpoints set it to null)
    attn_logit_softcapping: float | None = None

    @classmethod
    def from_hf(cls, path: str | Path) -> ModelConfig:
        """Read ``config.json`` from an HF model folder.

        Raises:
            ModelLoadError: missing folder/config, or an architecture we do not implement.
        """
        path = Path(path)
        cfg_file = path / "config.json"
        if not path.is_dir():
            raise ModelLoadError(f"model path {str(path)!r} is not a directory")
        if not cfg_file.is_file():
            raise ModelLoadError(f"no config.json in {str(path)!r}: expected an HF-format model folder")
        c = json.loads(cfg_file.read_text())
        archs = c.get("architectures") or []
        arch = archs[0] if archs else _MODEL_TYPES.get(c.get("model_type"), "?")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        n_heads = c["num_attention_heads"]
        eos = c.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        common = dict(
            architecture=arch,
            vocab_size=c["vocab_size"],
            hidden_size=c["hidden_size"],
            intermediate_size=c["intermediate_size"],
            num_layers=c["num_hidden_layers"],
            num_heads=n_heads,
            num_kv_heads=c.get("num_key_value_heads") or n_heads,
            head_dim=c.get("head_dim") or c["hidden_size"] // n_heads,
            rms_norm_eps=c.get("rms_norm_eps", 1e-6),
            bos_token_id=c.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )
        if ARCHITECTURE_FAMILIES[arch] == "gemma3":
            return cls(**common, **_gemma3_fields(c))
        if arch == "MistralForCausalLM" and c.get("sliding_window"):
            raise ModelLoadError("Mistral with sliding-window attention is not supported; "
                                 "set sliding_window to null for full attention")
        if arch == "Qwen2ForCausalLM" and c.get("use_sliding_window"):
            raise ModelLoadError("Qwen2 with use_sliding_window=true is not supported")
        if c.get("hidden_act", "silu") != "silu":
            raise ModelLoadError(f"hidden_act {c.get('hidden_act')!r} is not supported (only silu)")
        rope_scaling = c.get("rope_scaling") or (c.get("rope_parameters") if isinstance(
            c.get("rope_parameters"), dict) and c["rope_parameters"].get("rope_type", "default") != "default"
            else None)
        rope_theta = c.get("rope_theta")
        if rope_theta is None and isinstance(c.get("rope_parameters"), dict):
            rope_theta = c["rope_parameters"].get("rope_theta")
        return cls(
            **common,
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            max_position_embeddings=c.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
            attention_bias=bool(c.get("attention_bias", arch == "Qwen2ForCausalLM")),
            rope_scaling=rope_scaling,
        )

    @property
    def is_sliding(self) -> tuple[bool, ...]:
        """Per layer: does it attend within ``sliding_window`` only?"""
        if self.layer_types is None or self.sliding_window is None:
            return (False,) * self.num_layers
        return tuple(t == SLIDING for t in self.layer_types)

    def fingerprint(self) -> str:
        """Stable hash of the architecture: two sides agree on a KV layout only if equal."""
        d = asdict(self)
        d.pop("bos_token_id"); d.pop("eos_token_ids")
        # Fields added with Gemma 3 count only away from their defaults, so a Llama-family
        # model's fingerprint is what builds before them compute (mixed versions interoperate).
        for f in fields(self):
            if f.name in _GEMMA_FIELDS and d[f.name] == f.default:
                d.pop(f.name)
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


_GEMMA_FIELDS = ("family", "hidden_act", "layer_types", "sliding_window", "rope_local_theta", "rope_local_scaling",
                 "query_pre_attn_scalar", "final_logit_softcapping", "attn_logit_softcapping")


def _gemma3_fields(c: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig fields of a Gemma 3 text ``config.json`` (transformers 4.5x keys, or 5.x with
    per-layer-type ``rope_parameters``), with transformers' defaults for absent keys.

    Raises:
        ModelLoadError: an activation, attention mode or layer type we do not implement.
    """
    act = c.get("hidden_activation") or c.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise ModelLoadError(f"Gemma 3 hidden_activation {act!r} is not supported (only gelu_pytorch_tanh)")
    if c.get("use_bidirectional_attention"):
        raise ModelLoadError("Gemma 3 with use_bidirectional_attention=true (an encoder) is not supported")
    n = c["num_hidden_layers"]
    pattern = c.get("sliding_window_pattern") or c.get("_sliding_window_pattern") or 6
    types = tuple(c.get("layer_types") or (SLIDING if (i + 1) % pattern else FULL for i in range(n)))
    if len(types) != n or set(types) - {SLIDING, FULL}:
        raise ModelLoadError(f"layer_types must be {n} of {SLIDING!r} / {FULL!r}, got {list(types)}")
    rp = c.get("rope_parameters")
    if isinstance(rp, dict) and (FULL in rp or SLIDING in rp):  # transformers 5: one set per layer type
        glob, loc = dict(rp.get(FULL) or {}), dict(rp.get(SLIDING) or {})
    else:  # rope_scaling applies to the global (full-attention) layers only
        glob = {**(c.get("rope_scaling") or {}), "rope_theta": c.get("rope_theta")}
        loc = {"rope_theta": c.get("rope_local_base_freq")}
    theta = glob.pop("rope_theta", None)
    local_theta = loc.pop("rope_theta", None)

    def scaling(p: dict[str, Any]) -> dict[str, Any] | None:
        return p if p.get("rope_type", p.get("type", "default")) != "default" else None

    window = c.get("sliding_window", 4096)
    return dict(
        family="gemma3",
        rope_theta=float(theta if theta is not None else 1_000_000.0),
        max_position_embeddings=c.get("max_position_embeddings", 131_072),
        tie_word_embeddings=bool(c.get("tie_word_embeddings", True)),
        attention_bias=bool(c.get("attention_bias", False)),
        rope_scaling=scaling(glob),
        hidden_act=act,
        layer_types=types,
        sliding_window=int(window) if window else None,
        rope_local_theta=float(local_theta if local_theta is not None else 10_000.0),
        rope_local_scaling=scaling(loc),
        query_pre_attn_scalar=float(c.get("query_pre_attn_scalar", 256)),
        final_logit_softcapping=c.get("final_logit_softcapping"),
        attn_logit_softcapping=c.get("attn_logit_softcapping"),
    )


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache. ``num_blocks=None`` sizes the cache from ``memory_gb``."""

    block_size: int = 16
    num_blocks: int | None = None
    memory_gb: float = 2.0
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 1, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.memory_gb <= 0:
            raise ValueError(f"memory_gb must be > 0, got {self.memory_gb}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits.

    ``max_num_batched_tokens`` is the per-step token budget; with chunked prefill a long prompt
    takes what is left of it after the running decodes, so decodes never stall behind a prompt.
    """

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    enable_chunked_prefill: bool = True

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")


SPECULATIVE_METHODS = ("draft", "ngram", "layer_skip", "quant_self")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: a cheap draft proposes tokens, the target verifies them in one forward.

    ``method``: ``draft`` (a separate Llama-family checkpoint at ``draft_model`` with the
    target's tokenizer), ``ngram`` (prompt lookup: what followed the last n tokens earlier in
    the sequence), ``layer_skip`` (the target's first ``draft_layers`` layers + its LM head) or
    ``quant_self`` (a copy of the target quantized as ``draft_quantization``, INT4 by default;
    ``engine.quant`` short names). ``num_speculative_tokens`` is K, the most draft
    tokens verified per step; with ``adaptive`` each request's K moves in 1..K with its recent
    acceptance, and speculation is switched off for it while the measured gain is below 1.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    draft_model: str | None = None
    draft_layers: int | None = None  # layer_skip; None = half the target's layers
    draft_quantization: str = "int4"  # quant_self
    ngram_max: int = 4
    ngram_min: int = 2
    adaptive: bool = True

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative method must be one of {', '.join(SPECULATIVE_METHODS)}, "
                             f"got {self.method!r}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 8:
            raise ValueError(f"num_speculative_tokens must be an integer in 1..8, got {k!r}")
        if self.method == "draft" and not self.draft_model:
            raise ValueError("speculative method 'draft' needs draft_model (an HF-format folder)")
        if self.method != "draft" and self.draft_model:
            raise ValueError(f"draft_model is only used by method 'draft', not {self.method!r}")
        if self.draft_layers is not None and (not isinstance(self.draft_layers, int) or self.draft_layers < 1):
            raise ValueError(f"draft_layers must be an integer >= 1, got {self.draft_layers!r}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min}, {self.ngram_max}")
        if self.method == "quant_self":
            from engine.quant.config import QuantConfig  # heavy: engine.quant's package imports torch
            if QuantConfig.parse(self.draft_quantization) is None:
                raise ValueError("quant_self needs a draft_quantization other than 'none' (e.g. int4, int8)")

    @property
    def label(self) -> str:
        """Short name for status pages, e.g. ``ngram-k4``."""
        return f"{self.method}-k{self.num_speculative_tokens}" + ("" if self.adaptive else "-fixed")


@dataclass(frozen=True)
class EngineConfig:
    """Everything an engine needs. ``model=None`` means the bundled SmolLM2-135M-Instruct."""

    model: str | None = None
    dtype: str = "float32"  # fp32 is faster than bf16 on AVX2 CPUs without native bf16
    attention_backend: str = "sdpa"
    device: str = "cpu"
    max_model_len: int | None = None
    num_threads: int | None = None
    # weight quantization applied at load: "none", "int8", "int4", "int4-g64", "w8a8" (see
    # engine/quant/config.py); a quantized checkpoint folder as `model` needs none here
    quantization: str | None = None
    # a GGUF model's weights dequantized to `dtype` instead of served in their precision class
    # as shipped (engine/models/gguf.py); no effect on other models
    dequantize: bool = False
    # "int8": INT4/INT8 linears' small steps (native kernels, < 128 rows) quantize their inputs
    # per group of 32 and multiply bytes, llama.cpp's arithmetic on its K-quants: faster, not
    # token-identical to HF (engine/quant/linear/activations.py set_int8_activations; README says
    # what it costs in perplexity). "float32": fp32 activations, exact against the reference
    activations: str = "float32"
    # small decode steps (one request, a small batch, a verify step) through the fast path over
    # plain weights in huge pages (engine/models/single_token.py): native kernels built at load
    # (engine/models/native_decode.c), or torch.compile'd graphs where those do not build; fp32,
    # INT8 or INT4 models on CPU; the batched path reads the same weights (one layout each,
    # bench/memory.py: no second copy)
    compile_decode: bool = True
    # steps of up to this many tokens (1..32) take that path, and with speculation always a 1+K
    # verify step; bigger steps run the eager batched forward. None: 32 with the native kernels
    # (they beat the eager forward at 8 and 32 rows: bench/decode_rows.py), 4 with the compiled
    # graphs (each row count is its own set of graphs, compiled at load; past 4 oneDNN keeps up)
    compile_decode_rows: int | None = None
    # on CPU, the converted model is kept in and mapped from the served-weights cache
    # (engine/weight_cache.py): restarts skip the conversion and a node's workers of one model
    # share its pages. Where it is on, the one-token path's layouts are built even without
    # compile_decode (a prefill worker maps its decode worker's entry): INT8 linears then read
    # their interleaved copy (the same products, summed in another order). PDSERVE_WEIGHT_CACHE=0
    # turns it off for the whole process.
    weight_cache: bool = True
    # jump-forward (structured outputs): after a constrained request's sampled token, up to this
    # many tokens its grammar forces (a JSON key, punctuation) are appended at once and computed
    # together in its next step, instead of one forward each (engine/grammar.py). 0: off, the
    # default: the forced text is tokenized as the grammar library does, which may differ from
    # the tokens a masked model would pick, so constrained greedy output is then not the same as
    # without it. Requests asking for logprobs are never jumped (forced tokens have none).
    jump_forward: int = 0
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig | None = None  # None: no speculative decoding

    @property
    def verify_rows(self) -> int:
        """Rows of one request's 1+K verify step when speculating (else 1): the fast decode path
        runs at least this many."""
        return self.speculative.num_speculative_tokens + 1 if self.speculative is not None else 1

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.activations not in ACTIVATIONS:
            raise ValueError(f"activations must be one of {', '.join(ACTIVATIONS)}, got {self.activations!r}")
        if self.compile_decode_rows is not None and not 1 <= self.compile_decode_rows <= 32:
            raise ValueError(f"compile_decode_rows must be in 1..32, got {self.compile_decode_rows}")
        if not (isinstance(self.jump_forward, int) and 0 <= self.jump_forward <= MAX_JUMP_FORWARD):
            raise ValueError(f"jump_forward must be an integer in 0..{MAX_JUMP_FORWARD}, got {self.jump_forward!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.quantization is not None:
            from engine.quant.config import QuantConfig  # heavy: engine.quant's package imports torch
            QuantConfig.parse(self.quantization)  # raises ValueError listing the valid names
