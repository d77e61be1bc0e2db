"""Autoscaling benchmark: replay a load trace with a step change, with and without autoscaling.

The trace (open loop, Poisson arrivals): ``--base-rate`` of short chats for ``--before`` s,
then a step to ``--step-rate`` requests/s of long prompts (``--long-tokens``, short answers:
prefill pressure) for ``--during`` s, then the base load again for ``--after`` s. Each run
starts its own local cluster (1 prefill + 1 decode worker; the autoscaled run may grow each
pool to ``--max-replicas``). It samples pool sizes every 0.5 s and prints, per run, TTFT and
TPOT p50/p90 before/during/after the step and the time from the step until the TTFT p90 of
requests sent in a sliding window is back under ``--ttft-slo-ms`` (the recovery time).
``--plot FILE`` writes a PNG of pool sizes, TTFT and TPOT over time, both runs.
The last stdout line is one flat JSON object.
"""

from __future__ import annotations

# First: takes bench/ off sys.path, where bench/engine.py would shadow `engine` (bench/__init__.py).
import bench  # noqa: F401

import argparse
import asyncio
import json
import random
import sys
import threading
import time

from bench.loadgen import RequestSpec, percentile, run


def log(msg: str) -> None:
    print(f"[autoscale-bench] {msg}", file=sys.stderr, flush=True)


def trace(args, vocab: int) -> list[tuple[float, float, list[RequestSpec]]]:
    """Phases as (start offset s, rate, specs)."""
    rng = random.Random(args.seed)

    def chats(n):
        return [RequestSpec("chat", rng.randint(32, 64), tuple(rng.randrange(100, vocab) for _ in range(rng.randint(24, 64))))
                for _ in range(n)]

    def longs(n):
        return [RequestSpec("long", 8, tuple(rng.randrange(100, vocab) for _ in range(args.long_tokens)))
                for _ in range(n)]
    b, s = args.base_rate, args.step_rate
    return [(0.0, b, chats(int(b * args.before) + 4)),
            (args.before, s, longs(int(s * args.during) + 4)),
            (args.before + args.during, b, chats(int(b * args.after) + 4))]


def one_run(args, autoscale: bool, vocab: int) -> dict:
    # (heavy: Ray and a cluster, loaded only by what uses them)
    from router.app import BackgroundCluster
    from router.config import load_config
    over = {"metrics.port": 0, "prefill.kv_cache_gb": 0.2, "decode.kv_cache_gb": 0.3}
    if autoscale:
        over.update({"autoscale.enabled": True, "autoscale.interval_s": 0.5, "autoscale.window_s": 10.0,
                     "autoscale.prefill.max_replicas": args.max_replicas, "autoscale.decode.max_replicas":
                     args.max_replicas, "autoscale.prefill.up_delay_s": 2.0, "autoscale.prefill.down_delay_s": 10.0,
                     "autoscale.decode.up_delay_s": 2.0, "autoscale.decode.down_delay_s": 10.0,
                     "autoscale.prefill.target_ttft_ms": args.ttft_slo_ms,
                     "autoscale.decode.target_tpot_ms": args.tpot_slo_ms})
    cluster = BackgroundCluster(load_config(None, over))
    server = f"127.0.0.1:{cluster.port}"
    sizes: list[tuple[float, int, int]] = []
    stop = threading.Event()
    t0 = time.perf_counter()

    def sample() -> None:
        while not stop.is_set():
            ws = list(cluster.router.pools.workers.values())
            sizes.append((time.perf_counter() - t0, sum(w.role == "prefill" and w.state in ("ready", "starting")
                                                         for w in ws),
                          sum(w.role == "decode" and w.state in ("ready", "starting") for w in ws)))
            time.sleep(0.5)
    threading.Thread(target=sample, daemon=True).start()

    async def phases():
        tasks = []
        for offset, rate, specs in trace(args, vocab):
            await asyncio.sleep(max(0.0, t0 + offset - time.perf_counter()))
            dur = {0.0: args.before}.get(offset, args.during if rate == args.step_rate else args.after)
            tasks.append(asyncio.create_task(run(server, specs, rate=rate, duration_s=dur, seed=args.seed)))
        return await asyncio.gather(*tasks)
    try:
        out = asyncio.run(phases())
        if autoscale:  # let it shrink back, for the plot
            time.sleep(15)
    finally:
        stop.set()
        events = list(cluster.router.autoscaler.events) if autoscale else []
        cluster.stop()
    results = [r for rs, _ in out for r in rs]
    return {"results": results, "sizes": sizes, "t0": t0, "events": events}


