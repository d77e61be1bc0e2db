"""Router faults for bench/chaos.py (``--kinds kill_router,stop_router``): an HA pair under
greedy streams while the leading router is killed or stopped.

Two ``pdserve serve`` processes of one cluster (``ha.enabled``, one Ray: router.leader) serve
1 prefill + 1 decode worker (detached: router.ha). ``--concurrency`` clients stream greedy
requests whose answers were computed once undisturbed, over both routers' addresses, through
each client kind of ``--clients`` in turn (bench/chaos_clients.py: the asyncio and threaded
gRPC clients, which Resume or send again under the same id; OpenAI streams retried with their
Idempotency-Key). Faults,
one at a time at seeded random gaps, always on the router that leads:

- ``kill_router``: SIGKILL. Then a new ``pdserve serve`` on the killed one's ports (the
  clients' list stays valid), waited for until it stands by, so the next fault has a standby.
- ``stop_router``: SIGSTOP for ``--router-stop-s`` (past the lease), then SIGCONT: it must find
  its lease gone and stand by again (router.app), fenced off the workers (worker.fence), doing
  no harm; it is the next fault's standby. Its clients' streams learn of the stall from gRPC
  keepalive (router.client ``KEEPALIVE_S``), not from its wake.
- ``restart_head``: every process of the Ray head node SIGKILLed, both routers with it (a head
  machine's crash), then the head's Ray started again on its port and Redis and two new
  ``pdserve serve`` on the old ports (what the head's start commands do, deploy/cluster-aws.yaml).
  The workers are on nodes of their own and live through it: with this kind the whole run is on
  a 3-node cluster on this machine with GCS fault tolerance (tests/multinode.py ``gcs_ft``: the
  head's tables in a Redis outside it), not the private local Ray.

Takeover: from the fault until a router (the standby; after ``restart_head``, either new one)
answers a call on a new channel. Checks: every
stream complete and token-identical (``wrong``: not; ``hung``: no end within ``--hang-s`` or
still open after the run), no KV block held once the leader tracks no request (``leaked_blocks``),
no worker process replaced (``workers_replaced``), and after both routers stop, no worker left.
``stream_gap_s_max``: the longest wait of any stream between two responses (a fault's cost as
a client sees it).
"""

from __future__ import annotations

import random
import shutil
import signal
import tempfile
import threading
import time
import uuid
from collections import Counter
from pathlib import Path

from bench.chaos_clients import SHORT, TEXT, Streams, log
from bench.ha_pair import NoLeader, Router, in_ray, leader

TAKEOVER_GUARD_S = 120.0  # only against a hang: a standby that never leads
START_GUARD_S = 240.0  # a router process's start (imports, the model's folder) on a loaded machine


def cluster_yaml(args, name: str) -> dict:
    """The pair's cluster: small caches, the lease and the resume window from ``args``."""
    return {"mode": "disaggregated", "prefill": {"replicas": 1, "kv_cache_gb": 0.1},
            "decode": {"replicas": 1, "kv_cache_gb": 0.2}, "metrics": {"port": 0},
            "ha": {"enabled": True, "cluster_name": name, "grace_s": 60.0, "lease_s": args.router_lease_s,
                   "resume_s": args.router_resume_s}}


