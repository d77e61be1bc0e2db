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

Then, for a 1-thread profile (``node=True``, :func:`measure_node`), how much a neighbour on the
node slows a step: a second engine in another process (the other core) runs prompts, or decodes
a batch, while this one times decode steps, then prompt steps, each against the same steps alone
(costs.py ``node_decode_x``, ``node_prefill_x``). Half a minute.

Then (``cluster=True``, :func:`measure_cluster`) what a cluster adds: a local cluster of the
workers a mode of that thread count runs (1 thread: 1 prefill + 1 decode worker; 2: one
colocated worker) serves ``CLUSTER_REQUESTS`` lone requests, one at a time; the median TTFT
less the engine's own (the prompt's step, plus its transfer) is ``request_ms``, the median TPOT
less a lone decode step's time is ``loop_ms`` (costs.py); then ``CLUSTER_LONG`` lone long
prompts give ``prefill_x`` and, through a prefill and a decode worker, ``land_ms_per_ktok``
(``long_overheads``). About a minute more.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import platform
import statistics
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
CLUSTER_REQUESTS = 12  # lone requests through a running cluster (measure_cluster)
CLUSTER_PROMPT, CLUSTER_ANSWER = 64, 48  # their prompt and answer tokens
# then lone long prompts (prefill_x, land_ms_per_ktok): a document's length, a short answer
CLUSTER_LONG, CLUSTER_LONG_PROMPT, CLUSTER_LONG_ANSWER = 4, 1024, 16
# measure_node: the decode batch timed (a disaggregated decode worker's few streams), the prompt
# chunk timed and the neighbour's work (a prefill worker's prompts; a decode worker's batch)
NODE_BATCH, NODE_CTX, NODE_CHUNK, NODE_NEIGHBOUR_BATCH = 4, 256, 256, 16
NODE_DECODE_STEPS, NODE_PROMPTS = 40, 8


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
            log=print, cluster: bool = True, node: bool = True) -> CostModel:
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
    cost = CostModel(model=model or "smollm2-135m", step=fit_step(prefill, decode), block_size=cc.block_size,
                     kv_bytes_per_token=kv_tok, kv_blocks=eng.block_manager.num_blocks,
                     max_num_seqs=64, max_batched_tokens=2048, transfer_gbps=round(transfer_gbps, 3),
                     transfer_latency_ms=1.0, switch_ms=500.0, threads=threads,
                     machine=f"{platform.machine()} {platform.processor() or ''}".strip(), sources=sources,
                     samples={"prefill": prefill, "decode": decode})
    if node and threads == 1:  # (a 2-thread worker has the 2-core node to itself)
        cost = measure_node(cost, eng, model, log)
    del eng  # (its memory, before a cluster's workers load the model again)
    return measure_cluster(cost, model, log) if cluster else cost


