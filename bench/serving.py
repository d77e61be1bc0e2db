"""The serving benchmark: ``pdserve bench`` = ``python bench/serving.py`` (load generator: bench/loadgen.py).

N requests through gRPC streaming against a running server (``--server``) or clusters it starts
itself: the config's mode, or with ``--compare`` three on the same cores and workload, one after
the other:

- ``disaggregated``: 1 prefill + 1 decode worker, one thread each;
- ``colocated``: 1 worker, two threads, chunked prefill off (a long prompt is one step that
  stalls every running stream);
- ``colocated-chunked``: the same with chunked prefill (budget ``--chunk``);
- ``disaggregated-local``: as ``disaggregated``, with conditional disaggregation: prompts of at
  most ``--local-prefill-tokens`` are prefilled by the decode worker (``router.local_prefill_tokens``);
- ``adaptive``: two workers that switch roles by load (``mode: adaptive``, ``roles.min_prefill``
  0: one prefill + one decode worker, or two that prefill their own prompts), with the local
  prefill of short prompts and the role controller's defaults;
- ``adaptive-tuned`` (``--modes all`` or by name; a labelled row no key compares): the same with
  faster decisions and the benchmark's SLOs as the controller's targets (bench/modes.py TUNED).

``--modes`` runs a subset of them, in the order given. Every mode gets the same KV memory in
all (``--kv-gb``, split by role: bench/modes.py ``kv_split``); ``--seeds N`` repeats every rate
with N seeds and reports medians with the least and the most (bench/compare.py);
``--datasets mix,phase,shared-prefix`` runs the comparison on each in turn, every key in one
invocation (the prefix comparison for shared-prefix).

TTFT/TPOT/ITL/e2e p50/p90/p99, throughput, goodput under TTFT/TPOT targets. Prints a table (one
column per run) on stdout and, as the last line, one JSON object (flat, but for ``--datasets``'
``by_dataset``); ``--compare`` adds
``p99_tpot_ratio_disagg_vs_colocated`` (with ``adaptive``: ``goodput_ratio_adaptive_vs_best_fixed_<dataset>``,
``p99_tpot_ratio_adaptive_vs_colocated_<dataset>``, ``role_switches``), ``--prefix-compare`` runs the shared-prefix dataset on one
cluster config with prefix-blind and prefix-aware placement (``router.prefix_aware``) and adds
``ttft_p90_ratio_prefix_blind_vs_aware`` (``--prefix-cluster disaggregated``: also
``kv_bytes_ratio_aware_vs_blind``, the KV the decode workers received), ``--ttft-overhead``
adds ``cluster_ttft_overhead_ms_512`` (bench/ttft_overhead.py) and, on a cluster it started,
``openai_http_overhead_ms_512`` (the OpenAI API's TTFT over gRPC's), ``--plot-dir`` writes PNGs (bench/plots.py: latency CDFs, per-token
latency over time, goodput vs rate, an adaptive cluster's roles over time).
"""

from __future__ import annotations

# First: takes bench/ off sys.path, where bench/engine.py would shadow `engine` (bench/__init__.py).
import bench  # noqa: F401

import argparse
import asyncio
import collections
import json
import sys
import time
from collections.abc import Sequence

from bench.compare import adaptive_ratios, goodput_by_seed, is_sweep, per_dataset, spread, summary_table
from bench.loadgen import BenchError, make_workload, run, summarize
from bench.modes import COMPARE, DEFAULT_KV_GB, PREFIX_CLUSTERS, TUNED, cluster_config, prefix_compare

