"""A field load tool at pdserve's OpenAI API, beside pdserve's own benchmark of the same workload.

GuideLLM (the vLLM project's load tool) drives ``/v1/completions`` of one cluster with
synthetic text prompts of ``--prompt-tokens`` tokens and ``--max-tokens`` output tokens
(``ignore_eos``), ``--concurrency`` streams, ``--requests`` requests; pdserve's own loadgen
(bench/loadgen.py) drives the same cluster over gRPC with random-token prompts of the same
length and the same output length, streams and count. Rounds are interleaved (GuideLLM,
pdserve, GuideLLM, ...) so that a noisy neighbour hits both. Each tool reports with its own
definitions (GuideLLM's TTFT and ITL from the SSE stream it parses; ours from gRPC messages);
the table puts them side by side, then one JSON line.

GuideLLM is never a pdserve dependency (it brings its own torch): install it in a venv of its
own and pass its path::

    python -m venv /tmp/gl && /tmp/gl/bin/pip install guidellm==0.8.1
    python -m bench.field_load --guidellm /tmp/gl/bin/guidellm
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from bench.loadgen import make_workload, run, summarize


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.field_load", description=__doc__.split("\n\n")[0])
    p.add_argument("--guidellm", default="guidellm", help="the guidellm executable (default: on PATH)")
    p.add_argument("--requests", type=int, default=32, help="requests per round and tool (default 32)")
    p.add_argument("--concurrency", type=int, default=4, help="concurrent streams (default 4)")
    p.add_argument("--prompt-tokens", type=int, default=128, help="prompt length in tokens (default 128)")
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens per request (default 64)")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds of each tool (default 2)")
    p.add_argument("--config", default=None, help="cluster config (default: built-in)")
    return p


def guidellm_round(exe: str, http_base: str, model: str, tokenizer: Path, args) -> dict:
    """One GuideLLM run; its JSON report's medians and rates."""
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "report.json"
        cmd = [exe, "run",
               "--backend", f"kind=openai_http,target={http_base},model={model},request_format=/v1/completions",
               "--profile", f"kind=concurrent,streams={args.concurrency}",
               "--data", f"kind=synthetic_text,prompt_tokens={args.prompt_tokens},output_tokens={args.max_tokens}",
               "--constraint", f"kind=max_requests,count={args.requests}",
               "--tokenizer", f"kind=huggingface_auto,model={tokenizer}",
               "--output", f"kind=json,path={out}", "--disable-progress"]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        if r.returncode != 0 or not out.is_file():
            raise RuntimeError(f"guidellm failed (rc {r.returncode}): {r.stderr[-2000:] or r.stdout[-2000:]}")
        m = json.loads(out.read_text())["benchmarks"][0]["metrics"]

    def med(key: str, part: str = "successful") -> float:
        return m[key][part]["median"]

    return {"completed": m["request_totals"]["successful"],
            "failed": m["request_totals"]["errored"] + m["request_totals"]["incomplete"],
            "ttft_ms_p50": med("time_to_first_token_ms"), "itl_ms_p50": med("inter_token_latency_ms"),
            "tpot_ms_p50": med("time_per_output_token_ms"),
            "prompt_tokens_p50": med("prompt_token_count"), "output_tokens_p50": med("output_token_count"),
            "request_throughput": m["requests_per_second"]["successful"]["mean"],
            "output_tokens_per_s": m["output_tokens_per_second"]["successful"]["mean"]}


def pdserve_round(server: str, vocab: int, args, seed: int) -> dict:
    """One round of pdserve's own loadgen over gRPC, the same shape of workload."""
    specs = make_workload(args.requests, "random", vocab, seed, str(args.prompt_tokens), str(args.max_tokens))
    results, wall = asyncio.run(run(server, specs, concurrency=args.concurrency, seed=seed))
    s = summarize(results, wall, float("inf"), float("inf"))
    return {"completed": s["completed"], "failed": s["failed"], "ttft_ms_p50": s["ttft_ms_p50"],
            "itl_ms_p50": s["itl_ms_p50"], "tpot_ms_p50": s["tpot_ms_p50"],
            "prompt_tokens_p50": args.prompt_tokens, "output_tokens_p50": args.max_tokens,
            "request_throughput": s["request_throughput"], "output_tokens_per_s": s["output_tokens_per_s"]}


KEYS = ("ttft_ms_p50", "itl_ms_p50", "tpot_ms_p50", "request_throughput", "output_tokens_per_s")


def report(rounds: dict[str, list[dict]], args) -> dict:
    """Print the table (medians over rounds); return the flat JSON fields."""
    flat: dict = {"requests": args.requests, "concurrency": args.concurrency,
                  "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens, "rounds": args.rounds}
    print(f"{'tool':<22}{'done/failed':>12}{'TTFT p50 ms':>13}{'ITL p50 ms':>12}{'TPOT p50 ms':>13}"
          f"{'req/s':>8}{'out tok/s':>11}")
    for tool, rs in rounds.items():
        agg = {k: statistics.median(r[k] for r in rs) for k in KEYS}
        done, failed = sum(r["completed"] for r in rs), sum(r["failed"] for r in rs)
        print(f"{tool:<22}{f'{done}/{failed}':>12}{agg['ttft_ms_p50']:>13.1f}{agg['itl_ms_p50']:>12.1f}"
              f"{agg['tpot_ms_p50']:>13.1f}{agg['request_throughput']:>8.2f}{agg['output_tokens_per_s']:>11.1f}")
        flat.update({f"{tool}_{k}": round(v, 3) for k, v in agg.items()})
        flat.update({f"{tool}_completed": done, f"{tool}_failed": failed})
    return flat


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    exe = shutil.which(args.guidellm) or args.guidellm
    if not Path(exe).is_file():
        print(f"bench.field_load: error: no guidellm at {args.guidellm!r} (install it in its own venv: "
              "see --help)", file=sys.stderr)
        return 2
    # (heavy: gRPC, Ray and a cluster, loaded only by what uses them)
    from router.client import connect
    from pdserve.v1 import pdserve_pb2 as pb
    from router.app import BackgroundCluster, init_ray
    from router.config import load_config

    cfg = load_config(args.config, {"metrics.port": 0})
    init_ray(cfg)
    log(f"starting a {cfg.mode} cluster ...")
    cluster = BackgroundCluster(cfg, http_port=0)
    try:
        server, http_base = f"127.0.0.1:{cluster.port}", f"http://127.0.0.1:{cluster.http_port}"
        info = connect(server).GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
        # (heavy: torch and the engine, loaded only by what uses them)
        from engine.models.loader import resolve_model_path
        tokenizer = resolve_model_path(cfg.model, progress=False)
        model = cluster.router.served_model_name
        rounds: dict[str, list[dict]] = {"guidellm_openai_http": [], "pdserve_grpc": []}
        for i in range(args.rounds):
            log(f"round {i + 1}/{args.rounds}: guidellm at {http_base}/v1/completions ...")
            rounds["guidellm_openai_http"].append(guidellm_round(exe, http_base, model, tokenizer, args))
            log(f"round {i + 1}/{args.rounds}: pdserve loadgen at {server} (gRPC) ...")
            rounds["pdserve_grpc"].append(pdserve_round(server, info.vocab_size, args, seed=i))
    finally:
        cluster.stop()
        # (heavy: Ray and a cluster, loaded only by what uses them)
        import ray
        ray.shutdown()
    print(json.dumps(report(rounds, args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
