"""Soak run: mixed streaming load for a long time with a fault every few minutes, memory watched.

``python -m bench.soak`` runs bench/chaos.py's cluster, load and faults (one fault every
``--fault-every-s``, the kinds in turn) for ``--duration-s`` (default 30 min), sampling the
resident memory (RSS, /proc) of the router process and of every worker process. Growth per
hour is the least-squares slope of each process's RSS after a warm-up (``--warmup-s``; a
process replaced by a fault starts its own series), given with its standard error so that
"flat within noise" can be read off: a slope within two standard errors of 0, or one too small
to matter (``--flat-mb-per-h``). The router's process also runs the load generator's clients
(one process, so both are covered). Prints a table, then one JSON line.
"""

from __future__ import annotations

# First: takes bench/ off sys.path, where bench/engine.py would shadow `engine` (bench/__init__.py).
import bench  # noqa: F401

import argparse
import array
import json
import math
import os
import sys
import threading
import time
from collections.abc import Sequence

from bench.chaos import FAULT_KINDS, Chaos, cluster_config, log, run_chaos
from bench.chaos import build_parser as chaos_parser


# /proc/<pid>/status fields, in kB: the resident set and its split. Anonymous memory is the
# heap (malloc, torch); shmem is mapped shared segments (UCX's shared-memory transports map
# their peers' segments), file is code and mapped files.
_FIELDS = {"VmRSS:": "rss", "RssAnon:": "anon", "RssFile:": "file", "RssShmem:": "shmem"}
_KINDS = ("rss", "anon", "file", "shmem", "sysv")  # what memory() says of a process


def memory(pid: int) -> dict[str, float]:
    """MB by kind (``rss``, ``anon``, ``file``, ``shmem``) and ``sysv``: how many SysV shared-memory
    mappings it has; {} if the process is gone."""
    out: dict[str, float] = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key = line.split(None, 1)[0] if line.strip() else ""
                if key in _FIELDS:
                    out[_FIELDS[key]] = int(line.split()[1]) / 1024
    except (OSError, ValueError):
        return {}
    try:
        with open(f"/proc/{pid}/maps") as f:
            out["sysv"] = sum(1 for line in f if "SYSV" in line)
    except OSError:  # (another user's process): the RSS sample stands without it
        pass
    return out


