"""Measure this machine's engine and write the simulator's cost model (bench.sim.costs).

Runs the real ``engine.llm_engine.LLMEngine`` on ``--threads`` threads (1: a cluster worker's default,
``decode.threads: 1``) and times whole ``step()`` calls:

- prefill: one prompt per step, chunk sizes 16..1024 after 0 and 1024 tokens already
  computed (a prompt longer than the step budget arrives in chunks), the least of 3 prompts;
- decode: batches of 1..64 running requests at contexts of 64..1024 tokens each, the least
  of a few steps each.

KV bytes per token come from the model's shape; transfer GB/s from a copy of one prompt's KV
(the in-process transport's cost; a network is slower: pass ``--transfer-gbps``); the switch
cost is assumed (``sources`` says which figures are measured). About three minutes for
smollm2-135m on one core.
"""

from __future__ import annotations

import platform
import time

from bench.sim.costs import CostModel, fit_step

PREFILL_CHUNKS = (16, 64, 256, 1024)
PREFILL_PAST = (0, 1024)
DECODE_BATCHES = (1, 4, 16, 64)
DECODE_CTX = (64, 512, 1024)
DECODE_STEPS = 3
# Each point is the least of its samples (REPEATS prompts, DECODE_STEPS steps): the engine's own
# cost. On a shared machine a neighbour's burst lands on some samples (16 prompt tokens at 2
# threads: 1148 ms, 64 after 1024: 1219 ms, on the 2-core machine while others ran tests).
REPEATS = 3


def _engine(model: str | None, threads: int, budget: int):
    # (heavy: torch and the engine, loaded only by what uses them)
    from engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from engine.llm_engine import LLMEngine
    cfg = EngineConfig(model=model, num_threads=threads, cache=CacheConfig(memory_gb=1.0),
                       scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=64))
    return LLMEngine(cfg, progress=False)


def _prompt(i: int, n: int, vocab: int) -> list[int]:
    # distinct prompts: no prefix cache hit between samples
    return [(i * 7919 + j * 31 + 11) % (vocab - 10) + 5 for j in range(n)]


def profile(model: str | None = None, threads: int = 1, transfer_gbps: float | None = None,
            log=print) -> CostModel:
    """Measure and fit (module doc). ``log`` gets one line per measured point."""
    # (heavy: torch and the engine, loaded only by what uses them)
    import torch
    from engine.request import SamplingParams
    eng = _engine(model, threads, budget=max(PREFILL_CHUNKS))
    vocab, uid = eng.model_config.vocab_size, iter(range(10**9))
    greedy = SamplingParams(max_tokens=1, temperature=0.0)
    # Not measured: a fresh engine's first steps pay one-time costs (the first forward of each
    # shape: the first sample, 16 prompt tokens, took 557 ms, the next, 64 tokens, 338 ms).
    for n in (16, 256):
        eng.generate([_prompt(next(uid), n, vocab)], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    prefill: list[tuple[int, int, float]] = []
    for past in PREFILL_PAST:
        # One shared `past` prefix, computed once: each sample's prompt finds it in the prefix
        # cache and computes only its own chunk after it (one step: the budget holds it).
        head = _prompt(next(uid), past, vocab)
        if past:
            eng.add_request(head + [1], greedy)
            while eng.has_unfinished():
                eng.step()
        for n in PREFILL_CHUNKS:
            best = []
            for _ in range(REPEATS):  # (distinct prompts: no repeat finds another's chunk cached)
                eng.add_request(head + _prompt(next(uid), n, vocab), greedy)
                while eng.has_unfinished():
                    t0 = time.perf_counter()
                    eng.step()
                    last = (time.perf_counter() - t0) * 1e3
                best.append(last)
            prefill.append((n, past, min(best)))
            log(f"prefill chunk {n:5d} after {past:5d}: {min(best):8.2f} ms (of {', '.join(f'{x:.0f}' for x in best)})")
    decode: list[tuple[int, int, float]] = []
    for ctx in DECODE_CTX:
        # Requests share all but their last block (cached once): the batch grows to each size
        # in DECODE_BATCHES at a prefill cost of one block per request.
        head, rids = _prompt(next(uid), ctx - 16, vocab), []
        long = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
        for b in DECODE_BATCHES:
            while len(rids) < b:
                rids.append(eng.add_request(head + _prompt(next(uid), 16, vocab), long))
            while eng.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens
                                               for r in eng.scheduler.running):
                eng.step()
            times = []
            for _ in range(DECODE_STEPS):
                t0 = time.perf_counter()
                eng.step()
                times.append((time.perf_counter() - t0) * 1e3)
            ms = min(times)
            ctx_sum = sum(r.num_computed_tokens for r in eng.scheduler.running)
            decode.append((b, ctx_sum, ms))
            log(f"decode batch {b:3d} ctx {ctx:5d}: {ms:8.2f} ms")
        for rid in rids:
            eng.abort(rid)
    mc, cc = eng.model_config, eng.config.cache
    kv_tok = 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * torch.tensor([], dtype=eng.dtype).element_size()
    sources = {"step": "measured", "kv_bytes_per_token": "model shape", "switch_ms": "assumed"}
    if transfer_gbps is None:
        x = torch.empty(512 * kv_tok // 4, dtype=torch.float32)
        y = torch.empty_like(x)
        t0 = time.perf_counter()
        for _ in range(20):
            y.copy_(x)
        transfer_gbps = 20 * x.numel() * 4 / (time.perf_counter() - t0) / 1e9
        sources["transfer"] = "measured: in-process copy of 512 tokens' KV"
    else:
        sources["transfer"] = "given"
    return CostModel(model=model or "smollm2-135m", step=fit_step(prefill, decode), block_size=cc.block_size,
                     kv_bytes_per_token=kv_tok, kv_blocks=eng.block_manager.num_blocks,
                     max_num_seqs=64, max_batched_tokens=2048, transfer_gbps=round(transfer_gbps, 3),
                     transfer_latency_ms=1.0, switch_ms=500.0, threads=threads,
                     machine=f"{platform.machine()} {platform.processor() or ''}".strip(), sources=sources,
                     samples={"prefill": prefill, "decode": decode})
