"""Simulated workers: one engine's queues, KV blocks and prefix cache, timed by the cost model.

A request here is a :class:`SimJob`; it owns its state (where it runs, tokens computed and
generated, blocks held on each side). It also carries the fields of ``router.jobs.Job`` that
``router.prefix_index.prefix_view`` reads (``state``, ``prefilling``, ``prefill_id``,
``decode_id``, ``uncached``, ``prefix_hashes``), so the router's function reads it as it
reads the router's live jobs.

Queues of a worker (the engine's, engine.scheduler), and nothing else::

    waiting  (prompts to prefill here, FIFO; a prefill worker's take their blocks at the head)
      ──last chunk──► prefill worker: outgoing (KV in flight; blocks held until the transfer ends)
                      decode/colocated worker: ready
    ready    (first token out; waiting for a batch slot, ``max_num_seqs``)
      ──slot──► running (decoding) ──max_tokens──► finished (blocks freed)

    incoming (a decode worker's: blocks reserved, the prompt prefilled elsewhere, its KV on the
      way) ──transfer──► ready. Counted in the worker's remaining decode tokens, as the real
      decode worker counts its requests waiting for KV (worker/step_loop.py): a worker with
      one is not idle to the router.

A step is one forward (``CostModel.step_ms``): with prompts waiting, their chunks (chunked: with
the running decodes, within ``max_batched_tokens``; not chunked: whole prompts alone, decodes
wait); otherwise a *run* of decode-only steps up to the first request that finishes, timed in
closed form (``decode_run_ms``) and cut short at the next step boundary when the batch changes
(``interrupt``); KV that landed is taken in first, between steps: the next step or run starts
``CostModel.land_ms`` later (``take_in``; a worker with nothing to run spends it idle). A worker's ``neighbours`` share its node: while one of them is busy, its
steps take the cost model's ``node_decode_x`` / ``node_prefill_x`` times as long. When a
neighbour starts or stops (``repace``), a prompt step in progress goes on at the new pace for
the rest of its work, and a decode run is cut at its next step (the next run takes the new pace).
KV: a request's blocks are its context's, less the leading blocks it shares
with the worker's prefix cache; blocks never go below zero and all are free at the end
(``check``).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field

from bench.sim.costs import CostModel
from bench.sim.traces import Spec
from router.jobs import JobState
from router.placement import WorkerLoad


@dataclass(eq=False)
class SimJob:
    spec: Spec
    hashes: list[int]
    state: JobState = JobState.PLACING
    # router.jobs.Job's fields that prefix_view / expect_prefix read and write
    prefill_id: str = ""
    decode_id: str = ""
    uncached: int = 0
    prefix_hashes: list[int] = field(default_factory=list)
    placement: str = ""
    # progress
    computed: int = 0  # prompt tokens whose KV exists where it is prefilled
    generated: int = 0  # tokens out so far (the first one included)
    start: int = 0  # the first prompt position the decode worker lacks (its cached prefix before it)
    pblocks: int = 0  # blocks held on the prefill worker (pool prefill only)
    dblocks: int = 0  # blocks held on the decode (or colocated) worker
    shared: int = 0  # leading blocks the decode side shares with its prefix cache
    queued_at: float | None = None
    placed_at: float | None = None
    first_token: float | None = None
    finish: float | None = None
    refused: str = ""

    @property
    def prefilling(self) -> bool:
        return self.state is JobState.RUNNING and self.first_token is None

    @property
    def prompt_tokens(self) -> int:
        return self.spec.prompt_tokens

    @property
    def ctx(self) -> int:
        """Tokens of KV it has on its decode side (prompt and answer so far, less the last)."""
        return self.spec.prompt_tokens + max(0, self.generated - 1)


class SimWorker:
    """One worker (module doc). ``role``: "prefill", "decode" or "colocated"."""

    def __init__(self, wid: str, role: str, cost: CostModel, chunked: bool = True) -> None:
        self.wid, self.role, self.cost, self.chunked = wid, role, cost, chunked
        self.state, self.next_role = "ready", ""
        self.total = cost.kv_blocks
        self.used = 0
        self.cache: OrderedDict[int, None] = OrderedDict()  # block hashes, LRU first
        self.waiting: deque[SimJob] = deque()
        self.ready: deque[SimJob] = deque()
        self.running: list[SimJob] = []
        self.incoming: list[SimJob] = []
        self.outgoing = 0
        self.queued_tokens = 0  # prompt tokens in waiting not yet computed
        self.gen = 0  # bumps when the step in progress is replaced (stale events are dropped)
        self.busy = False
        self.run: tuple[float, int, int, int, float] | None = None  # decode run: (t0, steps, batch, ctx, x)
        self.neighbours: list[SimWorker] = []  # the other workers on its node (module doc)
        self.step_work: tuple[list[tuple[SimJob, int]], list[SimJob]] | None = None
        self.step_pace: tuple[float, float, float] | None = None  # its (since, ms of work left then, x)
        self.step_t0 = 0.0
        self.busy_ms = 0.0
        self.land_pending = 0.0  # ms of landed KV to take in before the next step (``take_in``)
        self.land_until = 0.0  # taking it in until then: no step starts before
        self.max_used = 0
        self.overflow = 0  # allocations past the total (placement promised room it did not have)

    # ---- what the router sees -------------------------------------------------------------------
    def load(self) -> WorkerLoad:
        remaining = sum(j.spec.max_tokens - j.generated for q in (self.running, self.ready, self.incoming) for j in q)
        if self.role != "prefill":
            remaining += sum(j.spec.max_tokens for j in self.waiting)
        return WorkerLoad(self.wid, self.role, self.total - self.used, self.total, self.cost.block_size,
                          queued_prompt_tokens=self.queued_tokens, remaining_decode_tokens=remaining,
                          accepting=self.state == "ready")

    def holds_nothing(self) -> bool:
        return not (self.waiting or self.ready or self.running or self.incoming or self.outgoing or self.used
                    or self.busy)

    # ---- KV and the prefix cache ---------------------------------------------------------------
    def alloc(self, n: int) -> None:
        self.used += n
        if self.used > self.total:
            self.overflow += 1
        self.max_used = max(self.max_used, self.used)

    def free(self, n: int) -> None:
        self.used -= n
        assert self.used >= 0, f"{self.wid}: KV blocks below zero"

    def cache_hit(self, hashes: list[int], prompt_tokens: int) -> int:
        """Leading prompt blocks its prefix cache holds (at most those before the last token)."""
        most, n = (prompt_tokens - 1) // self.cost.block_size, 0
        for h in hashes[:most]:
            if h not in self.cache:
                break
            n += 1
        return n

    def cache_add(self, hashes: list[int]) -> None:
        for h in hashes:
            self.cache[h] = None
            self.cache.move_to_end(h)
        while len(self.cache) > self.total:
            self.cache.popitem(last=False)

    # ---- queues ---------------------------------------------------------------------------------
    def submit(self, job: SimJob) -> None:
        """A prompt to prefill here (its blocks: decode/colocated at placement, prefill at start)."""
        self.waiting.append(job)
        self.queued_tokens += job.prompt_tokens - job.computed

    def grow(self, job: SimJob) -> None:
        """Its decode-side blocks follow its context."""
        want = self.cost.blocks_for(job.ctx + 1) - job.shared
        if want > job.dblocks:
            self.alloc(want - job.dblocks)
            job.dblocks = want

    def _pace(self) -> tuple[float, float]:
        """(decode-only, prompt) step time factors on its node now: a neighbour computing or
        not (module doc)."""
        if any(n.busy for n in self.neighbours):
            return self.cost.node_decode_x, self.cost.node_prefill_x
        return 1.0, 1.0

    def repace(self, now: float) -> float | None:
        """A neighbour started or stopped (module doc): the new end of the work in progress
        (``gen`` bumped: the old end is stale), or None where it does not move."""
        run_x, step_x = self._pace()
        if self.run is not None:
            return self.interrupt(now) if self.run[4] != run_x else None
        if self.step_pace is None or self.step_pace[2] == step_x:
            return None
        since, left, x = self.step_pace
        at = max(now, since)  # (a step waiting on an intake has done nothing yet)
        left = max(0.0, left - (at - since) * 1e3 / x)
        self.step_pace = (at, left, step_x)
        self.gen += 1
        return at + left * step_x / 1e3

    def take_in(self, ms: float) -> None:
        """Landed KV to take in (``CostModel.land_ms``): ``ms`` of this worker's time once the
        step in progress ends (a decode run is cut there: ``interrupt``)."""
        self.land_pending += ms
        self.busy_ms += ms

    def plan(self, now: float) -> tuple[float, str] | None:
        """Start the next step if idle: (its end time, kind) or None (nothing to do)."""
        if self.busy:
            return None
        while self.ready and len(self.running) < self.cost.max_num_seqs:
            self.running.append(self.ready.popleft())
        start = max(now, self.land_until) + self.land_pending / 1e3  # (after any KV intake: ``take_in``)
        self.land_until, self.land_pending = start, 0.0  # (nothing to run: the worker spends it idle)
        chunks = self._chunks()
        if chunks:
            batch = list(self.running) if self.chunked else []
            ms = self.cost.step_ms(len(batch), sum(j.ctx for j in batch), [(n, j.computed) for j, n in chunks])
            x = self._pace()[1]
            self.step_work, self.busy = (chunks, batch), True
            self.step_pace, self.step_t0 = (start, ms, x), start
            return start + ms * x / 1e3, "step"
        if self.running:
            k = min(j.spec.max_tokens - j.generated for j in self.running)
            b, ctx = len(self.running), sum(j.ctx for j in self.running)
            x = self._pace()[0]
            self.run, self.busy = (start, k, b, ctx, x), True
            return start + self.cost.decode_run_ms(b, ctx, k) * x / 1e3, "run"
        return None

    def _chunks(self) -> list[tuple[SimJob, int]]:
        budget = self.cost.max_batched_tokens - (len(self.running) if self.chunked else 0)
        out: list[tuple[SimJob, int]] = []
        for job in self.waiting:
            if budget <= 0:
                break
            if job.computed == 0 and self.role == "prefill" and job.pblocks == 0:
                hit = self.cache_hit(job.hashes, job.prompt_tokens)
                need = self.cost.blocks_for(job.prompt_tokens) - hit
                if self.total - self.used < need:
                    break  # its blocks come free when a transfer ends
                self.alloc(need)
                job.pblocks, job.computed = need, hit * self.cost.block_size
                self.queued_tokens -= job.computed
            left = job.prompt_tokens - job.computed
            if self.chunked:
                take = min(left, budget)
            elif out and left > budget:
                break
            else:
                take = left
            out.append((job, take))
            budget -= take
        return out

    def interrupt(self, now: float) -> float | None:
        """The batch changes: cut a decode run at the end of the step in progress. Returns the
        run's new end time, or None if it does not move (no run, or it ends by then anyway)."""
        if self.run is None:
            return None
        t0, k, b, ctx, x = self.run
        done = self.cost.decode_steps_within(b, ctx, (now - t0) * 1e3 / x)
        if done + 1 >= k:
            return None
        self.run = (t0, done + 1, b, ctx, x)
        self.gen += 1
        return t0 + self.cost.decode_run_ms(b, ctx, done + 1) * x / 1e3

    def end_run(self, now: float) -> list[SimJob]:
        """A decode run ended: every running request advanced its steps; returns the finished."""
        t0, k, b, ctx, x = self.run
        self.busy_ms += self.cost.decode_run_ms(b, ctx, k) * x
        self.run, self.busy = None, False
        for j in self.running:
            j.generated += k
        return self._settle(now)

    def end_step(self, now: float) -> tuple[list[SimJob], list[SimJob]]:
        """A step ended: (prompts whose last chunk it was, requests finished)."""
        chunks, batch = self.step_work
        self.step_work, self.step_pace, self.busy = None, None, False
        self.busy_ms += (now - self.step_t0) * 1e3
        for j in batch:
            j.generated += 1
        prefilled = []
        for j, n in chunks:
            j.computed += n
            self.queued_tokens -= n
            if j.computed >= j.prompt_tokens:
                self.waiting.remove(j)
                self.cache_add(j.hashes)
                prefilled.append(j)
        return prefilled, self._settle(now)

    def _settle(self, now: float) -> list[SimJob]:
        done = []
        for j in self.running:
            if j.generated >= j.spec.max_tokens:
                done.append(j)
            else:
                self.grow(j)
        for j in done:
            self.running.remove(j)
            self.free(j.dblocks)
            j.dblocks, j.finish, j.state = 0, now, JobState.DONE
        return done
