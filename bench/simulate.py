"""Cluster simulator: the router's real placement and role policies over simulated workers.

    python -m bench.simulate profile --model smollm2-135m      # measure this machine's engine
    python -m bench.simulate run --workers 16 --workload mix --rate 0.2
    python -m bench.simulate run --workers 4,16,64 --goodput    # DistServe goodput per mode and split
    pdserve plan --model smollm2-135m --workload agentic --ttft-slo 5 --tpot-slo 0.25
    python -m bench.simulate --validate                         # against the real cluster, same arrivals

``run`` simulates every mode (``--modes``) and P:D split (``--splits``) on the same arrivals,
prints a table and one JSON line. Rates are per worker (req/s), so 4, 16 and 64 workers see the
same load each. Every mode has the same KV per worker (the cost model's) and the router's
default controller settings (router/config.py); disaggregated-local and adaptive prefill
prompts of up to ``--local-prefill-tokens`` on the decode worker.

``--validate`` runs the real local cluster (each mode of bench/serving.py) and the simulator on
the same requests and arrival times for each load (mix, phase, shared-prefix), and prints the
TTFT and TPOT p50/p90 of both with their relative errors, and one JSON line with
``sim_vs_real_max_rel_error`` (bench/sim/validate.py).

The pieces (bench/sim/): ``costs`` (the cost model and its JSON), ``profile`` (measures it),
``traces`` (workloads), ``workers`` (simulated engines), ``policy`` (calls into router/),
``cluster`` (the event loop), ``report`` (percentiles, goodput, tables), ``fidelity`` and
``validate`` (the comparison with the real cluster).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from bench.sim.cluster import MODES, Cluster, ClusterSpec
from bench.sim.costs import CostModel, cached_path, load
from bench.sim.report import Timer, goodput, summarize, table
from bench.sim.traces import SLO, WORKLOADS, make_trace
from bench.sim.validate import add_args as add_validate_args
from bench.sim.validate import cmd_validate
from router.autoscale import DecodeTargets, PrefillTargets

ROOT = Path(__file__).resolve().parents[1]


def cost_path(model: str) -> Path:
    """The cost model for ``model``: this machine's profile if there is one, else the committed
    example (docs/bench/)."""
    mine = cached_path(model)
    return mine if mine.is_file() else ROOT / "docs" / "bench" / f"sim_cost_{model}.json"


def splits_for(n: int, which: str) -> list[int]:
    """Prefill-worker counts to try: ``all`` (1..n-1), or a spread of ratios (``grid``), or
    a comma list."""
    if n < 2:
        return []
    if which == "all":
        return list(range(1, n))
    if which == "grid":
        return sorted({min(n - 1, max(1, round(n * f))) for f in (1 / 8, 1 / 4, 3 / 8, 1 / 2, 5 / 8, 3 / 4)})
    return sorted({int(x) for x in which.split(",") if 0 < int(x) < n})


def configs(n: int, modes: list[str], splits: str) -> list[ClusterSpec]:
    out = []
    for mode in modes:
        if mode.startswith("colocated"):
            out.append(ClusterSpec(mode, n))
        else:
            out += [ClusterSpec(mode, n, prefill=p) for p in splits_for(n, splits)]
    return out


def slo_targets(slo: dict) -> tuple[PrefillTargets, DecodeTargets]:
    """The role controller's targets an operator serving to ``slo`` would set: the chats' TTFT
    for prompts up to ``long_prompt_tokens`` (1,024: chats are shorter), the documents' above
    it, the tightest class's TPOT. (An agent turn past 1,024 tokens is then held to the
    documents' TTFT target: the controller knows classes by prompt length only.)"""
    return (PrefillTargets(target_ttft_ms=slo["chat"][0] * 1e3, target_ttft_long_ms=slo["document"][0] * 1e3),
            DecodeTargets(target_tpot_ms=min(tpot for _, tpot in slo.values()) * 1e3))


def simulate(spec: ClusterSpec, cost: CostModel, workload: str, rate_per_worker: float, duration_s: float,
             seed: int, slo: dict) -> dict:
    """One run: the summary plus what the run was (mode, split, rate) and its CPU seconds."""
    if spec.mode == "adaptive-slo":
        tp, td = slo_targets(slo)
        spec = dataclasses.replace(spec, prefill_targets=tp, decode_targets=td)
    trace = make_trace(workload, rate_per_worker * spec.workers, duration_s, seed)
    with Timer() as t:
        c = Cluster(spec, cost)
        jobs = c.run(trace)
    s = summarize(jobs, slo, duration_s)
    s.update(mode=spec.mode, workers=spec.workers, prefill=spec.prefill if not spec.mode.startswith("colocated")
             else None, rate_per_worker=rate_per_worker, cpu_s=round(t.cpu_s, 3), events=c.events,
             switches=len(c.switches), kv_overflow=sum(w.overflow for w in c.workers.values()),
             placements=dict(c.placements))
    s["split"] = f"{spec.prefill}:{spec.workers - spec.prefill}" if s["prefill"] is not None else f"{spec.workers}c"
    return s


