"""The simulated cluster: a fake clock, one event heap, the workers and the router's policies.

Events (``heap`` of (time, seq, kind, payload); ``seq`` keeps equal times in insertion order,
so a run is a function of its inputs):

    arrive(job)            -> place it now, or queue it (the router's admission queue, FIFO)
    step(worker, gen)      -> a step or decode run ended (stale ``gen``: replaced, dropped)
    transfer(job)          -> its KV landed on its decode worker: first token, decoding starts
    timeout(job)           -> still queued after ``queue_timeout_s``: refused
    control                -> the role controller decides (adaptive)
    switched(worker)       -> a drained worker joins its new pool

The queue's head is retried whenever capacity may have grown (a request finished, a transfer
ended, a worker switched): the router's ``_wait_change``, without the 0.1 s poll.
"""

from __future__ import annotations

import heapq
import itertools
from collections import defaultdict, deque
from dataclasses import dataclass, field

from bench.sim.costs import CostModel
from bench.sim.policy import RouterSettings, place, role_signals
from bench.sim.traces import Spec
from bench.sim.workers import SimJob, SimWorker
from router.autoscale import DecodeTargets, Latency, PrefillTargets
from router.holdings import Holdings
from router.jobs import JobState
from router.prefix_index import PrefixIndex, block_hashes, prefilled
from router.roles import RolesConfig, RoleState, decide_moving

# adaptive-slo: adaptive with the controller's targets set to the SLOs served to (simulate.py
# slo_targets), as an operator would configure autoscale.prefill/decode; adaptive: its defaults
MODES = ("colocated", "colocated+chunked", "disaggregated", "disaggregated-local", "adaptive", "adaptive-slo")


@dataclass(frozen=True)
class ClusterSpec:
    """One simulated deployment. ``prefill``: workers starting as prefill workers (the rest
    decode); ignored by the colocated modes. Every worker has the cost model's KV (equal
    memory for every mode and split)."""

    mode: str
    workers: int
    prefill: int = 0
    local_prefill_tokens: int = 96  # disaggregated-local and adaptive (config: router.local_prefill_tokens)
    prefix_aware: bool = True
    queue_timeout_s: float = 60.0
    max_queue: int = 256
    roles: RolesConfig = field(default_factory=RolesConfig)
    prefill_targets: PrefillTargets = field(default_factory=PrefillTargets)
    decode_targets: DecodeTargets = field(default_factory=DecodeTargets)
    window_s: float = 30.0  # autoscale.window_s
    # workers per node, sharing its memory bandwidth (workers.py neighbours; worker i on node
    # i mod nodes, so prefill workers spread over the nodes): 1 = each alone, as the scale runs
    # assume; a 2-core machine running a prefill and a decode worker of one thread each is 2
    # (validate.sim_setup)
    node_workers: int = 1

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}; known: {', '.join(MODES)}")
        if self.workers < 1 or self.node_workers < 1:
            raise ValueError("workers and node_workers must be >= 1")
        if not self.mode.startswith("colocated") and not 1 <= self.prefill < self.workers:
            raise ValueError(f"{self.mode}: prefill workers must be in 1..{self.workers - 1}, got {self.prefill}")