def slope_per_h(series: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares slope of (seconds, MB) in MB/h, and its standard error."""
    # (heavy: numpy, loaded only by what uses them)
    import numpy as np
    t = np.array([s for s, _ in series]) / 3600
    y = np.array([m for _, m in series])
    if len(t) < 3 or np.ptp(t) == 0:
        return 0.0, float("inf")
    a, b = np.polyfit(t, y, 1)
    resid = y - (a * t + b)
    se = float(np.sqrt(resid @ resid / (len(t) - 2) / ((t - t.mean()) @ (t - t.mean()))))
    return float(a), se


def grows(slope: float, se: float, flat_mb_per_h: float) -> bool:
    """A process grows when its slope is above both its noise (two standard errors) and what is
    too small to matter. Only growth counts: a falling RSS (a start-up peak given back) is
    not a leak."""
    return slope > max(2 * se, flat_mb_per_h)


class Soak(Chaos):
    """Chaos's load and faults, spread over a duration, with RSS sampling."""

    def __init__(self, cluster, args) -> None:
        super().__init__(cluster, args)
        # "name pid" -> rows of (t, then MB by kind, sysv) as flat doubles: a sample costs 48
        # bytes in the process it weighs (a tuple and a dict per sample cost ~0.6 KB: 1.4 MB/h)
        self.rows: dict[str, array.array] = {}
        self.t0 = time.monotonic()

    def sample(self) -> None:
        now = time.monotonic() - self.t0
        procs = {f"router {os.getpid()}": os.getpid()}
        procs.update({f"{w['id']} {w['pid']}": w["pid"] for w in self.workers() if w["pid"]})
        for name, pid in procs.items():
            if (m := memory(pid)).get("rss") is not None:
                self.record(name, now, m)

    def _sampler(self) -> None:
        while not self.done.is_set():
            try:
                self.sample()
            except Exception as e:  # a worker between incarnations: the next sample sees it
                log(f"sample failed: {e!r}")
            self.done.wait(self.args.sample_s)

    def drive(self) -> None:
        self.t0 = time.monotonic()  # the load starts now (after the undisturbed reference run)
        threading.Thread(target=self._sampler, daemon=True).start()
        end = self.t0 + self.args.duration_s
        i = 0
        while (left := end - time.monotonic()) > 0:
            time.sleep(min(left, self.args.fault_every_s))
            if time.monotonic() >= end:
                break
            kind = self.args.kinds[i % len(self.args.kinds)]
            i += 1
            if (f := self.inject(kind)) is not None:
                with self.run.lock:
                    self.run.faults.append(f)
                log(f"{(time.monotonic() - self.t0) / 60:.1f} min: fault {kind} {f.worker}")
        self.sample()

    def record(self, name: str, t: float, m: dict[str, float]) -> None:
        # (NaN: not read, e.g. another user's process has no readable maps)
        self.rows.setdefault(name, array.array("d")).extend([t] + [m.get(k, math.nan) for k in _KINDS])

    def parts(self, name: str) -> list[tuple[float, dict[str, float]]]:
        """(t, memory()) per sample of one process."""
        r, w = self.rows[name], 1 + len(_KINDS)
        return [(r[i], {k: v for k, v in zip(_KINDS, r[i + 1:i + w]) if not math.isnan(v)})
                for i in range(0, len(r), w)]

    def growth(self) -> dict[str, dict]:
        out = {}
        for name in self.rows:
            parts = [(t, m) for t, m in self.parts(name) if t >= self.args.warmup_s]
            kept = [(t, m["rss"]) for t, m in parts]
            if len(kept) < 3 or kept[-1][0] - kept[0][0] < self.args.fault_every_s / 2:
                continue  # too short-lived (replaced by a fault) to say anything
            slope, se = slope_per_h(kept)
            late, _ = slope_per_h(kept[len(kept) // 2:])  # levelling off (warm-up) or not (a leak)
            out[name] = {"rss_mb_first": round(kept[0][1], 1), "rss_mb_last": round(kept[-1][1], 1),
                         "minutes": round((kept[-1][0] - kept[0][0]) / 60, 1), "growth_mb_per_h": round(slope, 2),
                         "stderr_mb_per_h": round(se, 2), "second_half_mb_per_h": round(late, 2),
                         "series": [(round(t), round(m, 1)) for t, m in kept[::max(1, len(kept) // 30)]],
                         "flat": not grows(slope, se, self.args.flat_mb_per_h)}
            # where the change is: heap (anon), shared segments (shmem, sysv), files
            out[name]["change"] = {k: round(parts[-1][1].get(k, 0) - parts[0][1].get(k, 0), 1)
                                   for k in ("anon", "shmem", "file", "sysv")}
        return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.soak", parents=[chaos_parser()], add_help=False,
                                conflict_handler="resolve", description=(
                                    "Soak run: chaos's load with a fault every few minutes for a long time, RSS of "
                                    "the router and every worker sampled; reports growth per hour. Table, then JSON."))
    p.add_argument("-h", "--help", action="help", help="show this help message and exit")
    p.add_argument("--duration-s", type=float, default=1800.0, help="length of the run (default 1800 = 30 min)")
    p.add_argument("--fault-every-s", type=float, default=180.0, help="one fault this often (default 180)")
    p.add_argument("--sample-s", type=float, default=10.0, help="RSS sampling interval (default 10)")
    p.add_argument("--warmup-s", type=float, default=120.0, help="RSS before this is not fitted (default 120)")
    p.add_argument("--flat-mb-per-h", type=float, default=5.0,
                   help="growth this small counts as flat whatever the noise (default 5 MB/h)")
    p.add_argument("--samples-out", default=None,
                   help="write every memory sample and fault time here as JSON (to attribute steps to faults)")
    p.set_defaults(requests=0, faults_per_kind=0, kinds=",".join(FAULT_KINDS))  # (router faults: not yet)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.kinds = [k for k in args.kinds.split(",") if k]
    if not args.kinds or set(args.kinds) - set(FAULT_KINDS):
        raise SystemExit(f"soak: unknown fault kinds {sorted(set(args.kinds) - set(FAULT_KINDS))}; "
                         f"valid: {', '.join(FAULT_KINDS)}")
    # (heavy: Ray and a cluster, loaded only by what uses them)
    from router.app import BackgroundCluster, init_ray
    cfg = cluster_config(args)
    init_ray(cfg)
    log(f"soak: {args.duration_s / 60:g} min, a fault every {args.fault_every_s:g}s")
    soak = None

    def make(cluster, a):
        nonlocal soak
        soak = Soak(cluster, a)
        return soak
    try:
        out = run_chaos(BackgroundCluster(cfg), args, make=make)
    finally:
        # (heavy: Ray and a cluster, loaded only by what uses them)
        import ray
        ray.shutdown()
    growth = soak.growth()
    if args.samples_out:
        with open(args.samples_out, "w") as f:
            json.dump({"memory": {name: soak.parts(name) for name in soak.rows},
                       "faults": [(x.kind, x.worker, round(x.at - soak.t0, 1)) for x in soak.run.faults]}, f)
    out.update(rss=growth, max_growth_mb_per_h=max((g["growth_mb_per_h"] for g in growth.values()), default=None),
               all_flat=all(g["flat"] for g in growth.values()), duration_s=args.duration_s)
    for name, g in sorted(growth.items()):
        print(f"{name:<24}{g['rss_mb_first']:>9.1f} MB -> {g['rss_mb_last']:>7.1f} MB over {g['minutes']:>5.1f} min: "
              f"{g['growth_mb_per_h']:+8.2f} ± {g['stderr_mb_per_h']:.2f} MB/h (second half {g['second_half_mb_per_h']:+.2f}) "
              f"{'flat' if g['flat'] else 'GROWS'}"
              + (" (" + ", ".join(f"{k} {v:+g}" for k, v in g["change"].items()) + ")" if "change" in g else ""))
    print(f"requests {out['requests']} (identical {out['completed_identical']}, errored {out['errored']}, wrong "
          f"{out['wrong']}, hung {out['hung']}), faults {out['faults']}, leaked blocks {out['leaked_blocks']}")
    print(json.dumps(out))
    return 0 if out["all_flat"] and not (out["wrong"] or out["hung"] or out["leaked_blocks"]) else 1


if __name__ == "__main__":
    sys.exit(main())