def goodput_of(spec: ClusterSpec, cost: CostModel, workload: str, duration_s: float, seed: int, slo: dict) -> dict:
    """DistServe goodput (req/s per worker within SLOs for 90% of requests) of one config."""
    with Timer() as t:
        g, probes = goodput(lambda r: simulate(spec, cost, workload, r, duration_s, seed, slo))
    return {"mode": spec.mode, "workers": spec.workers,
            "split": f"{spec.prefill}:{spec.workers - spec.prefill}" if not spec.mode.startswith("colocated")
            else f"{spec.workers}c", "goodput_per_worker": round(g, 4), "goodput_rps": round(g * spec.workers, 3),
            "probes": len(probes), "cpu_s": round(t.cpu_s, 2)}


def parse_slo(items: list[str], ttft: float | None = None, tpot: float | None = None) -> dict:
    """Per-class (TTFT s, TPOT s): the defaults (bench.sim.traces.SLO), every class's set by
    ``ttft``/``tpot``, then ``CLASS=TTFT,TPOT`` items."""
    slo = {k: (ttft if ttft is not None else a, tpot if tpot is not None else b) for k, (a, b) in SLO.items()}
    for item in items:
        try:
            cls, v = item.split("=")
            a, b = (float(x) for x in v.split(","))
        except ValueError:
            raise ValueError(f"--slo {item!r}: CLASS=TTFT_S,TPOT_S, e.g. chat=3,0.25") from None
        if cls not in slo:
            raise ValueError(f"--slo {item!r}: unknown class; known: {', '.join(slo)}")
        slo[cls] = (a, b)
    for cls, (a, b) in slo.items():
        if not (a > 0 and b > 0):
            raise ValueError(f"the {cls} SLO's TTFT and TPOT must be > 0 s, got {a}, {b}")
    return slo


RUN_COLS = [("workers", "N", "d"), ("mode", "mode", "s"), ("split", "P:D", "s"), ("ttft_ms_p50", "TTFT p50", ".0f"),
            ("ttft_ms_p90", "p90", ".0f"), ("ttft_ms_p99", "p99", ".0f"), ("tpot_ms_p50", "TPOT p50", ".0f"),
            ("tpot_ms_p90", "p90", ".0f"), ("tpot_ms_p99", "p99", ".0f"), ("slo_attainment", "SLO met", ".2f"),
            ("refused", "refused", "d"), ("switches", "switches", "d"), ("cpu_s", "CPU s", ".2f")]
GOOD_COLS = [("workers", "N", "d"), ("mode", "mode", "s"), ("split", "P:D", "s"),
             ("goodput_per_worker", "goodput/worker", ".3f"), ("goodput_rps", "goodput req/s", ".2f"),
             ("probes", "runs", "d"), ("cpu_s", "CPU s", ".1f")]


def cmd_run(args: argparse.Namespace) -> int:
    cost = load(args.cost or cost_path(args.model))
    slo = parse_slo(args.slo, args.ttft_slo, args.tpot_slo)
    modes = MODES if args.modes == "all" else args.modes.split(",")
    rows = []
    for n in (int(x) for x in args.workers.split(",")):
        for spec in configs(n, modes, args.splits):
            spec = _with(spec, args)
            rows.append(goodput_of(spec, cost, args.workload, args.duration, args.seed, slo) if args.goodput
                        else simulate(spec, cost, args.workload, args.rate, args.duration, args.seed, slo))
            if args.verbose:
                print(rows[-1], file=sys.stderr)
    print(table(rows, GOOD_COLS if args.goodput else RUN_COLS))
    print(json.dumps({"workload": args.workload, "cost_model": cost.model, "seed": args.seed,
                      "duration_s": args.duration, "slo": slo, "rows": rows}))
    return 0


def _with(spec: ClusterSpec, args: argparse.Namespace) -> ClusterSpec:
    return dataclasses.replace(spec, local_prefill_tokens=args.local_prefill_tokens,
                               prefix_aware=not args.prefix_blind, node_workers=args.node_workers)


def climb(evaluate, tried: dict[int, float], n: int) -> dict[int, float]:
    """From the splits ``tried`` (prefill workers -> goodput), evaluate the untried neighbours
    (p - 1, p + 1) of the best until the best has both tried: its local peak. The grid's step
    (2 at 16 workers) missed the mix's peak at 13:3 (0.395, where 12:4 gave 0.365 and 14:2
    0.270; docs/bench/README.md, at scale)."""
    tried = dict(tried)
    while tried:
        best = max(tried, key=lambda p: (tried[p], -p))
        todo = [q for q in (best - 1, best + 1) if 0 < q < n and q not in tried]
        if not todo:
            break
        for q in todo:
            tried[q] = evaluate(q)
    return tried


