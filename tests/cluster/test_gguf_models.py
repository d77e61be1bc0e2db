"""Catalogue GGUF models on a real disaggregated cluster: 1 prefill + 1 decode worker, KV over
UCX, weights dequantized (``dequantize: true``). Greedy output over gRPC is token-identical to
transformers loading the same GGUF file in fp32, a prompt longer than Gemma 3's 512-token
sliding window included (prefilled in chunks that cross it; HF's tokens from
tests/hf_reference.py: computed by transformers, recorded per input); the OpenAI API serves the model
under its catalogue name and renders chat messages with the model's own template (Qwen2.5-Coder),
or answers 400 for a model without one (Gemma 3 270M, a base model).

One cluster per model and one at a time (each worker holds the model in fp32): ``served`` is
module-scoped and parametrized by model, so pytest runs one model's tests and stops its cluster
before it starts the next. The reference is computed while the cluster starts, and its model
freed before the tests run.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from router.client import collect, connect, make_request
from tests import hf_reference

CONFIG = Path(__file__).resolve().parents[2] / "deploy" / "local.yaml"
NEW_TOKENS = 12
CHAT = [{"role": "user", "content": "Write a Python function that returns the square of a number."}]


def _long_prompt() -> str:
    """About 570 Gemma tokens of prose (the bundled held-out sample), cut at a sentence end."""
    from engine.quant.eval import HELDOUT
    text = HELDOUT["prose"].read_text()[:2600]
    return text[:text.rindex(". ") + 1]


PROMPTS = {
    "qwen2.5-coder-0.5b": ["def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
                           "The three primary colors are"],
    "gemma3-270m": ["The capital of France is", _long_prompt()],
}


@dataclass
class Reference:
    """transformers' view of the GGUF file: its tokenizer's ids and greedy continuations."""

    eos: set[int]
    prompt_ids: list[list[int]]
    greedy: list[list[int]]
    chat_ids: list[int] | None = None  # None: no chat template
    chat_greedy: list[int] = field(default_factory=list)
    chat_text: list[str] = field(default_factory=list)  # decoded prefixes of chat_greedy, by length


def _tokenizer(gguf: Path):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


def _inputs(gguf: Path, prompts: list[str]) -> dict:
    """transformers' EOS ids, prompt ids and chat ids (None: no template) of the file."""
    from transformers import AutoConfig, GenerationConfig
    tok = _tokenizer(gguf)
    # (what the model's generation_config holds, without building the model)
    eos = GenerationConfig.from_model_config(AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)).eos_token_id
    eos = sorted(set(eos if isinstance(eos, list) else [eos]) | {tok.eos_token_id})
    chat = None if tok.chat_template is None else list(
        tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=False))
    return {"eos": eos, "ids": [tok(p)["input_ids"] for p in prompts], "chat": chat}


def _reference(gguf: Path, prompts: list[str]) -> Reference:
    got = hf_reference.recorded(gguf, "cluster-inputs", [prompts, CHAT], lambda: _inputs(gguf, prompts))
    ids, chat = got["ids"], got["chat"]
    greedy = hf_reference.greedy(gguf, ids + ([chat] if chat else []), NEW_TOKENS)
    ref = Reference(set(got["eos"]), ids, greedy[:len(ids)])
    if chat is not None:
        ref.chat_ids, ref.chat_greedy = chat, greedy[-1]
        ref.chat_text = hf_reference.recorded(gguf, "decoded-prefixes", ref.chat_greedy, lambda: [
            _tokenizer(gguf).decode(ref.chat_greedy[:k], skip_special_tokens=True) for k in range(NEW_TOKENS + 1)])
    return ref


@dataclass
class Served:
    name: str
    cluster: object
    stub: object
    ref: Reference