def overheads(cost: CostModel, ttfts_ms: list[float], tpots_ms: list[float]) -> tuple[float, float]:
    """(request_ms, loop_ms) from lone requests' TTFTs and TPOTs (CLUSTER_PROMPT prompt tokens,
    CLUSTER_ANSWER answer tokens) through a cluster of ``cost``'s workers; never < 0. loop_ms:
    the median TPOT less a lone decode step of the engine's own; request_ms: the median TTFT less
    the prompt's step with its loop_ms (the simulator adds both to that step) and, for a prefill
    worker's prompt, its transfer."""
    engine = dataclasses.replace(cost, loop_ms=0.0, request_ms=0.0)
    # a lone stream's mean step over its answer: context from the prompt to the prompt + answer
    loop_ms = max(0.0, statistics.median(tpots_ms) - engine.step_ms(1, CLUSTER_PROMPT + CLUSTER_ANSWER // 2))
    first = engine.step_ms(0, 0, [(CLUSTER_PROMPT, 0)]) + loop_ms + (
        engine.transfer_ms(CLUSTER_PROMPT) if cost.threads == 1 else 0.0)
    return max(0.0, statistics.median(ttfts_ms) - first), loop_ms


def long_overheads(cost: CostModel, ttfts_ms: list[float], tpots_ms: list[float]) -> tuple[float, float]:
    """(prefill_x, land_ms_per_ktok) from lone long requests' TTFTs and TPOTs
    (CLUSTER_LONG_PROMPT prompt tokens, CLUSTER_LONG_ANSWER answer tokens) through the same
    cluster, ``cost`` carrying the short requests' request_ms and loop_ms. prefill_x: the median
    TTFT less what the simulator adds around the prompt's tokens (request_ms, the step's base
    and loop, a 1-thread profile's transfer), over the engine's own for them; never < 1.
    land_ms_per_ktok (1 thread: a decode worker receives it): the median TPOT's answer time
    less its decode steps, per 1,000 prompt tokens; never < 0."""
    engine = dataclasses.replace(cost, prefill_x=1.0, land_ms_per_ktok=0.0)
    p, a = CLUSTER_LONG_PROMPT, CLUSTER_LONG_ANSWER
    around = engine.step_ms(0, 0)  # (base + loop: the step without the prompt)
    tokens = engine.step_ms(0, 0, [(p, 0)]) - around
    rest = cost.request_ms + around + (engine.transfer_ms(p) if cost.threads == 1 else 0.0)
    prefill_x = max(1.0, (statistics.median(ttfts_ms) - rest) / tokens)
    if cost.threads != 1:
        return prefill_x, 0.0
    land = statistics.median(tpots_ms) * (a - 1) - engine.decode_run_ms(1, p, a - 1)
    return prefill_x, max(0.0, land) / (p / 1e3)


def measure_cluster(cost: CostModel, model: str | None, log=print) -> CostModel:
    """``cost`` with ``request_ms``, ``loop_ms``, ``prefill_x`` and ``land_ms_per_ktok`` measured
    on a local cluster (module doc)."""
    # (heavy: asyncio, Ray and a cluster, loaded only by what uses them)
    import asyncio
    import ray  # noqa: I001
    from bench.loadgen import make_workload, run
    from router.app import BackgroundCluster, init_ray
    from router.config import load_config
    mode = {"mode": "disaggregated", "prefill.threads": 1, "decode.threads": 1} if cost.threads == 1 else \
        {"mode": "colocated", "decode.threads": cost.threads}
    cfg = load_config(None, {**mode, "metrics.port": 0, **({"model": model} if model else {})})
    init_ray(cfg)
    cluster = BackgroundCluster(cfg)
    try:
        server = f"127.0.0.1:{cluster.port}"
        specs = make_workload(CLUSTER_REQUESTS + 2, "random", 1000, seed=7, prompt_tokens=str(CLUSTER_PROMPT),
                              max_tokens=str(CLUSTER_ANSWER))
        asyncio.run(run(server, specs[:2], concurrency=1))  # (warm-up: a fresh worker's first steps)
        results, _ = asyncio.run(run(server, specs[2:], concurrency=1))
        long_specs = make_workload(CLUSTER_LONG + 1, "random", 1000, seed=8, prompt_tokens=str(CLUSTER_LONG_PROMPT),
                                   max_tokens=str(CLUSTER_LONG_ANSWER))
        asyncio.run(run(server, long_specs[:1], concurrency=1))  # (warm-up: the long shapes' first step)
        long_results, _ = asyncio.run(run(server, long_specs[1:], concurrency=1))
    finally:
        cluster.stop()
        ray.shutdown()
    ok = [r for r in results if r.error is None and r.ttft is not None and r.tpot is not None]
    if len(ok) < CLUSTER_REQUESTS // 2:
        raise RuntimeError(f"the profile's cluster answered {len(ok)} of {len(results)} requests")
    ttfts, tpots = [r.ttft * 1e3 for r in ok], [r.tpot * 1e3 for r in ok]
    request_ms, loop_ms = overheads(cost, ttfts, tpots)
    log(f"cluster ({cfg.mode}): lone requests' TTFT median {statistics.median(ttfts):.0f} ms, TPOT "
        f"{statistics.median(tpots):.1f} ms: request_ms {request_ms:.1f}, loop_ms {loop_ms:.2f}")
    cost = dataclasses.replace(cost, request_ms=round(request_ms, 2), loop_ms=round(loop_ms, 3))
    long_ok = [r for r in long_results if r.error is None and r.ttft is not None and r.tpot is not None]
    lt, lp = [r.ttft * 1e3 for r in long_ok], [r.tpot * 1e3 for r in long_ok]
    prefill_x, land = long_overheads(cost, lt, lp) if long_ok else (1.0, 0.0)
    log(f"cluster ({cfg.mode}): {len(long_ok)} lone {CLUSTER_LONG_PROMPT}-token prompts' TTFT median "
        f"{statistics.median(lt) if lt else 0:.0f} ms, TPOT {statistics.median(lp) if lp else 0:.1f} ms: prefill_x "
        f"{prefill_x:.3f}, land_ms_per_ktok {land:.1f}")
    return dataclasses.replace(cost, prefill_x=round(prefill_x, 4), land_ms_per_ktok=round(land, 2),
                               sources={**cost.sources, "cluster": f"measured: {len(ok)} lone requests and "
                                                                   f"{len(long_ok)} lone long prompts through a "
                                                                   f"local {cfg.mode} cluster"},
                               samples={**cost.samples, "cluster": {"ttft_ms": ttfts, "tpot_ms": tpots,
                                                                    "long_ttft_ms": lt, "long_tpot_ms": lp}})


def _neighbour(model: str | None, kind: str, ready, stop) -> None:
    """The other engine on the node (measure_node), in its own process: until ``stop``, it
    prefills fresh prompts of NODE_CHUNK tokens (``kind`` "prefill") or decodes a batch of
    NODE_NEIGHBOUR_BATCH streams ("decode")."""
    # (heavy: torch and the engine, loaded only by what uses them)
    from engine.request import SamplingParams
    eng = _engine(model, 1, budget=max(PREFILL_CHUNKS))
    vocab, uid = eng.model_config.vocab_size, iter(range(10**6, 10**9))
    one, steps = SamplingParams(max_tokens=1, temperature=0.0), 0
    while not stop.is_set():
        if kind == "prefill" and not eng.has_unfinished():
            eng.add_request(_prompt(next(uid), NODE_CHUNK, vocab), one)
        while kind == "decode" and len(eng.scheduler.running) + len(eng.scheduler.waiting) < NODE_NEIGHBOUR_BATCH:
            # (answers of different lengths: the streams end, and are replaced, one at a time)
            n = 256 + 16 * (next(uid) % NODE_NEIGHBOUR_BATCH)
            eng.add_request(_prompt(next(uid), NODE_CTX, vocab), SamplingParams(max_tokens=n, temperature=0.0,
                                                                                 ignore_eos=True))
        eng.step()
        steps += 1
        # ready once at its steady work: its first prompts past, a decode batch's prompts computed
        if not ready.is_set() and steps >= 3 and (kind == "prefill" or (
                not eng.scheduler.waiting and all(r.num_computed_tokens >= r.num_prompt_tokens
                                                  for r in eng.scheduler.running))):
            ready.set()


def _timed_steps(eng, kind: str, uid, vocab: int) -> list[float]:
    """ms of NODE_DECODE_STEPS decode steps of a batch of NODE_BATCH at about NODE_CTX tokens
    each, or of NODE_PROMPTS fresh prompts of NODE_CHUNK tokens (one step each)."""
    # (heavy: torch and the engine, loaded only by what uses them)
    from engine.request import SamplingParams
    out = []
    if kind == "prefill":
        for _ in range(NODE_PROMPTS):
            eng.add_request(_prompt(next(uid), NODE_CHUNK, vocab), SamplingParams(max_tokens=1, temperature=0.0))
            t0 = time.perf_counter()
            while eng.has_unfinished():
                eng.step()
            out.append((time.perf_counter() - t0) * 1e3)
        return out
    rids = [eng.add_request(_prompt(next(uid), NODE_CTX, vocab),
                            SamplingParams(max_tokens=NODE_DECODE_STEPS + 8, temperature=0.0, ignore_eos=True))
            for _ in range(NODE_BATCH)]
    while eng.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in eng.scheduler.running):
        eng.step()
    for _ in range(NODE_DECODE_STEPS):
        t0 = time.perf_counter()
        eng.step()
        out.append((time.perf_counter() - t0) * 1e3)
    for rid in rids:
        eng.abort(rid)
    return out


def node_factor(alone_ms: list[float], beside_ms: list[float]) -> float:
    """Median beside a busy neighbour / median alone, at least 1 (a neighbour never speeds a
    step up: below 1 is noise)."""
    return max(1.0, statistics.median(beside_ms) / statistics.median(alone_ms))


def measure_node(cost: CostModel, eng, model: str | None, log=print) -> CostModel:
    """``cost`` with ``node_decode_x`` and ``node_prefill_x`` measured (module doc): this
    process's ``eng`` times its steps alone, then beside a neighbour process at work."""
    if len(os.sched_getaffinity(0)) < 2:  # (on one core a neighbour time-slices: not what a node shares)
        log("node: this process may use one CPU only: no neighbour measured (node factors 1)")
        return dataclasses.replace(cost, sources={**cost.sources, "node": "not measured: one CPU"})
    vocab, uid = eng.model_config.vocab_size, iter(range(2 * 10**9, 3 * 10**9))
    ctx = mp.get_context("spawn")  # (a fresh interpreter: no fork of this one's torch threads)
    x, samples = {}, {}
    for mine, theirs in (("decode", "prefill"), ("prefill", "decode")):
        alone = _timed_steps(eng, mine, uid, vocab)
        ready, stop = ctx.Event(), ctx.Event()
        p = ctx.Process(target=_neighbour, args=(model, theirs, ready, stop), daemon=True)
        p.start()
        try:
            t0 = time.monotonic()
            while not ready.wait(0.5):
                if not p.is_alive() or time.monotonic() - t0 > 300:
                    raise RuntimeError(f"the profile's neighbour engine ({theirs}) did not start "
                                       f"(exit code {p.exitcode}; waited {time.monotonic() - t0:.0f} s)")
            beside = _timed_steps(eng, mine, uid, vocab)
            if not p.is_alive():  # (else "beside" was alone for some of it)
                raise RuntimeError(f"the profile's neighbour engine ({theirs}) stopped (exit code {p.exitcode})")
        finally:
            stop.set()
            p.join(30)
            if p.is_alive():
                p.terminate()
                p.join(5)
        x[mine] = node_factor(alone, beside)
        samples[mine] = {"alone_ms": alone, "beside_ms": beside}
        log(f"node: {mine} steps beside a neighbour running {theirs}: median {statistics.median(beside):.1f} ms "
            f"against {statistics.median(alone):.1f} alone: x {x[mine]:.3f}")
    return dataclasses.replace(cost, node_decode_x=round(x["decode"], 3), node_prefill_x=round(x["prefill"], 3),
                               sources={**cost.sources, "node": "measured: two engines, two processes"},
                               samples={**cost.samples, "node": samples})