SHORT = {"disaggregated": "disagg", "colocated": "colocated", "colocated-chunked": "chunked",
         "disaggregated-local": "local", "adaptive": "adaptive", "adaptive-tuned": "tuned",
         "prefix-blind": "blind", "prefix-aware": "aware"}


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve bench", description=(
        "Serving benchmark over gRPC streaming: TTFT, TPOT, inter-token and end-to-end latency "
        "(p50/p90/p99), throughput and goodput under TTFT/TPOT targets. Starts its own local "
        "cluster(s) unless --server is given. Last stdout line: one flat JSON object."))
    p.add_argument("--server", help="a running pdserve server host:port (default: start a cluster here)")
    p.add_argument("--tls-ca", default=None, help="--server speaks TLS: the PEM CA that signed its certificate "
                                                 "(a token, if it wants one: $PDSERVE_TOKEN)")
    p.add_argument("--config", default=None, help="cluster config for the cluster it starts (default: built-in)")
    p.add_argument("--model", default=None,
                   help="the model of the clusters it starts: a catalogue name (`pdserve models`; pull it first), "
                        "a .gguf file or an HF folder (default: the config's, else the bundled SmolLM2-135M)")
    p.add_argument("--compare", action="store_true",
                   help="run the workload on disaggregated, colocated and colocated-chunked clusters")
    p.add_argument("--chunk", type=int, default=256, help="token budget of colocated-chunked (default 256)")
    p.add_argument("--modes", default="disaggregated,colocated,colocated-chunked",
                   help=f"--compare: which, in order, of {', '.join([*COMPARE, *TUNED])}, or all (every one; "
                        "default: the first three)")
    p.add_argument("--kv-gb", type=float, default=DEFAULT_KV_GB,
                   help=f"--compare: GiB of KV cache for each mode's workers in all, split by role (default "
                        f"{DEFAULT_KV_GB:g}; 0: each worker its config's own)")
    p.add_argument("--local-prefill-tokens", type=int, default=96,
                   help="disaggregated-local and adaptive: router.local_prefill_tokens (default 96: the mix's chats)")
    p.add_argument("--prefix-compare", action="store_true",
                   help="run the shared-prefix dataset on two colocated workers with prefix-blind, then "
                        "prefix-aware placement (router.prefix_aware), after a warm-up of one request per group")
    p.add_argument("--prefix-cluster", choices=sorted(PREFIX_CLUSTERS), default="colocated",
                   help="--prefix-compare on two colocated workers (default) or on one prefill and two decode "
                        "workers (then also the KV bytes the decode workers received, kv_bytes_mb, and "
                        "kv_bytes_ratio_aware_vs_blind)")
    p.add_argument("--prefix-kv-gb", type=float, default=0.25,
                   help="--prefix-compare: KV cache per worker (default 0.25 GB: ~5,400 tokens of the bundled "
                        "model, about half of the default groups)")
    w = p.add_argument_group("workload")
    w.add_argument("--dataset", default="mix",
                   help="random | mix (short chats + long documents; default) | shared-prefix (system prompts "
                        "shared by groups of requests) | phase (long documents and chats, then chats "
                        "with long answers) | a JSONL file of prompts")
    w.add_argument("--datasets", default=None,
                   help="--compare on each of these in turn, e.g. mix,phase,shared-prefix (shared-prefix: the "
                        "--prefix-compare pair on --prefix-cluster disaggregated, one run): every key of one "
                        "invocation (bench/compare.py per_dataset)")
    w.add_argument("--num-requests", type=int, default=32, help="requests to send (default 32)")
    w.add_argument("--prompt-tokens", default="256", help="random dataset: N or LO:HI (default 256)")
    w.add_argument("--max-tokens", default="64", help="random/file datasets: N or LO:HI (default 64)")
    w.add_argument("--long-share", type=float, default=0.2, help="mix: share of long documents (default 0.2)")
    w.add_argument("--long-tokens", type=int, default=1536, help="mix: long document length (default 1536)")
    w.add_argument("--prefix-groups", type=int, default=6, help="shared-prefix: system prompts (default 6)")
    w.add_argument("--prefix-tokens", type=int, default=1536, help="shared-prefix: system prompt length (default 1536)")
    w.add_argument("--phase-answer-tokens", default="128:256",
                   help="phase: new tokens of the second half's chat turns, N or LO:HI (default 128:256); "
                        "longer answers at the same rate keep more streams decoding at once")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--seeds", type=int, default=1,
                   help="run every rate with this many seeds (--seed, +100, +200, ...: other arrivals and prompts "
                        "of the same kind); figures: the median over them, least and most beside (default 1)")
    w.add_argument("--warmup", type=int, default=4,
                   help="requests sent to each cluster before the measured runs, not counted (default 4; 0: none)")
    a = p.add_argument_group("arrivals (one of)")
    a.add_argument("--rate", type=float, help="open loop: Poisson arrivals at this many requests/s")
    a.add_argument("--rates", help="open loop sweep, e.g. 0.5,1,2: goodput vs rate")
    a.add_argument("--concurrency", type=int, help="closed loop: requests in flight (default 4)")
    a.add_argument("--duration", type=float, default=300.0,
                   help="stop issuing requests after this many s (default 300)")
    s = p.add_argument_group("targets")
    s.add_argument("--ttft-slo-ms", type=float, default=3000.0, help="TTFT target (default 3000 ms)")
    s.add_argument("--tpot-slo-ms", type=float, default=150.0, help="TPOT target (default 150 ms)")
    s.add_argument("--ttft-slo-long-ms", type=float, default=None,
                   help="TTFT target of the long documents (mix, phase: kind 'long'), as DistServe sets one per "
                        "application (a summary is not held to a chat's first token) (default: --ttft-slo-ms)")
    p.add_argument("--plot-dir", help="write PNG plots here (needs matplotlib: pip install 'pdserve[bench]')")
    p.add_argument("--ttft-overhead", action="store_true",
                   help="also measure the cluster's TTFT overhead over the in-process engine, 512 tokens, and "
                        "(on a cluster it starts) the OpenAI HTTP API's over gRPC")
    return p


