"""Small-batch decode: the fast multi-row path (native kernels, or compiled graphs) against the
eager batched forward.

For each precision (fp32, INT8, INT4 weight-only) two engines on the bundled SmolLM2-135M, in one
process: ``compile_decode_rows`` = ``--rows`` (steps of up to that many tokens run the fast
path, engine/models/single_token.py) and ``compile_decode_rows=1`` (only one-token steps do;
every batch runs the eager batched forward, as before). Both keep the one-token path, so batch 1
is a control: its ratio should be 1.0 within noise.

Each batch size decodes ``--new-tokens`` greedy tokens per request from 128-token random prompts,
the two engines interleaved per repetition in alternating order (a noisy neighbour hits both);
the best steady decode rate of each is kept (``bench/engine.py``'s ``decode_tok_s``). Outputs
of the two engines are compared token for token where the path differs only in summation order
(fp32; quantized formats serve bf16 activations in the eager kernels, so their tokens may break
a near-tie either way and are not compared).

Prints progress on stderr, a table, the machine's read and copy bandwidth, and one JSON line:
``{precision}_b{batch}_tok_s`` / ``..._eager_tok_s`` / ``..._ratio``.
"""

from __future__ import annotations

import bench  # noqa: F401  (takes bench/ off sys.path: see bench/__init__.py)

import argparse
import json
import sys
import time
from collections.abc import Sequence

import torch

from bench.engine import Prompts, copy_bandwidth_gb_s, read_bandwidth_gb_s, run_engine
from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.llm_engine import LLMEngine

PROMPT_LEN = 128
QUANT = {"fp32": None, "int8": "int8", "int4": "int4"}


def build(precision: str, rows: int, threads: int | None) -> LLMEngine:
    return LLMEngine(EngineConfig(quantization=QUANT[precision], compile_decode_rows=rows, num_threads=threads,
                                  cache=CacheConfig(memory_gb=0.5, enable_prefix_caching=False),
                                  scheduler=SchedulerConfig(max_num_seqs=64)), progress=False)


def compare(precision: str, batches: Sequence[int], rows: int, new_tokens: int, reps: int,
            threads: int | None, log) -> dict:
    log(f"{precision}: loading two engines (compile_decode_rows {rows} and 1)")
    fast, eager = build(precision, rows, threads), build(precision, 1, threads)
    out: dict = {}
    prompts = Prompts(fast.model_config.vocab_size, seed=1)
    for b in batches:
        log(f"{precision} batch {b}: {reps} interleaved repetitions")
        best = {"fast": 0.0, "eager": 0.0}
        same = True
        for eng in (fast, eager):  # warm-up, same shapes
            run_engine(eng, prompts(b, PROMPT_LEN), 4)
        for rep in range(reps):
            ps = prompts(b, PROMPT_LEN)
            order = (("fast", fast), ("eager", eager)) if rep % 2 == 0 else (("eager", eager), ("fast", fast))
            toks = {}
            for name, eng in order:
                r = run_engine(eng, ps, new_tokens)
                best[name] = max(best[name], r["decode_tok_s"])
                toks[name] = [o.token_ids for o in r["outputs"]]
            same = same and toks["fast"] == toks["eager"]
        key = f"{precision}_b{b}"
        out[f"{key}_tok_s"], out[f"{key}_eager_tok_s"] = best["fast"], best["eager"]
        st = fast.model.single_token
        out[f"{precision}_rows"], out[f"{precision}_kernel"] = st.max_rows, st.kernel
        out[f"{key}_ratio"] = best["fast"] / best["eager"]
        if precision == "fp32":
            out[f"{key}_tokens_identical"] = same
    del fast, eager
    return out


def table(res: dict, precisions: Sequence[str], batches: Sequence[int]) -> str:
    lines = ["decode tok/s: the fast path vs the eager batched forward (same run); "
             + ", ".join(f"{p}: {res[p + '_kernel']} up to {res[p + '_rows']} rows" for p in precisions),
             f"{'precision':<10}{'batch':>6}{'fast':>11}{'eager':>9}{'ratio':>8}"]
    for p in precisions:
        for b in batches:
            k = f"{p}_b{b}"
            lines.append(f"{p:<10}{b:>6}{res[k + '_tok_s']:>11.1f}{res[k + '_eager_tok_s']:>9.1f}"
                         f"{res[k + '_ratio']:>8.2f}")
    lines.append(f"read bandwidth {res['read_bandwidth_gb_s']:.1f} GB/s, copy {res['copy_bandwidth_gb_s']:.1f} GB/s; "
                 f"CPU capability {res['cpu_capability']}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m bench.decode_rows", description=__doc__.split("\n")[0])
    p.add_argument("--precisions", default="fp32,int8,int4", help="comma-separated (default fp32,int8,int4)")
    p.add_argument("--batches", default="1,2,4,8,32", help="comma-separated batch sizes (default 1,2,4,8,32)")
    p.add_argument("--rows", type=int, default=EngineConfig().compile_decode_rows,
                   help="compile_decode_rows of the fast engine (default: the engine's, 32 with the native "
                        "kernels, 4 with the compiled graphs)")
    p.add_argument("--new-tokens", type=int, default=48, help="new tokens per request (default 48)")
    p.add_argument("--reps", type=int, default=3, help="interleaved repetitions per batch size (default 3)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = p.parse_args(argv)
    precisions = [x for x in args.precisions.split(",") if x]
    batches = [int(x) for x in args.batches.split(",") if x]
    for x in precisions:
        if x not in QUANT:
            p.error(f"unknown precision {x!r}; valid: {', '.join(QUANT)}")
    t0 = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t0:6.0f}s] {msg}", file=sys.stderr, flush=True)

    res: dict = {"rows": args.rows, "new_tokens": args.new_tokens, "reps": args.reps,
                 "cpu_capability": torch.backends.cpu.get_cpu_capability()}
    for prec in precisions:
        res.update(compare(prec, batches, args.rows, args.new_tokens, args.reps, args.threads, log))
    res["read_bandwidth_gb_s"], res["copy_bandwidth_gb_s"] = read_bandwidth_gb_s(), copy_bandwidth_gb_s()
    print(table(res, precisions, batches))
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in res.items()}), flush=True)
    return res


if __name__ == "__main__":
    main()
