"""Chaos run: a steady streaming load while a seeded driver breaks workers and KV transfers.

``python -m bench.chaos`` starts a local disaggregated cluster (2 prefill + 2 decode workers,
fault injection on, ``router.stall_s`` short), computes every workload request's tokens once
undisturbed, then runs the load again while faults land at random times from ``--seed``:

- ``kill_prefill`` / ``kill_decode``: SIGKILL a ready worker's process;
- ``stop_prefill`` / ``stop_decode``: SIGSTOP one for a random time up to twice ``stall_s``
  (short: it resumes; long: the router must notice, re-run its streams, replace it);
- ``corrupt`` / ``drop`` / ``sever``: the next KV message of a prefill worker is corrupted,
  lost, or its transport connection cut (``kv_transfer.fault_injection``);
- ``kill_router`` / ``stop_router`` / ``restart_head``: the leading router of an HA pair killed,
  or stopped past its lease, or the Ray head node crashed and restarted with both routers (GCS
  fault tolerance: the workers live on nodes of their own); a run of their own after the worker
  faults', on two ``pdserve serve`` processes (bench/chaos_router.py).

Every request must end either with exactly the undisturbed run's tokens or with a clear gRPC
status; never hang (no answer within ``--hang-s``), never a wrong answer with OK. At the end no
worker may hold a KV block, and after the cluster stops no worker process or listening port of
it may remain. Recovery of a fault: from the fault until its victim serves again (a killed or
replaced worker ready as a fresh process, a stopped one reporting again) and a probe request
sent after the fault has completed. Prints a table and, last, one JSON line.
"""

from __future__ import annotations

# First: takes bench/ off sys.path, where bench/engine.py would shadow `engine` (bench/__init__.py).
import bench  # noqa: F401

import argparse
import json
import os
import random
import signal
import socket
import sys
import threading
import time
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from bench.chaos_clients import CLIENT_KINDS, SHORT, TEXT, log  # (log: also bench/soak's)

FAULT_KINDS = ("kill_prefill", "kill_decode", "stop_prefill", "stop_decode", "corrupt", "drop", "sever")
ROUTER_KINDS = ("kill_router", "stop_router", "restart_head")  # bench/chaos_router.py
# A local cluster for the run: two workers per pool (a fault leaves one), a short stall bound,
# a lease short enough that a leak shows within the run, admission that outwaits recoveries.
CLUSTER = {"prefill.replicas": 2, "decode.replicas": 2, "prefill.kv_cache_gb": 0.1, "decode.kv_cache_gb": 0.1,
           "kv_transfer.fault_injection": True, "kv_transfer.lease_s": 10.0, "router.stall_s": 10.0,
           "router.queue_timeout_s": 300.0, "metrics.port": 0}


@dataclass(frozen=True)
class Spec:
    """One request of the workload: a prompt and its sampling (greedy, or seeded sampled)."""

    prompt: str
    sampling: dict

    @property
    def kind(self) -> str:
        return "sampled" if self.sampling.get("temperature") else "greedy"