def _rates(args) -> list[float | None]:
    given = sum(x is not None for x in (args.rate, args.rates, args.concurrency))
    if given > 1:
        raise BenchError("give at most one of --rate, --rates and --concurrency")
    if args.rates:
        try:
            rates = [float(x) for x in args.rates.split(",")]
        except ValueError:
            raise BenchError(f"--rates: expected numbers separated by commas, got {args.rates!r}") from None
        for r in rates:
            if not r > 0:
                raise BenchError(f"the request rate must be > 0, got {r}")
        return rates
    if args.rate is not None and not args.rate > 0:
        raise BenchError(f"the request rate must be > 0, got {args.rate}")
    return [args.rate]


def _plan(args) -> list[tuple[int, float | None, int]]:
    """The runs on one cluster, in order: (the rate's index, the rate, the seed) for every seed
    (``--seed``, +100, +200, ...) and, within it, every rate."""
    if args.seeds < 1:
        raise BenchError(f"--seeds must be >= 1, got {args.seeds}")
    return [(k, rate, args.seed + 100 * i) for i in range(args.seeds) for k, rate in enumerate(_rates(args))]


def _bar(total: int, desc: str):
    # (optional: tqdm comes with transformers, not a dependency of ours)
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, unit="req", file=sys.stderr, leave=False)


def bench_server(server: str, args, vocab: int, kv_bytes=None) -> dict:
    """Every rate of the run against one server: summaries and raw results; with ``kv_bytes``
    (a callable: (KV bytes the decode workers received, prompt tokens they already held and
    were not sent) so far), the MB each run moved and its decode-side prefix hit rate."""
    runs = []
    plan = _plan(args)
    if args.warmup:
        # Not counted: a fresh cluster's first requests are slow (the first took 10-15 s on the
        # 2-core machine in every mode). Other prompts than the measured ones (another seed): no
        # prefix of theirs is warmed.
        warm = workload(args, vocab, n=args.warmup, seed=args.seed + 1)
        asyncio.run(run(server, warm, concurrency=2, seed=args.seed + 1))
    for k, rate, seed in plan:
        specs = workload(args, vocab, k, seed=seed)
        conc = None if rate is not None else (args.concurrency or 4)
        if args.dataset == "shared-prefix" and args.prefix_compare:
            # Warm-up, not counted: each system prompt once, one at a time, so both placements
            # start from caches that hold every group somewhere (steady state, not cold start).
            asyncio.run(run(server, specs[:args.prefix_groups], concurrency=1, seed=args.seed))
        before = kv_bytes() if kv_bytes else (0, 0)
        started = time.time()
        with _bar(len(specs), f"{'rate %g/s' % rate if rate else 'concurrency %d' % conc}") as bar:
            results, wall = asyncio.run(run(server, specs, rate=rate, concurrency=conc, duration_s=args.duration,
                                            seed=seed, progress=lambda d, t: bar.update(1)))
        slo = (args.ttft_slo_ms / 1e3, args.tpot_slo_ms / 1e3)
        by_kind = {"long": args.ttft_slo_long_ms / 1e3} if args.ttft_slo_long_ms is not None else None
        kinds = sorted({r.spec.kind for r in results})
        summary = {"all": summarize(results, wall, *slo, ttft_slo_by_kind=by_kind)}
        if kv_bytes:
            # (a decode worker restarted meanwhile counts from 0 again: never below 0)
            (b1, t1), (b0, t0) = kv_bytes(), before
            summary["all"]["kv_bytes_mb"] = max(0, b1 - b0) / 1e6
            # The share of the prompts' tokens whose KV was not sent: the bytes sent are
            # (1 - this) of what a transfer of whole prompts would be.
            sent_for = sum(len(r.spec.token_ids) for r in results if r.error is None)
            summary["all"]["decode_prefix_hit_rate"] = (t1 - t0) / sent_for if sent_for else None
        if len(kinds) > 1:
            summary.update({k: summarize(results, wall, *slo, kind=k, ttft_slo_by_kind=by_kind) for k in kinds})
        for (code, detail), n in collections.Counter((r.error, r.detail) for r in results if r.error).most_common(5):
            log(f"{n} request(s) failed: {code}: {detail}")
        runs.append({"rate": rate, "seed": seed, "summary": summary, "results": results, "started": started})
    # (a sweep's goodput, the median over its seeds; one rate or a closed loop: none)
    best = spread(goodput_by_seed(runs).values())[0] if is_sweep(runs) else 0.0
    return {"runs": runs, "max_goodput_rate": best}


