"""``pdserve plan``: which mode and P:D split to deploy, by simulating them (bench/simulate.py)."""

from __future__ import annotations

import argparse
import json

from bench.sim.traces import WORKLOADS


def add_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan", help="recommend a mode and P:D split by simulating every one on a workload",
        description="Simulate every mode (colocated, colocated+chunked, disaggregated, disaggregated-local, "
                    "adaptive, and adaptive with the SLOs as its controller's targets: adaptive-slo) and P:D split on WORKERS workers with the router's real placement and role "
                    "policies, over a cost model of the engine on this machine (`python -m bench.simulate "
                    "profile`), and print the one with the highest DistServe goodput (requests/s at which 90% "
                    "meet both targets) with the alternatives'. Simulated, not measured: a plan to check on the "
                    "real cluster.")
    p.add_argument("--model", default="smollm2-135m", help="the model whose cost model to use (default smollm2-135m)")
    p.add_argument("--cost", default=None, help="a cost model JSON instead of --model's")
    p.add_argument("--workload", default="mix", choices=WORKLOADS, help="arrival trace shape (default mix)")
    p.add_argument("--ttft-slo", type=float, default=None, help="TTFT target in seconds, every class "
                                                                "(default: per class, bench/sim/traces.py)")
    p.add_argument("--tpot-slo", type=float, default=None, help="TPOT target in seconds, every class")
    p.add_argument("--workers", type=int, default=4, help="workers in the cluster (default 4)")
    p.add_argument("--splits", default="grid", help="P:D splits to try: grid (default: 1/8..3/4 prefill workers, then each mode's best split's "
                        "neighbours until it is a peak), all, or prefill counts 1,2")
    p.add_argument("--duration", type=float, default=300.0, help="simulated seconds per probe (default 300)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.set_defaults(func=cmd_plan)


def cmd_plan(args: argparse.Namespace) -> int:
    # (heavy: the simulator and the router's policies, loaded only for `pdserve plan`)
    from bench.sim.costs import load
    from bench.sim.report import table
    from bench.simulate import GOOD_COLS, cost_path, parse_slo, recommend, slo_targets
    if args.workers < 1:
        raise ValueError("--workers must be >= 1")
    cost = load(args.cost or cost_path(args.model))
    slo = parse_slo([], args.ttft_slo, args.tpot_slo)
    rows = recommend(cost, args.workload, args.workers, slo, args.duration, args.seed, args.splits)
    best = rows[0]
    if args.json:
        print(json.dumps({"recommended": best, "alternatives": rows[1:], "slo": slo, "cost_model": cost.model}))
        return 0
    if best["goodput_per_worker"] == 0:
        print(f"no mode meets the SLOs for 90% of requests even at the lowest rate tried ({args.workload}, {slo})")
    else:
        print(f"recommended: {best['mode']} {best['split']} — {best['goodput_rps']:.2f} req/s within SLO "
              f"({best['goodput_per_worker']:.3f} per worker), simulated")
        if best["mode"] == "adaptive-slo":
            tp, td = slo_targets(slo)
            print(f"  (mode: adaptive with the SLOs as the role controller's targets: autoscale.prefill."
                  f"target_ttft_ms {tp.target_ttft_ms:g}, target_ttft_long_ms {tp.target_ttft_long_ms:g}, "
                  f"autoscale.decode.target_tpot_ms {td.target_tpot_ms:g})")
    print(table(rows, GOOD_COLS))
    return 0