def greedy_prompts(n: int, seed: int, long_words: int) -> list[str]:
    """``n`` distinct prompts, short and long."""
    rng, words = random.Random(seed), TEXT.split()
    return [SHORT[i % len(SHORT)] + f" ({i})" if i % 3 != 2 else
            " ".join(words[j % len(words)] for j in range(rng.randint(long_words // 4, long_words // 2)))
            for i in range(n)]


class RouterChaos:
    """The pair, its clients, its faults and its checks (``args``: bench.chaos's, router kinds)."""

    def __init__(self, args, gcs: str, workdir: str, nodes=None) -> None:
        import yaml  # (heavy: only the router run writes a config)
        self.args, self.gcs = args, gcs
        self.nodes = nodes  # the multi-node cluster (restart_head), or None: the local Ray
        self.env = nodes.env(nodes.nodes[0]) if nodes else None  # the routers': the head's
        self.name = f"chaos-{uuid.uuid4().hex[:8]}"
        self.config = Path(workdir) / "cluster.yaml"
        self.config.write_text(yaml.safe_dump(cluster_yaml(args, self.name)))
        self.log = open(Path(workdir) / "serve.log", "w")
        self.rng = random.Random(args.seed)
        self.streams = Streams(args, greedy_prompts(args.concurrency, args.seed, args.long_words))
        self.takeovers: list[tuple[str, float]] = []
        self.faults: list[str] = []
        self.routers: list[Router] = []

    # ---- faults ------------------------------------------------------------------------------
    def fault(self, kind: str, lead: Router, standby: Router, last: bool) -> tuple[Router, Router]:
        """One fault on ``lead``; returns the router that leads after it (``standby``) and the
        one that stands by beside it (none is waited for after the ``last`` fault)."""
        t0 = time.monotonic()
        if kind == "restart_head":
            return self.restart_head(t0)
        if kind == "kill_router":
            lead.proc.send_signal(signal.SIGKILL)
        else:
            lead.proc.send_signal(signal.SIGSTOP)
        leader([standby], TAKEOVER_GUARD_S)
        self._took(kind, t0, "the standby")
        if kind == "kill_router":
            lead.proc.wait(timeout=60)
            if not last:  # a new router on its ports, the next fault's standby
                fresh = self.router(lead)
                self.routers[self.routers.index(lead)] = fresh
                self._until(fresh.stands_by, START_GUARD_S, "the restarted router did not stand by")
                return standby, fresh
            return standby, lead
        time.sleep(max(0.0, t0 + self.args.router_stop_s - time.monotonic()))
        lead.proc.send_signal(signal.SIGCONT)
        self._until(lead.stands_by, START_GUARD_S, "the woken router did not stand by again")
        if not standby.serves():
            raise NoLeader("the leader stopped serving when the old one woke")
        return standby, lead

    def restart_head(self, t0: float) -> tuple[Router, Router]:
        """The head's crash and restart (module docstring); the new pair, once one leads and
        the other stands by."""
        self.nodes.restart_head()  # (both routers run on the head: killed with it)
        for r in self.routers:
            r.proc.wait(timeout=60)
        log(f"fault {len(self.faults) + 1}: restart_head: the head's Ray was back after {time.monotonic() - t0:.1f} s")
        self.routers = [self.router(r) for r in self.routers]
        lead = leader(self.routers, START_GUARD_S)
        self._took("restart_head", t0, "a new router")
        standby = next(r for r in self.routers if r is not lead)
        self._until(standby.stands_by, START_GUARD_S, "the second new router did not stand by")
        return lead, standby

    def router(self, old: Router | None = None) -> Router:
        """A new ``pdserve serve`` of the pair (on ``old``'s ports: the clients' list stays valid)."""
        return Router(self.config, self.gcs, self.log, old and old.port, old and old.http_port, env=self.env)

    def _took(self, kind: str, t0: float, who: str) -> None:
        took = time.monotonic() - t0
        self.takeovers.append((kind, took))
        self.faults.append(kind)
        log(f"fault {len(self.faults)}: {kind}: {who} led after {took:.1f} s")

    def _until(self, ok, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not ok():
            if time.monotonic() > deadline:
                raise NoLeader(what)
            time.sleep(0.2)

    # ---- the run -----------------------------------------------------------------------------
    def __call__(self) -> dict:
        try:
            return self.run()
        except BaseException:  # (Ctrl-C, a failed check: no router process outlives the run)
            for r in self.routers:
                r.proc.send_signal(signal.SIGCONT)
                r.proc.kill()
            raise

    def run(self) -> dict:
        a = self.args
        t0 = time.monotonic()
        self.routers = [self.router() for _ in range(2)]
        lead = leader(self.routers, START_GUARD_S)
        standby = next(r for r in self.routers if r is not lead)
        self._until(standby.stands_by, START_GUARD_S, "the second router did not stand by")
        self.pids = pids = in_ray(self.gcs, self.env, "worker_pids", self.name)
        log(f"reference: {len(self.streams.prompts)} greedy streams undisturbed ...")
        want = self.streams.reference(f"127.0.0.1:{lead.port}", lead.http_port)
        servers = ",".join(f"127.0.0.1:{r.port}" for r in self.routers)
        clients = threading.Thread(target=self.streams.run, args=(want, servers, [r.http_port for r in self.routers]),
                                   daemon=True)
        clients.start()
        error = None
        try:
            lead = self.drive(lead, standby)
        except NoLeader as e:  # (the run goes on to its checks: counted as hung)
            error = str(e)
            log(f"stopping faults: {e}")
        self.streams.done.set()
        clients.join(a.hang_s + 60)
        leaked, stranded = self.leaked_blocks(next((r for r in self.routers if r.serves()), lead))
        now = in_ray(self.gcs, self.env, "worker_pids", self.name)
        replaced = sum(1 for w, p in pids.items() if now.get(w) != p)
        left = self.stop()
        return self.summary(leaked, stranded, replaced, left, error, time.monotonic() - t0)

    def drive(self, lead: Router, standby: Router) -> Router:
        """The faults: ``--faults-per-kind`` of each router kind, shuffled, at seeded gaps;
        returns the router that leads after the last."""
        plan = [k for k in self.args.router_kinds for _ in range(self.args.faults_per_kind)]
        self.rng.shuffle(plan)
        for n, kind in enumerate(plan):
            time.sleep(self.rng.uniform(0.5, 1.5) * self.args.fault_gap_s)
            lead, standby = self.fault(kind, lead, standby, n == len(plan) - 1)
        return lead

    def leaked_blocks(self, lead: Router) -> tuple[int, int | None]:
        """KV blocks still held once the leader tracks no request (waited for up to the resume
        window and more: a stream sent again leaves its adopted twin until then)."""
        # (heavy: gRPC, loaded only by what uses them)
        from pdserve.v1 import pdserve_pb2 as pb
        stub = lead.stub
        end = time.monotonic() + self.args.router_resume_s + 60
        while True:
            st = stub.GetClusterStatus(pb.GetClusterStatusRequest(check_blocks=True), timeout=60)
            used = sum(w.kv_blocks_used for w in st.workers)
            if (not used and not st.active_requests) or time.monotonic() > end:
                stranded = sum(w.stranded_blocks for w in st.workers) if st.blocks_checked else None
                return used, stranded
            time.sleep(0.25)

    def stop(self) -> int:
        """SIGTERM the standby, then the leader (the last router ends the workers); worker
        processes left after them (then ended here)."""
        for r in sorted(self.routers, key=lambda r: r.serves()):
            r.proc.send_signal(signal.SIGCONT)  # (a stopped one would never end)
            r.proc.send_signal(signal.SIGTERM)
            try:
                r.proc.wait(timeout=120)
            except Exception:
                r.proc.kill()
                r.proc.wait(timeout=30)
        self.log.close()
        return in_ray(self.gcs, self.env, "end_workers", self.name)

    def summary(self, leaked: int, stranded: int | None, replaced: int, left: int, error: str | None,
                wall: float) -> dict:
        # (heavy: numpy, loaded only by what uses them)
        import numpy as np

        def pct(xs: list[float], q: float) -> float | None:
            return round(float(np.percentile(xs, q)), 2) if xs else None
        took = [t for _, t in self.takeovers]
        by_kind = {k: [t for kk, t in self.takeovers if kk == k] for k in sorted(set(self.faults))}
        st = self.streams
        errored = {k: v for k, v in st.status.items() if k not in ("identical", "wrong", "hung")}
        return {"requests": st.requests, "router_faults": len(self.faults),
                "faults_by_kind": dict(Counter(self.faults)), "router_kills": self.faults.count("kill_router"),
                "router_stops": self.faults.count("stop_router"),
                "head_restarts": self.faults.count("restart_head"),
                "takeover_s_p50": pct(took, 50), "takeover_s_p99": pct(took, 99),
                "takeover_s_max": round(max(took), 2) if took else None,
                "takeover_s_by_kind": {k: [pct(v, 50), pct(v, 99)] for k, v in by_kind.items() if v},
                "completed_identical": st.status["identical"], "wrong": st.status["wrong"],
                "hung": st.status["hung"] + st.in_flight + int(error is not None),
                "errored": sum(errored.values()), "errored_by_status": errored,
                "leaked_blocks": leaked, "stranded_blocks": stranded, "workers_replaced": replaced,
                "workers_left": left, "stream_gap_s_max": round(max(st.gaps), 2) if st.gaps else None,
                "router_stop_s": self.args.router_stop_s, "lease_s": self.args.router_lease_s,
                "concurrency": self.args.concurrency,
                "by_client": {k: {"streams": st.kind.count(k), **c} for k, c in st.by_kind.items()},
                "max_tokens": self.args.max_tokens, "error": error,
                "wall_s": round(wall, 1), "seed": self.args.seed}


def table(out: dict) -> str:
    rows = [("router faults", out["router_faults"])] + [(f"  {k}", v) for k, v in
                                                         sorted(out["faults_by_kind"].items())]
    took = (out["takeover_s_p50"] or 0, out["takeover_s_p99"] or 0, out["takeover_s_max"] or 0)
    rows += [("takeover p50 / p99 / max (s)", " / ".join(f"{t:.1f}" for t in took))]
    rows += [(f"  {k} p50 / p99 (s)", f"{v[0]:.1f} / {v[1]:.1f}")
             for k, v in out["takeover_s_by_kind"].items()]
    rows += [("streams", out["requests"]), ("  completed identical", out["completed_identical"]),
             ("  errored", out["errored"]), ("  wrong", out["wrong"]), ("  hung", out["hung"])]
    rows += [(f"  {k} ({c['streams']} streams): identical",
              f"{c.get('identical', 0)} of {sum(v for s, v in c.items() if s != 'streams')}")
             for k, c in out["by_client"].items()]
    rows += [("longest wait in a stream (s)", out["stream_gap_s_max"]), ("KV blocks leaked", out["leaked_blocks"]),
             ("workers replaced", out["workers_replaced"]), ("workers left", out["workers_left"]),
             ("wall (s)", out["wall_s"])]
    return "\n".join(f"{k:<30}{v!s:>18}" for k, v in rows)


def bad(out: dict) -> bool:
    return bool(out["wrong"] or out["hung"] or out["errored"] or out["leaked_blocks"] or out["workers_replaced"]
                or out["workers_left"])


def run_router_chaos(args, gcs: str, nodes=None, make=None) -> dict:
    """The router run on the Ray at ``gcs`` (``nodes``: the multi-node cluster it is;
    ``make(args, gcs, workdir, nodes)`` builds the run, default :class:`RouterChaos`)."""
    with tempfile.TemporaryDirectory(prefix="pdserve-chaos-router-") as d:
        chaos = (make or RouterChaos)(args, gcs, d, nodes)
        out = chaos()
        lines = (Path(d) / "serve.log").read_text().splitlines(True)
        if bad(out):  # (what the routers said, for the one who reads the failure)
            log("serve.log tail:\n" + "".join(lines[-60:]))
        for rid, gap in chaos.streams.long_gaps:  # (the routers' lines of a stream that waited long)
            log(f"serve.log on {rid} ({gap:.1f} s without a new token):\n"
                + "".join(x for x in lines if rid in x)[-6000:])
    return out


def main_router(args, make=None) -> dict:
    """Start a private local Ray for the pair (with ``restart_head``: a 3-node cluster with GCS
    fault tolerance), run (``make``: as :func:`run_router_chaos`'s), shut it down."""
    if "restart_head" in args.router_kinds:
        # (heavy: a cluster's processes; the harness the multinode tests use)
        from tests.multinode import MultiNode
        root = Path(tempfile.mkdtemp(prefix="pdch-", dir="/tmp"))  # short: AF_UNIX paths under it
        log(f"starting a 3-node Ray cluster with GCS fault tolerance under {root} ...")
        nodes = MultiNode(root, gcs_ft=True).up()
        try:
            return run_router_chaos(args, nodes.address, nodes, make)
        finally:
            nodes.down()
            shutil.rmtree(root, ignore_errors=True)
    # (heavy: Ray and a cluster, loaded only by what uses them)
    import ray
    from router.app import init_ray
    from router.config import load_config
    init_ray(load_config(None, {"prefill.replicas": 1, "decode.replicas": 1}))
    try:
        return run_router_chaos(args, ray.get_runtime_context().gcs_address, make=make)
    finally:
        ray.shutdown()
