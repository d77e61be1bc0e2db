"""``python -m bench.simulate --validate``: the real cluster and the simulator on the same arrivals.

Three stages, in this order:

1. cost models: this machine's profile (``bench.sim.profile``) for each engine thread count
   the modes use (colocated workers run 2 threads, the others 1), from ~/.cache/pdserve/sim/
   or ``--cost`` files; profiled first where missing (about three minutes each), unless
   ``--no-profile`` (then the error names the command that makes one);
2. real: for each mode (bench/modes.py ``COMPARE``), the local cluster bench/serving.py starts
   for it, and on it each load in turn through ``serving.bench_server`` (its warm-up only on a
   fresh cluster): the workload of ``serving.workload``, sent at ``loadgen.poisson_arrivals``.
   One cluster per mode (their caches keep nothing a later load's prompts could hit: each load
   draws its prompts from its own seed, ``load_seed``); an adaptive cluster is started afresh
   for each load, as its roles are state the simulator starts without. The measurements can
   be saved (``--real-out``) and replayed (``--real-in``) without a cluster;
3. sim: for each real run, the simulated cluster of the same config (``sim_setup``) over the
   same requests and arrivals (``fidelity.sim_trace``), then the table and one JSON line
   (``fidelity.report``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

from bench.loadgen import poisson_arrivals
from bench.modes import COMPARE, cluster_config
from bench.serving import bench_server, build_parser, start_local, workload
from bench.sim.cluster import Cluster, ClusterSpec
from bench.sim.costs import CostModel, cached_path, load
from bench.sim.fidelity import TOLERANCE, Cell, Figures, cells, render_table, report, sim_trace
from bench.sim.report import latencies

LOADS = ("mix", "phase", "shared-prefix")
REAL_FORMAT = "pdserve-sim-validate-real/1"


def load_seed(seed: int, i: int) -> int:
    """The ``i``-th load's seed: its arrivals, shape and tokens. 100 apart, so that no load's
    prompts (nor a warm-up's, seed + 1) start with another's tokens on a cluster they share."""
    return seed + 100 * i


def load_args(load: str, n: int, rate: float, seed: int, warmup: int) -> argparse.Namespace:
    """bench/serving.py's arguments for one load: its defaults but for these."""
    return build_parser().parse_args(["--dataset", load, "--num-requests", str(n), "--rate", repr(rate),
                                      "--seed", str(seed), "--warmup", str(warmup), "--duration", "1e9"])


def sim_setup(cfg, costs: dict[int, CostModel], kv_blocks: int | None) -> tuple[ClusterSpec, CostModel]:
    """The simulated deployment of a real cluster config and the cost model its workers run by:
    the pools' sizes, the router's settings and the engine's budgets as configured; the KV the
    real workers reported (``kv_blocks``: their budget, bench/modes.py ``kv_split`` of
    ``--kv-gb``; the decode side's, as the simulator gives every worker one size). Both pools
    share the decode pool's step budget
    (equal in every mode here: the engine's default). Every worker shares the one machine's
    memory bandwidth: one node."""
    colocated = cfg.mode == "colocated"
    if colocated:
        mode = "colocated+chunked" if cfg.decode.chunked_prefill else "colocated"
    elif cfg.mode == "adaptive":
        mode = "adaptive"
    else:
        mode = "disaggregated-local" if cfg.router.local_prefill_tokens > 0 else "disaggregated"
    threads = cfg.decode.threads
    if not colocated and cfg.prefill.threads != threads:
        raise ValueError(f"{cfg.mode}: prefill threads {cfg.prefill.threads} != decode threads {threads}: "
                         "the simulator runs every worker by one cost model")
    if threads not in costs:
        raise ValueError(f"no cost model for {threads} engine thread(s); have {sorted(costs)}")
    cost = dataclasses.replace(costs[threads], block_size=cfg.decode.block_size,
                               max_batched_tokens=cfg.decode.max_batched_tokens,
                               max_num_seqs=cfg.decode.max_num_seqs,
                               kv_blocks=kv_blocks or costs[threads].kv_blocks)
    workers = cfg.decode.replicas + (0 if colocated else cfg.prefill.replicas)
    spec = ClusterSpec(mode, workers,
                       prefill=0 if colocated else cfg.prefill.replicas,
                       local_prefill_tokens=cfg.router.local_prefill_tokens, prefix_aware=cfg.router.prefix_aware,
                       queue_timeout_s=cfg.router.queue_timeout_s, max_queue=cfg.router.max_queue, roles=cfg.roles,
                       prefill_targets=cfg.autoscale.prefill, decode_targets=cfg.autoscale.decode,
                       window_s=cfg.autoscale.window_s, node_workers=workers)  # (one machine: one node)
    return spec, cost


def threads_needed(modes: list[str]) -> list[int]:
    a = load_args(LOADS[0], 1, 1.0, 0, 0)
    return sorted({cluster_config(m, COMPARE[m], a).decode.threads for m in modes})


def ensure_costs(model: str, threads: list[int], given: list[str], profile_ok: bool,
                 log: Callable[[str], None]) -> dict[int, CostModel]:
    """A cost model per thread count: ``given`` files (each serves its own ``threads``), else
    this machine's cached profile, else a fresh profile (``profile_ok``).

    Raises:
        ValueError: one is missing and ``profile_ok`` is false (the message says how to make it).
    """
    costs = {c.threads: c for c in (load(p) for p in given)}
    for t in threads:
        if t in costs:
            continue
        path = cached_path(model, t)
        if path.is_file():
            costs[t] = load(path)
            if t == 1 and "node" not in costs[t].sources:
                log(f"{path} has no node factors (profiled before they were measured): its workers never slow "
                    f"each other; re-profile to measure them (`python -m bench.simulate profile --model {model}`)")
            continue
        if not profile_ok:
            raise ValueError(f"no cost model of {model} at {t} thread(s) on this machine ({path}): make one with "
                             f"`python -m bench.simulate profile --model {model} --threads {t}`")
        log(f"profiling {model} at {t} thread(s) (no {path}) ...")
        # (heavy: torch and the engine, loaded only by what uses them)
        from bench.sim.profile import profile
        costs[t] = profile(model, threads=t, log=lambda s: None)
        log(f"wrote {costs[t].save(path)}")
    return costs


def run_real(model: str, modes: list[str], loads: list[str], n: int, rate: float, seed: int, warmup: int,
             fresh: bool, log: Callable[[str], None], saved: Callable[[dict], None] = lambda r: None) -> dict:
    """Stage 2 (module doc): every mode's cluster over every load. Returns the record
    (``REAL_FORMAT``): per run, the requests' TTFTs and TPOTs (s), failures, the KV blocks
    the workers reported and how late the client sent against the schedule. ``saved`` gets
    the record after each run (a run cut short keeps what it measured)."""
    # (heavy: Ray, gRPC and a cluster, loaded only by what uses them)
    import ray
    from pdserve.v1 import pdserve_pb2 as pb
    from router.app import init_ray
    from router.client import connect
    from router.config import load_config
    init_ray(load_config(None, {"prefill.replicas": 1, "decode.replicas": 1}))
    record = {"format": REAL_FORMAT, "model": model, "num_requests": n, "rate": rate, "seed": seed,
              "warmup": warmup, "modes": modes, "loads": loads, "runs": []}
    try:
        for mode in modes:
            cluster = None
            try:
                for i, ld in enumerate(loads):
                    s = load_seed(seed, i)
                    a = load_args(ld, n, rate, s, 0)
                    cfg = cluster_config(mode, {**COMPARE[mode], "model": model}, a)
                    if cluster is not None and (fresh or mode == "adaptive"):
                        cluster.stop()
                        cluster = None
                    if cluster is None:
                        log(f"{mode}: starting a cluster ...")
                        t0 = time.perf_counter()
                        cluster, server = start_local(cfg)
                        a.warmup = warmup
                        log(f"{mode}: up in {time.perf_counter() - t0:.1f} s")
                    stub = connect(server)
                    record["vocab"] = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10).vocab_size
                    log(f"{mode} / {ld}: {n} requests at {rate:g}/s (seed {s})")
                    t0 = time.perf_counter()
                    run = bench_server(server, a, record["vocab"])["runs"][0]
                    results = run["results"]
                    offsets = poisson_arrivals(len(results), rate, s)
                    lag = max(((r.sent - results[0].sent) - (at - offsets[0]) for r, at in zip(results, offsets)),
                              default=0.0)
                    totals = [w.status.kv_blocks_total for w in list(cluster.router.pools.workers.values())
                              if w.status is not None and str(w.role) != "prefill"]
                    record["runs"].append({"mode": mode, "load": ld, "seed": s, "kv_blocks": min(totals, default=None),
                                           "ttft_s": [r.ttft for r in results], "tpot_s": [r.tpot for r in results],
                                           "failed": sum(r.error is not None for r in results),
                                           # (where each was prefilled: local or pool, against the sim's)
                                           "prefill_worker": [r.prefill_worker for r in results],
                                           "send_lag_ms_max": round(lag * 1e3, 1),
                                           "wall_s": round(time.perf_counter() - t0, 1),
                                           # (a machine others load too measures them, not the cluster)
                                           "loadavg_1m_after": round(os.getloadavg()[0], 2)})
                    saved(record)
                    log(f"{mode} / {ld}: done in {record['runs'][-1]['wall_s']} s")
            finally:
                if cluster is not None:
                    cluster.stop()
    finally:
        ray.shutdown()
    return record


