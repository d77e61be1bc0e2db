"""``bench/serving.py --compare``: the figures that compare modes, over seeds (issue 44).

Every mode of a comparison runs the same requests at the same rates (bench/serving.py
``workload``), with the same cores and the same KV memory in all (bench/modes.py). With
``--seeds N`` each rate of the sweep runs N times, each seed its own arrivals and prompts of
the same kind, one after the other on the same cluster; a mode's figures are then the median
over its seeds, with the least and the most beside.

- **goodput** (DistServe's): per seed, the highest rate up to which every rate of the sweep had
  >= 90% of its requests within both SLOs (one rate: its requests/s within them); a mode's is
  the median of its seeds'. ``goodput_ratio_adaptive_vs_best_fixed_<dataset>`` divides
  adaptive's median by the best fixed mode's (colocated, colocated-chunked, disaggregated,
  disaggregated-local; never a tuned row), and ``..._by_seed`` the same per seed against
  the same mode (the same arrivals in every mode; a seed where that mode held none is left
  out), whose least and most are ``..._min`` and ``..._max``.
- **chats' tail TPOT**: per rate, the chats' TPOTs of every seed pooled. A p99 needs about 100
  samples behind it, so ``p99_tpot_ratio_adaptive_vs_colocated_<dataset>`` is given only where
  every rate has >= 100 of them; ``p90_tpot_ratio_adaptive_vs_colocated_<dataset>`` always. The
  key is the worst (highest) ratio over the rates.

``--datasets mix,phase,shared-prefix`` (:func:`per_dataset`) runs the comparison on each in
turn in one invocation, so that every key comes from one run of one code version.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
from collections.abc import Callable, Iterable

from bench.loadgen import BenchError, make_workload, max_goodput_rate, percentile
from bench.modes import COMPARE

P99_SAMPLES = 100  # the fewest samples a p99 is reported on (else the p90)


def seeds_of(runs: list[dict]) -> list:
    return list(dict.fromkeys(r.get("seed") for r in runs))


def is_sweep(runs: list[dict]) -> bool:
    return len({r["rate"] for r in runs}) > 1


def goodput_by_seed(runs: list[dict]) -> dict:
    """{seed: goodput} (module doc). One rate, or a closed loop: its requests/s within both SLOs."""
    out = {}
    for seed in seeds_of(runs):
        mine = [r for r in runs if r.get("seed") == seed]
        if is_sweep(runs):
            out[seed] = max_goodput_rate([(r["rate"], r["summary"]["all"]) for r in mine])
        else:
            out[seed] = mine[0]["summary"]["all"]["goodput_rps"]
    return out


def spread(xs: Iterable[float]) -> tuple[float, float, float]:
    """(median, least, most)."""
    xs = list(xs)
    return statistics.median(xs), min(xs), max(xs)


def chat_tpot_tails(runs: list[dict]) -> dict:
    """{rate: (samples, p90 ms, p99 ms)} of the chats' TPOT (every request's where the dataset has
    no kinds), pooled over the seeds of each rate."""
    kinds = {r.spec.kind for run in runs for r in run.get("results", [])}
    out = {}
    for rate in dict.fromkeys(r["rate"] for r in runs):
        xs = [r.tpot for run in runs if run["rate"] == rate for r in run.get("results", [])
              if r.error is None and r.tpot is not None and ("chat" not in kinds or r.spec.kind == "chat")]
        if xs:
            out[rate] = (len(xs), percentile(xs, 90) * 1e3, percentile(xs, 99) * 1e3)
    return out


def adaptive_ratios(results: dict[str, dict], flat: dict, dataset: str, log=print) -> None:
    """``goodput_ratio_adaptive_vs_best_fixed_<dataset>`` (with no fixed mode within the SLOs at
    a sweep's lowest rate: ``..._lower_bound``), the chats' tail TPOT ratios over colocated's,
    ``role_switches``; ``adaptive-tuned``, where it ran, its own labelled keys."""
    fixed = {label: goodput_by_seed(results[label]["runs"]) for label in results
             if label in COMPARE and label != "adaptive"}
    for label, short in (("adaptive", "adaptive"), ("adaptive-tuned", "adaptive_tuned")):
        if label in results:
            _goodput_ratio(results, fixed, label, short, flat, dataset, log)
            if "colocated" in results:
                _tpot_ratios(results, label, short, flat, dataset, log)
    if "adaptive" in results:
        flat["role_switches"] = len(results["adaptive"].get("role_switches", []))
        log(f"role switches: {flat['role_switches']}")


def _goodput_ratio(results, fixed: dict[str, dict], label: str, short: str, flat: dict, dataset: str, log) -> None:
    if not fixed:
        return
    mine = goodput_by_seed(results[label]["runs"])
    med = {name: spread(g.values())[0] for name, g in fixed.items()}
    best = max(med, key=med.get)
    key, ours = f"goodput_ratio_{short}_vs_best_fixed_{dataset}", spread(mine.values())[0]
    if med[best] > 0:
        flat[key] = ours / med[best]
        # (each seed against the same mode as the key: a ratio of medians lies within them)
        by_seed = {seed: mine[seed] / fixed[best][seed] for seed in mine if fixed[best].get(seed, 0.0) > 0}
        if len(mine) > 1:
            flat[f"{key}_by_seed"] = {str(s): round(x, 3) for s, x in by_seed.items()}
            if by_seed:
                flat[f"{key}_min"], flat[f"{key}_max"] = min(by_seed.values()), max(by_seed.values())
        log(f"\ngoodput: {label} / best fixed mode ({best}) = {flat[key]:.2f}"
            + (f" [{min(by_seed.values()):.2f} .. {max(by_seed.values()):.2f} by seed]"
               if len(mine) > 1 and by_seed else ""))
    elif ours > 0 and is_sweep(results[label]["runs"]):
        # No fixed mode held 90% even at the sweep's lowest rate: their goodput is below it,
        # so the ratio is above adaptive's / that rate (the key itself needs a lower rate).
        lowest = min(r["rate"] for r in results[label]["runs"])
        flat[f"{key}_lower_bound"] = ours / lowest
        log(f"\ngoodput: no fixed mode held 90% within both SLOs at {lowest:g} req/s, the lowest rate; "
            f"{label} / best fixed > {flat[f'{key}_lower_bound']:.2f} (sweep lower rates for the ratio)")


def _tpot_ratios(results, label: str, short: str, flat: dict, dataset: str, log) -> None:
    a, c = chat_tpot_tails(results[label]["runs"]), chat_tpot_tails(results["colocated"]["runs"])
    both = [rate for rate in a if rate in c and c[rate][1] > 0]
    if not both:
        return
    for q, i in (("p90", 1), ("p99", 2)):
        if q == "p99" and min(min(a[r][0], c[r][0]) for r in both) < P99_SAMPLES:
            continue  # (too few samples behind a p99: the p90 only)
        ratios = {rate: a[rate][i] / c[rate][i] for rate in both}
        key = f"{q}_tpot_ratio_{short}_vs_colocated_{dataset}"
        flat[key] = max(ratios.values())
        if len(ratios) > 1:
            flat[f"{key}_by_rate"] = {f"{rate:g}": round(x, 3) for rate, x in ratios.items()}
        log(f"{q} TPOT of chats: {label} / colocated = " + ", ".join(
            f"{x:.2f}" + (f" at {rate:g}/s" if rate is not None else "") for rate, x in ratios.items())
            + f" ({min(min(a[r][0], c[r][0]) for r in both)} samples or more a rate)")


def summary_table(results: dict[str, dict], log=print) -> dict:
    """Per mode: each rate's share within both SLOs and the goodput, median [least .. most] over
    the seeds; returns the flat fields ``<mode>_goodput_median|min|max`` and ``..._by_seed``."""
    flat: dict = {}
    # (None: a closed loop, no rate)
    rates = sorted({r["rate"] for res in results.values() for r in res["runs"]}, key=lambda x: (x is None, x or 0))
    log("\nwithin both SLOs, median [least .. most] over seeds, and goodput (req/s)")
    log(f"{'mode':<22}" + "".join(f"{f'{x:g}/s' if x is not None else 'closed loop':>20}" for x in rates)
        + f"{'goodput':>22}")
    for label, res in results.items():
        cells = []
        for rate in rates:
            att = [r["summary"]["all"]["slo_attainment"] for r in res["runs"] if r["rate"] == rate]
            m, lo, hi = spread(att) if att else (None, None, None)
            cells.append("-" if m is None else f"{m:.0%} [{lo:.0%}..{hi:.0%}]")
        g = goodput_by_seed(res["runs"])
        m, lo, hi = spread(g.values())
        name = label.replace("-", "_")
        flat.update({f"{name}_goodput_median": m, f"{name}_goodput_min": lo, f"{name}_goodput_max": hi,
                     f"{name}_goodput_by_seed": {str(s): x for s, x in g.items()}})
        log(f"{label:<22}" + "".join(f"{c:>20}" for c in cells) + f"{f'{m:g} [{lo:g}..{hi:g}]':>22}")
    return flat


# The prefix comparison's keys (bench/serving.py _report), named by no dataset
PREFIX_KEYS = ("ttft_p90_ratio_prefix_blind_vs_aware", "kv_bytes_ratio_aware_vs_blind",
               "kv_bytes_ratio_expected_from_hits")


def per_dataset(args: argparse.Namespace, run: Callable[[argparse.Namespace], dict]) -> dict:
    """``--compare --datasets A,B,...``: ``run`` (bench/serving.py ``_main``) on each dataset in
    turn, as ``--dataset`` with the same modes, rates and seeds; ``shared-prefix`` is the prefix
    comparison instead (``--prefix-compare --prefix-cluster disaggregated``: prefix-blind and
    prefix-aware placement, both of its keys; one run at the arrivals given, as
    ``--prefix-compare``: its keys are one run's). The keys named by their dataset and the
    prefix comparison's come up to the top; every dataset's whole output is under
    ``by_dataset``. Plots (``--plot-dir``) go to a folder per dataset."""
    names = [d.strip() for d in args.datasets.split(",") if d.strip()]
    if not args.compare:
        raise BenchError("--datasets runs --compare on each dataset: add --compare")
    if not names or len(set(names)) != len(names):
        raise BenchError(f"--datasets: give distinct dataset names, got {args.datasets!r}")
    for ds in names:  # (a bad name now, not after hours of the ones before it)
        make_workload(1, ds, 1000)
    out: dict = {"datasets": names, "by_dataset": {}}
    for ds in names:
        a = argparse.Namespace(**vars(args))
        a.datasets, a.dataset = None, ds
        if a.plot_dir:
            a.plot_dir = os.path.join(a.plot_dir, ds)
        if ds == "shared-prefix":
            a.compare, a.prefix_compare, a.prefix_cluster, a.rates, a.seeds = False, True, "disaggregated", None, 1
        part = run(a)
        out["by_dataset"][ds] = part
        named = re.compile(rf"_{re.escape(ds)}(_|$)")  # (..._mix, ..._mix_by_seed, ..._mix_lower_bound)
        out.update({k: v for k, v in part.items() if named.search(k) or k in PREFIX_KEYS})
    return out