def recommend(cost: CostModel, workload: str, workers: int, slo: dict, duration_s: float = 300.0,
              seed: int = 0, splits: str = "grid", modes: tuple[str, ...] = MODES) -> list[dict]:
    """Every mode and split's simulated goodput, best first (``pdserve plan``); on the grid,
    each mode's best split then climbed to its peak (:func:`climb`)."""
    rows = [goodput_of(spec, cost, workload, duration_s, seed, slo) for spec in configs(workers, list(modes), splits)]
    if splits == "grid":
        for mode in (m for m in modes if not m.startswith("colocated")):
            def one(p: int, mode=mode) -> float:
                rows.append(goodput_of(ClusterSpec(mode, workers, prefill=p), cost, workload, duration_s, seed, slo))
                return rows[-1]["goodput_per_worker"]
            climb(one, {int(r["split"].split(":")[0]): r["goodput_per_worker"] for r in rows if r["mode"] == mode},
                  workers)
    return sorted(rows, key=lambda r: (-r["goodput_per_worker"], r["mode"], r["split"]))


def cmd_profile(args: argparse.Namespace) -> int:
    # (heavy: torch and the engine, loaded only by what uses them)
    from bench.sim.profile import profile
    cost = profile(args.model, threads=args.threads, transfer_gbps=args.transfer_gbps,
                   log=lambda s: print(s, file=sys.stderr), cluster=args.cluster, node=args.node)
    out = cost.save(args.out or cached_path(args.model, args.threads))
    print(out)
    return 0


def add_run_args(a: argparse.ArgumentParser) -> None:
    a.add_argument("--model", default="smollm2-135m", help="the cost model's model (default smollm2-135m)")
    a.add_argument("--cost", default=None, help="a cost model JSON (default: this machine's profile of --model "
                                                "in ~/.cache/pdserve/sim/, else docs/bench/sim_cost_MODEL.json)")
    a.add_argument("--workload", default="mix", choices=WORKLOADS)
    a.add_argument("--duration", type=float, default=600.0, help="seconds of simulated traffic (default 600)")
    a.add_argument("--seed", type=int, default=0)
    a.add_argument("--slo", action="append", default=[], metavar="CLASS=TTFT,TPOT",
                   help=f"a class's targets in seconds (default: {SLO}); repeatable")
    a.add_argument("--ttft-slo", type=float, default=None, help="TTFT target (s) for every class")
    a.add_argument("--tpot-slo", type=float, default=None, help="TPOT target (s) for every class")
    a.add_argument("--splits", default="grid", help="P:D splits: grid (1/8..3/4 prefill), all, or prefill counts 1,2")
    a.add_argument("--local-prefill-tokens", type=int, default=96,
                   help="disaggregated-local and adaptive: router.local_prefill_tokens (default 96)")
    a.add_argument("--prefix-blind", action="store_true", help="router.prefix_aware: false")
    a.add_argument("--node-workers", type=int, default=1,
                   help="workers per node sharing its memory bandwidth (the cost model's node factors; default 1: "
                        "each alone, which flatters the modes that run prompts beside streams on one node)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.simulate", description=__doc__.split("\n\n")[0],
                                usage="%(prog)s {run,profile} ... | %(prog)s --validate [options]")
    sub = p.add_subparsers(dest="command")
    r = sub.add_parser("run", help="simulate modes and splits; a table and one JSON line")
    add_run_args(r)
    r.add_argument("--workers", default="4", help="cluster sizes, e.g. 4,16,64")
    r.add_argument("--modes", default="all", help=f"comma list of {', '.join(MODES)} (default all)")
    r.add_argument("--rate", type=float, default=0.1, help="arrivals per second per worker (default 0.1)")
    r.add_argument("--goodput", action="store_true", help="DistServe goodput by rate search instead of one rate")
    r.add_argument("-v", "--verbose", action="store_true")
    r.set_defaults(func=cmd_run)
    pr = sub.add_parser("profile", help="measure this machine's engine; write the cost model JSON")
    pr.add_argument("--model", default="smollm2-135m")
    pr.add_argument("--threads", type=int, default=1)
    pr.add_argument("--transfer-gbps", type=float, default=None, help="KV transfer GB/s (default: measure a copy)")
    pr.add_argument("--no-cluster", dest="cluster", action="store_false",
                    help="skip what a running cluster adds per request, per step and per long prompt "
                         "(request_ms, loop_ms, land_ms_per_ktok: 0; prefill_x: 1)")
    pr.add_argument("--no-node", dest="node", action="store_false",
                    help="skip how much a neighbour on the node slows a step (node factors: 1)")
    pr.add_argument("--out", default=None, help="where to write it (default ~/.cache/pdserve/sim/cost_MODEL.json; "
                                                "cost_MODEL_tT.json at --threads T > 1)")
    pr.set_defaults(func=cmd_profile)
    add_validate_args(p)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.validate == bool(args.command):
        parser.error("give a command (run, profile) or --validate")
    try:
        return cmd_validate(args) if args.validate else args.func(args)
    except ValueError as e:
        print(f"simulate: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