def simulate_record(record: dict, costs: dict[int, CostModel], log: Callable[[str], None]) -> list[Cell]:
    """Stage 3: each real run's simulated twin (module doc), compared cell by cell."""
    out: list[Cell] = []
    for run in record["runs"]:
        a = load_args(run["load"], record["num_requests"], record["rate"], run["seed"], 0)
        cfg = cluster_config(run["mode"], {**COMPARE[run["mode"]], "model": record["model"]}, a)
        spec, cost = sim_setup(cfg, costs, run.get("kv_blocks"))
        specs = workload(a, record["vocab"])
        trace = sim_trace(specs, poisson_arrivals(len(specs), record["rate"], run["seed"]))
        jobs = Cluster(spec, cost).run(trace)
        out += cells(run["mode"], run["load"], Figures.of(run["ttft_s"], run["tpot_s"]), Figures.of(*latencies(jobs)))
        log(f"simulated {run['mode']} / {run['load']}: {sum(1 for j in jobs if j.refused)} refused")
    return out


def add_args(p: argparse.ArgumentParser) -> None:
    """The ``--validate`` flag and its options (dests ``v_*``: the subcommands' own stay apart)."""
    g = p.add_argument_group("--validate: the simulator against the real cluster on the same arrivals")
    g.add_argument("--validate", action="store_true",
                   help="run the real local cluster and the simulator on the same arrivals for every mode and "
                        "load; print a table (real, sim, relative error of TTFT/TPOT p50/p90) and one JSON line "
                        "with sim_vs_real_max_rel_error. Progress on stderr. Defaults: about 15 min on 2 cores, "
                        "plus about 3 min per cost model it has to profile first")
    g.add_argument("--loads", dest="v_loads", metavar="LIST", default=",".join(LOADS),
                   help=f"comma list of bench/serving.py datasets (default {','.join(LOADS)})")
    g.add_argument("--modes", dest="v_modes", metavar="LIST", default=",".join(COMPARE),
                   help=f"comma list of {', '.join(COMPARE)} (default all)")
    g.add_argument("--num-requests", dest="v_n", metavar="N", type=int, default=10,
                   help="requests per load (default 10)")
    g.add_argument("--rate", dest="v_rate", metavar="RPS", type=float, default=0.4,
                   help="Poisson arrivals, req/s (default 0.4)")
    g.add_argument("--seed", dest="v_seed", metavar="SEED", type=int, default=0,
                   help="the first load's seed (default 0)")
    g.add_argument("--warmup", dest="v_warmup", metavar="N", type=int, default=2,
                   help="requests sent to each fresh cluster first, not counted (default 2)")
    g.add_argument("--fresh", dest="v_fresh", action="store_true",
                   help="a fresh cluster for every load (default: one per mode; adaptive: always fresh)")
    g.add_argument("--model", dest="v_model", metavar="MODEL", default="smollm2-135m", help="(default smollm2-135m)")
    g.add_argument("--cost", dest="v_cost", action="append", default=[], metavar="JSON",
                   help="a cost model to use for its thread count (repeatable; default: this machine's profiles "
                        "in ~/.cache/pdserve/sim/, made first where missing)")
    g.add_argument("--no-profile", dest="v_no_profile", action="store_true",
                   help="never profile: a missing cost model is an error that says how to make it")
    g.add_argument("--real-out", dest="v_real_out", default=None, metavar="JSON",
                   help="also write the real runs' measurements here")
    g.add_argument("--real-in", dest="v_real_in", default=None, metavar="JSON",
                   help="no cluster: simulate against measurements a --real-out wrote")
    g.add_argument("--real-vs", dest="v_real_vs", default=None, metavar="JSON",
                   help="with --real-in, no simulator: compare its runs with another real record of the same "
                        "arrivals (the floor a simulator's error is read against: how far the real cluster is "
                        "from itself); the JSON line's key is real_vs_real_max_rel_error")