@pytest.fixture(scope="module", params=list(PROMPTS))
def served(request, ray_session):
    from engine.models import catalog
    from router.app import BackgroundCluster
    from router.config import load_config
    name = request.param
    gguf = catalog.pulled_file(name)
    if gguf is None:
        pytest.skip(f"{name} is not pulled: `pdserve pull {name}` (make install does)")
    # prefill in chunks of 256 tokens: the long prompt's chunks cross Gemma's 512-token window
    cfg = load_config(CONFIG, {
        "model": name, "dequantize": True, "prefill.replicas": 1, "decode.replicas": 1,
        "prefill.kv_cache_gb": 0.1, "decode.kv_cache_gb": 0.1, "prefill.max_batched_tokens": 256,
        "kv_transfer.transport": "ucx", "metrics.port": 0})
    with ThreadPoolExecutor(1) as pool:  # the workers load while the reference is computed here
        starting = pool.submit(BackgroundCluster, cfg)
        try:
            ref = _reference(gguf, PROMPTS[name])
        finally:
            cluster = starting.result()
    try:
        yield Served(name, cluster, connect(f"127.0.0.1:{cluster.port}"), ref)
    finally:
        cluster.stop()


def _same_until_eos(ours: list[int], finish_reason: str, hf: list[int], eos: set[int]) -> None:
    """Ours stops at EOS (or after NEW_TOKENS); HF's loop never stops: ours is its prefix."""
    assert ours == hf[:len(ours)], (ours, hf)
    assert (len(ours) == NEW_TOKENS and finish_reason == "length") or (finish_reason == "stop" and ours[-1] in eos)


def test_greedy_over_grpc_equals_transformers_on_the_gguf(served, wait_idle):
    r = served.cluster.router
    assert [r.tokenizer(p)["input_ids"] for p in PROMPTS[served.name]] == served.ref.prompt_ids
    if served.name == "gemma3-270m":
        assert max(map(len, served.ref.prompt_ids)) > 512  # past the sliding window
    reqs = [make_request(p, max_tokens=NEW_TOKENS, temperature=0) for p in PROMPTS[served.name]]
    with ThreadPoolExecutor(len(reqs)) as pool:  # in one decode batch
        outs = list(pool.map(lambda q: collect(served.stub.Generate(q)), reqs))
    for out, hf in zip(outs, served.ref.greedy):
        assert len(out["token_ids"]) >= 4, out
        _same_until_eos(out["token_ids"], out["finish_reason"], hf, served.ref.eos)
        u = out["usage"]  # prefilled by the prefill worker, its KV sent to the decode worker
        assert u["prefill_worker"] == "prefill-0" and u["decode_worker"] == "decode-0", u
    wait_idle(served.stub, served.cluster)


def test_openai_api_names_the_model_and_renders_its_chat_template(served, wait_idle, monkeypatch):
    import openai

    import router.server
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{served.cluster.http_port}/v1", api_key="unused",
                           max_retries=0, timeout=300)
    [m] = client.models.list().data
    assert m.id == served.name  # the catalogue name, not the cache folder's <stem>-<digest>
    seen: list[list[int]] = []  # the prompt ids the router made of each request

    def recording(*args):
        ids = prompt_ids(*args)
        seen.append(ids)
        return ids
    prompt_ids = router.server.prompt_ids
    monkeypatch.setattr(router.server, "prompt_ids", recording)
    ref = served.ref
    if ref.chat_ids is None:  # a base model: a clear 400, not a 500
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=served.name, messages=CHAT, max_tokens=NEW_TOKENS, temperature=0)
        assert "no chat template" in e.value.message and e.value.param == "messages", e.value
        assert seen == []
    else:
        out = client.chat.completions.create(model=served.name, messages=CHAT, max_tokens=NEW_TOKENS, temperature=0)
        assert seen == [ref.chat_ids]  # the model's own template, as transformers renders it from the GGUF
        n = out.usage.completion_tokens
        assert out.usage.prompt_tokens == len(ref.chat_ids) and 1 <= n <= NEW_TOKENS
        c = out.choices[0]
        assert c.message.content == ref.chat_text[n], (c.message.content, ref.chat_text)
        assert (c.finish_reason == "length" and n == NEW_TOKENS) or \
            (c.finish_reason == "stop" and ref.chat_greedy[n - 1] in ref.eos)
    wait_idle(served.stub, served.cluster)