def workload(args, vocab: int, run: int = 0, n: int | None = None, seed: int | None = None):
    """The requests of a sweep's ``run``-th rate: the same for every mode at that rate; at
    every rate the same shape (kinds, lengths, answers) with other tokens. With the same
    prompts, every rate after the first found them all in the prefix cache (hit rate 0.97 on
    the mix) and measured a warm cache against the first rate's cold one. (A JSONL file's
    prompts are what they are: they repeat.) ``n`` and ``seed``: other than the arguments'
    (the warm-up's)."""
    return make_workload(args.num_requests if n is None else n, args.dataset, vocab,
                         args.seed if seed is None else seed, args.prompt_tokens, args.max_tokens, args.long_share,
                         args.long_tokens, args.prefix_groups, args.prefix_tokens, token_seed=run,
                         phase_answer_tokens=args.phase_answer_tokens)


def start_local(cfg):
    # (heavy: Ray and a cluster, loaded only by what uses them)
    from router.app import BackgroundCluster
    cluster = BackgroundCluster(cfg)
    return cluster, f"127.0.0.1:{cluster.port}"


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        out = per_dataset(args, _main) if args.datasets else _main(args)
    except BenchError as e:
        print(f"pdserve bench: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(out))
    return 0


def _compare_modes(args) -> dict[str, dict]:
    every = {**COMPARE, **TUNED}
    names = list(every) if args.modes == "all" else [m for m in args.modes.split(",") if m]
    for m in names:
        if m not in every:
            raise BenchError(f"--modes: unknown mode {m!r}; valid: {', '.join(every)}")
    if not names:
        raise BenchError("--modes: give at least one mode")
    return {m: every[m] for m in names}


def _main(args) -> dict:
    # (heavy: gRPC, Ray and a cluster, loaded only by what uses them)
    from router.client import connect
    from router.config import load_config
    _plan(args)  # refuse nonsense before starting anything
    if args.prefix_compare:
        if args.compare:
            raise BenchError("give --compare or --prefix-compare, not both")
        args.dataset = "shared-prefix"
    workload(args, 1000)
    if args.server and args.model:
        raise BenchError("--model picks the model of the clusters this starts: drop it with --server")
    if args.server and (args.compare or args.prefix_compare):
        raise BenchError("--compare and --prefix-compare start their own clusters: drop --server")
    out: dict = {}
    results: dict[str, dict] = {}
    modes = _compare_modes(args) if args.compare else prefix_compare(args.prefix_cluster) if args.prefix_compare \
        else {}
    names = list(modes) or [None]
    started = False
    for name in names:
        cluster = None
        server = args.server
        cfg = cluster_config(name, modes.get(name, {}), args)
        if server is None:
            # (heavy: Ray and a cluster, loaded only by what uses them)
            from router.app import init_ray
            if not started:
                init_ray(cfg if name is None or args.prefix_compare
                         else load_config(args.config, {"prefill.replicas": 1, "decode.replicas": 1}))
                started = True
            log(f"starting a {name or cfg.mode} cluster ...")
            cluster, server = start_local(cfg)
        try:
            # (heavy: gRPC, loaded only by what uses them)
            from pdserve.v1 import pdserve_pb2 as pb
            stub = connect(server, tls_ca=args.tls_ca if args.server else None)
            try:
                info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
            except Exception:
                raise BenchError(f"cannot reach a pdserve server at {server}") from None
            label = name or stub.GetClusterStatus(pb.GetClusterStatusRequest()).mode
            log(f"{label}: {info.model}, {args.num_requests} requests of dataset {args.dataset}")
            results[label] = bench_server(server, args, info.vocab_size,
                                          _kv_bytes(cluster) if args.prefix_compare and cluster is not None
                                          and cfg.mode != "colocated" else None)
            if cluster is not None and cluster.router.roles_controller is not None:
                results[label]["role_switches"] = list(cluster.router.roles_controller.switches)
                results[label]["roles_trace"] = list(cluster.router.roles_controller.trace)
            if args.ttft_overhead:
                # (heavy: torch and the engine, loaded only by what uses them)
                from bench.ttft_overhead import http_overhead, ttft_overhead
                out.update(ttft_overhead(stub, cfg, info.vocab_size, log))
                if cluster is not None and cluster.http_port:
                    out.update(http_overhead(stub, f"http://127.0.0.1:{cluster.http_port}/v1", info.vocab_size, log))
        finally:
            if cluster is not None:
                cluster.stop()
    if started:
        # (heavy: Ray and a cluster, loaded only by what uses them)
        import ray
        ray.shutdown()
    out.update(_report(results, args))
    if args.plot_dir:
        # (optional: matplotlib, the `bench` extra)
        from bench.plots import plot_all
        for path in plot_all(results, args.plot_dir):
            log(f"wrote {path}")
    return out


def _kv_bytes(cluster):
    """(KV bytes the cluster's decode workers have received, prompt tokens the router was told
    they held and so were not sent): the first from their latest status reports (every
    transfer of a finished request is complete, so it is counted once the worker reports again:
    waits for one heartbeat), the second from ``pdserve_router_decode_prefix_tokens``."""
    def total() -> tuple[int, float]:
        time.sleep(2.0)  # (a report follows every step and at least every heartbeat)
        received = sum(w.status.kv_transfer.bytes for w in list(cluster.router.pools.workers.values())
                       if w.role == "decode" and w.status is not None and w.status.kv_transfer is not None)
        held = cluster.router.metrics.registry.get_sample_value("pdserve_router_decode_prefix_tokens_total")
        return received, held or 0.0
    return total


def _report(results: dict[str, dict], args) -> dict:
    """Print the table; return the flat JSON fields."""
    flat: dict = {"dataset": args.dataset, "num_requests": args.num_requests,
                  "ttft_slo_ms": args.ttft_slo_ms, "tpot_slo_ms": args.tpot_slo_ms,
                  "ttft_slo_long_ms": args.ttft_slo_long_ms if args.ttft_slo_long_ms is not None else args.ttft_slo_ms}
    rows: dict[str, dict[str, object]] = {}
    for label, res in results.items():
        for run_ in res["runs"]:
            col = label if len(res["runs"]) == 1 else label + (f"@{run_['rate']:g}/s" if run_["rate"] else "") + (
                f"#{run_['seed']}" if args.seeds > 1 else "")
            for kind, summ in run_["summary"].items():
                for k, v in summ.items():
                    key = k if kind == "all" else f"{k}_{kind}"
                    rows.setdefault(key, {})[col] = v
                    if len(res["runs"]) == 1:
                        flat[f"{SHORT.get(label, label)}_{key}" if len(results) > 1 else key] = v
        if res["max_goodput_rate"]:
            flat[f"{SHORT.get(label, label)}_max_goodput_rate"] = res["max_goodput_rate"]
    cols = list(next(iter(rows.values())).keys()) if rows else []
    print(f"{'metric':<28}" + "".join(f"{c:>20}" for c in cols))
    for key, vals in rows.items():
        cells = [vals.get(c) for c in cols]
        print(f"{key:<28}" + "".join(f"{'-':>20}" if v is None else f"{v:>20.2f}" if isinstance(v, float)
                                     else f"{' ' + str(v):>20}" for v in cells))  # (a space before a long text)
    if "disaggregated" in results and "colocated" in results:
        kind = "_chat" if "disagg_tpot_ms_p99_chat" in flat else ""
        d, c = flat.get(f"disagg_tpot_ms_p99{kind}"), flat.get(f"colocated_tpot_ms_p99{kind}")
        if d and c:
            flat["p99_tpot_ratio_disagg_vs_colocated"] = d / c
            print(f"\np99 TPOT{kind.replace('_', ' of ')}: disaggregated / colocated = {d / c:.2f}")
        ch = flat.get(f"chunked_tpot_ms_p99{kind}")
        if d and ch:
            flat["p99_tpot_ratio_disagg_vs_chunked"] = d / ch
    if "prefix-blind" in results and "prefix-aware" in results:
        b, a = flat.get("blind_ttft_ms_p90"), flat.get("aware_ttft_ms_p90")
        if b and a:
            flat["ttft_p90_ratio_prefix_blind_vs_aware"] = b / a
            print(f"\nTTFT p90, shared prefixes: prefix-blind / prefix-aware = {b / a:.2f}")
        b, a = flat.get("blind_kv_bytes_mb"), flat.get("aware_kv_bytes_mb")
        if b and a is not None:
            flat["kv_bytes_ratio_aware_vs_blind"] = a / b
            print(f"KV bytes received by decode workers: prefix-aware / prefix-blind = {a / b:.2f}")
            hb, ha = flat.get("blind_decode_prefix_hit_rate"), flat.get("aware_decode_prefix_hit_rate")
            if hb is not None and ha is not None and hb < 1:
                # What the decode-side hits alone predict, (1 - aware's) / (1 - blind's): the
                # bytes shrink by the hit fraction when this matches the measured ratio.
                flat["kv_bytes_ratio_expected_from_hits"] = (1 - ha) / (1 - hb)
                print(f"  decode-side prefix hits {hb:.0%} blind, {ha:.0%} aware: expected ratio "
                      f"{(1 - ha) / (1 - hb):.2f}")
    if args.compare and (args.seeds > 1 or args.rates):
        flat.update(summary_table(results))
        if args.seeds > 1 and not args.rates:
            # (the per-mode keys and their ratios below are one run's: with seeds there are several)
            print("\n(--seeds with one rate: the per-mode figures are in the table above and the runs' "
                  "columns; the one-run keys and ratios are not given)")
    if "adaptive" in results or "adaptive-tuned" in results:
        adaptive_ratios(results, flat, args.dataset)
        _roles_log(results, flat)
    if "disaggregated-local" in results:
        kind = "_chat" if "local_tpot_ms_p99_chat" in flat else ""
        d, lo = flat.get("disagg_ttft_ms_p90"), flat.get("local_ttft_ms_p90")
        if d and lo:
            flat["ttft_p90_ratio_disagg_vs_local"] = d / lo
            print(f"\nTTFT p90: disaggregated / with local prefill of short prompts = {d / lo:.2f}")
        c, lt = flat.get(f"colocated_tpot_ms_p99{kind}"), flat.get(f"local_tpot_ms_p99{kind}")
        if c and lt:
            flat["p99_tpot_ratio_local_vs_colocated"] = lt / c
    return flat


def _roles_log(results: dict[str, dict], flat: dict) -> None:
    """The adaptive cluster's roles over time, its switches with their reasons and its decisions."""
    if "adaptive" not in results:
        return
    if "role_switches" in results["adaptive"] and "started" in results["adaptive"]["runs"][0]:
        # (optional: matplotlib, the `bench` extra)
        from bench.plots import roles_over_time
        # [seconds since the first measured request, prefill workers from then on]
        t0, pts = roles_over_time(results["adaptive"])
        flat["adaptive_prefill_workers_over_time"] = [[round(t, 1), n] for t, n in pts]
        # [seconds since the first measured request, from, to, why] of each switch
        flat["adaptive_role_switch_log"] = [[round(at - t0, 1), old, new, why]
                                            for at, _, old, new, why in results["adaptive"]["role_switches"]]
        # Each decision over the measured span: [s since the first request, prompt tokens queued
        # anywhere, TTFT p90 (ms), decode KV utilization, decode TPOT p90 (ms), "from->to" the
        # snapshots wanted or None]: which signal held a switch back
        ms = lambda s: None if s is None else round(s * 1e3)  # noqa: E731
        flat["adaptive_roles_trace"] = [
            [round(at - t0, 1), p.queued_prompt_tokens, ms(p.ttft_p90_s), round(d.kv_utilization, 3), ms(d.tpot_p90_s),
             "->".join(want) if want else None]
            for at, p, d, want in results["adaptive"].get("roles_trace", []) if 0 <= at - t0 <= pts[-1][0]]


if __name__ == "__main__":
    sys.exit(main())