def _names(text: str, known, what: str) -> list[str]:
    names = [x for x in text.split(",") if x]
    bad = [x for x in names if x not in known]
    if bad or not names:
        raise ValueError(f"--{what}: unknown or none: {', '.join(bad) or text!r}; known: {', '.join(known)}")
    return names


def cmd_validate(args: argparse.Namespace) -> int:
    def log(s: str) -> None:
        print(f"[validate] {s}", file=sys.stderr, flush=True)
    if args.v_real_vs:
        if not args.v_real_in:
            raise ValueError("--real-vs compares two real records: give the first with --real-in")
        return _real_vs_real(_read_record(args.v_real_in), _read_record(args.v_real_vs, "--real-vs"))
    record = _read_record(args.v_real_in) if args.v_real_in else None
    if record is None:
        modes = _names(args.v_modes, list(COMPARE), "modes")
        loads = _names(args.v_loads, list(LOADS) + ["random"], "loads")
        if args.v_n < 1 or not args.v_rate > 0:
            raise ValueError("--num-requests must be >= 1 and --rate > 0")
    else:  # (what ran is the record's: --modes and --loads do not apply)
        modes = record["modes"]
    model = record["model"] if record else args.v_model
    # profiled before any cluster starts: its timings want the machine to itself
    costs = ensure_costs(model, threads_needed(modes), args.v_cost, not args.v_no_profile, log)
    if record is None:
        out = Path(args.v_real_out) if args.v_real_out else None
        record = run_real(model, modes, loads, args.v_n, args.v_rate, args.v_seed, args.v_warmup, args.v_fresh, log,
                          (lambda r: out.write_text(json.dumps(r) + "\n")) if out else (lambda r: None))
    cs = simulate_record(record, costs, log)
    print(render_table(cs))
    meta = _meta(record)
    # each cost model as its own JSON form (bench/sim/costs.py: one place lists the fields), less the raw samples
    meta["cost_models"] = {str(t): {k: v for k, v in c.to_json().items() if k != "samples"}
                           for t, c in sorted(costs.items())}
    print(json.dumps(report(cs, meta, TOLERANCE)))
    return 0


