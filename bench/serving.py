"""Serving benchmark: N concurrent requests through gRPC; TTFT and TPOT p50/p99, tokens/s.

Starts its own cluster (local Ray, the pools of ``--config``) unless ``--server`` names a
running one. Prompts are random token ids, distinct per request, so the prefix cache never
helps. Times are taken by the client: TTFT = request sent -> first token received; TPOT = the
mean gap between a request's later tokens; throughput = all new tokens / wall time of the run.

``--ttft-overhead`` also measures, in the same run and with the cluster idle, what the
cluster adds to the time to first token of a 512-token prompt: the median client TTFT through
gRPC (router, Ray, prefill worker, first token back) minus the median TTFT of the in-process
engine with the prefill worker's engine config and thread count (both ``max_tokens=1``, a
fresh prompt each time, after a warm-up). Reported as ``cluster_ttft_overhead_ms_512``.

Prints progress on stderr, a table on stdout and, as the last stdout line, one flat JSON object.
Runs as ``python bench/serving.py`` or ``python -P bench/serving.py``.
"""

from __future__ import annotations

import os
import sys

_HERE = os.path.dirname(os.path.realpath(__file__))
_ROOT = os.path.dirname(_HERE)
sys.path[:] = [p for p in sys.path if os.path.realpath(p or os.curdir) != _HERE]
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import argparse  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from concurrent.futures import ThreadPoolExecutor  # noqa: E402

from router.client import connect, make_request  # noqa: E402


def log(msg: str) -> None:
    print(f"[serving] {msg}", file=sys.stderr, flush=True)


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))]


def random_prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(100, vocab) for _ in range(n)]


def one_request(stub, ids: list[int], max_tokens: int) -> dict:
    """Client-side timings of one streamed request."""
    t0 = time.perf_counter()
    times: list[float] = []
    n = 0
    for r in stub.Generate(make_request(token_ids=ids, max_tokens=max_tokens, ignore_eos=True, temperature=0.0)):
        if r.token_ids:
            times.extend([time.perf_counter()] * len(r.token_ids))
            n += len(r.token_ids)
    ttft = times[0] - t0
    tpot = (times[-1] - times[0]) / (n - 1) if n > 1 else None
    return {"ttft": ttft, "tpot": tpot, "tokens": n, "end": times[-1]}


def run_load(stub, n: int, concurrency: int, prompt_tokens: int, max_tokens: int, vocab: int, seed: int) -> dict:
    rng = random.Random(seed)
    prompts = [random_prompt(rng, prompt_tokens, vocab) for _ in range(n)]
    done = [0]
    lock = threading.Lock()

    def job(ids):
        r = one_request(stub, ids, max_tokens)
        with lock:
            done[0] += 1
            if done[0] % max(1, n // 10) == 0:
                log(f"  {done[0]}/{n} requests done")
        return r

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(job, prompts))
    wall = time.perf_counter() - t0
    ttfts = [r["ttft"] * 1e3 for r in results]
    tpots = [r["tpot"] * 1e3 for r in results if r["tpot"] is not None]
    tokens = sum(r["tokens"] for r in results)
    return {"requests": n, "concurrency": concurrency, "prompt_tokens": prompt_tokens, "max_tokens": max_tokens,
            "ttft_ms_p50": pct(ttfts, 50), "ttft_ms_p99": pct(ttfts, 99),
            "tpot_ms_p50": pct(tpots, 50), "tpot_ms_p99": pct(tpots, 99),
            "output_tokens": tokens, "wall_s": wall, "output_tokens_per_s": tokens / wall}


def ttft_overhead(stub, cfg, reps: int, vocab: int) -> dict:
    """Median TTFT of a 512-token prompt: through the cluster, then the in-process engine."""
    import torch

    from engine.llm_engine import LLMEngine
    from engine.request import SamplingParams
    from router.pools import engine_configs
    rng = random.Random(1234)
    log(f"TTFT overhead: {reps} cluster requests of 512 tokens (max_tokens=1) ...")
    one_request(stub, random_prompt(rng, 512, vocab), 1)  # warm-up
    cluster = [one_request(stub, random_prompt(rng, 512, vocab), 1)["ttft"] for _ in range(reps)]
    log("TTFT overhead: the in-process engine with the prefill worker's config ...")
    threads = torch.get_num_threads()
    prefill_cfg, _ = engine_configs(cfg, None)
    torch.set_num_threads(cfg.prefill.threads if cfg.mode != "colocated" else cfg.decode.threads)
    eng = LLMEngine(prefill_cfg, progress=False)
    sp = SamplingParams(max_tokens=1, ignore_eos=True)
    local = []
    for i in range(reps + 1):
        t0 = time.perf_counter()
        eng.generate([random_prompt(rng, 512, vocab)], sp)
        if i:  # the first is the warm-up
            local.append(time.perf_counter() - t0)
    torch.set_num_threads(threads)
    c, e = statistics.median(cluster) * 1e3, statistics.median(local) * 1e3
    return {"cluster_ttft_ms_512": c, "engine_ttft_ms_512": e, "cluster_ttft_overhead_ms_512": c - e}


def main() -> int:
    p = argparse.ArgumentParser(description="Send N concurrent requests through gRPC; print TTFT/TPOT "
                                            "p50/p99 and tokens/s (last line: one JSON object).")
    p.add_argument("--server", help="a running pdserve server (host:port); default: start a cluster here")
    p.add_argument("--config", default=os.path.join(_ROOT, "deploy", "local.yaml"),
                   help="cluster config when starting one (default deploy/local.yaml)")
    p.add_argument("--mode", choices=["disaggregated", "colocated"], help="override the config's mode")
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--ttft-overhead", action="store_true",
                   help="also measure the cluster's TTFT overhead over the in-process engine (512 tokens)")
    p.add_argument("--ttft-reps", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    from pdserve.v1 import pdserve_pb2 as pb
    from router.config import load_config
    cfg = load_config(args.config, {"mode": args.mode} if args.mode else None)
    cluster = None
    server = args.server
    if server is None:
        from router.app import BackgroundCluster, init_ray
        log(f"starting a local cluster ({cfg.mode}) ...")
        init_ray(cfg)
        cluster = BackgroundCluster(cfg)
        server = f"127.0.0.1:{cluster.port}"
    try:
        stub = connect(server)
        info = stub.GetModelInfo(pb.GetModelInfoRequest())
        status = stub.GetClusterStatus(pb.GetClusterStatusRequest())
        workers = ", ".join(f"{w.worker_id}" for w in status.workers)
        log(f"{info.model} on {status.mode}: {workers}")
        one_request(stub, random_prompt(random.Random(-1), 16, info.vocab_size), 4)  # warm-up
        log(f"{args.num_requests} requests, concurrency {args.concurrency}, {args.prompt_tokens} prompt "
            f"tokens, {args.max_tokens} new tokens ...")
        res = {"mode": status.mode, "workers": len(status.workers),
               **run_load(stub, args.num_requests, args.concurrency, args.prompt_tokens, args.max_tokens,
                          info.vocab_size, args.seed)}
        if args.ttft_overhead:
            res.update(ttft_overhead(stub, cfg, args.ttft_reps, info.vocab_size))
    finally:
        if cluster is not None:
            cluster.stop()
            import ray
            ray.shutdown()

    print(f"{'metric':<32}{'value':>12}")
    for k, v in res.items():
        print(f"{k:<32}{v:>12.2f}" if isinstance(v, float) else f"{k:<32}{v!s:>12}")
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
