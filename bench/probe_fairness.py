"""``bench/probe.py --fairness``: two tokens at 3:1 weights (one priority class) under
overload, each one's generated tokens per second and their ratio (issue 42: 3:1 +-15%)."""

from __future__ import annotations

# First: takes bench/ off sys.path, where bench/engine.py would shadow `engine` (bench/__init__.py).
import bench  # noqa: F401

import argparse
import asyncio
import collections
import contextlib
import json
import time
from dataclasses import dataclass

from bench.probe_wire import PROMPT, Target, aim, log

@dataclass
class Fairness:
    """``--fairness``: both tokens in one priority class at ``weights`` (greedy, victim), each
    keeping ``outstanding`` gRPC streams of ``max_tokens`` (EOS ignored) in flight, far more than
    a KV cache of ``kv_cache_gb`` holds at once (the server it starts), so both always wait in the
    router's placement queue, where admission's fair share (router.admission) decides. Tokens are
    counted as they arrive, in the ``duration_s`` after ``warmup_s``."""

    weights: tuple[float, float] = (3.0, 1.0)
    outstanding: int = 12
    max_tokens: int = 32
    kv_cache_gb: float = 0.02  # SmolLM2-135M, fp32: ~29 blocks of 16 tokens, ~9 requests of 38 tokens at once
    warmup_s: float = 5.0
    duration_s: float = 30.0

    def policy(self) -> str:
        return f"tokens:\n  greedy: {{weight: {self.weights[0]:g}}}\n  victim: {{weight: {self.weights[1]:g}}}\n"


async def fairness(t: Target, f: Fairness) -> dict:
    """Each token's generated tokens per second while both overload the server; flat summary."""
    # (heavy: gRPC, loaded only by what uses them)
    import grpc

    # (heavy: gRPC, loaded only by what uses them)
    from router.client import make_request
    from pdserve.v1 import pdserve_pb2_grpc as pb_grpc
    names = {"greedy": t.greedy, "victim": t.victim}
    tokens = collections.Counter()
    done = collections.Counter()
    errors = collections.Counter()
    t0 = time.monotonic()
    start, end = t0 + f.warmup_s, t0 + f.warmup_s + f.duration_s

    async def client(stub, name: str) -> None:
        meta = (("authorization", f"Bearer {names[name]}"),)
        while time.monotonic() < end:
            try:
                async for r in stub.Generate(make_request(PROMPT, max_tokens=f.max_tokens, ignore_eos=True),
                                             metadata=meta, timeout=120):
                    if start <= time.monotonic() < end:
                        tokens[name] += len(r.token_ids)
                if start <= time.monotonic() < end:
                    done[name] += 1
            except grpc.aio.AioRpcError as e:
                errors[f"{name} {e.code().name}"] += 1
                await asyncio.sleep(1.0)  # (the retry hint of a full queue or a queue timeout)

    log(f"fairness: greedy and victim at weights {f.weights[0]:g}:{f.weights[1]:g}, {f.outstanding} streams "
        f"each of {f.max_tokens} tokens, {f.warmup_s:g} s warm-up, {f.duration_s:g} s measured ...")
    async with grpc.aio.insecure_channel(t.grpc) as ch:
        stub = pb_grpc.GenerationStub(ch)
        tasks = [asyncio.create_task(client(stub, name)) for name in names for _ in range(f.outstanding)]
        await asyncio.sleep(end - time.monotonic())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    rate = {name: tokens[name] / f.duration_s for name in names}
    expected = f.weights[0] / f.weights[1]
    ratio = rate["greedy"] / rate["victim"] if rate["victim"] else None
    summary = {"fairness_weights": list(f.weights), "fairness_throughput_ratio": ratio,
               "fairness_expected_ratio": expected,
               "fairness_within_15pct": ratio is not None and abs(ratio / expected - 1) <= 0.15,
               "fairness_duration_s": f.duration_s, "fairness_outstanding": f.outstanding,
               "fairness_max_tokens": f.max_tokens}
    for name in names:
        summary[f"fairness_tokens_per_s_{name}"] = rate[name]
        summary[f"fairness_requests_{name}"] = done[name]
    for k, n in errors.items():
        summary[f"fairness_errors.{k.replace(' ', '_')}"] = n
    return summary


def fairness_table(s: dict) -> str:
    w = s["fairness_weights"]
    r = s["fairness_throughput_ratio"]
    head = ("weights (greedy:victim)", "greedy tok/s", "victim tok/s", "ratio", "expected", "within 15%")
    row = (f"{w[0]:g}:{w[1]:g}", f"{s['fairness_tokens_per_s_greedy']:.1f}", f"{s['fairness_tokens_per_s_victim']:.1f}",
           "-" if r is None else f"{r:.2f}", f"{s['fairness_expected_ratio']:.2f}", str(s["fairness_within_15pct"]))
    return "\n".join("  ".join(f"{c:>{len(h)}}" for c, h in zip(line, head)) for line in (head, row))


def main(args: argparse.Namespace) -> int:
    """``bench/probe.py --fairness``: two tokens at ``--weights`` under overload; exit 1 beyond 15%."""
    gw, vw = (float(x) for x in args.weights.split(":"))
    f = Fairness((gw, vw), args.outstanding, args.fair_max_tokens, args.kv_cache_gb, args.warmup_s, args.duration_s)
    with contextlib.ExitStack() as stack:
        t = aim(args, stack, ["mode=colocated", "decode.compile_decode=false", f"decode.kv_cache_gb={f.kv_cache_gb}"],
                policy_yaml=f.policy(), need_http=False)
        if t is None:
            return 2
        summary = asyncio.run(fairness(t, f))
    print(fairness_table(summary))
    print(json.dumps(summary))
    return 0 if summary["fairness_within_15pct"] else 1