SAME = ("model", "num_requests", "rate", "seed", "warmup")  # what two records must share to be compared


def _meta(record: dict) -> dict:
    meta = {k: record.get(k) for k in ("model", "num_requests", "rate", "seed", "loads", "modes")}
    meta["runs"] = [{k: r.get(k) for k in ("mode", "load", "seed", "kv_blocks", "failed", "send_lag_ms_max", "wall_s",
                                            "loadavg_1m_after")} for r in record["runs"]]
    return meta


def real_cells(a: dict, b: dict) -> list[Cell]:
    """Run by run, record ``a`` against ``b`` (``b`` in the second column): the runs both have,
    matched by mode, load and seed.

    Raises:
        ValueError: the records ran different requests or arrivals (a field of ``SAME`` differs),
            or share no run.
    """
    diff = [k for k in SAME if a.get(k) != b.get(k)]
    if diff:
        raise ValueError("the two records did not send the same requests at the same times: "
                         + ", ".join(f"{k} {a.get(k)!r} vs {b.get(k)!r}" for k in diff))
    theirs = {(r["mode"], r["load"], r["seed"]): r for r in b["runs"]}
    out: list[Cell] = []
    for r in a["runs"]:
        o = theirs.get((r["mode"], r["load"], r["seed"]))
        if o is not None:
            out += cells(r["mode"], r["load"], Figures.of(r["ttft_s"], r["tpot_s"]), Figures.of(o["ttft_s"], o["tpot_s"]))
    if not out:
        raise ValueError("the two records share no run (mode, load and seed)")
    return out


def _real_vs_real(a: dict, b: dict) -> int:
    cs = real_cells(a, b)
    print(render_table(cs, other="real 2"))
    print(json.dumps(report(cs, {**_meta(a), "runs_2": _meta(b)["runs"]}, TOLERANCE, key="real_vs_real_max_rel_error")))
    return 0


def _read_record(path: str, flag: str = "--real-in") -> dict:
    try:
        record = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{flag} {path}: {e}") from None
    if not isinstance(record, dict) or record.get("format") != REAL_FORMAT:
        raise ValueError(f"{flag} {path}: not a {REAL_FORMAT} record (its `format` field)")
    return record