class Cluster:
    """Runs one trace through one deployment (module doc). What the live jobs hold is kept in
    a ``router.holdings.Holdings`` as the router keeps it (updated as each job is placed, gets
    its first token and ends), so a placement costs what it costs the router."""

    def __init__(self, spec: ClusterSpec, cost: CostModel) -> None:
        self.spec, self.cost = spec, cost
        colocated = spec.mode.startswith("colocated")
        self.settings = RouterSettings(colocated=colocated, adaptive=spec.mode.startswith("adaptive"),
                                       prefix_aware=spec.prefix_aware,
                                       local_prefill_tokens=spec.local_prefill_tokens
                                       if spec.mode in ("disaggregated-local", "adaptive", "adaptive-slo") else 0)
        self.workers: dict[str, SimWorker] = {}
        for i in range(spec.workers):
            role = "colocated" if colocated else "prefill" if i < spec.prefill else "decode"
            self.workers[f"w{i:03d}"] = SimWorker(f"w{i:03d}", role, cost,
                                                  chunked=spec.mode != "colocated")
        # worker i on node i mod nodes: the prefill workers (the first ones) spread over the nodes
        ws, nodes = list(self.workers.values()), -(-spec.workers // spec.node_workers)
        for i, w in enumerate(ws):
            w.neighbours = [n for k, n in enumerate(ws) if k % nodes == i % nodes and n is not w]
        self._announced: dict[str, bool] = {}  # each worker's busy state its neighbours last saw
        self._quiet_node = cost.node_decode_x == cost.node_prefill_x == 1.0  # (neighbours change nothing)
        self.index = PrefixIndex() if spec.prefix_aware else None
        self.heap: list = []
        self.seq = itertools.count()
        self.now = 0.0
        self.queue: deque[SimJob] = deque()
        self.jobs: list[SimJob] = []
        self.live: set[SimJob] = set()
        self._prefilling: set[SimJob] = set()  # placed, no first token yet
        self._closed = 0  # jobs finished or refused
        self.holdings = Holdings()  # what the live jobs hold (router.holdings)
        self.recent: deque[Latency] = deque()  # TTFT at first tokens, TPOT at finishes
        self.role_state = RoleState()
        self.switches: list[tuple[float, str, str, str, str]] = []
        self.calls: dict[str, int] = {}
        self.placements: dict[str, int] = defaultdict(int)
        self.events = 0

    # ---- the loop ------------------------------------------------------------------------------
    def push(self, t: float, kind: str, payload=None) -> None:
        heapq.heappush(self.heap, (t, next(self.seq), kind, payload))

    def run(self, trace: list[Spec]) -> list[SimJob]:
        bs = self.cost.block_size
        for spec in trace:
            job = SimJob(spec, block_hashes(spec.prompt, bs) if self.index is not None else [])
            self.jobs.append(job)
            # (the router sees it once the client's call has crossed: costs.py request_ms)
            self.push(spec.arrival + self.cost.request_ms / 1e3, "arrive", job)
        if self.settings.adaptive:
            self.push(self.spec.roles.interval_s, "control")
        while self.heap and self._closed < len(self.jobs):
            self.now, _, kind, x = heapq.heappop(self.heap)
            self.events += 1
            if kind == "arrive":
                x.queued_at = self.now
                if self.queue or not self._try(x):
                    self._enqueue(x)
            elif kind == "step":
                w, gen = x
                if gen == w.gen:
                    self._step_done(w)
            elif kind == "transfer":
                self._landed(x)
            elif kind == "timeout":
                if x.state is JobState.PLACING and not x.refused and x in self.queue:
                    self.queue.remove(x)
                    self._refuse(x, "no KV capacity for queue_timeout_s")
                    self._retry()
            elif kind == "control":
                self._control()
                self.push(self.now + self.spec.roles.interval_s, "control")
            elif kind == "switched":
                x.role, x.next_role, x.state = x.next_role, "", "ready"
                self._kick(x)
                self._retry()
        return self.jobs

    # ---- placement -----------------------------------------------------------------------------
    def _try(self, job: SimJob) -> bool:
        missed = False
        while True:
            d = place(self.settings, self.index, self.workers, job, self.holdings, missed, self.calls)
            if d is None:
                return False
            dw = self.workers[d.decode]
            if d.prefill is None and d.check is not None:
                # local by a prefix the index believes cached: the worker checks (else the pool)
                have = dw.cache_hit(job.hashes, job.prompt_tokens) * self.cost.block_size
                if job.prompt_tokens - have > d.check:
                    missed = True  # (and the index learns it does not hold it, as the router's does)
                    self.index.discard(dw.wid, job.hashes)
                    continue
            self._commit(job, d)
            return True

    def _commit(self, job: SimJob, d) -> None:
        dw, bs = self.workers[d.decode], self.cost.block_size
        job.state, job.placed_at = JobState.RUNNING, self.now
        job.decode_id = d.decode
        job.placement = d.where if d.where == "colocated" else f"{d.where}:{d.why}"
        self.placements[job.placement] += 1
        self.live.add(job)
        self._prefilling.add(job)
        hit = dw.cache_hit(job.hashes, job.prompt_tokens) if job.hashes else 0
        job.shared = hit
        if d.prefill is None:  # the decode (or colocated) worker prefills it
            job.prefill_id, job.computed = d.decode, hit * bs
            if self.index is not None:  # placed: it will hold the prompt's blocks; it found ``hit``
                self.index.record(dw.wid, job.hashes, dw.total)
                prefilled(self.index, dw.wid, job.hashes, d.hit, hit * bs, bs)
            self.holdings.update(job)
            dw.alloc(self.cost.blocks_for(job.prompt_tokens) - hit)
            job.dblocks = self.cost.blocks_for(job.prompt_tokens) - hit
            dw.submit(job)
            self._kick(dw, interrupt=True)
            return
        # decode reserves (its cached prefix is not sent again), prefill computes the prompt
        job.prefill_id, job.start = d.prefill, hit * bs
        job.dblocks = self.cost.blocks_for(job.prompt_tokens) - hit
        dw.alloc(job.dblocks)
        dw.incoming.append(job)
        pw = self.workers[d.prefill]
        if self.index is not None:  # both hold the prompt's blocks now (router: decode_view)
            self.index.record(dw.wid, job.hashes, dw.total)
            self.index.record(pw.wid, job.hashes, pw.total)
        self.holdings.update(job)
        pw.submit(job)
        self._kick(pw)

    def _enqueue(self, job: SimJob) -> None:
        if len(self.queue) >= self.spec.max_queue:
            self._refuse(job, "admission queue full")
            return
        self.queue.append(job)
        self.push(self.now + self.spec.queue_timeout_s, "timeout", job)

    def _retry(self) -> None:
        while self.queue and self._try(self.queue[0]):
            self.queue.popleft()

    def _refuse(self, job: SimJob, why: str) -> None:
        job.refused, job.state = why, JobState.DONE
        self._closed += 1

    # ---- workers -------------------------------------------------------------------------------
    def _kick(self, w: SimWorker, interrupt: bool = False) -> None:
        if w.busy:
            if interrupt:
                t = w.interrupt(self.now)
                if t is not None:
                    self.push(t, "step", (w, w.gen))
            return
        nxt = w.plan(self.now)
        if nxt is not None:
            self.push(nxt[0], "step", (w, w.gen))
        elif w.state == "draining" and w.holds_nothing():
            w.state = "switching"  # (rewiring: the switch's cost, once)
            self.push(self.now + self.cost.switch_ms / 1e3, "switched", w)
        self._announce(w)

    def _announce(self, w: SimWorker) -> None:
        """``w`` started or stopped computing: its neighbours' decode runs end at their next step
        and go on at the pace a busy (or quiet) node gives them (workers.py module doc)."""
        if not w.neighbours or self._announced.get(w.wid, False) == w.busy or self._quiet_node:
            return
        self._announced[w.wid] = w.busy
        for n in w.neighbours:
            t = n.repace(self.now)  # (None where its pace does not change: nothing is cut)
            if t is not None:
                self.push(t, "step", (n, n.gen))

    def _step_done(self, w: SimWorker) -> None:
        if w.run is not None:
            done, prefilled = w.end_run(self.now), []
        else:
            prefilled, done = w.end_step(self.now)
        for j in prefilled:
            if w.role == "prefill":  # the KV goes to the decode worker (less its cached prefix)
                w.outgoing += 1
                self.push(self.now + self.cost.transfer_ms(j.prompt_tokens - j.start) / 1e3, "transfer", j)
            else:
                self._first_token(j, w)
        for j in done:
            self._finished(j)
        self._kick(w)
        if done:
            self._retry()

    def _landed(self, job: SimJob) -> None:
        pw, dw = self.workers[job.prefill_id], self.workers[job.decode_id]
        pw.outgoing -= 1
        pw.free(job.pblocks)
        job.pblocks = 0
        dw.incoming.remove(job)
        dw.cache_add(job.hashes)
        dw.take_in(self.cost.land_ms(job.prompt_tokens - job.start))
        self._first_token(job, dw)
        self._kick(pw)
        self._kick(dw, interrupt=True)
        self._retry()

    def _first_token(self, job: SimJob, w: SimWorker) -> None:
        job.first_token, job.generated = self.now, 1
        self._prefilling.discard(job)
        self.holdings.update(job)
        # (from its placement, as the router's Job.queue_free_ttft)
        self.recent.append(Latency(self.now, self.now - job.placed_at, None, job.prompt_tokens))
        if job.spec.max_tokens <= 1:
            w.free(job.dblocks)
            job.dblocks, job.finish, job.state = 0, self.now, JobState.DONE
            self._finished(job)
            return
        w.grow(job)
        w.ready.append(job)

    def _finished(self, job: SimJob) -> None:
        self.live.discard(job)
        self.holdings.drop(job)
        self._closed += 1
        m = job.spec.max_tokens
        self.recent.append(Latency(self.now, None, (job.finish - job.first_token) / (m - 1) if m > 1 else None))

    # ---- roles (adaptive) ----------------------------------------------------------------------
    def _control(self) -> None:
        # the workers on their way to another role (roles.decide_moving, as RoleController.step)
        moving = [w.next_role for w in self.workers.values() if w.state in ("draining", "switching")]
        while self.recent and self.recent[0][0] < self.now - self.spec.window_s:
            self.recent.popleft()
        paces = []
        for w in self.workers.values():
            if w.running:
                pace = self.cost.step_ms(len(w.running), sum(j.ctx for j in w.running)) / 1e3 * (
                    w.run[4] if w.run is not None else 1.0)
                paces += [pace for j in w.running if j.generated >= 16]
        awaiting = [(self.now - j.placed_at, j.prompt_tokens) for j in self._prefilling]
        s_p, s_d = role_signals(self.workers, list(self.recent), paces, len(self.queue), awaiting, self.now,
                                self.spec.window_s, self.spec.prefill_targets)
        self.calls["roles.decide"] = self.calls.get("roles.decide", 0) + 1
        want, why = decide_moving(self.now, s_p, s_d, moving, self.spec.prefill_targets, self.spec.decode_targets,
                                  self.spec.roles, self.role_state)
        if want is None:
            return
        old, new = want
        cands = [w for w in self.workers.values() if w.role == old and w.state == "ready"]
        if not cands:
            return
        w = min(cands, key=lambda w: (w.used, len(w.running), w.wid))  # pools._least_loaded
        w.state, w.next_role = "draining", new
        self.switches.append((self.now, w.wid, old, new, why))
        self._kick(w)
