"""Soak run: mixed streaming load for a long time with a fault every few minutes, memory watched.

``python -m bench.soak`` runs bench/chaos.py's cluster, load and faults (one fault every
``--fault-every-s``, the kinds in turn) for ``--duration-s`` (default 30 min), sampling the
resident memory (RSS, /proc) of the router process and of every worker process. Growth per
hour is the least-squares slope of each process's RSS after a warm-up (``--warmup-s`` from its
first sample; a process replaced by a fault starts its own series), given with its standard error so that
"flat within noise" can be read off: a slope within two standard errors of 0, or one too small
to matter (``--flat-mb-per-h``). The router's process also runs the load generator's clients
(one process, so both are covered). Prints a table, then one JSON line.

Router kinds (``--kinds kill_router,stop_router,restart_head``) run a soak of their own, on
bench/chaos_router.py's HA pair of ``pdserve serve`` processes (RouterSoak).
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

from bench.chaos import FAULT_KINDS, ROUTER_KINDS, Chaos, cluster_config, log, run_chaos
from bench.chaos import build_parser as chaos_parser
from bench.chaos_router import RouterChaos, bad, main_router, table
from bench.ha_pair import Router


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


class MemorySeries:
    """RSS samples per process (``rows``) and their growth; needs ``args`` (``warmup_s``,
    ``fault_every_s``, ``flat_mb_per_h``). For :class:`Soak` and :class:`RouterSoak`."""

    rows: dict[str, array.array]

    def record(self, name: str, t: float, m: dict[str, float]) -> None:
        # (NaN: not read, e.g. another user's process has no readable maps)
        self.rows.setdefault(name, array.array("d")).extend([t] + [m.get(k, math.nan) for k in _KINDS])

    def sample_pids(self, t: float, procs: dict[str, int]) -> None:
        """One sample of each of ``procs`` ("name pid" -> pid) that is alive."""
        for name, pid in procs.items():
            if (m := memory(pid)).get("rss") is not None:
                self.record(name, t, m)

    def sample_until(self, done: threading.Event) -> None:
        """``self.sample()`` every ``--sample-s`` until ``done`` is set."""
        while not done.is_set():
            try:
                self.sample()
            except Exception as e:  # a process between incarnations: the next sample sees it
                log(f"sample failed: {e!r}")
            done.wait(self.args.sample_s)

    def parts(self, name: str) -> list[tuple[float, dict[str, float]]]:
        """(t, memory()) per sample of one process."""
        r, w = self.rows[name], 1 + len(_KINDS)
        return [(r[i], {k: v for k, v in zip(_KINDS, r[i + 1:i + w]) if not math.isnan(v)})
                for i in range(0, len(r), w)]

    def growth(self) -> dict[str, dict]:
        out = {}
        for name in self.rows:
            # (the warm-up from each process's first sample: one that a fault started mid-run
            # warms up too, as a router loading its model and tokenizer does)
            every = self.parts(name)
            parts = [(t, m) for t, m in every if t >= every[0][0] + self.args.warmup_s]
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


class Soak(MemorySeries, Chaos):
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
        self.sample_pids(now, procs)

    def drive(self) -> None:
        self.t0 = time.monotonic()  # the load starts now (after the undisturbed reference run)
        threading.Thread(target=self.sample_until, args=(self.done,), daemon=True).start()
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


class RouterSoak(MemorySeries, RouterChaos):
    """Router faults in a soak: bench/chaos_router.py's HA pair, workers and streams for
    ``--duration-s``, one router fault every ``--fault-every-s`` (the router kinds in turn; a
    killed router is always started again, so the pair stays whole to the end), memory sampled
    every ``--sample-s``: each router process (a series per stretch of one role, leading or
    standing by), each worker (the same processes throughout: none may be replaced) and this
    process, which runs the clients. Checks: chaos_router's (every stream identical, none hung, no block held
    after, no worker replaced or left) and the soak's (every long-lived process's RSS flat)."""

    def __init__(self, args, gcs: str, workdir: str, nodes=None) -> None:
        super().__init__(args, gcs, workdir, nodes)
        self.rows: dict[str, array.array] = {}  # (as Soak's: flat doubles per process)
        self.t0 = time.monotonic()
        self.fault_at: list[tuple[str, float]] = []
        self._roles: dict[int, tuple[str, float]] = {}  # router pid -> (its role, since)

    def sample(self) -> None:
        now = time.monotonic() - self.t0
        procs = {f"clients {os.getpid()}": os.getpid()}
        procs.update({self._episode(r, now): r.proc.pid for r in list(self.routers) if r.proc.poll() is None})
        procs.update({f"{w} {pid}": pid for w, pid in self.pids.items()})
        self.sample_pids(now, procs)

    def _episode(self, r: Router, now: float) -> str:
        """A router's series: one per stretch of one role. A standby that takes the lead steps
        up ~120 MB at once (it loads what serving needs: measured 338 -> 455 MB, then 427 MB
        flat), a step the fit would read as growth; each stretch warms up on its own."""
        role = "leads" if r.serves() else "stands by"  # (a stopped leader: stands by, unanswering)
        was = self._roles.get(r.proc.pid)
        if was is None or was[0] != role:
            self._roles[r.proc.pid] = was = (role, now)
        return f"router {r.proc.pid} {role} from {was[1]:.0f}s"

    def drive(self, lead: Router, standby: Router) -> Router:
        self.t0 = time.monotonic()  # the load starts now (after the undisturbed reference run)
        done = threading.Event()
        thread = threading.Thread(target=self.sample_until, args=(done,), daemon=True)
        thread.start()
        end = self.t0 + self.args.duration_s
        try:
            while (left := end - time.monotonic()) > 0:
                time.sleep(min(left, self.args.fault_every_s))
                if time.monotonic() >= end:
                    break
                kind = self.args.router_kinds[len(self.faults) % len(self.args.router_kinds)]
                self.fault_at.append((kind, round(time.monotonic() - self.t0, 1)))
                log(f"{(time.monotonic() - self.t0) / 60:.1f} min: fault {kind}")
                lead, standby = self.fault(kind, lead, standby, last=False)
        finally:
            done.set()
            thread.join()
        self.sample()
        return lead


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
    p.add_argument("--kinds", default=",".join(FAULT_KINDS), help=(
        f"fault kinds, in turn (default: the worker kinds, {','.join(FAULT_KINDS)}); router kinds "
        f"({','.join(ROUTER_KINDS)}) run a soak of their own on an HA pair (RouterSoak), "
        f"after the worker kinds' if both are given"))
    p.set_defaults(requests=0, faults_per_kind=0)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    kinds = [k for k in args.kinds.split(",") if k]
    if not kinds or set(kinds) - set(FAULT_KINDS + ROUTER_KINDS):
        raise SystemExit(f"soak: unknown fault kinds {sorted(set(kinds) - set(FAULT_KINDS + ROUTER_KINDS))}; "
                         f"valid: {', '.join(FAULT_KINDS + ROUTER_KINDS)}")
    # The worker faults' soak and the router faults' (RouterSoak) are two runs, each
    # of --duration-s, as chaos's two runs are.
    args.kinds = [k for k in kinds if k in FAULT_KINDS]
    args.router_kinds = [k for k in kinds if k in ROUTER_KINDS]
    args.clients = [c for c in args.clients.split(",") if c]
    ok = True
    if args.kinds:
        out = soak_workers(args)
        ok = out["all_flat"] and not (out["wrong"] or out["hung"] or out["leaked_blocks"])
    if args.router_kinds:
        ok = soak_routers(args) and ok
    return 0 if ok else 1


def soak_workers(args) -> dict:
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
    if args.samples_out:
        with open(args.samples_out, "w") as f:
            json.dump({"memory": {name: soak.parts(name) for name in soak.rows},
                       "faults": [(x.kind, x.worker, round(x.at - soak.t0, 1)) for x in soak.run.faults]}, f)
    report(out, soak, args)
    print(f"requests {out['requests']} (identical {out['completed_identical']}, errored {out['errored']}, wrong "
          f"{out['wrong']}, hung {out['hung']}), faults {out['faults']}, leaked blocks {out['leaked_blocks']}")
    print(json.dumps(out))
    return out


def soak_routers(args) -> bool:
    """The router faults' soak (RouterSoak); whether all was well."""
    log(f"soak (router faults: {','.join(args.router_kinds)}): {args.duration_s / 60:g} min, "
        f"a fault every {args.fault_every_s:g}s")
    soak = None

    def make(*a):
        nonlocal soak
        soak = RouterSoak(*a)
        return soak
    out = main_router(args, make)
    if args.samples_out:
        with open(args.samples_out + ".router" if args.kinds else args.samples_out, "w") as f:
            json.dump({"memory": {name: soak.parts(name) for name in soak.rows}, "faults": soak.fault_at}, f)
    print(table(out))
    report(out, soak, args)
    print(json.dumps(out))
    return out["all_flat"] and not bad(out)


def report(out: dict, soak: MemorySeries, args) -> None:
    """Each long-lived process's growth, printed and added to ``out``."""
    growth = soak.growth()
    out.update(rss=growth, max_growth_mb_per_h=max((g["growth_mb_per_h"] for g in growth.values()), default=None),
               all_flat=all(g["flat"] for g in growth.values()), duration_s=args.duration_s)
    for name, g in sorted(growth.items()):
        print(f"{name:<24}{g['rss_mb_first']:>9.1f} MB -> {g['rss_mb_last']:>7.1f} MB over {g['minutes']:>5.1f} min: "
              f"{g['growth_mb_per_h']:+8.2f} ± {g['stderr_mb_per_h']:.2f} MB/h (second half {g['second_half_mb_per_h']:+.2f}) "
              f"{'flat' if g['flat'] else 'GROWS'}"
              + (" (" + ", ".join(f"{k} {v:+g}" for k, v in g["change"].items()) + ")" if "change" in g else ""))


if __name__ == "__main__":
    sys.exit(main())
