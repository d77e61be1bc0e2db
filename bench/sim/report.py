"""What a simulated run scored: latency percentiles per class, SLO attainment, DistServe goodput.

Goodput (DistServe, as bench/loadgen.py ``max_goodput_rate``): the highest arrival rate at
which at least 90% of requests meet both their class's TTFT and TPOT targets (a refused
request meets neither). ``goodput`` finds it by doubling the rate until a run misses, then
bisecting the bracket, each probe a fresh simulation of the same seed's trace shape.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

from bench.loadgen import SLO_ATTAINMENT, percentile
from bench.sim.workers import SimJob


def latencies(jobs: list[SimJob]) -> tuple[list[float], list[float]]:
    """(TTFTs, TPOTs) in seconds of the jobs not refused, by the load generator's rules
    (bench/loadgen.py ``Result``): TTFT from arrival to the first token, TPOT (last - first
    token) / (tokens - 1) over answers of more than one token."""
    ok = [j for j in jobs if not j.refused]
    return ([j.first_token - j.spec.arrival for j in ok],
            [(j.finish - j.first_token) / (j.spec.max_tokens - 1) for j in ok if j.spec.max_tokens > 1])


def summarize(jobs: list[SimJob], slo: Mapping[str, tuple[float, float]], duration_s: float) -> dict:
    """Flat stats (ms) over all requests and per class: ttft/tpot p50/p90/p99, attainment."""
    out: dict = {}
    classes = sorted({j.spec.cls for j in jobs})
    for cls in [None, *classes]:
        js = [j for j in jobs if cls is None or j.spec.cls == cls]
        ok = [j for j in js if not j.refused]
        ttft, tpot = latencies(ok)
        met = sum(1 for j in ok if _meets(j, slo))
        pre = "" if cls is None else f"{cls}_"
        out[f"{pre}requests"], out[f"{pre}refused"] = len(js), len(js) - len(ok)
        for name, xs in (("ttft", ttft), ("tpot", tpot)):
            for q in (50, 90, 99):
                v = percentile(xs, q)
                out[f"{pre}{name}_ms_p{q}"] = None if v is None else round(v * 1e3, 3)
        out[f"{pre}slo_attainment"] = round(met / len(js), 4) if js else 0.0
    out["throughput_rps"] = round(sum(1 for j in jobs if not j.refused) / duration_s, 4)
    return out


def _meets(j: SimJob, slo: Mapping[str, tuple[float, float]]) -> bool:
    ttft_s, tpot_s = slo[j.spec.cls]
    m = j.spec.max_tokens
    tpot = (j.finish - j.first_token) / (m - 1) if m > 1 else 0.0
    return j.first_token - j.spec.arrival <= ttft_s and tpot <= tpot_s


def goodput(run_at: Callable[[float], dict], lo: float = 0.02, hi_cap: float = 64.0, steps: int = 6) -> tuple[float, list]:
    """Highest rate (req/s per worker) whose run's ``slo_attainment`` >= 90% (module doc):
    (that rate, [(rate, summary), ...] of every probe). ``run_at(rate)`` simulates one rate."""
    probes: list = []

    def ok(rate: float) -> bool:
        s = run_at(rate)
        probes.append((rate, s))
        return s["slo_attainment"] >= SLO_ATTAINMENT

    if not ok(lo):
        return 0.0, probes
    good, bad = lo, None
    while bad is None:
        r = good * 2
        if r > hi_cap:
            return good, probes
        if ok(r):
            good = r
        else:
            bad = r
    for _ in range(steps):
        mid = (good + bad) / 2
        if ok(mid):
            good = mid
        else:
            bad = mid
    return good, probes


def table(rows: list[dict], cols: list[tuple[str, str, str]]) -> str:
    """Plain text table: ``cols`` are (key, header, format)."""
    head = [h for _, h, _ in cols]
    body = [[("-" if r.get(k) is None else format(r[k], f)) for k, _, f in cols] for r in rows]
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    line = lambda xs: "  ".join(x.rjust(w) for x, w in zip(xs, widths))  # noqa: E731
    return "\n".join([line(head), line(["-" * w for w in widths])] + [line(b) for b in body])


class Timer:
    def __enter__(self) -> "Timer":
        self.t0 = time.process_time()
        return self

    def __exit__(self, *exc) -> None:
        self.cpu_s = time.process_time() - self.t0
