"""Small frozen configs, one per component, validated when built."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from engine.errors import ModelLoadError

# HF architectures our Llama-family model code implements exactly.
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Llama-family decoder, read from an HF ``config.json``."""

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
        arch = archs[0] if archs else "?"
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        if arch == "MistralForCausalLM" and c.get("sliding_window"):
            raise ModelLoadError("Mistral with sliding-window attention is not supported; "
                                 "set sliding_window to null for full attention")
        if arch == "Qwen2ForCausalLM" and c.get("use_sliding_window"):
            raise ModelLoadError("Qwen2 with use_sliding_window=true is not supported")
        if c.get("hidden_act", "silu") != "silu":
            raise ModelLoadError(f"hidden_act {c.get('hidden_act')!r} is not supported (only silu)")
        n_heads = c["num_attention_heads"]
        eos = c.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        rope_scaling = c.get("rope_scaling") or (c.get("rope_parameters") if isinstance(
            c.get("rope_parameters"), dict) and c["rope_parameters"].get("rope_type", "default") != "default"
            else None)
        rope_theta = c.get("rope_theta")
        if rope_theta is None and isinstance(c.get("rope_parameters"), dict):
            rope_theta = c["rope_parameters"].get("rope_theta")
        return cls(
            architecture=arch,
            vocab_size=c["vocab_size"],
            hidden_size=c["hidden_size"],
            intermediate_size=c["intermediate_size"],
            num_layers=c["num_hidden_layers"],
            num_heads=n_heads,
            num_kv_heads=c.get("num_key_value_heads") or n_heads,
            head_dim=c.get("head_dim") or c["hidden_size"] // n_heads,
            rms_norm_eps=c.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            max_position_embeddings=c.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
            attention_bias=bool(c.get("attention_bias", arch == "Qwen2ForCausalLM")),
            rope_scaling=rope_scaling,
            bos_token_id=c.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    def fingerprint(self) -> str:
        """Stable hash of the architecture: two sides agree on a KV layout only if equal."""
        d = asdict(self)
        d.pop("bos_token_id"); d.pop("eos_token_ids")
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


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
            from engine.quant.config import QuantConfig  # lazy: only this method needs it
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
    # small decode steps (one request, a small batch, a verify step) through the fast path over
    # plain weights in huge pages (engine/models/single_token.py): native kernels built at load
    # (engine/models/native_decode.c), or torch.compile'd graphs where those do not build; fp32,
    # INT8 or INT4 models on CPU; costs a second copy of the fp32 decoder weights
    compile_decode: bool = True
    # steps of up to this many tokens (1..32) take that path, and with speculation always a 1+K
    # verify step; bigger steps run the eager batched forward. None: 32 with the native kernels
    # (they beat the eager forward at 8 and 32 rows: bench/decode_rows.py), 4 with the compiled
    # graphs (each row count is its own set of graphs, compiled at load; past 4 oneDNN keeps up)
    compile_decode_rows: int | None = None
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
        if self.compile_decode_rows is not None and not 1 <= self.compile_decode_rows <= 32:
            raise ValueError(f"compile_decode_rows must be in 1..32, got {self.compile_decode_rows}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.quantization is not None:
            from engine.quant.config import QuantConfig
            QuantConfig.parse(self.quantization)  # raises ValueError listing the valid names
