"""What the cluster adds to time to first token: gRPC + router + Ray + KV transfer, measured
against the in-process engine with the prefill worker's config, in the same run; and, given the
OpenAI API's address, what HTTP + server-sent events add over gRPC (requests interleaved)."""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable

PROMPT_TOKENS = 512


def _client_ttft(stub, ids: list[int]) -> tuple[float, float]:
    """(time to the first token, time from it to the second) of one 2-token request. The gap
    is the first decode step as a client sees it: the decode worker must have the KV and the
    first token before it can run."""
    # (heavy: gRPC, loaded only by what uses them)
    from router.client import make_request
    t0 = time.perf_counter()
    times = []
    for r in stub.Generate(make_request(token_ids=ids, max_tokens=2, ignore_eos=True)):
        times += [time.perf_counter()] * len(r.token_ids)
    if len(times) < 2:
        raise RuntimeError("the server sent fewer than 2 tokens")
    return times[0] - t0, times[1] - times[0]


def _http_ttft(client, model: str, ids: list[int]) -> float:
    """Time to the first token of one 2-token streamed /v1/completions request (logprobs on,
    so that a token whose text is held back still comes as its own chunk)."""
    t0 = time.perf_counter()
    for chunk in client.completions.create(model=model, prompt=ids, max_tokens=2, temperature=0, logprobs=0,
                                           stream=True, extra_body={"ignore_eos": True}):
        if chunk.choices and chunk.choices[0].logprobs and chunk.choices[0].logprobs.tokens:
            return time.perf_counter() - t0
    raise RuntimeError("the server streamed no token")


def http_overhead(stub, http_base: str, vocab: int, log: Callable[[str], None] = print, reps: int = 9) -> dict:
    """Median TTFT of fresh 512-token prompts over gRPC and over the OpenAI API, interleaved
    (gRPC, HTTP, gRPC, ...) so that a noisy neighbour hits both."""
    # (optional: the openai client, a test extra)
    import openai
    client = openai.OpenAI(base_url=http_base, api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    rng = random.Random(4321)

    def prompt() -> list[int]:
        return [rng.randrange(100, vocab) for _ in range(PROMPT_TOKENS)]
    log(f"HTTP overhead: {reps} requests each over gRPC and the OpenAI API, interleaved ...")
    _client_ttft(stub, prompt())
    _http_ttft(client, model, prompt())
    grpc_ms, http_ms = [], []
    for _ in range(reps):
        grpc_ms.append(_client_ttft(stub, prompt())[0] * 1e3)
        http_ms.append(_http_ttft(client, model, prompt()) * 1e3)
    g, h = statistics.median(grpc_ms), statistics.median(http_ms)
    return {"grpc_ttft_ms_512": g, "openai_http_ttft_ms_512": h, "openai_http_overhead_ms_512": h - g}


def ttft_overhead(stub, cfg, vocab: int, log: Callable[[str], None] = print, reps: int = 5) -> dict:
    """Median TTFT of fresh 512-token prompts (after a warm-up): through the idle cluster, then
    in this process on an engine built like its prefill worker (same engine config and thread
    count). Returns ms values and their difference, and the cluster's median gap from the first
    token to the second (``cluster_first_decode_gap_ms_512``)."""
    # (heavy: torch and the engine, loaded only by what uses them)
    import torch

    # (heavy: torch and the engine, loaded only by what uses them)
    from engine.llm_engine import LLMEngine
    from engine.request import SamplingParams
    from router.pools import engine_configs
    rng = random.Random(1234)

    def prompt() -> list[int]:  # fresh ids: the prefix cache never helps
        return [rng.randrange(100, vocab) for _ in range(PROMPT_TOKENS)]
    log(f"TTFT overhead: {reps} cluster requests of {PROMPT_TOKENS} tokens ...")
    _client_ttft(stub, prompt())
    cluster, gaps = zip(*(_client_ttft(stub, prompt()) for _ in range(reps)))
    log("TTFT overhead: the in-process engine with the prefill worker's config ...")
    prefill_cfg, decode_cfg = engine_configs(cfg, cfg.model)
    colocated = cfg.mode == "colocated"
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.decode.threads if colocated else cfg.prefill.threads)
    try:
        eng = LLMEngine(decode_cfg if colocated else prefill_cfg, progress=False)
        sp = SamplingParams(max_tokens=1, ignore_eos=True)
        local = []
        for i in range(reps + 1):
            t0 = time.perf_counter()
            eng.generate([prompt()], sp)
            if i:  # the first is the warm-up
                local.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    c, e = statistics.median(cluster) * 1e3, statistics.median(local) * 1e3
    return {"cluster_ttft_ms_512": c, "engine_ttft_ms_512": e, "cluster_ttft_overhead_ms_512": c - e,
            "cluster_first_decode_gap_ms_512": statistics.median(gaps) * 1e3}
