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


# Prompts with HF's greedy continuations: the reference every serving path must equal.
GREEDY_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village at the edge of a great forest, there lived an old "
    "clockmaker who had never once left the valley. Every morning he",
    "Q: What is 17 times 3?\nA:",
    "A list of the planets of the solar system, in order from the sun: Mercury, Venus,",
]
GREEDY_NEW_TOKENS = 64


@pytest.fixture(scope="session")
def greedy_reference(request, model_path, tokenizer) -> list[tuple[str, list[int]]]:
    """(prompt, HF generate's greedy new tokens, at most 64), one prompt at a time (no padding
    effects in the reference). HF stops at EOS: so must every path compared with it. Recorded
    per input by tests/hf_reference.py (the model's files, versions, CPU dispatch, prompt)."""
    from tests import hf_reference
    prompts = [tokenizer(p)["input_ids"] for p in GREEDY_PROMPTS]
    tokens = hf_reference.generate(model_path, prompts, GREEDY_NEW_TOKENS, lambda: request.getfixturevalue("hf_model"))
    return list(zip(GREEDY_PROMPTS, tokens))


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
             max_num_seqs: int = 64, model: str | None = None, compile_decode: bool = True,
             quantization: str | None = None, speculative=None, num_threads: int | None = None,
             compile_decode_rows: int | None = None, activations: str = "float32",
             weight_cache: bool = True, jump_forward: int = 0) -> LLMEngine:
        cfg = EngineConfig(
            model=str(model) if model is not None else str(model_path), dtype=dtype, jump_forward=jump_forward,
            compile_decode=compile_decode, compile_decode_rows=compile_decode_rows,
            quantization=quantization, speculative=speculative,
            num_threads=num_threads, activations=activations, weight_cache=weight_cache,
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


@pytest.fixture(scope="session")
def ray_session(tmp_path_factory):
    """One private local Ray for the whole test session, as `pdserve serve` starts one
    (router.app.local_ray_env: loopback, dashboard off, no auth token file, its own temp dir),
    with room for every pool the tests create."""
    import ray

    from router.app import start_local_ray
    for attempt in (1, 2):
        try:
            start_local_ray(8, {"prefill": 4, "decode": 4}, str(tmp_path_factory.mktemp("ray")))
            break
        except RuntimeError as e:
            # Once in a pre-check (2026-12-06) Ray's GCS server never wrote its port file within
            # Ray's 30 s and every test on Ray errored at setup; nothing of ours had run yet. One
            # more start, in a fresh folder, before the session's Ray tests give up.
            if attempt == 2 or "Timed out waiting for file" not in str(e):
                raise
            ray.shutdown()
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def connect_kv():
    """``connect(tx, rx)``: a KVSender's handshake with a KVReceiver in this process (the
    receiver is pumped meanwhile, as a decode worker's step loop would)."""
    import threading
    import time

    def connect(tx, rx) -> None:
        stop = threading.Event()

        def pump() -> None:
            while not stop.is_set():
                rx.progress()
                time.sleep(0.0005)
        th = threading.Thread(target=pump, daemon=True)
        th.start()
        try:
            tx.connect(rx.address)
        finally:
            stop.set()
            th.join()
    return connect


@pytest.fixture(scope="session")
def certs(tmp_path_factory):
    """A test CA and the server and client certificates it signed (tests/tls_certs.py)."""
    from tests.tls_certs import make_certs
    return make_certs(tmp_path_factory.mktemp("certs"))
