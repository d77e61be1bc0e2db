"""Memory of one engine per model and precision: resident (RSS, PSS), the loading peak, and where
it goes (engine/memory.py's account: weights as served, packed copies, KV cache, other).

Each (model, precision) loads in its own process (a peak RSS is per process and never goes
down), generates a few tokens so every fast path is built, then reports. The overhead is
``rss - weights - kv_cache``: what the worker holds beyond the weights it serves and its KV
cache (packed copies, runtime, tokenizer, Python). The KV cache counts only pages touched; the
run fills a fixed amount of it (``--kv-cache-gb``, all of it written once) so that RSS holds it.

    python -m bench.memory                              # smollm2-135m fp32/int8/int4
    python -m bench.memory --models qwen2.5-coder-0.5b,qwen2.5-coder-1.5b --precisions shipped,int8,int4
    python -m bench.memory --pair qwen2.5-coder-1.5b:int4   # 1 prefill + 1 decode worker, one node

Each engine loads twice, each time in a fresh process: the first load converts the model into
the served-weights cache (engine/weight_cache.py) unless it is there already, the second maps it
as every later start does; the row is the second, with the first's loading peak beside it.

``--pair``: a local disaggregated cluster (Ray actors, the router) with one prefill and one
decode worker of the model, both serving it in the one precision (``prefill.quantization`` =
``decode.quantization``, so both map one served-weights cache entry); their PSS (shared pages
split between them) from `GetModelInfo` after a short request and one prompt as long as the KV
caches hold (every KV page written once on both workers). ``two_worker_pss_over_one_copy_gb``: their
total PSS minus one copy of the weights minus both KV caches.

Prints a table and one JSON line (``rss_overhead_gb_max``: the worst resident - weights - KV).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

PRECISIONS = ("fp32", "shipped", "int8", "int4")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.memory", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="smollm2-135m", help="catalogue names or paths, comma-separated")
    p.add_argument("--precisions", default="fp32,int8,int4",
                   help=f"comma-separated, of {', '.join(PRECISIONS)} (shipped: a GGUF's own formats)")
    p.add_argument("--kv-cache-gb", type=float, default=0.5, help="KV cache per engine (default 0.5)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--pair", metavar="MODEL:PRECISION",
                   help="measure 1 prefill + 1 decode worker of MODEL in a local cluster instead")
    p.add_argument("--one", help=argparse.SUPPRESS)  # internal: MODEL:PRECISION in this process
    return p


def engine_config(model: str, precision: str, kv_gb: float, threads: int):
    # (heavy: torch and the engine, loaded only by what uses them)
    from engine.config import CacheConfig, EngineConfig
    quant = {"fp32": None, "shipped": None, "int8": "int8", "int4": "int4"}[precision]
    return EngineConfig(model=model, quantization=quant, dequantize=precision == "fp32" and model != "smollm2-135m",
                        num_threads=threads, cache=CacheConfig(memory_gb=kv_gb))


def measure_one(model: str, precision: str, kv_gb: float, threads: int) -> dict:
    """Load, touch the whole KV cache, generate 8 tokens; the account and process memory."""
    # (heavy: torch and the engine, loaded only by what uses them)
    from engine.llm_engine import LLMEngine
    from engine.memory import account, process_memory
    from engine.request import SamplingParams
    t0 = time.monotonic()
    eng = LLMEngine(engine_config(model, precision, kv_gb, threads), progress=False)
    load_s = time.monotonic() - t0
    for k, v in eng.runner.kv_caches:  # written once: resident, as a busy worker's is
        k.fill_(0)
        v.fill_(0)
    eng.generate(["The capital of France is"], SamplingParams(max_tokens=8, temperature=0.0))
    acc = account(eng)
    mem = process_memory()
    gb = acc.gb()
    return {"model": model, "precision": precision, "weights_from": eng.model.weights_from,
            "load_s": round(load_s, 1), **mem, **{f"{k}_gb": v for k, v in gb.items()},
            "overhead_gb": round(mem["rss_gb"] - gb["weights"] - gb["kv_cache"], 3),
            "peak_over_rss": round(mem["peak_rss_gb"] / mem["rss_gb"], 3) if mem["rss_gb"] else None,
            "top_packed": [(p, round(n / 1e9, 3)) for p, n in acc.top("packed_copies", 4)]}


def run(models: Sequence[str], precisions: Sequence[str], kv_gb: float, threads: int) -> list[dict]:
    rows = []
    for m in models:
        for p in precisions:
            first, row = (_one_process(m, p, kv_gb, threads, n) for n in ("first", "second"))
            row.update(first_weights_from=first["weights_from"], first_load_s=first["load_s"],
                       first_peak_rss_gb=first["peak_rss_gb"],
                       first_peak_over_rss=round(first["peak_rss_gb"] / row["rss_gb"], 3))
            rows.append(row)
    return rows


def _one_process(model: str, precision: str, kv_gb: float, threads: int, which: str) -> dict:
    print(f"measuring {model} {precision} ({which} load) ...", file=sys.stderr, flush=True)
    r = subprocess.run([sys.executable, "-m", "bench.memory", "--one", f"{model}:{precision}", "--kv-cache-gb",
                        str(kv_gb), "--threads", str(threads)], capture_output=True, text=True)
    if r.returncode != 0:
        print(r.stderr[-2000:], file=sys.stderr)
        raise SystemExit(f"{model} {precision} failed")
    return json.loads(r.stdout.strip().splitlines()[-1])


def measure_pair(model: str, precision: str, kv_gb: float, threads: int) -> dict:
    """1 prefill + 1 decode worker of ``model`` in ``precision``, one node: their memory after a request."""
    # (heavy: Ray, gRPC and the router, loaded only by what uses them)
    import ray
    from pdserve.v1 import pdserve_pb2 as pb
    from router.app import BackgroundCluster, init_ray
    from router.client import collect, connect, make_request
    from router.config import load_config
    quant = {"fp32": "none", "shipped": "none", "int8": "int8", "int4": "int4"}[precision]
    cfg = load_config(None, {"mode": "disaggregated", "model": model, "prefill.replicas": 1, "decode.replicas": 1,
                             "prefill.threads": threads, "decode.threads": threads,
                             "prefill.kv_cache_gb": kv_gb, "decode.kv_cache_gb": kv_gb,
                             "prefill.quantization": quant, "decode.quantization": quant,
                             # steps short enough that a loaded machine's prefill of the fill
                             # prompt below still reports within router.stall_s
                             "prefill.max_batched_tokens": 512,
                             "dequantize": precision == "fp32" and model != "smollm2-135m"})
    init_ray(cfg, temp_dir=tempfile.mkdtemp(prefix="pdserve-bench-memory-"))
    cluster = BackgroundCluster(cfg, http_port=None)
    try:
        stub = connect(f"127.0.0.1:{cluster.port}")
        collect(stub.Generate(make_request("The capital of France is", max_tokens=8, temperature=0.0)))
        # Then one prompt as long as the smaller KV cache holds: every block written once, on both
        # workers (the prefill computes it, the decode receives it), so PSS holds both caches as a
        # busy pair's does, as the one-engine rows do.
        info = stub.GetModelInfo(pb.GetModelInfoRequest())
        blocks = min(w.kv_blocks_total for w in stub.GetClusterStatus(pb.GetClusterStatusRequest()).workers)
        fill = min(int(blocks * info.block_size * 0.95), info.context_length - 2)
        print(f"filling the KV caches: a {fill}-token prompt", file=sys.stderr, flush=True)
        ids = [1000 + (i * 7919) % 20000 for i in range(fill)]
        collect(stub.Generate(make_request(token_ids=ids, max_tokens=1, temperature=0.0)))
        time.sleep(12)  # workers refresh their RSS/PSS every 5 s with their reports
        mem = list(stub.GetModelInfo(pb.GetModelInfoRequest()).memory)
    finally:
        cluster.stop()
        ray.shutdown()
    workers = [{"role": m.role, "weights_gb": round(m.weights_gb, 3), "kv_cache_gb": round(m.kv_cache_gb, 3),
                "rss_gb": round(m.rss_gb, 3), "pss_gb": round(m.pss_gb, 3)} for m in mem]
    one_copy = max(w["weights_gb"] for w in workers)
    over = sum(w["pss_gb"] for w in workers) - one_copy - sum(w["kv_cache_gb"] for w in workers)
    return {"model": model, "precision": precision, "workers": workers, "two_worker_pss_over_one_copy_gb": round(over, 3)}


def table(rows: list[dict]) -> str:
    head = f"{'model':22s} {'precision':9s} {'weights':>8s} {'packed':>8s} {'kv':>6s} {'rss':>6s} {'pss':>6s} " \
           f"{'peak':>6s} {'overhead':>8s} {'peak/rss':>8s} {'load s':>6s} | {'1st load':>8s} {'peak/rss':>8s} " \
           f"{'load s':>6s}   (GB)"
    lines = [head]
    for r in rows:
        lines.append(f"{r['model']:22s} {r['precision']:9s} {r['weights_gb']:8.2f} {r['packed_copies_gb']:8.2f} "
                     f"{r['kv_cache_gb']:6.2f} {r['rss_gb']:6.2f} {r['pss_gb']:6.2f} {r['peak_rss_gb']:6.2f} "
                     f"{r['overhead_gb']:8.2f} {r['peak_over_rss']:8.2f} {r['load_s']:6.1f} | "
                     f"{r['first_weights_from']:>8s} {r['first_peak_over_rss']:8.2f} {r['first_load_s']:6.1f}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.one:
        model, _, precision = args.one.rpartition(":")
        print(json.dumps(measure_one(model, precision, args.kv_cache_gb, args.threads)))
        return 0
    if args.pair:
        model, _, precision = args.pair.rpartition(":")
        if precision not in PRECISIONS:
            raise SystemExit(f"--pair {args.pair}: precision must be one of {', '.join(PRECISIONS)}")
        out = measure_pair(model, precision, args.kv_cache_gb, args.threads)
        for w in out["workers"]:
            print(f"{w['role']:8s} weights {w['weights_gb']:.2f}  kv {w['kv_cache_gb']:.2f}  rss {w['rss_gb']:.2f}  "
                  f"pss {w['pss_gb']:.2f} GB")
        print(json.dumps(out))
        return 0
    precisions = [p for p in args.precisions.split(",") if p]
    bad = [p for p in precisions if p not in PRECISIONS]
    if bad:
        raise SystemExit(f"unknown precision {bad}; valid: {', '.join(PRECISIONS)}")
    rows = run([m for m in args.models.split(",") if m], precisions, args.kv_cache_gb, args.threads)
    print(table(rows))
    print(json.dumps({"rows": rows, "rss_overhead_gb_max": max(r["overhead_gb"] for r in rows),
                      "peak_over_rss_max": max(r["peak_over_rss"] for r in rows)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
