"""PNG plots of a serving benchmark (matplotlib, only when asked for with --plot-dir)."""

from __future__ import annotations

from pathlib import Path

from bench.compare import spread


def plot_all(results: dict[str, dict], out_dir: str) -> list[Path]:
    """Latency CDFs, per-token latency over time, (for sweeps) goodput vs rate and (for an
    adaptive cluster) its prefill workers over time."""
    try:
        # (optional: matplotlib, the `bench` extra)
        import matplotlib
    except ImportError:
        raise SystemExit("--plot-dir needs matplotlib: pip install 'pdserve[bench]'") from None
    matplotlib.use("Agg")
    # (optional: matplotlib, the `bench` extra)
    import matplotlib.pyplot as plt
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for label, res in results.items():
        rs = [r for r in res["runs"][0]["results"] if r.error is None]
        for ax, name, xs in ((axes[0], "TTFT", [r.ttft for r in rs if r.ttft is not None]),
                             (axes[1], "TPOT", [r.tpot for r in rs if r.tpot is not None]),
                             (axes[2], "inter-token latency", [g for r in rs for g in r.itls])):
            xs = sorted(x * 1e3 for x in xs)
            if xs:
                ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=label)
            ax.set_xlabel(f"{name} (ms)")
            ax.set_xscale("log")
            ax.set_ylabel("fraction of requests" if name != "inter-token latency" else "fraction of gaps")
            ax.grid(True, alpha=0.3)
    axes[0].legend()
    fig.suptitle("latency CDFs")
    paths.append(_save(plt, fig, out / "latency_cdf.png"))

    fig, ax = plt.subplots(figsize=(12, 4))
    for label, res in results.items():
        rs = res["runs"][0]["results"]
        t0 = min(r.sent for r in rs)
        pts = sorted((b - t0, (b - a) * 1e3) for r in rs if r.error is None and r.spec.kind != "long"
                     for a, b in zip(r.batch_times, r.batch_times[1:]))
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], ".", markersize=3, label=label)
    ax.set_xlabel("time since the first request (s)")
    ax.set_ylabel("gap between tokens (ms)")
    ax.set_yscale("log")
    ax.set_title("per-token latency of streaming requests over time (prefill stalls show as spikes)")
    paths.append(_save(plt, fig, out / "tpot_over_time.png", ax))

    switched = {k: v for k, v in results.items() if "role_switches" in v}
    if switched:
        fig, ax = plt.subplots(figsize=(12, 3))
        for label, res in switched.items():
            _, pts = roles_over_time(res)
            ax.step([p[0] for p in pts], [p[1] for p in pts], where="post", label=label)
        ax.set_xlabel("time since the first request (s)")
        ax.set_ylabel("prefill workers")
        ax.set_title("roles over time (the rest decode)")
        paths.append(_save(plt, fig, out / "roles_over_time.png", ax))

    # (a sweep: more than one rate; with --seeds, each rate's median over its seeds, least and most as bars)
    sweeps = {k: v for k, v in results.items() if len({r["rate"] for r in v["runs"] if r["rate"] is not None}) > 1}
    if sweeps:
        fig, ax = plt.subplots(figsize=(6, 4))
        for label, res in sweeps.items():
            rates = sorted({r["rate"] for r in res["runs"] if r["rate"] is not None})
            mid, lo, hi = zip(*(spread(r["summary"]["all"]["goodput_rps"] for r in res["runs"] if r["rate"] == x)
                                for x in rates))
            ax.errorbar(rates, mid, yerr=[[m - a for m, a in zip(mid, lo)], [b - m for m, b in zip(mid, hi)]],
                        fmt="o-", capsize=3, label=label)
        ax.set_xlabel("offered rate (requests/s)")
        ax.set_ylabel("goodput (requests/s meeting both SLOs)")
        paths.append(_save(plt, fig, out / "goodput_vs_rate.png", ax))
    return paths


def _save(plt, fig, path: Path, ax=None) -> Path:
    """Legend and grid on ``ax`` (if given), then write ``fig`` to ``path`` and close it."""
    if ax is not None:
        ax.legend()
        ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def roles_over_time(res: dict) -> tuple[float, list[tuple[float, int]]]:
    """(the first run's start, [(seconds since it, prefill workers)]) over every run of an
    adaptive cluster: it starts with one prefill worker; switches before the first request set
    where the line starts, switches after the last response are left out."""
    runs = res["runs"]
    t0 = runs[0]["started"]  # (wall clock, as the switches' times; a result's are perf_counter's)
    end = max((run["started"] + max(r.end for r in run["results"]) - min(r.sent for r in run["results"])
               for run in runs if run["results"]), default=t0)
    n, pts = 1, []
    for at, _, old, new, *_ in sorted(res["role_switches"]):
        if at > end:
            break
        if at > t0 and not pts:
            pts.append((0.0, n))
        n += (new == "prefill") - (old == "prefill")
        if at > t0:
            pts.append((at - t0, n))
    return t0, (pts or [(0.0, n)]) + [(max(0.0, end - t0), n)]
