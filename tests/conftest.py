"""Shared fixtures: the real bundled model, HF reference, engines that must end leak-free."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.llm_engine import LLMEngine


@pytest.fixture(scope="session")
def model_path():
    """HF-format folder of the bundled SmolLM2-135M-Instruct (converted once, cached)."""
    from engine.models.gguf_convert import default_model_path
    return default_model_path(progress=False)


@pytest.fixture(scope="session")
def hf_model(model_path):
    """transformers' own LlamaForCausalLM on the same weights: the reference."""
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tokenizer(model_path):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(model_path))


@pytest.fixture
def make_engine(model_path) -> Iterator[Callable[..., LLMEngine]]:
    """Build engines on the real model; after the test each must hold zero blocks and requests."""
    built: list[LLMEngine] = []

    def make(budget: int = 2048, chunked: bool = True, prefix: bool = True, memory_gb: float = 0.25,
             num_blocks: int | None = None, block_size: int = 16, dtype: str = "float32",
             max_num_seqs: int = 64, model: str | None = None) -> LLMEngine:
        cfg = EngineConfig(
            model=str(model) if model is not None else str(model_path), dtype=dtype,
            cache=CacheConfig(block_size=block_size, num_blocks=num_blocks, memory_gb=memory_gb,
                              enable_prefix_caching=prefix),
            scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
                                      enable_chunked_prefill=chunked))
        eng = LLMEngine(cfg, progress=False)
        built.append(eng)
        return eng

    yield make
    for eng in built:
        assert not eng.has_unfinished(), "a test left requests in the engine"
        assert eng.block_manager.num_used_blocks == 0, "a test leaked KV blocks"
        eng.block_manager.check_invariants()
