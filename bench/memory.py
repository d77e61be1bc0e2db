"""Memory of one engine per model and precision: resident (RSS, PSS), the loading peak, and where
it goes (engine/memory.py's account: weights as served, packed copies, KV cache, other).

Each (model, precision) loads in its own process (a peak RSS is per process and never goes
down), generates a few tokens so every fast path is built, then reports. The overhead is
``rss - weights - kv_cache``: what the worker holds beyond the weights it serves and its KV
cache (packed copies, runtime, tokenizer, Python). The KV cache counts only pages touched; the
run fills a fixed amount of it (``--kv-cache-gb``, all of it written once) so that RSS holds it.

    python -m bench.memory                              # smollm2-135m fp32/int8/int4
    python -m bench.memory --models qwen2.5-coder-0.5b,qwen2.5-coder-1.5b --precisions shipped,int8,int4

Prints a table and one JSON line (``rss_overhead_gb_max``: the worst resident - weights - KV).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Sequence

PRECISIONS = ("fp32", "shipped", "int8", "int4")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.memory", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="smollm2-135m", help="catalogue names or paths, comma-separated")
    p.add_argument("--precisions", default="fp32,int8,int4",
                   help=f"comma-separated, of {', '.join(PRECISIONS)} (shipped: a GGUF's own formats)")
    p.add_argument("--kv-cache-gb", type=float, default=0.5, help="KV cache per engine (default 0.5)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--one", help=argparse.SUPPRESS)  # internal: MODEL:PRECISION in this process
    return p


def engine_config(model: str, precision: str, kv_gb: float, threads: int):
    from engine.config import CacheConfig, EngineConfig
    quant = {"fp32": None, "shipped": None, "int8": "int8", "int4": "int4"}[precision]
    return EngineConfig(model=model, quantization=quant, dequantize=precision == "fp32" and model != "smollm2-135m",
                        num_threads=threads, cache=CacheConfig(memory_gb=kv_gb))


def measure_one(model: str, precision: str, kv_gb: float, threads: int) -> dict:
    """Load, touch the whole KV cache, generate 8 tokens; the account and process memory."""
    from engine.llm_engine import LLMEngine
    from engine.memory import account, process_memory
    from engine.request import SamplingParams
    eng = LLMEngine(engine_config(model, precision, kv_gb, threads), progress=False)
    for k, v in eng.runner.kv_caches:  # written once: resident, as a busy worker's is
        k.fill_(0)
        v.fill_(0)
    eng.generate(["The capital of France is"], SamplingParams(max_tokens=8, temperature=0.0))
    acc = account(eng)
    mem = process_memory()
    gb = acc.gb()
    return {"model": model, "precision": precision, **mem, **{f"{k}_gb": v for k, v in gb.items()},
            "overhead_gb": round(mem["rss_gb"] - gb["weights"] - gb["kv_cache"], 3),
            "peak_over_rss": round(mem["peak_rss_gb"] / mem["rss_gb"], 3) if mem["rss_gb"] else None,
            "top_packed": [(p, round(n / 1e9, 3)) for p, n in acc.top("packed_copies", 4)]}


def run(models: Sequence[str], precisions: Sequence[str], kv_gb: float, threads: int) -> list[dict]:
    rows = []
    for m in models:
        for p in precisions:
            print(f"measuring {m} {p} ...", file=sys.stderr, flush=True)
            r = subprocess.run([sys.executable, "-m", "bench.memory", "--one", f"{m}:{p}", "--kv-cache-gb",
                                str(kv_gb), "--threads", str(threads)], capture_output=True, text=True)
            if r.returncode != 0:
                print(r.stderr[-2000:], file=sys.stderr)
                raise SystemExit(f"{m} {p} failed")
            rows.append(json.loads(r.stdout.strip().splitlines()[-1]))
    return rows


def table(rows: list[dict]) -> str:
    head = f"{'model':22s} {'precision':9s} {'weights':>8s} {'packed':>8s} {'kv':>6s} {'rss':>6s} {'pss':>6s} " \
           f"{'peak':>6s} {'overhead':>8s} {'peak/rss':>8s}   (GB)"
    lines = [head]
    for r in rows:
        lines.append(f"{r['model']:22s} {r['precision']:9s} {r['weights_gb']:8.2f} {r['packed_copies_gb']:8.2f} "
                     f"{r['kv_cache_gb']:6.2f} {r['rss_gb']:6.2f} {r['pss_gb']:6.2f} {r['peak_rss_gb']:6.2f} "
                     f"{r['overhead_gb']:8.2f} {r['peak_over_rss']:8.2f}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.one:
        model, _, precision = args.one.rpartition(":")
        print(json.dumps(measure_one(model, precision, args.kv_cache_gb, args.threads)))
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