def make_specs(n: int, seed: int, max_tokens: int, long_words: int) -> list[Spec]:
    """``n`` distinct requests: short and long prompts, greedy and seeded-sampled, mixed."""
    rng = random.Random(seed)
    words = TEXT.split()
    out = []
    for i in range(n):
        if i % 3 == 2:  # a long prompt: its KV takes many frames (faults land mid-transfer)
            prompt = " ".join(words[j % len(words)] for j in range(rng.randint(long_words // 2, long_words)))
        else:
            prompt = SHORT[i % len(SHORT)]
        sampling = dict(max_tokens=rng.randint(max_tokens // 2, max_tokens), ignore_eos=True)
        if i % 2:
            sampling.update(temperature=0.9, top_k=40, seed=1000 + i)
        else:
            sampling.update(temperature=0.0)
        out.append(Spec(prompt, sampling))
    return out


@dataclass
class Fault:
    kind: str
    at: float
    worker: str = ""
    recovery_s: float | None = None


@dataclass
class Run:
    """What one chaos run saw (filled by the load, the driver and the final checks)."""

    # How each request ended (identical | wrong | hung | a gRPC status name), counted: nothing
    # is kept per request (the soak weighs the router's process, which runs the load too)
    status: Counter = field(default_factory=Counter)
    requests: int = 0
    in_flight: int = 0  # sent and not answered: hung, once the run is over
    faults: list[Fault] = field(default_factory=list)
    pids: set[int] = field(default_factory=set)
    unrecovered: bool = False  # a pool stayed without a ready worker for hang_s: counted as hung
    lock: threading.Lock = field(default_factory=threading.Lock)


class Chaos:
    """Load, faults and checks against a running ``router.app.BackgroundCluster``."""

    def __init__(self, cluster, args) -> None:
        # (heavy: gRPC, loaded only by what uses them)
        from router.client import connect
        self.cluster, self.args = cluster, args
        self.stub = connect(f"127.0.0.1:{cluster.port}")
        self.rng = random.Random(args.seed)
        self.specs = make_specs(args.specs, args.seed, args.max_tokens, args.long_words)
        self.run = Run()
        self.done = threading.Event()
        self.recovering: list[threading.Thread] = []

    # ---- the cluster as the router sees it (read on its event loop) --------------------------
    def workers(self) -> list[dict]:
        async def read():
            return [dict(id=w.worker_id, role=w.role, state=w.state, restarts=w.restarts, actor=w.actor,
                         pid=w.status.pid if w.status else None, seen=w.last_seen)
                    for w in self.cluster.router.pools.workers.values()]
        out = self.cluster.call(read, timeout=30)
        with self.run.lock:
            self.run.pids.update(w["pid"] for w in out if w["pid"])
        return out

    # ---- requests ----------------------------------------------------------------------------
    def generate(self, spec: Spec, rid: str) -> list[int]:
        # (heavy: gRPC, loaded only by what uses them)
        from router.client import collect, make_request
        return collect(self.stub.Generate(make_request(spec.prompt, request_id=rid, **spec.sampling),
                                          timeout=self.args.hang_s))["token_ids"]

    def reference(self) -> list[list[int]]:
        with ThreadPoolExecutor(self.args.concurrency) as pool:
            return list(pool.map(lambda i: self.generate(self.specs[i], f"ref{i}"), range(len(self.specs))))

    def _client(self, n: int, want: list[list[int]], counter: list[int]) -> None:
        # (heavy: gRPC, loaded only by what uses them)
        import grpc
        while True:
            with self.run.lock:
                i = counter[0]
                counter[0] += 1
                if i >= n and self.done.is_set():
                    return
                self.run.requests += 1
                self.run.in_flight += 1
            spec = i % len(self.specs)
            try:
                status = "identical" if self.generate(self.specs[spec], f"c{i}") == want[spec] else "wrong"
            except grpc.RpcError as e:
                status = "hung" if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED else e.code().name
            with self.run.lock:
                self.run.status[status] += 1
                self.run.in_flight -= 1

    # ---- faults ------------------------------------------------------------------------------
    def _victim(self, role: str) -> dict | None:
        ready = [w for w in self.workers() if w["role"] == role and w["state"] == "ready" and w["pid"]]
        return self.rng.choice(ready) if ready else None

    def inject(self, kind: str) -> Fault | None:
        """One fault now; None if it has no victim now (every worker of the role is down)."""
        # (heavy: Ray and a cluster, loaded only by what uses them)
        import ray
        role = "decode" if kind.endswith("decode") else "prefill"
        w = self._victim(role)
        if w is None:
            return None
        f = Fault(kind, time.monotonic(), w["id"])
        if kind.startswith("kill"):
            _signal(w["pid"], signal.SIGKILL)
        elif kind.startswith("stop"):
            _signal(w["pid"], signal.SIGSTOP)
            pause = self.rng.uniform(0.2, 2 * self.args.stall_s)
            threading.Timer(pause, _signal, (w["pid"], signal.SIGCONT)).start()
        else:
            try:
                ray.get(w["actor"].inject.remote(kind), timeout=10)
            except Exception as e:  # it died meanwhile (another fault): no fault of this kind now
                log(f"inject {kind} into {w['id']} failed: {e!r}")
                return None
        t = threading.Thread(target=self._recover, args=(f, w), daemon=True)
        t.start()
        self.recovering.append(t)
        return f

    def _recover(self, f: Fault, victim: dict) -> None:
        """Time until the victim serves again and a probe sent after the fault completes."""
        end = f.at + self.args.hang_s
        back = f.kind in ("corrupt", "drop", "sever")
        while not back and time.monotonic() < end:
            now = {w["id"]: w for w in self.workers()}.get(victim["id"])
            back = now is not None and now["state"] == "ready" and (
                now["restarts"] > victim["restarts"] or (now["seen"] > f.at + 1.0 and _running(victim["pid"])))
            time.sleep(0.1)
        while time.monotonic() < end:
            try:
                self.generate(Spec("Hello", dict(max_tokens=1, temperature=0.0)), f"probe{id(f)}-{time.monotonic()}")
                f.recovery_s = time.monotonic() - f.at
                return
            except Exception:
                time.sleep(0.2)

    def drive(self) -> None:
        """Inject every planned fault at seeded random gaps while the load runs."""
        plan = [k for k in self.args.kinds for _ in range(self.args.faults_per_kind)]
        self.rng.shuffle(plan)
        for kind in plan:
            time.sleep(self.rng.uniform(0.5, 1.5) * self.args.fault_gap_s)
            waited = time.monotonic()
            while (f := self.inject(kind)) is None:  # no victim now: after the next recovery
                if time.monotonic() - waited > self.args.hang_s:  # the pool never came back: a hang
                    log(f"no {kind} victim for {self.args.hang_s:g}s: the cluster did not recover; stopping faults")
                    self.run.unrecovered = True
                    return
                time.sleep(0.5)
            with self.run.lock:
                self.run.faults.append(f)
            log(f"fault {len(self.run.faults)}/{len(plan)}: {kind} {f.worker}")

    # ---- the run -----------------------------------------------------------------------------
    def __call__(self) -> dict:
        a = self.args
        t0 = time.monotonic()
        log(f"reference: {len(self.specs)} requests undisturbed ...")
        want = self.reference()
        self.workers()
        log(f"chaos: at least {a.requests} requests, {a.faults_per_kind} faults of each of {', '.join(a.kinds)}")
        counter = [0]
        clients = [threading.Thread(target=self._client, args=(a.requests, want, counter), daemon=True)
                   for _ in range(a.concurrency)]
        for c in clients:
            c.start()
        self.drive()
        self.done.set()
        for t in clients + self.recovering:  # every request answered, every fault recovered (or hung)
            t.join(a.hang_s + 60)
        leaked, stranded = self.leaked_blocks()
        return self.summary(leaked, stranded, time.monotonic() - t0)

    def leaked_blocks(self) -> tuple[int, int | None]:
        """KV blocks still held once every worker is back and the router tracks no request
        (waited for up to a lease plus the stall bound: every path frees sooner), and those the
        block check attributes to no live request."""
        # (heavy: gRPC, loaded only by what uses them)
        from pdserve.v1 import pdserve_pb2 as pb
        end = time.monotonic() + self.args.lease_s + self.args.stall_s + 30
        while True:
            st = self.stub.GetClusterStatus(pb.GetClusterStatusRequest(check_blocks=True), timeout=60)
            used = sum(w.kv_blocks_used for w in st.workers)
            if (all(w.state == "ready" for w in st.workers) and not used and not st.active_requests) \
                    or time.monotonic() > end:
                self.workers()
                # Asked again now that all is quiet: the check above may have seen a request
                # ending between the workers' answers and the router's list (see the proto).
                st = self.stub.GetClusterStatus(pb.GetClusterStatusRequest(check_blocks=True), timeout=60)
                stranded = sum(w.stranded_blocks for w in st.workers) if st.blocks_checked else None
                return used, stranded
            time.sleep(0.25)

    def summary(self, leaked: int, stranded: int | None, wall: float) -> dict:
        # (heavy: numpy, loaded only by what uses them)
        import numpy as np
        with self.run.lock:  # (a client that outlived its join may still be finishing)
            f, status, requests, in_flight = list(self.run.faults), Counter(self.run.status), self.run.requests, \
                self.run.in_flight
        rec = [x.recovery_s for x in f if x.recovery_s is not None]
        errored = {k: v for k, v in status.items() if k not in ("identical", "wrong", "hung")}
        return {"requests": requests, "faults": len(f), "faults_by_kind": dict(Counter(x.kind for x in f)),
                "completed_identical": status["identical"], "errored": sum(errored.values()),
                "errored_by_status": errored, "wrong": status["wrong"],
                "hung": status["hung"] + in_flight + int(self.run.unrecovered),
                "leaked_blocks": leaked, "stranded_blocks": stranded,
                "swept_blocks": int(self.cluster.router.metrics.swept_blocks._value.get()),
                "reruns": int(self.cluster.router.metrics.retries._value.get()),
                "recovered": len(rec), "recovery_s_p50": float(np.percentile(rec, 50)) if rec else None,
                "recovery_s_p99": float(np.percentile(rec, 99)) if rec else None, "wall_s": round(wall, 1),
                "seed": self.args.seed}


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:  # already gone (replaced by the router meanwhile)
        pass


def _running(pid: int) -> bool:
    """Alive and not stopped (state T)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("T", "Z", "X")
    except OSError:
        return False


def leftovers(pids: set[int], ports: Sequence[int]) -> tuple[list[int], list[int]]:
    """Worker processes still alive and our ports still accepting, after the cluster stopped."""
    alive = [p for p in pids if os.path.exists(f"/proc/{p}")]
    listening = []
    for port in ports:
        with socket.socket() as s:
            s.settimeout(1)
            if s.connect_ex(("127.0.0.1", port)) == 0:
                listening.append(port)
    return alive, listening


def table(out: dict) -> str:
    rows = [("faults injected", out["faults"])] + [(f"  {k}", v) for k, v in sorted(out["faults_by_kind"].items())]
    rows += [("requests", out["requests"]), ("  completed identical", out["completed_identical"]),
             ("  errored (clear status)", out["errored"])]
    rows += [(f"    {k}", v) for k, v in sorted(out["errored_by_status"].items())]
    rows += [("  wrong", out["wrong"]), ("  hung", out["hung"]), ("re-runs", out["reruns"]),
             ("KV blocks leaked", out["leaked_blocks"]), ("KV blocks swept", out["swept_blocks"]),
             ("processes left", out.get("leaked_processes", "-")), ("ports left", out.get("leaked_ports", "-")),
             ("recovery p50 / p99 (s)", f"{out['recovery_s_p50'] or 0:.1f} / {out['recovery_s_p99'] or 0:.1f}"),
             ("wall (s)", out["wall_s"])]
    return "\n".join(f"{k:<28}{v:>10}" for k, v in rows)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.chaos", description=(
        "Chaos run against a local disaggregated cluster: streaming load while workers are killed, "
        "stopped and KV transfers corrupted, dropped or cut. Every request must end identical to an "
        "undisturbed run or with a clear gRPC status; no hang, no leaked block, process or port. "
        "Prints a table, then one JSON line. Exit status 1 if anything was wrong, hung or leaked (blocks "
        "the router's sweep had to free count as leaked)."))
    p.add_argument("--requests", type=int, default=200, help="at least this many requests (default 200); "
                   "the load goes on until every fault is in")
    p.add_argument("--faults-per-kind", type=int, default=20, help="faults of each kind (default 20)")
    kinds = ",".join(FAULT_KINDS + ROUTER_KINDS)
    p.add_argument("--kinds", default=kinds, help=f"fault kinds (default: all: {kinds})")
    p.add_argument("--fault-gap-s", type=float, default=3.0, help="mean seconds between faults (default 3)")
    p.add_argument("--concurrency", type=int, default=8, help="concurrent streams (default 8)")
    p.add_argument("--specs", type=int, default=24, help="distinct requests the load cycles through (default 24)")
    p.add_argument("--max-tokens", type=int, default=32, help="max_tokens of the longest request (default 32)")
    p.add_argument("--long-words", type=int, default=300, help="words of the longest prompt (default 300)")
    p.add_argument("--stall-s", type=float, default=CLUSTER["router.stall_s"], help="router.stall_s (default 10)")
    p.add_argument("--lease-s", type=float, default=CLUSTER["kv_transfer.lease_s"], help="kv_transfer.lease_s (default 10)")
    p.add_argument("--hang-s", type=float, default=300.0, help="a request unanswered this long is hung (default 300)")
    p.add_argument("--transport", default="ucx", help="KV transport: ucx | zmq (default ucx)")
    p.add_argument("--config", default=None, help="base cluster config (default: built-in)")
    p.add_argument("--seed", type=int, default=0, help="seeds the workload and every fault's time and victim")
    p.add_argument("--router-stop-s", type=float, default=10.0, help="stop_router: SIGSTOP this long (default 10)")
    p.add_argument("--router-lease-s", type=float, default=3.0, help="router faults: ha.lease_s (default 3)")
    p.add_argument("--router-resume-s", type=float, default=15.0, help="router faults: ha.resume_s (default 15)")
    p.add_argument("--clients", default=",".join(CLIENT_KINDS),
                   help="router faults: the client kinds the streams take in turn (bench/chaos_clients.py): "
                        f"asyncio (router.client astream), threads (stream, the CLI's), openai (SSE retried with "
                        f"its Idempotency-Key) (default: {','.join(CLIENT_KINDS)})")
    return p


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    kinds = [k for k in args.kinds.split(",") if k]
    bad = sorted(set(kinds) - set(FAULT_KINDS + ROUTER_KINDS))
    if bad or not kinds:
        raise SystemExit(f"chaos: unknown fault kinds {bad}; valid: {', '.join(FAULT_KINDS + ROUTER_KINDS)}")
    # The worker faults' run (``kinds``) and the router faults' (``router_kinds``) are two runs
    args.kinds = [k for k in kinds if k in FAULT_KINDS]
    args.router_kinds = [k for k in kinds if k in ROUTER_KINDS]
    args.clients = [c for c in args.clients.split(",") if c]
    if not args.clients or set(args.clients) - set(CLIENT_KINDS):
        raise SystemExit(f"chaos: --clients {','.join(args.clients)}: valid kinds: {', '.join(CLIENT_KINDS)}")
    return args


def cluster_config(args):
    # (heavy: Ray and a cluster, loaded only by what uses them)
    from router.config import load_config
    return load_config(args.config, {**CLUSTER, "router.stall_s": args.stall_s, "kv_transfer.lease_s": args.lease_s,
                                     "kv_transfer.transport": args.transport})


def run_chaos(cluster, args, make=None) -> dict:
    """The run against ``cluster`` (started with :func:`cluster_config`; ``make(cluster, args)``
    builds the run, default :class:`Chaos`); stops it, then checks that no worker process or
    port of it is left."""
    out = (make or Chaos)(cluster, args)
    result = out()
    ports = [cluster.port] + ([int(cluster.router.metrics.address.rsplit(":", 1)[1])]
                              if cluster.router.metrics.address else [])
    cluster.stop()
    deadline = time.monotonic() + 30  # Ray reaps killed actors' processes asynchronously
    while True:
        procs, left = leftovers(out.run.pids, ports)
        if not procs and not left or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    result.update(leaked_processes=len(procs), leaked_ports=len(left))
    return result


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    out = main_workers(args) if args.kinds else {}
    if args.router_kinds:
        # (heavy: Ray and two routers, loaded only by what uses them)
        from bench.chaos_router import bad, main_router
        from bench.chaos_router import table as router_table
        routers = main_router(args)
        print(router_table(routers))
        print(json.dumps(routers))
        if out:  # both runs: the one line says both (the worker run's keys, the router run's beside)
            out = {**out, "router": routers, **{k: routers[k] for k in ("router_kills", "takeover_s_p50",
                                                                        "takeover_s_p99")},
                   **{k: out[k] + routers[k] for k in ("wrong", "hung", "leaked_blocks")}}
            print(json.dumps(out))
        return 1 if bad(routers) or (out and _bad(out)) else 0
    return 1 if _bad(out) else 0


def main_workers(args) -> dict:
    # (heavy: Ray and a cluster, loaded only by what uses them)
    from router.app import BackgroundCluster, init_ray
    cfg = cluster_config(args)
    init_ray(cfg)
    log("starting a cluster: 2 prefill + 2 decode workers ...")
    try:
        out = run_chaos(BackgroundCluster(cfg), args)
    finally:
        # (heavy: Ray and a cluster, loaded only by what uses them)
        import ray
        ray.shutdown()
    print(table(out))
    print(json.dumps(out))
    return out


def _bad(out: dict) -> bool:
    return bool(out["wrong"] or out["hung"] or out["leaked_blocks"] or out["swept_blocks"]
                or out["leaked_processes"] or out["leaked_ports"])


if __name__ == "__main__":
    sys.exit(main())
