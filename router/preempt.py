"""Preemption: lower-priority decodes make room for a higher-priority request waiting for KV.

Strict priority (router.admission) orders the requests that wait; once placed, a request
would keep its blocks until it ends, so a burst of low-priority streams could hold a
high-priority request out for their whole length. Here the gap closes: when the request whose
turn it is (the first waiting one, so of the highest class waiting) finds no decode worker
with room (``placement.plan`` answered Wait), and requests of a *lower* class run, the router
ends some of those on their workers (each ``abort`` frees their KV blocks at once, on every
worker of the attempt) and puts them back in the queue. They re-run later from their prompt
plus the tokens already streamed, by the machinery of a lost worker (router.jobs ``rerun``: a
new attempt; the client sees one stream, nothing repeated or lost)::

    RUNNING ──preempted (aborted on its workers)──► PLACING (attempt + 1, in its class) ──► RUNNING

``choose`` is the decision, pure over a snapshot (loads and the running requests); the
``Preemptor`` reads the snapshot and carries the answer out. Rules:

- Never for an equal or lower class: only requests of a strictly lower class are victims.
- Only if it helps: the victims are taken on one worker, until the waiting request would fit
  there (``placement.pick_decode`` on that worker with their blocks, growth and seats given
  back); a worker where even all of them would not make room is not touched.
- Victims, on a worker: lowest class first, then the least progress (fewest tokens streamed:
  its re-run recomputes the least, and its client has seen the least of it), then the most
  recent arrival (vLLM's order within a priority: the older, further along in its wait, finish).
- Among workers: the one where only the lowest class is touched, then the fewest victims,
  then the least progress lost.
- Starvation: a request preempted ``router.max_preemptions`` times is no victim any more (it
  runs to its end); 0 turns preemption off. While it waits to be placed again it is bound by
  ``router.queue_timeout_s`` like any waiting request: under higher-class load that outlasts it,
  it ends with RESOURCE_EXHAUSTED after the tokens it already streamed (docs/security.md).
- Room on its way: the blocks of victims preempted in the last ``SETTLE_S`` count as free on
  their worker until its reports show them (every 50 ms, after the abort's step), so a
  waiting request does not preempt again for room that is already being freed.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from router.admission import Admission
from router.jobs import Job, JobState, Preempted
from router.placement import Demand, WorkerLoad, pick_decode
from router.policy import PRIORITIES

log = logging.getLogger("pdserve.router")

SETTLE_S = 1.0  # a victim's freed blocks count as free this long (module doc: room on its way)
NORMAL_RANK = PRIORITIES.index("normal")  # a job without a lease (tests) is of the default class


@dataclass(frozen=True)
class Running:
    """One running request as preemption reads it."""

    job_id: str
    rank: int  # its token's priority class (0: the highest)
    worker_id: str  # its decode (or colocated) worker
    tokens: int  # prompt + generated: the KV it holds there
    remaining: int  # tokens it may still generate (in the worker's remaining_decode_tokens)
    generated: int  # its progress: tokens already streamed
    arrival: float
    preemptions: int = 0

    def victim_order(self) -> tuple[int, int, float]:
        """Lowest class, then least progress, then most recent (module doc)."""
        return -self.rank, self.generated, -self.arrival


def without(w: WorkerLoad, gone: Iterable[Running]) -> WorkerLoad:
    """``w`` once the requests ``gone`` have left it: their blocks, growth and seats given back."""
    gone = list(gone)
    if not gone:
        return w
    seats = None if w.free_seqs is None else w.free_seqs + len(gone)
    growth = max(0, w.remaining_decode_tokens - sum(r.remaining for r in gone))
    return dataclasses.replace(w, free_blocks=w.free_blocks + sum(w.blocks_for(r.tokens) for r in gone),
                               remaining_decode_tokens=growth, free_seqs=seats)


def choose(rank: int, demand: Demand, loads: Sequence[WorkerLoad], running: Sequence[Running],
           reserve_fraction: float = 1.0, max_preemptions: int = 2,
           freeing: Sequence[Running] = ()) -> tuple[Running, ...]:
    """The requests to preempt so that a waiting request of class ``rank`` fits (module doc).

    Args:
        rank: the waiting request's class (0: the highest).
        demand: the waiting request (its prompt and max_tokens).
        loads: the decode (or colocated) workers now.
        running: the running requests.
        reserve_fraction: ``decode.reserve_fraction`` (as placement uses it).
        max_preemptions: a request preempted this often is no victim (0: preemption off).
        freeing: victims preempted recently whose blocks the loads may not show free yet.
    Returns:
        The victims, all on one worker; () when none should be preempted (room exists or is
        being freed, no lower-class request runs, or preempting them would not make room).
    """
    def fits(w: WorkerLoad) -> bool:
        return pick_decode([w], demand.prompt_tokens, demand.max_tokens, reserve_fraction) is not None

    credited = [without(w, (f for f in freeing if f.worker_id == w.worker_id)) for w in loads]
    if max_preemptions <= 0 or any(fits(w) for w in credited):
        return ()
    best: tuple[Running, ...] = ()
    best_key = None
    for w in credited:
        victims = sorted((r for r in running if r.worker_id == w.worker_id and r.rank > rank
                          and r.preemptions < max_preemptions), key=Running.victim_order)
        for k in range(1, len(victims) + 1):
            if fits(without(w, victims[:k])):
                taken = victims[:k]
                key = (-min(r.rank for r in taken), k, sum(r.generated for r in taken), w.worker_id)
                if best_key is None or key < best_key:
                    best, best_key = tuple(taken), key
                break
    return best


def running(job: Job) -> Running | None:
    """``job`` as ``choose`` reads it; None unless it runs on a decode (or colocated) worker."""
    if job.state is not JobState.RUNNING or job.decode is None:
        return None
    rank = job.lease.policy.rank if job.lease is not None else NORMAL_RANK
    return Running(job.request_id, rank, job.decode.worker_id, len(job.prompt_ids) + len(job.generated),
                   max(0, job.params.max_tokens - len(job.generated)), len(job.generated), job.arrival,
                   job.preemptions)


class Preemptor:
    """Carries ``choose``'s answer out: aborts the victims on their workers and re-queues them.

    Args:
        pools: router.pools.Pools (or tests' FakePools): ``abort`` on each worker of a victim.
        admission: counts each preemption under the victim's token name (``/metrics``).
        max_preemptions: ``router.max_preemptions``.
        jobs: the router's live jobs, read at each decision.
        clock: seconds, monotonic (tests pass a fake one).
    """

    def __init__(self, pools: Any, admission: Admission, max_preemptions: int,
                 jobs: Callable[[], Iterable[Job]], clock: Callable[[], float] = time.monotonic) -> None:
        self.pools, self.admission, self.max_preemptions = pools, admission, max_preemptions
        self.jobs, self.clock = jobs, clock
        self._freeing: list[tuple[float, Running]] = []  # (when, victim): room on its way

    def make_room(self, waiter: Job, demand: Demand, loads: Sequence[WorkerLoad],
                  reserve_fraction: float) -> int:
        """Preempt what ``choose`` says for ``waiter`` (it found no room); returns how many."""
        rank = waiter.lease.policy.rank if waiter.lease is not None else NORMAL_RANK
        if self.max_preemptions <= 0 or rank == len(PRIORITIES) - 1:  # (the lowest class preempts no one)
            return 0
        now = self.clock()
        self._freeing = [(t, r) for t, r in self._freeing if now - t < SETTLE_S]
        live = {r.job_id: (r, j) for j in self.jobs() if (r := running(j)) is not None}
        victims = choose(rank, demand, loads, [r for r, _ in live.values()], reserve_fraction,
                         self.max_preemptions, [r for _, r in self._freeing])
        for v in victims:
            self.preempt(live[v.job_id][1], why=f"for {waiter.request_id}")
            self._freeing.append((now, v))
        return len(victims)

    def preempt(self, job: Job, why: str) -> None:
        """Free ``job``'s blocks on its workers now and send it back to PLACING (its stream
        re-runs it: router.server; a consumer that is not reading does not delay the free)."""
        job.preemptions += 1
        log.info("rid=%s event=preempted times=%d reason=%r decode=%s tokens=%d", job.request_id,
                 job.preemptions, why, job.decode_id, len(job.generated))
        job.release(self.pools.abort)
        job.put(None, Preempted())
        if job.lease is not None:
            self.admission.preempted(job.lease)