def summarize(run_: dict, args) -> dict:
    t0, step, end = run_["t0"], args.before, args.before + args.during
    res = [r for r in run_["results"] if r.error is None]
    out: dict = {"requests": len(run_["results"]), "failed": len(run_["results"]) - len(res),
                 "max_prefill_workers": max((s[1] for s in run_["sizes"]), default=0),
                 "max_decode_workers": max((s[2] for s in run_["sizes"]), default=0)}
    for name, lo, hi in (("before", 0, step), ("during", step, end), ("after", end, 1e9)):
        ph = [r for r in res if lo <= r.sent - t0 < hi]
        for m in ("ttft", "tpot"):
            xs = [getattr(r, m) for r in ph if getattr(r, m) is not None]
            for q in (50, 90):
                v = percentile(xs, q)
                out[f"{m}_ms_p{q}_{name}"] = None if v is None else v * 1e3
    # Recovery: from the step, the first time the TTFT p90 of requests sent in the next 5 s
    # window is under target, and it stays so for every later window.
    windows = []
    t = step
    while t < end + args.after:
        xs = [r.ttft for r in res if t <= r.sent - t0 < t + 5 and r.ttft is not None]
        windows.append((t, percentile(xs, 90) if xs else None))
        t += 1.0
    ok_from = None
    for t, p90 in windows:
        good = p90 is None or p90 * 1e3 <= args.ttft_slo_ms
        ok_from = (ok_from if ok_from is not None else t) if good else None
    out["recovery_s"] = None if ok_from is None else ok_from - step
    return out


def plot(runs: dict[str, dict], args, path: str) -> None:
    # (optional: matplotlib, the `bench` extra)
    import matplotlib
    matplotlib.use("Agg")
    # (optional: matplotlib, the `bench` extra)
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(3, 1, figsize=(11, 9), sharex=True)
    for label, r in runs.items():
        ts = [s[0] for s in r["sizes"]]
        axes[0].step(ts, [s[1] for s in r["sizes"]], where="post", label=f"{label}: prefill")
        axes[0].step(ts, [s[2] for s in r["sizes"]], where="post", linestyle="--", label=f"{label}: decode")
        ok = [x for x in r["results"] if x.error is None]
        axes[1].plot([x.sent - r["t0"] for x in ok if x.ttft], [x.ttft * 1e3 for x in ok if x.ttft], ".", label=label)
        axes[2].plot([x.sent - r["t0"] for x in ok if x.tpot], [x.tpot * 1e3 for x in ok if x.tpot], ".", label=label)
    for ax, name in zip(axes, ("workers", "TTFT (ms)", "TPOT (ms)")):
        ax.axvspan(args.before, args.before + args.during, color="orange", alpha=0.1)
        ax.set_ylabel(name)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    axes[1].axhline(args.ttft_slo_ms, color="red", linewidth=0.8)
    axes[1].set_yscale("log")
    axes[2].set_yscale("log")
    axes[2].set_xlabel("time (s); shaded: the step in load")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-rate", type=float, default=0.5)
    p.add_argument("--step-rate", type=float, default=1.0)
    p.add_argument("--long-tokens", type=int, default=768)
    p.add_argument("--before", type=float, default=20.0)
    p.add_argument("--during", type=float, default=40.0)
    p.add_argument("--after", type=float, default=20.0)
    p.add_argument("--max-replicas", type=int, default=2)
    p.add_argument("--ttft-slo-ms", type=float, default=3000.0)
    p.add_argument("--tpot-slo-ms", type=float, default=300.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", help="PNG path")
    args = p.parse_args()
    if min(args.base_rate, args.step_rate) <= 0:
        p.error("rates must be > 0")
    # (heavy: Ray and a cluster, loaded only by what uses them)
    from router.app import init_ray
    from router.config import load_config
    init_ray(load_config(None, {"prefill.replicas": args.max_replicas, "decode.replicas": args.max_replicas}))
    runs = {}
    for label, auto in (("static", False), ("autoscaled", True)):
        log(f"{label} run: {args.before:g} s at {args.base_rate:g}/s, {args.during:g} s at {args.step_rate:g}/s of "
            f"{args.long_tokens}-token prompts, {args.after:g} s at {args.base_rate:g}/s ...")
        runs[label] = one_run(args, auto, 49152)
    # (heavy: Ray and a cluster, loaded only by what uses them)
    import ray
    ray.shutdown()
    flat: dict = {}
    print(f"{'metric':<26}{'static':>14}{'autoscaled':>14}")
    sums = {k: summarize(v, args) for k, v in runs.items()}
    for key in sums["static"]:
        a, b = sums["static"][key], sums["autoscaled"][key]
        print(f"{key:<26}" + "".join(f"{'-':>14}" if v is None else f"{v:>14.1f}" if isinstance(v, float)
                                     else f"{v!s:>14}" for v in (a, b)))
        flat[f"static_{key}"], flat[f"autoscaled_{key}"] = a, b
    for e in runs["autoscaled"]["events"]:
        log(f"  {e}")
    if args.plot:
        plot(runs, args, args.plot)
        log(f"wrote {args.plot}")
    print(json.dumps(flat))
    return 0


if __name__ == "__main__":
    sys.exit(main())
